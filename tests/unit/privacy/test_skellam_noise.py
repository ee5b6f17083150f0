"""Poisson and Skellam noise from the CSPRNG: means, variances and pmfs (both samplers: inversion below mean 10, PTRS
from 10 on), and the closure under addition distributed DP relies on.

Every test replays a fixed SecureRandom key, so each is deterministic; the bounds are still chosen so that a correct
sampler fails them with probability below 1e-6 over keys: z = 5.3 standard errors for means and variances (normal
approximation; two-sided p = 1.2e-7) and the chi-square statistic's 1 - 1e-6 quantile (Wilson-Hilferty)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedclinic.privacy.secure_random import SecureRandom
from fedclinic.privacy.skellam_noise import poisson_noise, skellam_noise

Z = 5.3
N = 200_000


def _rng(tag: bytes) -> SecureRandom:
    return SecureRandom(key=tag.ljust(32, b"."))


def _poisson_pmf(lam: float, kmax: int) -> np.ndarray:
    return np.array([math.exp(-lam + k * math.log(lam) - math.lgamma(k + 1)) for k in range(kmax + 1)])


def _skellam_pmf(mu: float, kmax: int) -> dict[int, float]:
    """P(P1 - P2 = k) for P1, P2 ~ Poisson(mu/2), by convolution (= exp(-mu) I_k(mu))."""
    p = _poisson_pmf(mu / 2, kmax + 200)
    return {k: float(np.dot(p[abs(k):], p[:p.size - abs(k)])) for k in range(-kmax, kmax + 1)}


def _chi2_quantile(dof: int, z: float = 4.75) -> float:
    """Upper 1 - 1e-6 quantile of chi-square with ``dof`` degrees of freedom (Wilson-Hilferty; z = Phi^-1(1-1e-6))."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def _chi2(samples: np.ndarray, pmf: dict[int, float]) -> tuple[float, int]:
    keys = [k for k, p in pmf.items() if p * samples.size >= 20]
    counts = {k: int(np.count_nonzero(samples == k)) for k in keys}
    rest_expected = samples.size * (1 - sum(pmf[k] for k in keys))
    stat = sum((counts[k] - samples.size * pmf[k]) ** 2 / (samples.size * pmf[k]) for k in keys)
    rest = samples.size - sum(counts.values())
    if rest_expected >= 20:
        stat += (rest - rest_expected) ** 2 / rest_expected
        return stat, len(keys)
    return stat, len(keys) - 1


@pytest.mark.parametrize("lam", [0.25, 3.0, 9.9, 10.0, 40.0, 5e3, 2.5e8])
def test_poisson_mean_and_variance(lam):
    x = poisson_noise(_rng(f"poisson-{lam}".encode()), lam, N)
    assert x.dtype == np.int64 and x.min() >= 0
    assert abs(x.mean() - lam) <= Z * math.sqrt(lam / N)
    # var of the sample variance of Poisson: (mu4 - sigma^4) / n with mu4 = lam (1 + 3 lam)
    assert abs(x.var() - lam) <= Z * math.sqrt((lam * (1 + 3 * lam) - lam * lam) / N)


@pytest.mark.parametrize("lam", [3.0, 40.0])  # inversion, PTRS
def test_poisson_pmf(lam):
    x = poisson_noise(_rng(f"pmf-{lam}".encode()), lam, N)
    pmf = dict(enumerate(_poisson_pmf(lam, int(lam * 4 + 40))))
    stat, dof = _chi2(x, pmf)
    assert stat <= _chi2_quantile(dof), (stat, dof)


@pytest.mark.parametrize("mu", [6.0, 60.0, 1e6])
def test_skellam_mean_variance_and_pmf(mu):
    x = skellam_noise(_rng(f"skellam-{mu}".encode()), mu, N)
    assert abs(x.mean()) <= Z * math.sqrt(mu / N)
    # the fourth central moment of Skellam(mu) is mu + 3 mu^2
    assert abs(x.var() - mu) <= Z * math.sqrt((mu + 2 * mu * mu) / N)
    if mu <= 60:
        stat, dof = _chi2(x, _skellam_pmf(mu, int(8 * math.sqrt(mu) + 10)))
        assert stat <= _chi2_quantile(dof), (stat, dof)


def test_a_sum_of_shares_is_skellam_of_the_summed_variance():
    rng = _rng(b"closure")
    total = sum(skellam_noise(rng, 4.0, N) for _ in range(3))
    stat, dof = _chi2(total, _skellam_pmf(12.0, 40))
    assert stat <= _chi2_quantile(dof), (stat, dof)


def test_distinct_keys_give_distinct_noise_and_a_key_replays():
    a = skellam_noise(_rng(b"a"), 100.0, 1000)
    assert np.array_equal(a, skellam_noise(_rng(b"a"), 100.0, 1000))
    assert not np.array_equal(a, skellam_noise(_rng(b"b"), 100.0, 1000))
    assert not np.array_equal(skellam_noise(SecureRandom(), 100.0, 1000), skellam_noise(SecureRandom(), 100.0, 1000))


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="Poisson mean"):
        poisson_noise(_rng(b"x"), -1.0, 3)
    with pytest.raises(ValueError, match="Poisson mean"):
        poisson_noise(_rng(b"x"), math.inf, 3)
    with pytest.raises(ValueError, match="Skellam variance"):
        skellam_noise(_rng(b"x"), math.nan, 3)
    assert not poisson_noise(_rng(b"x"), 0.0, 5).any()


def test_log_factorial_matches_lgamma_on_both_sides_of_the_table():
    from fedclinic.privacy.skellam_noise import _log_factorial

    k = np.array([0, 1, 7, 255, 256, 257, 1000, 123_456, 1e9, 3e12], dtype=np.float64)
    want = np.array([math.lgamma(x + 1) for x in k])
    np.testing.assert_allclose(_log_factorial(k), want, rtol=4e-16, atol=1e-15)
