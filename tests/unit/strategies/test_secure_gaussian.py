"""SecureGaussian: N(0, std^2) from the ChaCha20 keystream -- its distribution, its independence, one rounding
from float64, replay only with the key.

Statistical bounds: each of the 11 checks below fails for a correct sampler with probability below 1e-8 (6
standard errors of an asymptotically normal statistic: two-sided 2e-9; Kolmogorov-Smirnov sqrt(n) D_n < 3.1:
P <= 2 exp(-2 * 3.1^2) = 9e-9; chi-square with 39 degrees of freedom < 115: P = 2e-9), so the file's
false-failure probability is below 1e-7. The streams are keyed (fixed), so a run is also reproducible.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.special import ndtr

from fedclinic.strategies.secure_gaussian import CHUNK, SecureGaussian, replay_key
from fedclinic.strategies.secure_random import SecureRandom

Z = 6.0  # standard errors: two-sided tail 2e-9


def _keyed(purpose: str = "test") -> SecureGaussian:
    return SecureGaussian.replay(2026, purpose)


def test_float32_samples_have_the_normal_distribution():
    n = 1_000_000  # more than one chunk
    z = _keyed().sample(n, 1.0).astype(np.float64)
    assert abs(z.mean()) < Z / math.sqrt(n)
    assert abs(z.var() - 1.0) < Z * math.sqrt(2.0 / n)
    s = np.sort(z)
    cdf = ndtr(s)
    d = max(float(np.max(np.arange(1, n + 1) / n - cdf)), float(np.max(cdf - np.arange(n) / n)))
    assert math.sqrt(n) * d < 3.1  # Kolmogorov-Smirnov against the normal CDF
    # the tails, which KS barely sees: beyond 3 sigma, Binomial(n, 2.6998e-3)
    p3 = 2 * ndtr(-3.0)
    assert abs(np.count_nonzero(np.abs(z) > 3.0) - n * p3) < Z * math.sqrt(n * p3 * (1 - p3))
    # a chi-square over 40 equiprobable bins (39 degrees of freedom: P(chi2 > 115) = 2e-9)
    bins = np.minimum((ndtr(z) * 40).astype(int), 39)
    counts = np.bincount(bins, minlength=40)
    assert float(((counts - n / 40) ** 2 / (n / 40)).sum()) < 115


def test_consecutive_values_and_the_two_halves_of_a_pair_are_independent():
    """Lag-1 correlation of the values and of their squares (a shared radius would correlate the squares),
    and the same between the polar method's two outputs of each accepted pair (u- and v-halves of a draw)."""
    n = 1_000_000
    z = _keyed().sample(n, 1.0).astype(np.float64)
    for a, b in ((z[:-1], z[1:]), (z[:-1] ** 2, z[1:] ** 2)):
        assert abs(np.corrcoef(a, b)[0, 1]) < Z / math.sqrt(n)
    half = 200_000
    w = _keyed("pairs")._standard(2 * half)  # one draw: u * f first, then v * f of the same pairs
    for a, b in ((w[:half], w[half:]), (w[:half] ** 2, w[half:] ** 2)):
        assert abs(np.corrcoef(a, b)[0, 1]) < Z / math.sqrt(half)


def test_float64_samples_are_four_draws_halved_and_normal():
    n = 200_000
    got = _keyed().sample(n, 3.0, np.float64)
    ref = _keyed()
    want = np.zeros(n)
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        part = sum(ref._standard(m) for _ in range(4))
        want[start:start + m] = part * (3.0 / 2.0)
    np.testing.assert_array_equal(got, want)
    assert abs(got.mean()) < Z * 3.0 / math.sqrt(n)
    assert abs(got.var() / 9.0 - 1.0) < Z * math.sqrt(2.0 / n)


def test_scaling_happens_in_float64_before_the_one_rounding():
    """float32 noise is std * (a float64 draw), rounded once: scaling a rounded float32 would leave gaps in the
    reachable float32 values (the floating-point attack's foothold)."""
    std = 1.3
    got = _keyed().sample((300, 7), std)
    assert got.dtype == np.float32 and got.shape == (300, 7)
    want = (_keyed()._standard(2100) * std).astype(np.float32).reshape(300, 7)
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got, _keyed()._standard(2100).astype(np.float32).reshape(300, 7) * np.float32(std))
    half = _keyed().sample(2100, std, np.float16)
    np.testing.assert_array_equal(half, (_keyed()._standard(2100) * std).astype(np.float16))


def test_fresh_samplers_differ_and_a_keyed_one_replays():
    a, b = SecureGaussian().sample(64, 1.0), SecureGaussian().sample(64, 1.0)
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(_keyed().sample(64, 1.0), _keyed().sample(64, 1.0))
    assert not np.array_equal(_keyed("noise").sample(64, 1.0), _keyed("sampler").sample(64, 1.0))
    key = replay_key(7, "x")
    assert len(key) == 32 and key != replay_key(8, "x") and key != replay_key(7, "y")
    s = SecureGaussian(SecureRandom(key))
    np.testing.assert_array_equal(s.sample(10, 1.0), SecureGaussian.replay(7, "x").sample(10, 1.0))


def test_edge_cases_and_bad_arguments():
    g = _keyed()
    assert g.sample((), 2.0, np.float64).shape == () and g.sample(0, 1.0).shape == (0,)
    np.testing.assert_array_equal(g.sample(5, 0.0), np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="floating-point dtype"):
        g.sample(3, 1.0, np.int32)
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="finite and >= 0"):
            g.sample(3, bad)
