"""Tiny dropout-free packages of the three text families and the comparison every distributed-round test makes:
one site round in this process (``run_site_round``) against the same round as 2 gloo processes
(``run_site_round_distributed``), from the same package, data, seed and global batch."""

from __future__ import annotations

import os

import numpy as np
import pytest

from fedclinic.federation.site_round import SiteRoundInput, run_site_round

#: set by `make test-distributed`: the per-family equality tests (each launches 2 processes that import torch)
FULL = os.environ.get("FEDCLINIC_TEST_DISTRIBUTED") == "1"
full_only = pytest.mark.skipif(not FULL, reason="one 2-process launch per family: run `make test-distributed`")
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
TWO_CPUS = ["cpu", "cpu"]


def classification_package(seed: int = 0):
    """The tiny 1-layer BERT text classifier of tests.helpers.text_models, without dropout."""
    from fedclinic.models import package_from_config
    from tests.helpers import text_models

    config = {"model_type": "bert", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
              "intermediate_size": 32, "max_position_embeddings": 64, **NO_DROPOUT}
    return package_from_config(architecture="transformer", labels=text_models.LABELS,
                               tokenizer_json=text_models.tiny_tokenizer_json(), config=config, max_length=16,
                               seed=seed)


def classification_examples(n: int, seed: int):
    from fedclinic.data.text import Example
    from tests.helpers import text_models

    return [Example(r["text"], (r["label"],)) for r in text_models.make_examples(n, seed)]


def ner_package(seed: int = 0):
    """The tiny BERT + CRF of tests.helpers.ner_models, without dropout."""
    from fedclinic.models.token_classification import package_ner_from_config
    from tests.helpers import ner_models

    return package_ner_from_config(labels=ner_models.LABELS, tokenizer_json=ner_models.tokenizer(),
                                   config={**ner_models.TINY, **NO_DROPOUT}, architecture="transformer-crf",
                                   max_length=32, seed=seed)


def relative_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """||a - b|| / ||a|| over all tensors (a and b name the same tensors)."""
    assert set(a) == set(b)
    num = sum(float(np.sum((a[k].astype(np.float64) - b[k]) ** 2)) for k in a)
    den = sum(float(np.sum(a[k].astype(np.float64) ** 2)) for k in a)
    return (num / den) ** 0.5


def both_rounds(package, examples, train, *, dp=None, dp_entropy=None, devices=TWO_CPUS, **launch):
    """(1-process result, distributed result) of round 1 at site ``site-a`` training every tensor (``launch``: more
    arguments of ``run_site_round_distributed``)."""
    from fedclinic.federation.distributed_round import run_site_round_distributed
    from fedclinic.models import build_model
    from fedclinic.training import trainer as training

    results = []
    for distributed in (False, True):
        loaded = build_model(package)
        data = training.encode(examples, loaded, max_length=train.max_length)
        inp = SiteRoundInput(task_id="t-ddp", site="site-a", round=1, send=list(package.tensors), train=train,
                             dp=dp, dp_entropy=dp_entropy)
        results.append(run_site_round_distributed(loaded, data, inp, files=package.files, devices=devices, **launch)
                       if distributed else run_site_round(loaded, data, inp))
    return results[0], results[1]
