"""Distributed DP inside the ring: a site's update as clipped, scaled, rounded integers plus its share of Skellam noise.

Privacy level ``"distributed"`` (mechanism ``"skellam"``; Agarwal, Kairouz, Liu, NeurIPS 2021). Each site, on its
flattened update ``x`` (``d`` values, every tensor of the round)::

    x'  = x min(1, C / ||x||_2)                     one L2 clip of the whole update (client-level unit)
    y   = gamma x'                                   ||y||_2 <= c = C gamma
    r   = conditional randomized rounding of y       stochastic rounding, redrawn while ||r||_2 > Delta_2
    v   = r + N,  N ~ Skellam(mu_site)^d            the site's share of the noise (fedclinic.privacy.skellam_noise)
    in  = v mod 2^R                                  two's complement in the session's ring Z_{2^R}

(``Delta_2``: :func:`fedclinic.strategies.skellam_accounting.rounded_l2_bound`). The secure sum of ``m`` survivors
is ``S = sum_i r_i + N_total mod 2^R`` with ``N_total ~ Skellam(m mu_site)`` exactly (Skellam is closed under
addition); :meth:`SkellamEncoding.decode` reads ``S`` as a signed integer in ``[-2^(R-1), 2^(R-1))`` and returns
the mean ``S / (gamma m)``. The aggregator adds nothing: the noise in the released mean has per-value variance
``m mu_site / (gamma m)^2`` and it cannot be removed without every survivor's share.

No random rotation. The reference implementation flattens the update with a randomized Hadamard transform so that
a narrow ring (e.g. 16-20 bits) rarely wraps; here the ring is chosen for the worst case instead, which needs no
rotation: every coordinate of a rounded update obeys ``|r_j| <= ||r||_2 <= Delta_2``, so ``|sum_i r_i| <= n Delta_2``
for a cohort of ``n``, and the noise of variance ``V = n mu_site`` obeys Bernstein's inequality for a sum of
centred Poisson increments (each bounded by 1): ``P(|N| >= t) <= 2 exp(-t^2 / (2 (V + t/3)))``. With
``L = ln(2 d / p)``, ``t = L/3 + sqrt(L^2/9 + 2 V L)`` bounds all ``d`` values at once except with probability ``p``
(:data:`WRAP_PROBABILITY` = 2^-40 per session). :meth:`SkellamEncoding.check_cohort` requires
``n Delta_2 + t < 2^(R-1)`` (and ``< 2^53``: the signed sum converts to float64 exactly); :func:`ring_for` picks
the narrowest ring of 16, 32 or 64 bits that satisfies it. A wrap (probability below ``p``) would only corrupt the
mean, never weaken the privacy: the released value is a function of the noisy sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fedclinic.secagg.encoding import encode
from fedclinic.secagg.errors import SecAggConfigError, SecAggInputError
from fedclinic.strategies.skellam_accounting import MECHANISMS, SkellamSensitivity

WRAP_PROBABILITY = 2.0 ** -40
"""Largest probability that some value of a session's noisy sum leaves the signed ring (see the module docstring)."""
MAX_ROUNDINGS = 1000
"""Conditional rounding redraws at most this many times (each redraw is needed with probability <= beta)."""
_RINGS = {16: np.dtype(np.uint16), 32: np.dtype(np.uint32), 64: np.dtype(np.uint64)}
_EXACT = 2.0 ** 53


class UniformSource(Protocol):
    """Where the rounding's uniforms come from (``fedclinic.privacy.secure_random.SecureRandom`` at the sites)."""

    def uniform(self, shape: int) -> np.ndarray:
        """Uniform float64 values on ``[0, 1)``."""


@dataclass(frozen=True)
class SkellamEncoding:
    """One session's distributed-DP encoding of the update slots (see the module docstring)."""

    clip_norm: float          # C: the whole update's L2 clip norm (update units)
    scale: float              # gamma: integer steps per unit
    site_variance: float      # mu_site: each site's Skellam variance per value (integer units)
    values: int               # d: the update's values
    ring_bits: int            # R: the session's ring
    beta: float               # conditional rounding's beta
    mechanism: str = "skellam"

    def __post_init__(self) -> None:
        if self.mechanism not in MECHANISMS:
            raise SecAggConfigError(f"distributed DP mechanism must be one of {MECHANISMS}, got {self.mechanism!r}")
        for name in ("clip_norm", "scale", "site_variance"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise SecAggConfigError(f"distributed DP {name} must be a finite positive number, got {v!r}")
            object.__setattr__(self, name, float(v))
        if not (isinstance(self.values, int) and self.values > 0):
            raise SecAggConfigError(f"distributed DP needs a positive number of values, got {self.values!r}")
        if self.ring_bits not in _RINGS:
            raise SecAggConfigError(f"ring_bits must be one of {tuple(_RINGS)}, got {self.ring_bits!r}")
        if not (isinstance(self.beta, (int, float)) and 0.0 <= self.beta < 1.0):
            raise SecAggConfigError(f"conditional rounding beta must be in [0, 1), got {self.beta!r}")
        object.__setattr__(self, "beta", float(self.beta))

    @property
    def sensitivity(self) -> SkellamSensitivity:
        return SkellamSensitivity(self.clip_norm, self.scale, self.values, self.beta)

    @property
    def l2_bound(self) -> float:
        """``Delta_2``: the largest L2 norm of a site's rounded update (integer units)."""
        return self.sensitivity.l2

    @property
    def dtype(self) -> np.dtype:
        return _RINGS[self.ring_bits]

    def wrap_bound(self, cohort: int) -> float:
        """``n Delta_2 + t``: what ``|sum|`` stays below for every value, except with probability
        :data:`WRAP_PROBABILITY`, for a cohort of ``n`` (module docstring)."""
        v = cohort * self.site_variance
        big_l = math.log(2.0 * self.values / WRAP_PROBABILITY)
        return cohort * self.l2_bound + big_l / 3.0 + math.sqrt(big_l * big_l / 9.0 + 2.0 * v * big_l)

    def check_cohort(self, cohort: int) -> None:
        """Refuse a cohort whose noisy sum could leave the signed ring (SecAggConfigError)."""
        room = min(2.0 ** (self.ring_bits - 1), _EXACT)
        if self.wrap_bound(cohort) >= room:
            raise SecAggConfigError(
                f"{cohort} sites' rounded updates (L2 norm <= {self.l2_bound:.4g} each) plus Skellam noise of variance "
                f"{cohort * self.site_variance:.4g} can exceed +-{room:.4g} and wrap the {self.ring_bits}-bit ring; "
                "use a wider ring, a smaller scale or fewer sites")

    def noise_stddev(self, survivors: int) -> float:
        """Standard deviation per value of the noise in the decoded mean of ``survivors`` sites (update units)."""
        return math.sqrt(survivors * self.site_variance) / (self.scale * survivors)

    def digest_parts(self) -> bytes:
        """What places a value in the encoded slots: part of the layout digest, hence of the session id."""
        return encode("skellam", self.mechanism, self.clip_norm, self.scale, self.site_variance, self.values,
                      self.ring_bits, self.beta)

    def round_update(self, x: np.ndarray, rng: UniformSource) -> np.ndarray:
        """``r``: ``x`` clipped to L2 norm C, scaled by gamma and rounded conditionally (int64)."""
        arr = np.asarray(x)
        if arr.ndim != 1 or arr.dtype.kind != "f" or arr.size != self.values:
            raise SecAggInputError(f"distributed DP encodes a 1-D float vector of {self.values} values, got shape "
                                   f"{arr.shape} dtype {arr.dtype}")
        y = arr.astype(np.float64)
        norm = math.sqrt(float(np.dot(y, y)))
        if not math.isfinite(norm):
            raise SecAggInputError("the update has a non-finite value; distributed DP needs finite values (check "
                                   "training for divergence)")
        factor = self.scale * min(1.0, self.clip_norm / norm) if norm > 0 else self.scale
        y *= factor
        low = np.floor(y)
        frac = y - low
        bound_sq = self.l2_bound ** 2
        for _ in range(MAX_ROUNDINGS):
            r = low + (rng.uniform(self.values) < frac)
            if float(np.dot(r, r)) <= bound_sq:
                return r.astype(np.int64)
        raise SecAggInputError(f"conditional rounding exceeded the norm bound {MAX_ROUNDINGS} times (beta "
                               f"{self.beta:g}); this does not happen by chance")

    def encode(self, x: np.ndarray, noise: np.ndarray, rng: UniformSource) -> np.ndarray:
        """The site's slots in the ring: ``(round_update(x) + noise) mod 2^R`` (``noise``: int64 Skellam shares of
        variance :attr:`site_variance`, one per value)."""
        n = np.asarray(noise)
        if n.shape != (self.values,) or n.dtype != np.int64:
            raise SecAggInputError(f"distributed DP needs {self.values} int64 noise values, got {n.shape} {n.dtype}")
        v = self.round_update(x, rng) + n
        return to_ring(v, self.ring_bits)

    def decode(self, total: np.ndarray, survivors: int) -> np.ndarray:
        """The survivors' noisy mean (float64) from their ring sum of the update slots: signed, over gamma m."""
        if survivors < 1:
            raise SecAggInputError("decoding needs the number of survivors (>= 1)")
        return signed(total, self.ring_bits).astype(np.float64) / (self.scale * survivors)


def to_ring(v: np.ndarray, ring_bits: int) -> np.ndarray:
    """Signed int64 values as elements of Z_{2^R} (two's complement), in the ring's unsigned dtype."""
    words = v.astype(np.int64).view(np.uint64)
    if ring_bits == 64:
        return words.copy()
    return (words & np.uint64((1 << ring_bits) - 1)).astype(_RINGS[ring_bits])


def signed(total: np.ndarray, ring_bits: int) -> np.ndarray:
    """Ring elements read as signed integers in ``[-2^(R-1), 2^(R-1))`` (int64)."""
    if total.dtype != _RINGS[ring_bits]:
        raise SecAggInputError(f"a {ring_bits}-bit ring sum has dtype {_RINGS[ring_bits]}, got {total.dtype}")
    if ring_bits == 64:
        return total.view(np.int64).copy()
    v = total.astype(np.int64)
    v[v >= (1 << (ring_bits - 1))] -= 1 << ring_bits
    return v


def ring_for(clip_norm: float, scale: float, site_variance: float, values: int, beta: float, cohort: int) -> int:
    """The narrowest ring of 16, 32 or 64 bits that holds the noisy sum of ``cohort`` sites (module docstring)."""
    last: SecAggConfigError | None = None
    for r in _RINGS:
        enc = SkellamEncoding(clip_norm, scale, site_variance, values, r, beta)
        try:
            enc.check_cohort(cohort)
            return r
        except SecAggConfigError as exc:
            last = exc
    assert last is not None
    raise last
