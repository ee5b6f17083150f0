"""The tiny two-label text-classification set the federation tests run on: clinical-ish notes labelled
``cardio`` or ``neuro``, a word-level tokenizer over their words, tiny packages of each architecture, and site
data files."""

from __future__ import annotations

import json
import random
from pathlib import Path

LABELS = ["cardio", "neuro"]
WORDS = {
    "cardio": ["heart", "chest", "pressure", "beta", "statin", "arrhythmia", "palpitations", "angina"],
    "neuro": ["migraine", "seizure", "tremor", "numbness", "aura", "dizziness", "neuropathy", "stroke"],
}
FILLER = ["patient", "reports", "the", "after", "with", "daily", "mild", "severe", "since", "week"]


def tiny_tokenizer_json(padding_words: int = 0) -> bytes:
    """A word-level tokenizer over every word of the set ([PAD], [UNK], [CLS], [SEP] first), plus
    ``padding_words`` words the data never uses (a larger embedding, for transfer tests)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + sorted({w for ws in WORDS.values() for w in ws} | set(FILLER))
    vocab += [f"unused{i}" for i in range(padding_words)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str().encode()


def tiny_package(architecture: str = "logreg", seed: int = 0):
    """A seeded tiny text-classification package: ``logreg``, a 1-layer 16-wide BERT (``transformer``) or a small
    BiLSTM (``lstm``)."""
    from fedclinic.models import package_from_config

    config = {}
    if architecture == "transformer":
        config = {"model_type": "bert", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "intermediate_size": 32, "max_position_embeddings": 64}
    elif architecture == "lstm":
        config = {"embedding_dim": 16, "hidden_size": 16, "num_layers": 1, "bidirectional": True}
    return package_from_config(architecture=architecture, labels=LABELS, tokenizer_json=tiny_tokenizer_json(),
                               config=config, max_length=16, seed=seed)


def wide_package(padding_words: int = 30_000, embedding_dim: int = 64, seed: int = 0):
    """A small LSTM whose embedding is large (``padding_words`` x ``embedding_dim`` float32, 7.7 MB by default):
    model fetches and updates of several 2 MiB chunks, still trained in a second on a CPU."""
    from fedclinic.models import package_from_config

    return package_from_config(architecture="lstm", labels=LABELS, tokenizer_json=tiny_tokenizer_json(padding_words),
                               config={"embedding_dim": embedding_dim, "hidden_size": 8, "num_layers": 1,
                                       "bidirectional": False}, max_length=16, seed=seed)


def make_examples(n: int, seed: int) -> list[dict]:
    """``n`` JSONL rows ``{"text", "label"}``, labels in turn, three keywords of the label and three filler words."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = LABELS[i % 2]
        words = rng.sample(WORDS[label], 3) + rng.sample(FILLER, 3)
        rng.shuffle(words)
        rows.append({"text": " ".join(words), "label": label})
    return rows


def write_site_data(folder: Path, n: int, seed: int) -> Path:
    """``folder/train.jsonl`` with :func:`make_examples` ``(n, seed)``: one site's dataset."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in make_examples(n, seed)))
    return path
