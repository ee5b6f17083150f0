"""A task's distributed-DP plan (privacy level ``"distributed"``): what it requires, the noise each site adds, and
what a session's setup must say about it.

The plan is a pure function of the signed task spec and the update's size ``d``, so the aggregator and every site
compute the same one (the site from the spec its owner signed, never from the aggregator's word):

- ``C`` = ``privacy.max_grad_norm`` (the whole update's L2 clip), ``gamma`` = ``privacy.scale`` or
  :func:`~fedclinic.strategies.skellam_accounting.auto_scale`, ``beta`` = ``privacy.rounding_beta`` or
  ``exp(-1/2)``;
- ``mu_site`` = :func:`~fedclinic.strategies.skellam_accounting.plan_site_variance` for ``rounds.num_rounds``
  rounds and the *fewest survivors* a session may close with, ``floor = max(3, min_cohort, min_sites)`` (the
  library aborts a session with fewer survivors, :class:`~fedclinic.secagg.ServerSession`'s ``min_cohort``), so the
  target holds whoever drops out; more survivors only add noise;
- the ring: the narrowest that holds the noisy sum of the session's cohort
  (:func:`~fedclinic.secagg.skellam_encoding.ring_for`).

Refused with this level (:func:`privacy_problems`, run by the one spec validator): no secure aggregation (the
noise shares would be visible in each update), sample weighting (a weight above 1 multiplies one site's
contribution and breaks the sensitivity bound ``Delta_2``), a codec other than ``raw`` (value codecs requantize
the masked vector, top-k sums a subset of coordinates whose noise and clipping this plan does not cover), SAFL
layer selection (a partial update), strategy ``dp-fedavg`` (the aggregator would add noise of its own and would
need every update) and any mechanism other than ``"skellam"``.
"""

from __future__ import annotations

import math

from fedclinic.codecs import CodecSpecError, parse_codec
from fedclinic.errors import ConfigError
from fedclinic.proto import task_pb2
from fedclinic.secagg.errors import SecAggConfigError, SecAggRefusal
from fedclinic.secagg.skellam_encoding import SkellamEncoding, ring_for
from fedclinic.strategies.skellam_accounting import (DEFAULT_BETA, MECHANISMS, SkellamSensitivity, auto_scale,
                                                     plan_site_variance)

LEVEL = "distributed"
VARIANCE_TOLERANCE = 1e-6
"""A setup's per-site variance may fall short of a site's own plan by this relative amount (float rounding of the
planner's bisection on another machine) and no more."""


def is_distributed(spec: task_pb2.TaskSpec) -> bool:
    """Whether the task asks for distributed DP."""
    return spec.privacy.level == LEVEL


def mechanism_of(spec: task_pb2.TaskSpec) -> str:
    return spec.privacy.mechanism or "skellam"


def beta_of(spec: task_pb2.TaskSpec) -> float:
    return spec.privacy.rounding_beta or DEFAULT_BETA


def scale_of(spec: task_pb2.TaskSpec, values: int) -> float:
    return spec.privacy.scale or auto_scale(spec.privacy.max_grad_norm, values)


def delta_of(spec: task_pb2.TaskSpec) -> float:
    return spec.privacy.target_delta or 1e-5


def sensitivity_of(spec: task_pb2.TaskSpec, values: int) -> SkellamSensitivity:
    return SkellamSensitivity(spec.privacy.max_grad_norm, scale_of(spec, values), values, beta_of(spec))


def site_variance(spec: task_pb2.TaskSpec, values: int, min_survivors: int) -> float:
    """``mu_site`` of the plan (module docstring); SecAggConfigError when the plan cannot be made."""
    pc = spec.privacy
    try:
        return plan_site_variance(clip_norm=pc.max_grad_norm, scale=scale_of(spec, values), dim=values,
                                  rounds=max(1, spec.rounds.num_rounds), min_survivors=min_survivors,
                                  delta=delta_of(spec), target_epsilon=pc.target_epsilon,
                                  noise_multiplier=pc.noise_multiplier, beta=beta_of(spec))
    except ConfigError as exc:
        raise SecAggConfigError(f"distributed DP: {exc}") from None


def encoding_for(spec: task_pb2.TaskSpec, values: int, cohort: int, min_survivors: int) -> SkellamEncoding:
    """The session's encoding for a cohort of ``cohort`` sites: the plan in the narrowest ring that holds it."""
    mu = site_variance(spec, values, min_survivors)
    c, gamma, beta = spec.privacy.max_grad_norm, scale_of(spec, values), beta_of(spec)
    ring = ring_for(c, gamma, mu, values, beta, cohort)
    return SkellamEncoding(c, gamma, mu, values, ring, beta, mechanism_of(spec))


def epsilon_after(spec: task_pb2.TaskSpec, values: int, min_survivors: int, survivors: list[int]) -> float:
    """The accountant's epsilon (at the task's delta) after one closed round per entry of ``survivors`` (how many
    sites' noise shares each round's sum carried)."""
    mu = site_variance(spec, values, min_survivors)
    return sensitivity_of(spec, values).epsilon([m * mu for m in survivors], delta_of(spec))


def check_setup(spec: task_pb2.TaskSpec, values: int, min_survivors: int, *, mechanism: str, scale: float,
                clip_norm: float, beta: float, site_variance_told: float) -> None:
    """A site's check of a session's distributed-DP fields against its own plan from the signed spec: the same
    mechanism, clip, scale and beta, and at least the planned variance. Raises SecAggRefusal naming the mismatch."""
    if mechanism != mechanism_of(spec):
        raise SecAggRefusal(f"the session asks for distributed-DP mechanism {mechanism!r}; the signed task says "
                            f"{mechanism_of(spec)!r}")
    own = {"clip norm": spec.privacy.max_grad_norm, "scale": scale_of(spec, values), "rounding beta": beta_of(spec)}
    told = {"clip norm": clip_norm, "scale": scale, "rounding beta": beta}
    for key, want in own.items():
        if not math.isclose(told[key], want, rel_tol=1e-12, abs_tol=0.0):
            raise SecAggRefusal(f"the session's distributed-DP {key} is {told[key]!r}; the signed task gives {want!r}")
    planned = site_variance(spec, values, min_survivors)
    if not site_variance_told >= planned * (1.0 - VARIANCE_TOLERANCE):
        raise SecAggRefusal(f"the session asks each site for Skellam noise of variance {site_variance_told:.6g}; the "
                            f"signed task needs at least {planned:.6g} (so that {min_survivors} survivors meet its "
                            "privacy target)")


def privacy_problems(spec: task_pb2.TaskSpec) -> list[str]:
    """Why a task with privacy level "distributed" cannot run (module docstring); empty for another level."""
    if not is_distributed(spec):
        return []
    pc, p = spec.privacy, []
    sa = spec.secure_aggregation
    if not sa.enabled:
        p.append('privacy level "distributed" adds each site\'s noise share inside secure aggregation; set '
                 '[secure_aggregation] enabled = true (or use level "client" with strategy "dp-fedavg")')
    if sa.enabled and sa.weighting != "uniform":
        p.append('privacy level "distributed" needs [secure_aggregation] weighting = "uniform": a sample-count weight '
                 "multiplies one site's clipped update and breaks the sensitivity bound the noise is planned for")
    if mechanism_of(spec) not in MECHANISMS:
        p.append(f"privacy: mechanism must be one of {', '.join(MECHANISMS)} for level \"distributed\", got "
                 f"{pc.mechanism!r}")
    if (pc.target_epsilon > 0) == (pc.noise_multiplier > 0):
        p.append("privacy: give target_epsilon (the whole task's budget, all rounds) or noise_multiplier, not both")
    if not (math.isfinite(pc.max_grad_norm) and pc.max_grad_norm > 0):
        p.append(f"privacy: max_grad_norm (the L2 clip of each site's whole update) must be a positive number, got "
                 f"{pc.max_grad_norm!r}")
    if not 0 < delta_of(spec) < 1:
        p.append(f"privacy: target_delta must be in (0, 1), e.g. 1e-5, got {pc.target_delta!r}")
    if not (math.isfinite(pc.scale) and pc.scale >= 0):
        p.append(f"privacy: scale must be a positive number of integer steps per unit (0 = automatic), got "
                 f"{pc.scale!r}")
    if not 0 <= pc.rounding_beta < 1:
        p.append(f"privacy: rounding_beta must be in [0, 1) (0 = exp(-1/2)), got {pc.rounding_beta!r}")
    if spec.strategy == "dp-fedavg":
        p.append('privacy level "distributed": the sites add the noise; strategy "dp-fedavg" would clip and noise '
                 'again at the aggregator, which secure aggregation hides the updates from; use "fedavg"')
    if spec.update.selection == "safl":
        p.append('privacy level "distributed" sums whole updates; SAFL layer selection sends partial ones')
    if spec.update.codec not in ("", "raw"):
        try:
            codec = parse_codec(spec.update.codec)
            name = codec.spec
        except CodecSpecError:
            name = spec.update.codec
        p.append(f"privacy level \"distributed\" needs update codec 'raw': {name!r} would requantize or subsample the "
                 "noised integer update, which the noise plan does not cover")
    return p
