"""Tiny FedNER (``cnn-bilstm-crf``) packages on the toy NER set (:mod:`tests.helpers.ner_models`), and the names
of their shared and private tensors."""

from __future__ import annotations

from fedclinic.models.token_classification import package_ner_from_config
from fedclinic.transport.package import ModelPackage

from tests.helpers.ner_models import LABELS, tokenizer

ARCH = "cnn-bilstm-crf"
TINY = {"embedding_dim": 16, "char_dim": 8, "char_filters": 16, "word_filters": 16, "lstm_hidden": 16,
        "dropout": 0.1}
LSTM = [f"lstm.{kind}_l0{suffix}" for suffix in ("", "_reverse")
        for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
SHARED = ["word_embedding.weight", "char_embedding.weight", "char_cnn.weight", "char_cnn.bias", "word_cnn.weight",
          "word_cnn.bias"]
PRIVATE = [*LSTM, "classifier.weight", "classifier.bias", "crf.transitions", "crf.start_transitions",
           "crf.end_transitions"]


def package(seed: int = 0, scheme: str = "BIO", config=TINY, tok: bytes | None = None) -> ModelPackage:
    """A seeded tiny FedNER package on the toy NER labels (``tok``: another tokenizer)."""
    return package_ner_from_config(labels=LABELS, tokenizer_json=tok or tokenizer(), config=config, architecture=ARCH,
                                   scheme=scheme, max_length=32, seed=seed)
