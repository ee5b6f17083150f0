"""A task's ``[secure_aggregation]`` settings: defaults, checks, and the session parameters they give.

Shared by the SDK (:class:`fedclinic.spec.task.Task` validates before submitting) and the aggregator
(``validate_spec`` refuses at ``SubmitTask``, and the round engine builds each round's
:class:`~fedclinic.secagg.config.SessionParams` with :func:`session_params`), so both refuse the same things
with the same words.

``task.toml``::

    [secure_aggregation]
    enabled = true
    min_cohort = 3          # fewest sites in a session and among its survivors (>= 3)
    threshold = 0           # 0 = ceil(2h/3) of the h share holders per site; else 2t > h must hold
    clip = 0.5              # each delta value is clipped to [-clip, clip] before quantization
    bits = 20               # quantization precision (2^bits - 1 levels over [-clip, clip])
    rounding = "stochastic" # or "nearest"
    degree = 0              # 0 = complete graph (SecAgg); an even k = SecAgg+ with k neighbours
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from fedclinic.proto import task_pb2
from fedclinic.secagg.config import MIN_COHORT_FLOOR, SessionParams
from fedclinic.secagg.errors import SecAggConfigError
from fedclinic.secagg.quantize import Quantizer
from fedclinic.strategies import make_strategy

KEYS = ("enabled", "min_cohort", "threshold", "clip", "bits", "rounding", "degree")
DEFAULT_CLIP = 1.0
DEFAULT_BITS = 20
#: the strategies that work on a sum alone (``needs_per_site_updates`` is False), offered in refusals
SUM_STRATEGIES = ("fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad")


def config_from_dict(doc: Mapping[str, Any]) -> task_pb2.SecureAggregationConfig:
    """The proto of a ``[secure_aggregation]`` table (call :func:`dict_problems` first)."""
    if not doc:
        return task_pb2.SecureAggregationConfig()
    return task_pb2.SecureAggregationConfig(
        enabled=bool(doc.get("enabled", False)), threshold=int(doc.get("threshold", 0)),
        min_cohort=int(doc.get("min_cohort", MIN_COHORT_FLOOR)), clip=float(doc.get("clip", DEFAULT_CLIP)),
        bits=int(doc.get("bits", DEFAULT_BITS)), rounding=str(doc.get("rounding", "stochastic")),
        degree=int(doc.get("degree", 0)))


def dict_problems(doc: Mapping[str, Any]) -> list[str]:
    """Type problems of a ``[secure_aggregation]`` table (unknown keys, wrong types)."""
    if not isinstance(doc, Mapping):
        return ["secure_aggregation must be a table, e.g. [secure_aggregation] enabled = true"]
    p = [f"secure_aggregation: unknown setting {k!r} (known: {', '.join(KEYS)})" for k in doc if k not in KEYS]
    if "enabled" in doc and not isinstance(doc["enabled"], bool):
        p.append("secure_aggregation: enabled must be true or false")
    for key in ("min_cohort", "threshold", "bits", "degree"):
        v = doc.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            p.append(f"secure_aggregation: {key} must be an integer, got {v!r}")
        elif v is not None and not -(1 << 31) <= v < (1 << 31):  # the spec's int32 (bounds: fedclinic.spec.validation)
            p.append(f"secure_aggregation: {key} is out of range, got {v!r}")
    clip = doc.get("clip")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))):
        p.append(f"secure_aggregation: clip must be a number, got {clip!r}")
    if "rounding" in doc and not isinstance(doc["rounding"], str):
        p.append("secure_aggregation: rounding must be \"stochastic\" or \"nearest\"")
    return p


def effective_config(cfg: task_pb2.SecureAggregationConfig) -> task_pb2.SecureAggregationConfig:
    """``cfg`` with its defaults filled in (min_cohort 3, clip 1.0, 20 bits, stochastic rounding): what runs."""
    out = task_pb2.SecureAggregationConfig()
    out.CopyFrom(cfg)
    out.min_cohort = cfg.min_cohort or MIN_COHORT_FLOOR
    out.clip = cfg.clip or DEFAULT_CLIP
    out.bits = cfg.bits or DEFAULT_BITS
    out.rounding = cfg.rounding or "stochastic"
    return out


def quantizer_of(cfg: task_pb2.SecureAggregationConfig) -> Quantizer:
    """The task's quantizer (defaults filled in); raises SecAggConfigError for bad settings."""
    return Quantizer(clip=cfg.clip or DEFAULT_CLIP, bits=cfg.bits or DEFAULT_BITS,
                     rounding=cfg.rounding or "stochastic")  # type: ignore[arg-type]


def floor_of(spec: task_pb2.TaskSpec) -> int:
    """Fewest sites a session may have at any phase, survivors included: ``max(3, min_cohort, min_sites)``."""
    return max(MIN_COHORT_FLOOR, spec.secure_aggregation.min_cohort, spec.rounds.min_sites)


def session_params(spec: task_pb2.TaskSpec, *, task_id: str, round_number: int, cohort: tuple[str, ...],
                   model_hash_hex: str, vector_length: int, nonce: bytes | None = None) -> SessionParams:
    """One round's session parameters from the task's settings; raises SecAggConfigError when the library
    refuses them for this cohort (e.g. a fixed threshold with too many or too few holders)."""
    cfg = spec.secure_aggregation
    kw: dict[str, Any] = {} if nonce is None else {"nonce": nonce}
    return SessionParams(task_id=task_id, round=round_number, cohort=cohort, model_hash=bytes.fromhex(model_hash_hex),
                         vector_length=vector_length, quantizer=quantizer_of(cfg), degree=cfg.degree or None,
                         threshold=cfg.threshold, **kw)


def spec_problems(spec: task_pb2.TaskSpec) -> list[str]:
    """Why a task with secure aggregation cannot run (empty when it can, or when it is off).

    Checks the minimum cohort (>= 3), that the library accepts threshold, degree and quantizer for the
    smallest cohort the task allows (``max(3, min_cohort, min_sites)`` sites), and that the strategy can work
    on a sum alone (``Strategy.needs_per_site_updates`` is False).
    """
    cfg = spec.secure_aggregation
    if not cfg.enabled:
        return []
    p: list[str] = []
    if cfg.min_cohort < MIN_COHORT_FLOOR:
        p.append(f"secure_aggregation.min_cohort is {cfg.min_cohort}; it must be at least {MIN_COHORT_FLOOR}: with "
                 "two sites each one learns the other's update by subtracting its own from the sum")
    if not (math.isfinite(cfg.clip) and cfg.clip >= 0):
        p.append("secure_aggregation.clip must be a positive number (the largest |delta| value kept)")
    n0 = floor_of(spec)
    try:
        session_params(spec, task_id="check", round_number=1, cohort=tuple(f"site-{i}" for i in range(n0)),
                       model_hash_hex="00" * 32, vector_length=1)
    except SecAggConfigError as exc:
        p.append(f"secure_aggregation (checked for the smallest cohort, {n0} sites): {exc}")
    try:
        strategy = make_strategy(spec.strategy, {**dict(spec.strategy_params), **dict(spec.strategy_options)})
    except Exception:  # a bad strategy is reported by the strategy check itself
        strategy = None
    if strategy is not None and strategy.needs_per_site_updates:
        p.append(f"strategy {strategy.name!r} looks at each site's update (its norm, coordinates or distance), but "
                 "secure aggregation reveals only the sum of the updates; choose one of "
                 f"{', '.join(SUM_STRATEGIES)} or turn secure aggregation off")
    if spec.privacy.level == "client":
        p.append('privacy level "client" clips each site\'s update at the aggregator, which secure aggregation '
                 'hides; use level "sample" (DP-SGD at every site) with secure aggregation')
    return p
