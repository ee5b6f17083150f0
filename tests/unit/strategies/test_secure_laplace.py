"""The discrete Laplace sampler behind noisy statistics: its distribution (a DKW test with a stated false-failure
bound), replay, and bad arguments."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedclinic.strategies.secure_gaussian import replay_key
from fedclinic.strategies.secure_laplace import SecureDiscreteLaplace, discrete_laplace_cdf
from fedclinic.strategies.secure_random import SecureRandom
from tests.helpers.distribution import dkw_margin, laplace_distance



@pytest.mark.parametrize("scale", [0.7, 3.0, 40.0])
def test_samples_have_the_discrete_laplace_distribution(scale):
    # an exact sampler fails with probability <= 1e-6 per scale (DKW); the second line checks the test's power
    n = 100_000
    z = SecureDiscreteLaplace().sample(n, scale)
    assert z.dtype == np.int64 and z.shape == (n,)
    assert laplace_distance(z, scale) < dkw_margin(n)
    assert laplace_distance(z, scale * 1.25) > dkw_margin(n)  # the test has power against a wrong scale


def test_the_cdf_is_the_sum_of_the_pmf():
    t = 2.5
    p = math.exp(-1 / t)
    pmf = lambda z: (1 - p) / (1 + p) * p ** abs(z)  # noqa: E731
    for z in (-7, -1, 0, 3):
        assert discrete_laplace_cdf(z, t) == pytest.approx(sum(pmf(k) for k in range(-400, z + 1)), abs=1e-12)


def test_fresh_samplers_differ_and_a_keyed_one_replays():
    a, b = SecureDiscreteLaplace().sample(64, 5.0), SecureDiscreteLaplace().sample(64, 5.0)
    assert not np.array_equal(a, b)
    key = replay_key(7, "statistics")
    assert np.array_equal(SecureDiscreteLaplace(SecureRandom(key)).sample(64, 5.0),
                          SecureDiscreteLaplace(SecureRandom(key)).sample(64, 5.0))


def test_bad_arguments():
    s = SecureDiscreteLaplace()
    assert s.sample(0, 1.0).shape == (0,)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="scale"):
            s.sample(3, bad)
    with pytest.raises(ValueError):
        s.sample(-1, 1.0)
