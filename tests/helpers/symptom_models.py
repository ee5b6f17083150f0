"""The tiny three-label symptom set (``resp``, ``skin``, ``gi``) of the trainer and simulator unit tests: keyword
and filler words, a word-level tokenizer over them, examples, tiny packages, and the tiny BERT config the unit tests
share."""

from __future__ import annotations

import random

from fedclinic.data.text import Example
from fedclinic.models import build_model, package_from_config, wordlevel_tokenizer_json

KEYWORDS = {"resp": ["fever", "cough", "chills"], "skin": ["rash", "itch", "hives"], "gi": ["nausea", "vomit", "cramps"]}
FILLER = "the patient reports today mild severe since yesterday and with no history of".split()
LABELS = list(KEYWORDS)
TOK = wordlevel_tokenizer_json(FILLER + [w for ws in KEYWORDS.values() for w in ws])
TINY_BERT = dict(model_type="bert", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64, max_position_embeddings=64)


def examples(n, seed=0, multi=False):
    """Labels in turn (resp, skin, gi, ...), each row four filler words and two keywords of each label; ``multi``:
    every other row also has the next label."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        labs = [LABELS[i % 3]] + ([LABELS[(i + 1) % 3]] if multi and i % 2 else [])
        words = rng.sample(FILLER, 4) + [w for lab in labs for w in rng.sample(KEYWORDS[lab], 2)]
        rng.shuffle(words)
        out.append(Example(" ".join(words), tuple(labs)))
    return out


def random_examples(n, seed):
    """Labels drawn at random, each row four filler words and one keyword (the simulator tests' sites)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        lab = LABELS[rng.randrange(3)]
        words = rng.sample(FILLER, 4) + rng.sample(KEYWORDS[lab], 1)
        rng.shuffle(words)
        out.append(Example(" ".join(words), (lab,)))
    return out


def model(arch="logreg", multi=False, **cfg):
    """A tiny package of ``arch`` (``cfg`` overrides its config) and the model built from it."""
    config = {"transformer": TINY_BERT, "lstm": {"embedding_dim": 8, "hidden_size": 8}, "logreg": {}}[arch]
    pkg = package_from_config(architecture=arch, labels=LABELS, tokenizer_json=TOK, config={**config, **cfg},
                              multi_label=multi, max_length=32)
    return pkg, build_model(pkg)
