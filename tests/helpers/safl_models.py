"""Tiny BERTs for SAFL layer selection: seeded ones, and constructed ones whose attention to [CLS] and [SEP] is
set per layer (so layer scores have a closed form), with examples of given lengths."""

from __future__ import annotations

import math

import numpy as np

from fedclinic.data.text import Example

LABELS = ["cardio", "neuro"]
WORDS = ["heart", "chest", "migraine", "seizure", "patient", "reports", "daily", "mild"]


def bert_package(layers: int = 4, seed: int = 0, hidden: int = 8):
    """A seeded tiny BERT package with ``layers`` layers of width ``hidden``."""
    from fedclinic.models import package_from_config, wordlevel_tokenizer_json

    config = {"model_type": "bert", "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": 2,
              "intermediate_size": 16, "max_position_embeddings": 32}
    return package_from_config(architecture="transformer", labels=LABELS, tokenizer_json=wordlevel_tokenizer_json(WORDS),
                               config=config, max_length=16, seed=seed)


def examples(n: int, seed: int = 0) -> list[Example]:
    """``n`` rows of 2 to 6 random words, labels in turn."""
    rng = np.random.default_rng(seed)
    return [Example(" ".join(rng.choice(WORDS, size=int(rng.integers(2, 7)))), (LABELS[i % 2],)) for i in range(n)]


CLS_LOGITS = [1.5, 8.0, 0.0, 4.0]   # layer l: the attention logit of key [CLS] from every query
SEP_LOGITS = [5.0, 0.0, 2.5, 0.0]   # ... and of key [SEP] (the last real token); other keys: 0


def constructed_model(cls_logits=CLS_LOGITS, sep_logits=SEP_LOGITS, seed: int = 0):
    """A BERT (one layer per logit) whose hidden states stay the normalised embeddings (attention output and FFN
    output are zero, so each residual LayerNorm gives back its input) and whose attention rows are all the same:
    every query is the constant e_0 of its head, keys are k_j = (x_l h_j[0] + y_l h_j[1]) / c on the head's first
    coordinate (times sqrt(head_dim) = 2). [CLS] embeds as (a, 0, -a/6, ...), [SEP] as (0, a, -a/6, ...), every
    other token has zero first two coordinates and zero mean; c = LayerNorm([CLS])[0]. So with n real tokens::

        alpha(i -> [CLS]) = e^x / (e^x + e^y + n - 2)    alpha(i -> [SEP]) = e^y / (e^x + e^y + n - 2)

    for every query i and head, and A_l(cls), A_l(last) of an example are exactly these numbers.
    """
    import torch

    from fedclinic.models import build_model

    loaded = build_model(bert_package(layers=len(cls_logits), seed=seed))
    m = loaded.module
    vocab = loaded.tokenizer.get_vocab()
    cls_id, sep_id = vocab["[CLS]"], vocab["[SEP]"]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        emb = m.bert.embeddings
        words = torch.zeros_like(emb.word_embeddings.weight)
        rest = torch.randn(words.shape[0], 6, generator=gen)
        words[:, 2:] = rest - rest.mean(dim=1, keepdim=True)
        a = 3.0
        words[cls_id] = torch.tensor([a, 0.0] + [-a / 6] * 6)
        words[sep_id] = torch.tensor([0.0, a] + [-a / 6] * 6)
        c = float(torch.nn.functional.layer_norm(words[cls_id], (8,), eps=m.config.layer_norm_eps)[0])
        emb.word_embeddings.weight.copy_(words)
        emb.position_embeddings.weight.zero_()
        emb.token_type_embeddings.weight.zero_()
        for layer, x, y in zip(m.bert.encoder.layer, cls_logits, sep_logits):
            att = layer.attention
            att.self.query.weight.zero_()
            att.self.query.bias.zero_()
            att.self.query.bias[0] = att.self.query.bias[4] = 1.0        # head 0 and head 1 (head_dim 4)
            att.self.key.weight.zero_()
            att.self.key.bias.zero_()
            for row in (0, 4):
                att.self.key.weight[row, 0] = 2 * x / c
                att.self.key.weight[row, 1] = 2 * y / c
            att.output.dense.weight.zero_()
            att.output.dense.bias.zero_()
            layer.output.dense.weight.zero_()
            layer.output.dense.bias.zero_()
    return loaded


def constructed_package(cls_logits, sep_logits, seed: int = 0):
    """:func:`constructed_model` as a package (to simulate or submit)."""
    from fedclinic.models import module_tensors
    from fedclinic.transport.package import ModelPackage

    loaded = constructed_model(cls_logits, sep_logits, seed)
    return ModelPackage(tensors=module_tensors(loaded.module), files=dict(bert_package(layers=len(cls_logits)).files))


#: a 3-layer model whose choice (top-1, token "cls") depends on the text length n: layer 1 (e^x = 6, no [SEP]
#: competition) wins while 6 / (n + 5) > ~1/2, i.e. for n <= 6; layer 0 (e^x = e^y = e^8) wins for longer texts
FLIP_CLS, FLIP_SEP = [8.0, math.log(6.0), 0.0], [8.0, 0.0, 0.0]


def length_examples(n: int, words: int, seed: int = 0) -> list[Example]:
    """``n`` rows of exactly ``words`` words ([CLS] and [SEP] make ``words + 2`` tokens)."""
    rng = np.random.default_rng(seed)
    return [Example(" ".join(rng.choice(WORDS, size=words)), (LABELS[i % 2],)) for i in range(n)]
