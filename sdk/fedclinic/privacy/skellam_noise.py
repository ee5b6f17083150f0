"""Integer noise for distributed DP: Poisson and symmetric Skellam variates from a :class:`SecureRandom` stream.

A symmetric Skellam variate of variance ``mu`` is ``X = P1 - P2`` with ``P1, P2 ~ Poisson(mu / 2)`` independent
(Skellam 1946); its pmf is ``P(X = k) = exp(-mu) I_|k|(mu)`` (``I`` the modified Bessel function of the first
kind), and a sum of independent Skellam variates of variances ``mu_i`` is Skellam of variance ``sum mu_i``. That
closure is what distributed DP relies on: every site adds ``Skellam(mu_site)`` to its integer update inside the
secure-aggregation ring and the survivors' sum carries exactly ``Skellam(m mu_site)`` (Agarwal, Kairouz, Liu,
NeurIPS 2021, "The Skellam Mechanism for Differentially Private Federated Learning", Sec. 3).

Poisson sampling, vectorised over a whole update (every uniform from :class:`SecureRandom`, never numpy's PRNG):

- ``lam < 10``: inversion. ``k`` is the least integer with ``u <= F(k)``, ``F`` the Poisson cdf summed in float64
  (``F(k) = sum_{j<=k} e^-lam lam^j / j!``); the pmf terms are formed by the recurrence ``p_j = p_{j-1} lam / j``.
- ``lam >= 10``: PTRS, Hoermann's transformed rejection with squeeze (W. Hoermann, "The transformed rejection
  method for generating Poisson random variables", Insurance: Mathematics and Economics 12, 1993, Sec. 3.3)::

      b = 0.931 + 2.53 sqrt(lam),  a = -0.059 + 0.02483 b,  1/alpha = 1.1239 + 1.1328 / (b - 3.4),
      v_r = 0.9277 - 3.6224 / (b - 2)
      repeat: U ~ U(-1/2, 1/2), V ~ U(0, 1), us = 1/2 - |U|, k = floor((2a / us + b) U + lam + 0.43)
              accept k if us >= 0.07 and V <= v_r                                  (the squeeze)
              reject if k < 0 or (us < 0.013 and V > us)
              accept k if log(V / alpha / (a / us^2 + b)) <= -lam + k log(lam) - log(k!)

  Every candidate is accepted or rejected by that rule, so the accepted ``k`` follow Poisson(lam) exactly (up to
  float64 arithmetic; ``log k!`` from a table below 256 and Stirling's series above, to float64 precision); the
  expected number of tries per variate is below 1.15 for ``lam >= 10``. Rejected
  positions are redrawn in vectorised rounds until none is left.

Both samplers are exact in distribution up to float64 rounding (relative 2^-52 on the pmf); ``test_skellam_noise``
checks means, variances and the pmf against ``exp(-mu) I_k(mu)``.
"""

from __future__ import annotations

import math

import numpy as np

from fedclinic.privacy.secure_random import SecureRandom

INVERSION_LIMIT = 10.0
"""Below this mean Poisson variates are drawn by inversion, from it on by PTRS."""
MAX_MEAN = 2.0 ** 52
"""Largest Poisson mean sampled (values stay exact integers in float64)."""

_TABLE = 256
_LOG_FACTORIAL = np.array([math.lgamma(k + 1.0) for k in range(_TABLE)])
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def _log_factorial(k: np.ndarray) -> np.ndarray:
    """``log(k!)`` for non-negative integer-valued float64 ``k``: a table below 256, else Stirling's series
    ``(x - 1/2) log x - x + log(2 pi)/2 + 1/(12x) - 1/(360x^3) + 1/(1260x^5) - 1/(1680x^7)`` with ``x = k + 1``
    (the next term is below ``1/(1188 x^9) < 10^-24`` for ``x >= 257``)."""
    out = np.empty_like(k)
    small = k < _TABLE
    out[small] = _LOG_FACTORIAL[k[small].astype(np.int64)]
    x = k[~small] + 1.0
    inv = 1.0 / x
    inv2 = inv * inv
    series = inv * (1.0 / 12 - inv2 * (1.0 / 360 - inv2 * (1.0 / 1260 - inv2 / 1680)))
    out[~small] = (x - 0.5) * np.log(x) - x + _HALF_LOG_2PI + series
    return out


def poisson_noise(rng: SecureRandom, lam: float, n: int) -> np.ndarray:
    """``n`` independent Poisson(``lam``) variates as int64 (see the module docstring for the algorithms)."""
    if not (math.isfinite(lam) and 0.0 <= lam <= MAX_MEAN):
        raise ValueError(f"a Poisson mean must be in [0, 2^52], got {lam!r}")
    if n < 0:
        raise ValueError(f"cannot draw {n} variates")
    if lam == 0.0 or n == 0:
        return np.zeros(n, dtype=np.int64)
    if lam < INVERSION_LIMIT:
        return _inversion(rng, lam, n)
    return _ptrs(rng, lam, n)


def skellam_noise(rng: SecureRandom, variance: float, n: int) -> np.ndarray:
    """``n`` independent symmetric Skellam variates of the given ``variance`` (``Poisson(v/2) - Poisson(v/2)``),
    int64."""
    if not (math.isfinite(variance) and variance >= 0.0):
        raise ValueError(f"a Skellam variance must be a finite number >= 0, got {variance!r}")
    return poisson_noise(rng, variance / 2.0, n) - poisson_noise(rng, variance / 2.0, n)


def _inversion(rng: SecureRandom, lam: float, n: int) -> np.ndarray:
    u = rng.uniform(n)
    out = np.zeros(n, dtype=np.int64)
    p = math.exp(-lam)
    cdf = p
    pending = np.flatnonzero(u > cdf)
    k = 0
    while pending.size:
        k += 1
        p *= lam / k
        if p == 0.0:  # the float cdf stopped growing (u within 2^-52 of 1): the remaining mass is below 2^-1074
            out[pending] = k
            break
        cdf += p
        out[pending] = k
        pending = pending[u[pending] > cdf]
    return out


def _ptrs(rng: SecureRandom, lam: float, n: int) -> np.ndarray:
    slam = math.sqrt(lam)
    log_lam = math.log(lam)
    b = 0.931 + 2.53 * slam
    a = -0.059 + 0.02483 * b
    inv_alpha = 1.1239 + 1.1328 / (b - 3.4)
    v_r = 0.9277 - 3.6224 / (b - 2.0)
    out = np.empty(n, dtype=np.int64)
    pending = np.arange(n)
    while pending.size:
        m = pending.size
        u = rng.uniform(m) - 0.5
        v = rng.uniform_open(m)
        us = 0.5 - np.abs(u)
        k = np.floor((2.0 * a / us + b) * u + lam + 0.43)
        accept = (us >= 0.07) & (v <= v_r)
        maybe = ~accept & (k >= 0) & ~((us < 0.013) & (v > us))
        if maybe.any():
            idx = np.flatnonzero(maybe)
            kk = k[idx]
            lhs = np.log(v[idx] * inv_alpha / (a / (us[idx] * us[idx]) + b))
            rhs = -lam + kk * log_lam - _log_factorial(kk)
            accept[idx[lhs <= rhs]] = True
        out[pending[accept]] = k[accept].astype(np.int64)
        pending = pending[~accept]
    return out
