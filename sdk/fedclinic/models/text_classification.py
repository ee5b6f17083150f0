"""The "text-classification" model family: transformer encoder, LSTM, or logistic regression over tokens.

All three architectures read the same inputs — token ids and an attention mask made by the task's
``tokenizer.json`` (loaded with :func:`tokenizers.Tokenizer.from_str`, never with remote code) — and return
one logit per label. Which one a package holds is written in its ``fedclinic_model.json``::

    {"format": 1, "family": "text-classification", "architecture": "transformer" | "lstm" | "logreg",
     "labels": [...], "multi_label": false, "max_length": 128, "base_model": "...", "arch_config": {...}}

Architectures
-------------
``transformer``
    A Hugging Face ``*ForSequenceClassification`` built with ``AutoConfig.for_model`` and
    ``AutoModelForSequenceClassification.from_config`` for a ``model_type`` in :data:`ALLOWED_MODEL_TYPES`
    (classes that ship inside transformers; no code is ever fetched). The package also holds the HF
    ``config.json``, so a saved package folder loads with ``from_pretrained(folder)``. Tensor names are the
    HF state-dict keys, e.g. for BERT/MiniLM ``bert.embeddings.word_embeddings.weight``,
    ``bert.encoder.layer.{i}.attention.self.query.weight``, ``bert.pooler.dense.weight``,
    ``classifier.weight``. With ``pooling = "mean"`` (a ``config`` key, recorded in ``arch_config``) the head
    reads the masked mean of the last layer instead of the ``[CLS]`` pooler, and the model has no pooler
    (:mod:`fedclinic.models.mean_pooling`; sentence encoders such as all-MiniLM-L6-v2 were trained that way).
``lstm``
    ``embedding -> (Bi)LSTM -> dropout -> linear``; the feature is the final hidden state of the last
    layer (both directions concatenated when bidirectional), computed on packed sequences so padding never
    enters the recurrence. Tensors: ``embedding.weight``, ``lstm.weight_ih_l{k}[_reverse]``, ...,
    ``classifier.weight``, ``classifier.bias``.
``logreg``
    Multinomial logistic regression on token counts: ``logits = C(x) W + b`` where ``C(x)`` is the vector
    of token counts (padding excluded), implemented as ``EmbeddingBag(vocab, labels, mode="sum")``.
    Tensors: ``token_weights.weight`` (vocab x labels) and ``bias``. Initialised at zero (the problem is
    convex, so the seed does not matter).
"""

from __future__ import annotations

import warnings

import contextlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import numpy as np

from fedclinic.errors import ConfigError, IntegrityError
from fedclinic.models.mean_pooling import (POOLINGS, mean_pooled_classifier_class, pooling_problem,
                                           sentence_transformers_pooling)
from fedclinic.models.meta import ModelMeta
from fedclinic.transport.package import META_FILE, WEIGHTS_FILE, ModelPackage, meta_bytes

if TYPE_CHECKING:  # pragma: no cover
    import tokenizers
    import torch

log = logging.getLogger("fedclinic.models")

FAMILY = "text-classification"
FORMAT = 1
ARCHITECTURES = ("transformer", "lstm", "logreg")
#: HF ``model_type`` values whose sequence-classification classes may be built (all ship in transformers).
ALLOWED_MODEL_TYPES = ("bert", "roberta", "distilbert", "electra")
TOKENIZER_FILE = "tokenizer.json"
HF_CONFIG_FILE = "config.json"
#: Plain-JSON tokenizer side files copied from a pretrained folder (so the package is a usable HF folder).
_TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")
#: Sub-modules a sequence-classification model may lack in a pretrained checkpoint (newly initialised).
_FRESH_MODULES = ("classifier.", "pre_classifier.")
_PAD_CANDIDATES = ("[PAD]", "<pad>", "<PAD>", "[pad]")

LSTM_DEFAULTS: dict[str, Any] = {
    "embedding_dim": 128,
    "hidden_size": 128,
    "num_layers": 1,
    "bidirectional": True,
    "dropout": 0.1,
}


# ------------------------------------------------------------------------------------------------------------
# loaded model


@dataclass
class LoadedModel(ModelMeta):
    """A built model: the torch module, the task's tokenizer and the parsed ``fedclinic_model.json``.

    ``tokenizer`` is a :class:`tokenizers.Tokenizer` with padding disabled (the trainer pads per batch).
    """

    module: "torch.nn.Module"
    tokenizer: "tokenizers.Tokenizer"
    meta: dict
    #: id used to pad token sequences (from the tokenizer's padding settings or its [PAD]/<pad> token)
    pad_id: int = 0

    @property
    def max_length(self) -> int:
        return int(self.meta.get("max_length", 128))

    def logits(self, input_ids: "torch.Tensor", attention_mask: "torch.Tensor") -> "torch.Tensor":
        """Forward pass: ``[batch, seq]`` ids and mask -> ``[batch, num_labels]`` logits."""
        if self.architecture == "transformer":
            return self.module(input_ids=input_ids, attention_mask=attention_mask).logits
        return self.module(input_ids, attention_mask)


# ------------------------------------------------------------------------------------------------------------
# our own modules


def _torch():
    import torch

    return torch


def _lstm_class():
    torch = _torch()
    from torch import nn
    from torch.nn.utils.rnn import pack_padded_sequence

    class LSTMClassifier(nn.Module):
        """Embedding -> (Bi)LSTM over packed sequences -> dropout -> linear head."""

        def __init__(self, *, vocab_size: int, num_labels: int, embedding_dim: int, hidden_size: int,
                     num_layers: int, bidirectional: bool, dropout: float, pad_token_id: int) -> None:
            super().__init__()
            self.bidirectional = bool(bidirectional)
            self.embedding = nn.Embedding(vocab_size, embedding_dim, padding_idx=pad_token_id)
            self.lstm = nn.LSTM(embedding_dim, hidden_size, num_layers=num_layers, batch_first=True,
                                bidirectional=bidirectional, dropout=dropout if num_layers > 1 else 0.0)
            self.dropout = nn.Dropout(dropout)
            self.classifier = nn.Linear(hidden_size * (2 if bidirectional else 1), num_labels)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            if torch.compiler.is_exporting():
                return self.classifier(self._features_unpacked(input_ids, attention_mask))
            lengths = attention_mask.sum(dim=1).clamp(min=1).to("cpu", torch.int64)
            packed = pack_padded_sequence(self.embedding(input_ids), lengths, batch_first=True,
                                          enforce_sorted=False)
            _, (h_n, _) = self.lstm(packed)  # h_n: [layers * dirs, batch, hidden], in input order
            feat = torch.cat([h_n[-2], h_n[-1]], dim=-1) if self.bidirectional else h_n[-1]
            return self.classifier(self.dropout(feat))

        def _features_unpacked(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            """The same final hidden states without packing (for ONNX export): :func:`lstm_final_states_unpacked`."""
            return lstm_final_states_unpacked(self.embedding(input_ids), attention_mask, self.lstm, self.bidirectional)

    return LSTMClassifier


def lstm_final_states_unpacked(x: "torch.Tensor", attention_mask: "torch.Tensor", lstm: "torch.nn.LSTM",
                               bidirectional: bool) -> "torch.Tensor":
    """The last layer's final hidden state(s) of a batch-first ``lstm`` over embedded ``x`` ``[B, L, E]``, without
    packing: what ``lstm(pack_padded_sequence(x, lengths))`` gives in ``h_n`` (both directions concatenated when
    ``bidirectional``), for ONNX export, where packed sequences of dynamic lengths cannot be traced (inference
    only: no inter-layer dropout).

    Each direction runs as a one-layer LSTM over the padded batch. The reverse direction runs forward over each
    sequence reversed *within its length* (positions past the length stay in place), so a valid position never
    sees padding; the forward state is read at position ``length - 1``. Exports check this against the packed
    path.
    """
    torch = _torch()
    lengths = attention_mask.sum(dim=1).clamp(min=1)
    steps = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
    inside = steps < lengths.unsqueeze(1)
    rev = torch.where(inside, lengths.unsqueeze(1) - 1 - steps, steps)  # an involution on each row
    hidden = lstm.hidden_size

    def gather(t: "torch.Tensor", index: "torch.Tensor") -> "torch.Tensor":
        return torch.gather(t, 1, index.unsqueeze(-1).expand(-1, -1, t.shape[-1]))

    def run(inp: "torch.Tensor", layer: int, suffix: str) -> "torch.Tensor":
        weights = [getattr(lstm, f"{kind}_l{layer}{suffix}") for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
        zeros = inp.new_zeros(1, inp.shape[0], hidden)
        out, _, _ = torch.lstm(inp, (zeros, zeros), weights, True, 1, 0.0, False, False, True)
        return out

    for layer in range(lstm.num_layers):
        forward_out = run(x, layer, "")
        if bidirectional:
            backward_out = gather(run(gather(x, rev), layer, "_reverse"), rev)
            x = torch.cat([forward_out, backward_out], dim=-1)
        else:
            x = forward_out
    last = (lengths - 1).unsqueeze(1)
    h_forward = gather(forward_out, last).squeeze(1)
    if not bidirectional:
        return h_forward
    return torch.cat([h_forward, backward_out[:, 0]], dim=-1)


def _logreg_class():
    torch = _torch()
    from torch import nn

    class BagOfTokensLogReg(nn.Module):
        """logits = counts(x) @ W + b, with counts over non-padding tokens (EmbeddingBag, mode="sum")."""

        def __init__(self, *, vocab_size: int, num_labels: int) -> None:
            super().__init__()
            self.token_weights = nn.EmbeddingBag(vocab_size, num_labels, mode="sum")
            self.bias = nn.Parameter(torch.zeros(num_labels))
            nn.init.zeros_(self.token_weights.weight)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            weights = attention_mask.to(self.token_weights.weight.dtype)
            return self.token_weights(input_ids, per_sample_weights=weights) + self.bias

    return BagOfTokensLogReg


# ------------------------------------------------------------------------------------------------------------
# tokenizer helpers


def load_tokenizer(tokenizer_json: bytes | str) -> "tokenizers.Tokenizer":
    """Parse a ``tokenizer.json`` (padding switched off; truncation is set per call by the encoder)."""
    from tokenizers import Tokenizer

    text = tokenizer_json.decode("utf-8") if isinstance(tokenizer_json, (bytes, bytearray)) else tokenizer_json
    try:
        tok = Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises a plain Exception on bad JSON
        raise IntegrityError(f"{TOKENIZER_FILE} could not be parsed: {exc}; re-export it with "
                             "tokenizer.save_pretrained() from a fast tokenizer") from None
    tok.no_padding()
    tok.no_truncation()
    return tok


def tokenize_truncated(tokenizer: "tokenizers.Tokenizer", texts: Sequence[str], *, max_length: int,
                       offsets: bool = True) -> list:
    """The tokenizer's encodings of ``texts``, each truncated to ``max_length`` tokens (no padding): the one
    tokenization step of every text family (:func:`encode_texts`, the NER encoder with offsets). Without
    ``offsets`` the character offsets are not computed (``encode_batch_fast``: the same ids, about a quarter less
    time on a batch of reviews)."""
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length)
    try:
        encode = tokenizer.encode_batch if offsets else tokenizer.encode_batch_fast
        return encode(list(texts))
    finally:
        tokenizer.no_truncation()


def pad_encodings(encs: Sequence, *, pad_id: int, pad_to: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids, attention_mask)``, int64 ``[n, width]``, right-padded with ``pad_id`` to the longest
    encoding (or to ``pad_to``)."""
    width = max(pad_to or 0, 1, *(len(e.ids) for e in encs))
    ids = np.full((len(encs), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(encs), width), dtype=np.int64)
    for i, e in enumerate(encs):
        ids[i, :len(e.ids)] = e.ids
        mask[i, :len(e.ids)] = 1
    return ids, mask


def encode_texts(tokenizer: "tokenizers.Tokenizer", texts: Sequence[str], *, max_length: int, pad_id: int,
                 pad_to: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids, attention_mask)``, int64 ``[n, width]``: each text tokenized and truncated to ``max_length``,
    right-padded with ``pad_id`` to the longest one (or to ``pad_to``). The one tokenization path of the
    trainer, the exporter and the serving bundle, so a served model sees exactly what it was trained on.
    """
    return pad_encodings(tokenize_truncated(tokenizer, texts, max_length=max_length, offsets=False), pad_id=pad_id,
                         pad_to=pad_to)


def tokenizer_pad_id(tokenizer_json: bytes | str) -> int:
    """The padding id: the token named in the file's padding settings, else [PAD]/<pad>, else 0."""
    doc = json.loads(tokenizer_json)
    tok = load_tokenizer(tokenizer_json)
    names = [(doc.get("padding") or {}).get("pad_token"), *_PAD_CANDIDATES]
    for name in names:
        idx = tok.token_to_id(name) if name else None
        if idx is not None:
            return int(idx)
    return 0


def wordlevel_tokenizer_json(words: Sequence[str], *, lowercase: bool = True) -> bytes:
    """A small BERT-style word-level ``tokenizer.json`` for tests and demos, built with ``tokenizers``.

    Ids: 0 ``[PAD]``, 1 ``[UNK]``, 2 ``[CLS]``, 3 ``[SEP]``, then ``words`` in the given order (duplicates
    dropped). Text is split on whitespace and punctuation (``BertPreTokenizer``); each sequence becomes
    ``[CLS] ... [SEP]``.
    """
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    vocab: dict[str, int] = {t: i for i, t in enumerate(specials)}
    for w in words:
        w = w.lower() if lowercase else w
        if not w or any(c.isspace() for c in w):
            raise ConfigError(f"tokenizer word {w!r} must be non-empty and contain no whitespace")
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.add_special_tokens(specials)
    return tok.to_str().encode("utf-8")


# ------------------------------------------------------------------------------------------------------------
# tensors <-> module


def module_tensors(module: "torch.nn.Module", names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Detached CPU copies of the module's (persistent) state-dict entries as numpy arrays.

    Floating tensors come back as float32 (whatever the module's dtype); integer buffers keep their dtype.
    ``names`` restricts the result (unknown names raise :class:`IntegrityError`).
    """
    torch = _torch()
    state = module.state_dict()
    if names is None:
        names = list(state)
    else:
        unknown = [n for n in names if n not in state]
        if unknown:
            raise IntegrityError(f"the model has no tensor(s) {_fmt(unknown)}; it holds e.g. {_fmt(list(state))}")
    out: dict[str, np.ndarray] = {}
    for name in names:
        t = state[name].detach()
        if t.is_floating_point():
            t = t.to(device="cpu", dtype=torch.float32)
        else:
            t = t.to("cpu")
        out[name] = t.numpy().copy()
    return out


def load_tensors(module: "torch.nn.Module", tensors: Mapping[str, np.ndarray]) -> None:
    """Copy ``tensors`` into the module's state in place (a partial update; the others stay as they are).

    Every name must exist and every shape must match, else :class:`IntegrityError` names the offenders and
    nothing is changed.
    """
    torch = _torch()
    state = module.state_dict()
    unknown = [n for n in tensors if n not in state]
    bad_shape = [f"{n} {tuple(np.shape(a))} != model {tuple(state[n].shape)}"
                 for n, a in tensors.items() if n in state and tuple(np.shape(a)) != tuple(state[n].shape)]
    if unknown or bad_shape:
        parts = []
        if unknown:
            parts.append(f"unknown tensor(s) {_fmt(unknown)}")
        if bad_shape:
            parts.append(f"shape mismatch: {_fmt(bad_shape)}")
        raise IntegrityError("cannot load weights: " + "; ".join(parts)
                             + ". The package does not belong to this model (check family/architecture/config)")
    with torch.no_grad(), warnings.catch_warnings():
        # Read-only arrays (downloads, memory maps) are fine here: the tensor is only read by copy_().
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, arr in tensors.items():
            dst = state[name]
            src = torch.from_numpy(np.ascontiguousarray(arr))
            dst.copy_(src.to(dtype=dst.dtype, device=dst.device))


def _fmt(items: Sequence[str], limit: int = 8) -> str:
    items = list(items)
    shown = ", ".join(repr(i) if " " not in str(i) else str(i) for i in items[:limit])
    return shown + (f" ... ({len(items)} in all)" if len(items) > limit else "")


# ------------------------------------------------------------------------------------------------------------
# validation


def _check_labels(labels: Sequence[str], multi_label: bool) -> list[str]:
    if isinstance(labels, str):
        raise ConfigError("labels must be a list of label names, not one string")
    labels = list(labels)
    if not all(isinstance(x, str) and x.strip() for x in labels):
        raise ConfigError(f"labels must be non-empty strings, got {labels!r}")
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise ConfigError(f"labels must be unique; repeated: {dupes}")
    need = 1 if multi_label else 2
    if len(labels) < need:
        raise ConfigError(f"a {'multi' if multi_label else 'single'}-label task needs at least {need} labels, "
                          f"got {labels}")
    return labels


def _check_architecture(architecture: str) -> str:
    if architecture not in ARCHITECTURES:
        raise ConfigError(f"unknown architecture {architecture!r} for family {FAMILY!r}; "
                          f"choose one of: {', '.join(ARCHITECTURES)}")
    return architecture


def _check_model_type(model_type: Any) -> str:
    if model_type not in ALLOWED_MODEL_TYPES:
        raise ConfigError(f"model_type {model_type!r} is not allowed for the transformer architecture; "
                          f"allowed: {', '.join(ALLOWED_MODEL_TYPES)} (classes built into transformers; "
                          "no remote code is ever run)")
    return str(model_type)


def _check_max_length(max_length: int) -> int:
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 2:
        raise ConfigError(f"max_length must be an integer >= 2, got {max_length!r}")
    return max_length


_meta_bytes = meta_bytes  # the family modules import it from here


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Run with torch's global RNG seeded, restoring the caller's RNG state afterwards."""
    torch = _torch()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        yield


# ------------------------------------------------------------------------------------------------------------
# transformer


def _hf_config(config_dict: Mapping[str, Any], labels: Sequence[str], multi_label: bool):
    from transformers import AutoConfig

    d = dict(config_dict)
    model_type = _check_model_type(d.pop("model_type", None))
    for key in ("_name_or_path", "auto_map", "trust_remote_code"):
        d.pop(key, None)
    d["id2label"] = {i: lab for i, lab in enumerate(labels)}
    d["label2id"] = {lab: i for i, lab in enumerate(labels)}
    d["num_labels"] = len(labels)
    d["problem_type"] = "multi_label_classification" if multi_label else "single_label_classification"
    try:
        return AutoConfig.for_model(model_type, **d)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid {model_type} config: {exc}") from None


def _max_positions(config) -> int | None:
    n = getattr(config, "max_position_embeddings", None)
    if n is None:
        return None
    if config.model_type == "roberta":  # positions start after the padding index
        return int(n) - int(config.pad_token_id or 0) - 1
    return int(n)


def _check_transformer_fits(config, vocab_size: int, max_length: int) -> None:
    if int(config.vocab_size) < vocab_size:
        raise ConfigError(f"the tokenizer has {vocab_size} tokens but the model's vocab_size is "
                          f"{config.vocab_size}; use the tokenizer the model was trained with or raise vocab_size")
    limit = _max_positions(config)
    if limit is not None and max_length > limit:
        raise ConfigError(f"max_length {max_length} exceeds what the model supports ({limit} positions); "
                          f"lower max_length")


def _hf_config_bytes(module, architecture: str | None = None) -> bytes:
    """The module's HF ``config.json``; ``architectures`` names ``architecture`` or else the module's class."""
    d = module.config.to_dict()
    d.pop("_name_or_path", None)
    d["architectures"] = [architecture or type(module).__name__]
    return (json.dumps(d, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _transformer_config_bytes(module, pooling: str) -> bytes:
    # a mean-pooled classifier is not a Hugging Face class; its encoder is (the head is fedclinic's)
    return _hf_config_bytes(module, type(module.encoder).__name__ if pooling == "mean" else None)


def _pop_pooling(config: dict[str, Any]) -> str:
    """Remove and check the ``pooling`` key of a transformer ``config`` (default ``cls``)."""
    pooling = config.pop("pooling", "cls")
    problem = pooling_problem(pooling)
    if problem:
        raise ConfigError(problem)
    return pooling


def _transformer_arch_config(model_type: str, pooling: str) -> dict[str, Any]:
    # the [CLS] form records no pooling key, so packages made before mean pooling existed keep their hash
    return {"model_type": model_type, **({"pooling": pooling} if pooling != "cls" else {})}


def _build_hf_module(config, seed: int, pooling: str = "cls"):
    from transformers import AutoModelForSequenceClassification

    with _seeded(seed):
        if pooling == "mean":
            module = mean_pooled_classifier_class()(config)
        else:
            module = AutoModelForSequenceClassification.from_config(config)
    return module.float()


def _read_checkpoint(folder: Path) -> dict[str, np.ndarray]:
    """Read safetensors weights (single file or sharded with an index); never pickle-based formats."""
    from safetensors.numpy import load_file

    single = folder / WEIGHTS_FILE
    index = folder / "model.safetensors.index.json"
    if single.is_file():
        return _load_safetensors(single, load_file)
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        out: dict[str, np.ndarray] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = (folder / shard).resolve()
            if not shard_path.is_relative_to(folder.resolve()):
                raise IntegrityError(f"{index} points outside its folder: {shard!r}")
            out.update(_load_safetensors(shard_path, load_file))
        return out
    raise ConfigError(f"{folder} holds no {WEIGHTS_FILE}; only safetensors weights are loaded (pickle-based "
                      "pytorch_model.bin is refused). Convert it once with save_pretrained(safe_serialization=True)")


def _load_safetensors(path: Path, load_file) -> dict[str, np.ndarray]:
    try:
        arrays = load_file(str(path))
    except Exception as exc:
        # bf16 has no numpy dtype: fall back to torch's reader (still safetensors, no pickle)
        try:
            from safetensors.torch import load_file as torch_load_file

            return {k: v.float().numpy() if v.is_floating_point() else v.numpy()
                    for k, v in torch_load_file(str(path)).items()}
        except Exception:
            raise IntegrityError(f"cannot read weights {path}: {exc}") from None
    return arrays


def _map_checkpoint(module, checkpoint: Mapping[str, np.ndarray],
                    fresh_modules: tuple[str, ...] = _FRESH_MODULES) -> dict[str, np.ndarray]:
    """Match checkpoint names to the module's state-dict names.

    Accepts names with or without the base-model prefix (``bert.``) and legacy LayerNorm ``gamma``/``beta``.
    Raises IntegrityError when a tensor of the encoder itself is missing or has the wrong shape. The
    classification head is never taken from the checkpoint (a new task has new labels) and a pooler may be
    absent; those keep their seeded initialisation. ``fresh_modules``: name prefixes of the task's new head(s).
    """
    state = module.state_dict()
    prefix = getattr(module, "base_model_prefix", "") or ""
    normalised: dict[str, np.ndarray] = {}
    for key, arr in checkpoint.items():
        key = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", key)
        key = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", key)
        normalised[key] = arr
    mapped: dict[str, np.ndarray] = {}
    for name in state:
        if name.startswith(fresh_modules):
            continue  # the task's labels get a new head, even when the checkpoint has one for other labels
        if name in normalised:
            mapped[name] = normalised[name]
        elif prefix and name.startswith(prefix + ".") and name[len(prefix) + 1:] in normalised:
            mapped[name] = normalised[name[len(prefix) + 1:]]
    missing = [n for n in state if n not in mapped]
    fresh = [n for n in missing if n.startswith(fresh_modules) or ".pooler." in f".{n}"]
    hard_missing = [n for n in missing if n not in fresh]
    if hard_missing:
        raise IntegrityError(f"the pretrained weights lack encoder tensor(s) {_fmt(hard_missing)}; the folder "
                             "does not match its config.json (wrong model_type or a different model)")
    bad = [f"{n} {tuple(a.shape)} != model {tuple(state[n].shape)}" for n, a in mapped.items()
           if tuple(a.shape) != tuple(state[n].shape)]
    if bad:
        raise IntegrityError(f"pretrained tensor shape mismatch: {_fmt(bad)}")
    if fresh:
        log.info("newly initialised (seeded): %s", ", ".join(fresh))
    return mapped


# ------------------------------------------------------------------------------------------------------------
# public: packaging


def package_pretrained(
    path: str | Path,
    *,
    labels: Sequence[str],
    architecture: str = "transformer",
    multi_label: bool = False,
    max_length: int = 128,
    seed: int = 0,
    config: Mapping[str, Any] | None = None,
) -> ModelPackage:
    """Package a local Hugging Face folder (``config.json`` + safetensors + ``tokenizer.json``) for a task.

    ``transformer``: the encoder weights come from the folder; the new classification head (and a pooler if
    the checkpoint has none) is initialised from ``seed`` (same seed, same package hash). ``config``
    overrides HF config fields that do not change shapes (e.g. ``{"hidden_dropout_prob": 0.0}``) and may set
    ``pooling``: ``"cls"`` (default, HF's pooler) or ``"mean"`` (:mod:`fedclinic.models.mean_pooling`).
    ``lstm`` / ``logreg``: only the folder's tokenizer is used; ``config`` sets the architecture's fields.
    Nothing is downloaded; nothing but JSON and safetensors is read.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"pretrained model folder {folder} does not exist; give a local folder with "
                          f"{HF_CONFIG_FILE}, {WEIGHTS_FILE} and {TOKENIZER_FILE}")
    _check_architecture(architecture)
    tok_path = folder / TOKENIZER_FILE
    if not tok_path.is_file():
        raise ConfigError(f"{folder} has no {TOKENIZER_FILE}; save a fast tokenizer there once with "
                          "tokenizer.save_pretrained(folder)")
    tokenizer_json = tok_path.read_bytes()
    cfg_path = folder / HF_CONFIG_FILE
    hf_cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    base_model = str(hf_cfg.get("_name_or_path") or folder.name)
    side_files = {n: (folder / n).read_bytes() for n in _TOKENIZER_SIDE_FILES if (folder / n).is_file()}
    if architecture != "transformer":
        pkg = package_from_config(architecture=architecture, labels=labels, tokenizer_json=tokenizer_json,
                                  config=dict(config or {}), multi_label=multi_label, max_length=max_length,
                                  seed=seed, base_model=base_model)
        pkg.files.update(side_files)
        return pkg
    if not cfg_path.is_file():
        raise ConfigError(f"{folder} has no {HF_CONFIG_FILE}; a transformer folder needs its Hugging Face config")
    labels = _check_labels(labels, multi_label)
    _check_max_length(max_length)
    merged = {**hf_cfg, **dict(config or {})}
    pooling = _pop_pooling(merged)
    declared = sentence_transformers_pooling(folder)
    if declared is not None and declared != pooling:
        log.info("%s was trained with %s pooling; set pooling = %r in the model config to use it, or keep %s",
                 folder, declared, declared, pooling)
    hf_config = _hf_config(merged, labels, multi_label)
    tokenizer = load_tokenizer(tokenizer_json)
    _check_transformer_fits(hf_config, tokenizer.get_vocab_size(with_added_tokens=True), max_length)
    checkpoint = _read_checkpoint(folder)
    module = _build_hf_module(hf_config, seed, pooling)
    load_tensors(module, _map_checkpoint(module, checkpoint))
    meta = _meta(architecture, labels, multi_label, max_length, base_model,
                 _transformer_arch_config(hf_config.model_type, pooling))
    files = {META_FILE: _meta_bytes(meta), TOKENIZER_FILE: tokenizer_json,
             HF_CONFIG_FILE: _transformer_config_bytes(module, pooling),
             **side_files}
    return ModelPackage(tensors=module_tensors(module), files=files)


def package_from_config(
    *,
    architecture: str,
    labels: Sequence[str],
    tokenizer_json: bytes,
    config: Mapping[str, Any],
    multi_label: bool = False,
    max_length: int = 128,
    seed: int = 0,
    base_model: str = "from-config",
) -> ModelPackage:
    """A freshly initialised model (seeded) from an architecture config — tiny models for tests and baselines.

    ``transformer``: ``config`` is an HF config dict with ``model_type`` (e.g. ``{"model_type": "bert",
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}``, plus
    an optional ``pooling``: ``"cls"`` or ``"mean"``); ``vocab_size`` and ``pad_token_id`` default to the
    tokenizer's. ``lstm``: keys of :data:`LSTM_DEFAULTS`.
    ``logreg``: no keys. ``vocab_size`` always comes from the tokenizer for lstm/logreg.
    """
    _check_architecture(architecture)
    labels = _check_labels(labels, multi_label)
    _check_max_length(max_length)
    if isinstance(tokenizer_json, str):
        tokenizer_json = tokenizer_json.encode("utf-8")
    tokenizer = load_tokenizer(tokenizer_json)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    pad_id = tokenizer_pad_id(tokenizer_json)
    config = dict(config or {})
    files = {TOKENIZER_FILE: bytes(tokenizer_json)}
    if architecture == "transformer":
        config.setdefault("vocab_size", vocab_size)
        config.setdefault("pad_token_id", pad_id)
        pooling = _pop_pooling(config)
        hf_config = _hf_config(config, labels, multi_label)
        _check_transformer_fits(hf_config, vocab_size, max_length)
        module = _build_hf_module(hf_config, seed, pooling)
        arch_config: dict[str, Any] = _transformer_arch_config(hf_config.model_type, pooling)
        files[HF_CONFIG_FILE] = _transformer_config_bytes(module, pooling)
    else:
        arch_config = _arch_config(architecture, config, vocab_size, pad_id)
        with _seeded(seed):
            module = _build_own_module(architecture, arch_config, len(labels))
    meta = _meta(architecture, labels, multi_label, max_length, base_model, arch_config)
    files[META_FILE] = _meta_bytes(meta)
    return ModelPackage(tensors=module_tensors(module), files=files)


def _meta(architecture: str, labels: list[str], multi_label: bool, max_length: int, base_model: str,
          arch_config: Mapping[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "family": FAMILY, "architecture": architecture, "labels": list(labels),
            "multi_label": bool(multi_label), "max_length": int(max_length), "base_model": base_model,
            "arch_config": dict(arch_config)}


def _arch_config(architecture: str, config: Mapping[str, Any], vocab_size: int, pad_id: int) -> dict[str, Any]:
    config = dict(config)
    config.pop("vocab_size", None)
    config.pop("pad_token_id", None)
    if architecture == "logreg":
        if config:
            raise ConfigError(f"logreg takes no config keys, got {sorted(config)}")
        return {"vocab_size": vocab_size}
    unknown = sorted(set(config) - set(LSTM_DEFAULTS))
    if unknown:
        raise ConfigError(f"unknown lstm config key(s) {unknown}; allowed: {sorted(LSTM_DEFAULTS)}")
    out = {**LSTM_DEFAULTS, **config, "vocab_size": vocab_size, "pad_token_id": pad_id}
    for key in ("embedding_dim", "hidden_size", "num_layers"):
        if not isinstance(out[key], int) or isinstance(out[key], bool) or out[key] < 1:
            raise ConfigError(f"lstm {key} must be a positive integer, got {out[key]!r}")
    if not isinstance(out["bidirectional"], bool):
        raise ConfigError(f"lstm bidirectional must be true or false, got {out['bidirectional']!r}")
    if not isinstance(out["dropout"], (int, float)) or not 0.0 <= float(out["dropout"]) < 1.0:
        raise ConfigError(f"lstm dropout must be in [0, 1), got {out['dropout']!r}")
    out["dropout"] = float(out["dropout"])
    return out


def _build_own_module(architecture: str, arch_config: Mapping[str, Any], num_labels: int):
    try:
        if architecture == "lstm":
            kw = {k: arch_config[k] for k in (*LSTM_DEFAULTS, "vocab_size", "pad_token_id")}
            return _lstm_class()(num_labels=num_labels, **kw)
        return _logreg_class()(vocab_size=int(arch_config["vocab_size"]), num_labels=num_labels)
    except KeyError as exc:
        raise IntegrityError(f"fedclinic_model.json arch_config lacks {exc} for architecture {architecture!r}") from None


# ------------------------------------------------------------------------------------------------------------
# public: building


def build(package: ModelPackage) -> LoadedModel:
    """Build the module of a text-classification package and load its tensors strictly."""
    meta = package.meta
    architecture = _check_architecture(meta.get("architecture"))
    labels = meta.get("labels")
    if not isinstance(labels, list):
        raise IntegrityError(f"{META_FILE} has no label list")
    multi_label = bool(meta.get("multi_label", False))
    labels = _check_labels(labels, multi_label)
    tok_bytes = package.files.get(TOKENIZER_FILE)
    if tok_bytes is None:
        raise IntegrityError(f"the package has no {TOKENIZER_FILE}; every text model carries its tokenizer")
    tokenizer = load_tokenizer(tok_bytes)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    if architecture == "transformer":
        raw = package.files.get(HF_CONFIG_FILE)
        if raw is None:
            raise IntegrityError(f"a transformer package needs {HF_CONFIG_FILE}")
        hf = json.loads(raw)
        declared = (meta.get("arch_config") or {}).get("model_type")
        pooling = (meta.get("arch_config") or {}).get("pooling", "cls")
        if pooling not in POOLINGS:
            raise IntegrityError(f"{META_FILE} declares pooling {pooling!r}; this version knows {list(POOLINGS)}")
        _check_model_type(hf.get("model_type"))
        if declared is not None and declared != hf.get("model_type"):
            raise IntegrityError(f"{META_FILE} says model_type {declared!r} but {HF_CONFIG_FILE} says "
                                 f"{hf.get('model_type')!r}")
        config = _hf_config(hf, labels, multi_label)
        if int(config.vocab_size) < vocab_size:
            raise IntegrityError(f"{TOKENIZER_FILE} has {vocab_size} tokens but the model's vocab_size is "
                                 f"{config.vocab_size}")
        module = _build_hf_module(config, 0, pooling)
    else:
        arch = dict(meta.get("arch_config") or {})
        if int(arch.get("vocab_size", -1)) != vocab_size:
            raise IntegrityError(f"{META_FILE} declares vocab_size {arch.get('vocab_size')} but {TOKENIZER_FILE} "
                                 f"has {vocab_size} tokens")
        with _seeded(0):  # the initial values are overwritten; seeding keeps the caller's RNG untouched
            module = _build_own_module(architecture, arch, len(labels))
    load_strict(module, package.tensors)
    module.eval()
    return LoadedModel(module=module, tokenizer=tokenizer, meta=meta, pad_id=tokenizer_pad_id(tok_bytes))


def load_strict(module, tensors: Mapping[str, np.ndarray]) -> None:
    """Load a full set of tensors: missing, unexpected or mis-shaped ones raise IntegrityError naming them."""
    state = module.state_dict()
    missing = [n for n in state if n not in tensors]
    unexpected = [n for n in tensors if n not in state]
    parts = []
    if missing:
        parts.append(f"missing tensor(s) {_fmt(missing)}")
    if unexpected:
        parts.append(f"unexpected tensor(s) {_fmt(unexpected)}")
    if parts:
        raise IntegrityError("the package's weights do not match its declared model: " + "; ".join(parts))
    load_tensors(module, tensors)
