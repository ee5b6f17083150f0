"""fedclinic.data.partition: property tests for the partition invariants, and the skew each one produces."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedclinic.errors import ConfigError
from fedclinic.data.partition import dirichlet_label_skew, iid, quantity_skew

SETTINGS = settings(max_examples=60, deadline=None)


def _assert_partition(parts, n, sites, min_per_site):
    assert len(parts) == sites
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(n))  # complete and disjoint
    assert all(p == sorted(p) for p in parts)
    assert all(isinstance(i, int) for i in flat)
    assert min(len(p) for p in parts) >= min_per_site


@SETTINGS
@given(sites=st.integers(1, 12), extra=st.integers(0, 200), seed=st.integers(0, 2**32 - 1))
def test_iid_properties(sites, extra, seed):
    n = sites + extra
    parts = iid(n, sites, seed)
    _assert_partition(parts, n, sites, 1)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert parts == iid(n, sites, seed)


@SETTINGS
@given(sites=st.integers(1, 10), m=st.integers(0, 5), extra=st.integers(0, 200),
       alpha=st.floats(0.01, 100), seed=st.integers(0, 2**32 - 1))
def test_quantity_skew_properties(sites, m, extra, alpha, seed):
    n = sites * m + extra
    parts = quantity_skew(n, sites, alpha, seed, min_per_site=m)
    _assert_partition(parts, n, sites, m)
    assert parts == quantity_skew(n, sites, alpha, seed, min_per_site=m)


@SETTINGS
@given(labels=st.lists(st.sampled_from("abcde"), min_size=1, max_size=200), sites=st.integers(1, 8),
       m=st.integers(0, 4), alpha=st.floats(0.01, 100), seed=st.integers(0, 2**32 - 1))
def test_dirichlet_label_skew_properties(labels, sites, m, alpha, seed):
    if len(labels) < sites * m:
        with pytest.raises(ConfigError, match="cannot give each of"):
            dirichlet_label_skew(labels, sites, alpha, seed, min_per_site=m)
        return
    parts = dirichlet_label_skew(labels, sites, alpha, seed, min_per_site=m)
    _assert_partition(parts, len(labels), sites, m)
    assert parts == dirichlet_label_skew(labels, sites, alpha, seed, min_per_site=m)


def test_seeds_change_the_split():
    assert iid(100, 4, 0) != iid(100, 4, 1)
    assert quantity_skew(100, 4, 1.0, 0) != quantity_skew(100, 4, 1.0, 1)
    labels = [i % 5 for i in range(200)]
    assert dirichlet_label_skew(labels, 4, 0.5, 0) != dirichlet_label_skew(labels, 4, 0.5, 1)


def test_small_alpha_skews_labels_large_alpha_does_not():
    labels = [i % 4 for i in range(4000)]

    def mean_tv(alpha):  # mean total-variation distance of site label mixes from the global (uniform) mix
        tvs = []
        for p in dirichlet_label_skew(labels, 5, alpha, seed=3):
            hist = np.bincount([labels[i] for i in p], minlength=4) / len(p)
            tvs.append(0.5 * np.abs(hist - 0.25).sum())
        return float(np.mean(tvs))

    assert mean_tv(0.05) > 0.4
    assert mean_tv(1000.0) < 0.05


def test_quantity_skew_sizes_follow_alpha():
    small = [len(p) for p in quantity_skew(5000, 5, 0.1, seed=1)]
    large = [len(p) for p in quantity_skew(5000, 5, 1000.0, seed=1)]
    assert max(small) / min(small) > 5
    assert max(large) / min(large) < 1.2


def test_extreme_skew_still_meets_min_per_site():
    labels = ["a"] * 30  # one class: with alpha tiny, almost all draws give everything to one site
    parts = dirichlet_label_skew(labels, 6, 1e-4, seed=0, min_per_site=5)
    _assert_partition(parts, 30, 6, 5)


@pytest.mark.parametrize("call,msg", [
    (lambda: iid(3, 4, 0), "cannot give each of 4 sites at least 1 example"),
    (lambda: iid(10, 0, 0), "sites must be a positive integer"),
    (lambda: quantity_skew(10, 2, 0.0, 0), "alpha must be a finite number > 0"),
    (lambda: quantity_skew(10, 2, float("nan"), 0), "alpha must be a finite number > 0"),
    (lambda: quantity_skew(10, 2, 1.0, 0, min_per_site=-1), "min_per_site must be >= 0"),
    (lambda: dirichlet_label_skew(["a"] * 5, 2, 1.0, 0, min_per_site=3), "at least 3 example"),
])
def test_bad_arguments(call, msg):
    with pytest.raises(ConfigError, match=msg):
        call()
