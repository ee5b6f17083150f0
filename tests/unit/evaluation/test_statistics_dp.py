"""Noisy statistics: each group's noise has the discrete Laplace scale its sensitivity and share of epsilon give
(a DKW test: an exact mechanism fails it with probability <= 1e-6), derived values are post-processing, suppression follows."""

from __future__ import annotations

import numpy as np
import pytest

from fedclinic.data.text import Example
from fedclinic.evaluation.statistics import site_statistics
from fedclinic.evaluation.statistics_counts import measure
from fedclinic.evaluation.statistics_dp import (
    LENGTH_EDGES,
    histogram,
    histogram_quantiles,
    label_sensitivity,
    noisy_release,
)
from fedclinic.models.base import load_tokenizer, wordlevel_tokenizer_json
from fedclinic.proto import task_pb2
from fedclinic.strategies.secure_gaussian import replay_key
from fedclinic.strategies.secure_laplace import SecureDiscreteLaplace
from fedclinic.strategies.secure_random import SecureRandom
from tests.helpers.distribution import dkw_margin, laplace_distance

WORDS = "the patient reports mild fever cough".split()


def _spec(epsilon: float, multi_label: bool = False) -> task_pb2.TaskSpec:
    return task_pb2.TaskSpec(family="text-classification", labels=["a", "b", "c"], multi_label=multi_label,
                             training=task_pb2.TrainingConfig(max_length=8),
                             statistics=task_pb2.StatisticsConfig(epsilon=epsilon))


def _examples(n: int = 300) -> list[Example]:
    return [Example(" ".join(WORDS[: 1 + i % 6]), ("ab"[i % 2],)) for i in range(n)]


def test_each_group_gets_the_scale_of_its_sensitivity_over_its_share_of_epsilon():
    # 3 groups without a tokenizer (rows, labels, char lengths): rows get scale 1 / (eps / 3); with a tokenizer
    # 6 groups. The test fails with probability <= 1e-6 per case for a correct mechanism (DKW, 1000 draws), and
    # one with probability > 1 - 1e-6 when the epsilon is not split (scale 3x smaller).
    eps, n = 1.5, 1000
    tok = load_tokenizer(wordlevel_tokenizer_json(WORDS))
    for tokenizer, groups in ((None, 3), (tok, 6)):
        counts = measure(_examples(), tokenizer, "abc", multi_label=False, max_length=8)
        sampler = SecureDiscreteLaplace()
        draws = np.array([noisy_release(counts, eps, sampler)["rows"] for _ in range(n)]) - counts.rows
        assert laplace_distance(draws.astype(np.int64), groups / eps) < dkw_margin(n)
        assert laplace_distance(draws.astype(np.int64), 1 / eps) > dkw_margin(n)


def test_the_label_group_sensitivity_counts_every_label_and_pair_a_row_can_change():
    assert label_sensitivity(1, False) == 1
    assert label_sensitivity(5, True) == 5 + 10 and label_sensitivity(5, False) == 5  # NER: entity types, no pairs
    ner_row = type("NerRow", (), {"text": "x", "entities": ()})()
    assert measure([ner_row], None, "abc", multi_label=False, max_length=8).labels_per_row == 3
    counts = measure([Example("fever", ("a", "b"))] * 200, None, "abc", multi_label=True, max_length=8)
    n, eps = 2000, 3.0
    sampler = SecureDiscreteLaplace()
    draws = np.array([noisy_release(counts, eps, sampler)["label/a"] for _ in range(n)]) - 200
    assert laplace_distance(draws.astype(np.int64), 3 * label_sensitivity(3, True) / eps) < dkw_margin(n)


def test_a_noisy_answer_is_close_at_large_epsilon_and_suppression_applies_to_noisy_counts():
    tok = load_tokenizer(wordlevel_tokenizer_json(WORDS))
    exact = site_statistics(_examples(3000), tok, task_pb2.TaskSpec(labels=["a", "b", "c"],
                            training=task_pb2.TrainingConfig(max_length=8)), min_cell=10)
    noisy = site_statistics(_examples(3000), tok, _spec(100.0), min_cell=10)
    assert abs(noisy["rows"] - exact["rows"]) < 5 and abs(noisy["label/a"] - exact["label/a"]) < 5
    assert noisy["tokens_q50"] == pytest.approx(exact["tokens_q50"], rel=0.25)
    assert noisy["unk_rate"] == pytest.approx(0.0, abs=0.01)
    assert 0 <= noisy["truncated_rate"] <= 1
    assert noisy["label/c"] == 0 or "suppressed/label/c" in noisy  # a noisy 1..9 is withheld like an exact one
    assert all(isinstance(v, float) for v in noisy.values())


def test_a_replayed_sampler_gives_the_same_answer_and_a_fresh_one_another():
    counts = measure(_examples(), None, "abc", multi_label=False, max_length=8)
    key = replay_key(3, "statistics")
    a = noisy_release(counts, 1.0, SecureDiscreteLaplace(SecureRandom(key)))
    assert a == noisy_release(counts, 1.0, SecureDiscreteLaplace(SecureRandom(key)))
    assert any(noisy_release(counts, 1.0) != a for _ in range(3))
    with pytest.raises(ValueError):
        noisy_release(counts, 0.0)


def test_histogram_quantiles_interpolate_within_log_bins():
    lengths = np.arange(1, 1001)
    h = histogram(lengths)
    assert h.sum() == 1000 and LENGTH_EDGES[0] == 0 and np.all(np.diff(LENGTH_EDGES) > 0)
    for got, pp in zip(histogram_quantiles(h), (5, 25, 50, 75, 95)):
        assert got == pytest.approx(np.percentile(lengths, pp), rel=0.1)
