"""Distribution tests with a stated false-failure bound: the DKW inequality on an integer-valued sample."""

from __future__ import annotations

import math

import numpy as np

#: the probability that an exact sampler fails a test built on dkw_margin
FAIL_PROB = 1e-6


def dkw_margin(n: int, fail_prob: float = FAIL_PROB) -> float:
    """The Dvoretzky-Kiefer-Wolfowitz bound (Massart's constant): P(sup |F_n - F| > e) <= 2 exp(-2 n e^2), so with
    this e an exact sampler of n draws fails the test with probability at most ``fail_prob``."""
    return math.sqrt(math.log(2 / fail_prob) / (2 * n))


def sup_cdf_distance(samples: np.ndarray, cdf) -> float:
    """sup over the integers of |empirical CDF - ``cdf``| for an integer-valued sample (both are step functions
    on the integers)."""
    zs = np.arange(samples.min() - 1, samples.max() + 1)
    empirical = np.searchsorted(np.sort(samples), zs, side="right") / len(samples)
    return float(np.max(np.abs(empirical - cdf(zs))))


def laplace_distance(samples: np.ndarray, scale: float) -> float:
    """:func:`sup_cdf_distance` of a sample from the discrete Laplace distribution of scale ``scale``."""
    from fedclinic.strategies.secure_laplace import discrete_laplace_cdf

    return sup_cdf_distance(samples, lambda z: discrete_laplace_cdf(z, scale))
