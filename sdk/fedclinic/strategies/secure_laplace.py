"""Discrete Laplace noise for differentially private counts, from the project's cryptographically secure stream.

:class:`SecureDiscreteLaplace` draws integers ``Z`` with

    P(Z = z) = (1 - p) / (1 + p) * p^|z|,      p = exp(-1 / t),      z in {..., -1, 0, 1, ...}

(the *discrete Laplace* or two-sided geometric distribution of scale ``t``; Ghosh, Roughgarden & Sundararajan,
"Universally utility-maximizing privacy mechanisms", STOC 2009). Adding it to an integer count vector of L1
sensitivity ``Delta`` with ``t = Delta / epsilon`` is ``epsilon``-differentially private (pure DP, delta 0): the
ratio of the output probabilities of two neighbouring inputs is at most ``p^-Delta = exp(epsilon)``. Its variance
is ``2p / (1 - p)^2`` (about ``2 t^2`` for large ``t``).

Method: ``Z = G1 - G2`` for two independent geometric variables ``G = floor(ln U / ln p)`` (``P(G = g) = (1 - p)
p^g``), with ``U`` the open uniforms of :class:`~fedclinic.strategies.secure_random.SecureRandom` (ChaCha20 keyed
from ``os.urandom``; 53-bit grid, never 0 or 1). The output is an integer, so the floating-point attacks on
continuous Laplace samplers (Mironov, CCS 2012: gaps in the reachable doubles) do not apply to what is released;
the only deviation from the exact distribution is the 2^-53 grid of ``U`` (a relative error of the probability of
each ``g`` of order 2^-53 * t, and no ``|G| > 53 ln 2 * t`` -- about 37 t -- whose exact probability is below
2^-53).

Replay: a test passes ``SecureDiscreteLaplace(SecureRandom(key))``; every site path uses a fresh one.
"""

from __future__ import annotations

import math

import numpy as np

from fedclinic.strategies.secure_random import SecureRandom


class SecureDiscreteLaplace:
    """Discrete Laplace samples (see the module docstring) from a :class:`SecureRandom` keystream."""

    def __init__(self, source: SecureRandom | None = None) -> None:
        self._source = source if source is not None else SecureRandom()

    def sample(self, n: int, scale: float) -> np.ndarray:
        """``n`` independent discrete Laplace integers of scale ``t = scale`` (int64). ``scale`` must be finite and
        > 0; for ``epsilon``-DP on a count vector of L1 sensitivity ``Delta`` use ``scale = Delta / epsilon``."""
        scale = float(scale)
        if not (scale > 0 and math.isfinite(scale)):
            raise ValueError(f"discrete Laplace scale must be finite and > 0, got {scale}")
        if n < 0:
            raise ValueError(f"cannot draw {n} samples")
        if n == 0:
            return np.zeros(0, np.int64)
        log_p = -1.0 / scale                       # ln p, p = exp(-1/t)
        u = self._source.uniform_open(2 * n)       # (0, 1): ln u is finite and < 0
        g = np.floor(np.log(u) / log_p).astype(np.int64)
        return g[:n] - g[n:]


def discrete_laplace_cdf(z: np.ndarray | float, scale: float) -> np.ndarray:
    """The exact CDF ``P(Z <= z)`` of the discrete Laplace distribution of scale ``t`` at integers ``z`` (for
    tests and for a reader's confidence intervals)."""
    p = math.exp(-1.0 / float(scale))
    z = np.floor(np.asarray(z, dtype=np.float64))
    neg = p ** (-z) / (1 + p)                      # z < 0: sum_{k <= z} (1-p)/(1+p) p^-k = p^-z / (1 + p)
    pos = 1.0 - p ** (z + 1) / (1 + p)             # z >= 0
    return np.where(z < 0, neg, pos)


__all__ = ["SecureDiscreteLaplace", "discrete_laplace_cdf"]
