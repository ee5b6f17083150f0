"""Accounting of the distributed Skellam mechanism (privacy level "distributed"), and its noise planner (torch-free).

The mechanism (Agarwal, Kairouz, Liu, NeurIPS 2021, "The Skellam Mechanism for Differentially Private Federated
Learning"; sensitivity analysis of randomized rounding from Kairouz, Liu, Steinke, ICML 2021, "The Distributed
Discrete Gaussian Mechanism for Federated Learning with Secure Aggregation"). Each site clips its whole update to
L2 norm ``C``, scales it by ``gamma`` (integer steps per unit) and rounds it to the integer grid by conditional
randomized rounding: stochastic rounding, repeated until the rounded vector's L2 norm is at most ``Delta_2``::

    Delta_2 = min( c + sqrt(d),  sqrt( c^2 + d/4 + sqrt(2 ln(1/beta)) (c + sqrt(d)/2) ) ),   c = C gamma

(``c + sqrt(d)`` holds for any rounding; the second bound holds for stochastic rounding with probability at
least ``1 - beta``, Kairouz et al. 2021, Thm. 1 / Prop. 22, so one rounding is redrawn with probability at most
``beta``). On the integer grid ``||v||_1 <= ||v||_2^2`` and ``||v||_1 <= sqrt(d) ||v||_2``, so
``Delta_1 = Delta_2 min(sqrt(d), Delta_2)``. Every site then adds Skellam noise of variance ``mu_site`` per
coordinate; the sum of ``m`` survivors carries Skellam noise of variance ``mu = m mu_site``, and one round is
(Agarwal et al. 2021, Thm. 3.5 with their ``Sk(mu/2, mu/2)`` of variance ``mu``; integer orders ``alpha > 1``)::

    eps_RDP(alpha) = alpha Delta_2^2 / (2 mu) + min( ((2 alpha - 1) Delta_2^2 + 6 Delta_1) / (4 mu^2),
                                                      3 Delta_1 / (2 mu) )

for one site's whole update (client-level; every enrolled site may take part in every round: sampling rate 1).
Adjacency is *zero-out*, as in the reference implementation and Kairouz et al.: the neighbouring input replaces one
survivor's update by zeros, so its noise share stays in the sum and ``mu`` counts all ``m`` survivors. Survivors
that collude with the aggregator know their own shares: against ``k`` of them only ``(m - k) mu_site`` protects
the others (plan with ``min_cohort`` raised by ``k`` to cover that). Rounds compose by adding RDP; (epsilon, delta)
follows by the conversion of
:func:`fedclinic.strategies.dp_accounting.epsilon_from_rdp` (the one Opacus' RDP accountant uses). The orders are
those of the reference implementation (google-research/federated ``distributed_dp/accounting_utils.py``:
2..128 and 256), whose ``skellam_epsilon`` gives the golden values of ``test_skellam_accounting``.

The planner (:func:`plan_site_variance`) picks the smallest total variance ``mu`` for which ``rounds`` rounds
spend at most the target epsilon, and divides it by the *fewest* survivors a session may close with: more
survivors only add noise. :func:`auto_scale` picks ``gamma`` when the task leaves it at 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from fedclinic.errors import ConfigError
from fedclinic.strategies.dp_accounting import epsilon_from_rdp

RDP_ORDERS: tuple[int, ...] = tuple(range(2, 129)) + (256,)
"""Integer RDP orders (the Skellam bound holds for integer orders > 1)."""
DEFAULT_BETA = math.exp(-0.5)
"""Conditional rounding's default beta (the reference implementation's)."""
AUTO_SCALE_FACTOR = 32.0
""":func:`auto_scale` makes ``C gamma`` at least this many times ``sqrt(d)``: rounding then inflates the squared
sensitivity by about ``d/4 / (C gamma)^2 <= 1/4096``."""
MECHANISMS = ("skellam",)


def rounded_l2_bound(scaled_clip: float, dim: int, beta: float) -> float:
    """``Delta_2`` in integer units for a vector of L2 norm at most ``scaled_clip`` (``C gamma``) and ``dim`` values
    after conditional randomized rounding with ``beta`` (module docstring; ``beta = 0``: plain ``c + sqrt(d)``)."""
    if not (scaled_clip > 0 and math.isfinite(scaled_clip)):
        raise ConfigError(f"the scaled clip norm must be a positive number, got {scaled_clip!r}")
    if not (isinstance(dim, int) and dim > 0):
        raise ConfigError(f"the dimension must be a positive integer, got {dim!r}")
    if not 0.0 <= beta < 1.0:
        raise ConfigError(f"the conditional-rounding beta must be in [0, 1), got {beta!r}")
    plain = scaled_clip + math.sqrt(dim)
    if beta == 0.0:
        return plain
    spread = math.sqrt(2.0 * math.log(1.0 / beta)) * (scaled_clip + 0.5 * math.sqrt(dim))
    squared = scaled_clip ** 2 + 0.25 * dim + spread
    return min(plain, math.sqrt(squared))


def rounded_l1_bound(l2_bound: float, dim: int) -> float:
    """``Delta_1 = Delta_2 min(sqrt(d), Delta_2)``: integer vectors have ``||v||_1 <= ||v||_2^2``."""
    return l2_bound * min(math.sqrt(dim), l2_bound)


def skellam_rdp(order: float, l1: float, l2: float, variance: float) -> float:
    """One release of the Skellam mechanism at RDP order ``order`` (Agarwal et al. 2021, Thm. 3.5; module
    docstring): sensitivities ``l1``, ``l2`` and noise ``variance``, all in integer units."""
    if not variance > 0:
        return math.inf
    a, mu = float(order), float(variance)
    surcharge = min(((2.0 * a - 1.0) * l2 * l2 + 6.0 * l1) / (4.0 * mu * mu), 3.0 * l1 / (2.0 * mu))
    return a * l2 * l2 / (2.0 * mu) + surcharge


@dataclass(frozen=True)
class SkellamSensitivity:
    """The integer-domain sensitivities of one site's rounded update: ``C gamma`` clipped, ``dim`` values."""

    clip_norm: float
    scale: float
    dim: int
    beta: float = DEFAULT_BETA

    @property
    def l2(self) -> float:
        return rounded_l2_bound(self.clip_norm * self.scale, self.dim, self.beta)

    @property
    def l1(self) -> float:
        return rounded_l1_bound(self.l2, self.dim)

    def rdp(self, variances: Sequence[float], orders: Sequence[int] = RDP_ORDERS) -> list[float]:
        """RDP at each order of the composition of one release per entry of ``variances`` (total noise variance of
        each round's sum, integer units)."""
        l1, l2 = self.l1, self.l2
        return [sum(skellam_rdp(a, l1, l2, v) for v in variances) for a in orders]

    def epsilon(self, variances: Sequence[float], delta: float) -> float:
        """Epsilon at ``delta`` after one round per entry of ``variances``; 0 for no round."""
        if not variances:
            return 0.0
        return epsilon_from_rdp(RDP_ORDERS, self.rdp(variances), delta)[0]


def auto_scale(clip_norm: float, dim: int) -> float:
    """``gamma`` for a task that leaves ``scale`` at 0: the power of two for which ``C gamma`` is the smallest power
    of two at least :data:`AUTO_SCALE_FACTOR` ``sqrt(d)`` (exact in binary, the same at every member)."""
    target = AUTO_SCALE_FACTOR * math.sqrt(dim)
    return 2.0 ** math.ceil(math.log2(target)) / clip_norm


def plan_site_variance(*, clip_norm: float, scale: float, dim: int, rounds: int, min_survivors: int, delta: float,
                       target_epsilon: float = 0.0, noise_multiplier: float = 0.0, beta: float = DEFAULT_BETA) -> float:
    """``mu_site``: the Skellam variance (integer units, per value) each site adds so that a session's ``min_survivors``
    shares together meet the plan for ``rounds`` rounds.

    With ``target_epsilon``: the smallest total variance ``mu`` (to a relative 1e-9, rounded up) whose ``rounds``-fold
    composition spends at most ``target_epsilon`` at ``delta``; with ``noise_multiplier`` z instead:
    ``mu = (z Delta_2)^2`` (the total noise's standard deviation is z times the L2 sensitivity, as for Gaussian
    client-level DP). Returns ``mu / min_survivors``. Raises ConfigError when no variance reaches the target.
    """
    if (target_epsilon > 0) == (noise_multiplier > 0):
        raise ConfigError("distributed DP needs target_epsilon or noise_multiplier (one of them)")
    if not (isinstance(rounds, int) and rounds > 0):
        raise ConfigError(f"distributed DP plans for a positive number of rounds, got {rounds!r}")
    if not (isinstance(min_survivors, int) and min_survivors > 0):
        raise ConfigError(f"the fewest survivors must be a positive integer, got {min_survivors!r}")
    sens = SkellamSensitivity(clip_norm, scale, dim, beta)
    if noise_multiplier > 0:
        return (noise_multiplier * sens.l2) ** 2 / min_survivors

    def spends(mu: float) -> float:
        return sens.epsilon([mu] * rounds, delta)

    lo = hi = sens.l2 ** 2
    while spends(hi) > target_epsilon:
        lo, hi = hi, hi * 4.0
        if hi > 1e300:
            raise ConfigError(f"no Skellam noise reaches epsilon {target_epsilon} for {rounds} rounds")
    while spends(lo) <= target_epsilon and lo > 1e-300:
        lo /= 4.0
    while hi - lo > 1e-9 * hi:
        mid = (lo + hi) / 2.0
        if spends(mid) <= target_epsilon:
            hi = mid
        else:
            lo = mid
    return hi / min_survivors
