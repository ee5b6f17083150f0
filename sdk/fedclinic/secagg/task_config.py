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
    weighting = "samples"   # each site's input weighted by its sample count (as plain FedAvg); or "uniform"
    weight_cap = 65536      # largest weight of one site (sample counts above count as this many)
    metric_clip = 100.0     # evaluation metrics are summed under the masks, each clipped to [-metric_clip, metric_clip]

Each session's ring (16, 32 or 64 bits, the masked vector's wire dtype) is the narrowest that holds the sum of
its cohort's weighted quantized deltas (:func:`layout_for`): 8-bit quantization with uniform weights travels as
``uint16`` (up to 257 sites), 8 bits with sample weights up to 65536 as ``uint32`` (up to 257 sites), 20 bits with
sample weights as ``uint64``. The evaluation metrics get the precision left in that ring (up to 24 bits).

A task whose update codec is ``topk:F`` (a fraction, fp32 values) runs its secure rounds on a shared random index
set of ``ceil(F * P)`` coordinates (:func:`index_fraction_of`; :mod:`fedclinic.secagg.vector_layout`); other
codecs are refused with secure aggregation (:func:`fedclinic.transport.codec_wire.spec_problems`).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from fedclinic.codecs import FP32, CodecSpecError, TopK, parse_codec
from fedclinic.proto import task_pb2
from fedclinic.secagg import dp_plan
from fedclinic.secagg.config import MIN_COHORT_FLOOR, SessionParams
from fedclinic.secagg.errors import SecAggConfigError
from fedclinic.secagg.quantize import Quantizer, ring_for
from fedclinic.secagg.vector_layout import MAX_METRICS, VectorLayout, metric_bits_for, tensor_sizes
from fedclinic.strategies import make_strategy

KEYS = ("enabled", "min_cohort", "threshold", "clip", "bits", "rounding", "degree", "weighting", "weight_cap",
        "metric_clip")
DEFAULT_CLIP = 1.0
DEFAULT_BITS = 20
DEFAULT_WEIGHT_CAP = 1 << 16
MAX_WEIGHT_CAP = 1 << 24
DEFAULT_METRIC_CLIP = 100.0
WEIGHTINGS = ("samples", "uniform")
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
        degree=int(doc.get("degree", 0)), weighting=str(doc.get("weighting", "")),
        weight_cap=int(doc.get("weight_cap", 0)), metric_clip=float(doc.get("metric_clip", 0.0)))


def dict_problems(doc: Mapping[str, Any]) -> list[str]:
    """Type problems of a ``[secure_aggregation]`` table (unknown keys, wrong types)."""
    if not isinstance(doc, Mapping):
        return ["secure_aggregation must be a table, e.g. [secure_aggregation] enabled = true"]
    p = [f"secure_aggregation: unknown setting {k!r} (known: {', '.join(KEYS)})" for k in doc if k not in KEYS]
    if "enabled" in doc and not isinstance(doc["enabled"], bool):
        p.append("secure_aggregation: enabled must be true or false")
    for key in ("min_cohort", "threshold", "bits", "degree", "weight_cap"):
        v = doc.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            p.append(f"secure_aggregation: {key} must be an integer, got {v!r}")
        elif v is not None and not -(1 << 31) <= v < (1 << 31):  # the spec's int32 (bounds: fedclinic.spec.validation)
            p.append(f"secure_aggregation: {key} is out of range, got {v!r}")
    for key in ("clip", "metric_clip"):
        v = doc.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            p.append(f"secure_aggregation: {key} must be a number, got {v!r}")
    if "weighting" in doc and doc["weighting"] not in WEIGHTINGS:
        p.append(f"secure_aggregation: weighting must be \"samples\" or \"uniform\", got {doc['weighting']!r}")
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
    out.weighting = cfg.weighting or "samples"
    out.weight_cap = weight_cap_of(cfg)
    out.metric_clip = cfg.metric_clip or DEFAULT_METRIC_CLIP
    return out


def weight_cap_of(cfg: task_pb2.SecureAggregationConfig) -> int:
    """The largest weight of one site: 1 under ``weighting = "uniform"``, else ``weight_cap`` (default 65536)."""
    return 1 if cfg.weighting == "uniform" else (cfg.weight_cap or DEFAULT_WEIGHT_CAP)


def quantizer_of(cfg: task_pb2.SecureAggregationConfig, *, ring_bits: int = 32, weight_cap: int = 1) -> Quantizer:
    """The task's quantizer (defaults filled in) in a ring of ``ring_bits`` with weights up to ``weight_cap``;
    raises SecAggConfigError for bad settings."""
    return Quantizer(clip=cfg.clip or DEFAULT_CLIP, bits=cfg.bits or DEFAULT_BITS,
                     rounding=cfg.rounding or "stochastic", ring_bits=ring_bits,  # type: ignore[arg-type]
                     weight_cap=weight_cap)


def index_fraction_of(spec: task_pb2.TaskSpec) -> float:
    """The fraction ``F`` of the delta's coordinates a secure round sums: the task's ``topk:F`` codec (fp32 kept
    values) under secure aggregation, else 0 (dense). Other codecs are refused by ``codec_wire.spec_problems``."""
    if not spec.secure_aggregation.enabled or spec.update.codec in ("", "raw"):
        return 0.0
    try:
        codec = parse_codec(spec.update.codec)
    except CodecSpecError:
        return 0.0
    if isinstance(codec, TopK) and codec.fraction is not None and isinstance(codec.values, FP32):
        return float(codec.fraction)
    return 0.0


def layout_for(spec: task_pb2.TaskSpec, names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...], cohort: int,
               metric_names: tuple[str, ...] = (), index_seed: bytes = b"") -> VectorLayout:
    """One session's input layout: the task's quantizer in the narrowest ring that holds ``cohort`` weighted
    inputs, one count slot per tensor under SAFL, the (at most :data:`MAX_METRICS`) metric names summed, and
    under a ``topk:F`` codec the shared index set drawn from ``index_seed`` (:func:`index_fraction_of`)."""
    cfg = spec.secure_aggregation
    if dp_plan.is_distributed(spec):
        return _distributed_layout(spec, tensor_sizes(names, shapes), cohort)
    cap = weight_cap_of(cfg)
    metric_names = tuple(sorted(metric_names))[:MAX_METRICS]
    q = quantizer_of(cfg, ring_bits=ring_for(quantizer_of(cfg).levels, cap, cohort), weight_cap=cap)
    return VectorLayout(tensor_sizes(names, shapes), q, metric_names=metric_names,
                        metric_clip=cfg.metric_clip or DEFAULT_METRIC_CLIP,
                        per_tensor_counts=spec.update.selection == "safl", metric_bits=metric_bits_for(q, cohort),
                        index_fraction=index_fraction_of(spec), index_seed=index_seed)


def _distributed_layout(spec: task_pb2.TaskSpec, tensors: tuple[tuple[str, int], ...], cohort: int) -> VectorLayout:
    """Privacy level "distributed": the plan's Skellam encoding (:mod:`fedclinic.secagg.dp_plan`) in its ring, uniform
    weights, no metric slots (evaluation metrics are not noised, so they are not released), dense. The quantizer
    only names the ring (its bits: at most the task's, as many as the ring holds for the cohort's count slot)."""
    values = sum(n for _, n in tensors)
    enc = dp_plan.encoding_for(spec, values, cohort, floor_of(spec))
    cfg = spec.secure_aggregation
    room = min((1 << enc.ring_bits) - 1, (1 << 53) - 1) // max(1, cohort)
    bits = max(1, min(cfg.bits or DEFAULT_BITS, room.bit_length() - 1))
    rounding = cfg.rounding or "stochastic"
    q = Quantizer(clip=cfg.clip or DEFAULT_CLIP, bits=bits, rounding=rounding,  # type: ignore[arg-type]
                  ring_bits=enc.ring_bits, weight_cap=1)
    return VectorLayout(tensors, q, dp=enc)


def floor_of(spec: task_pb2.TaskSpec) -> int:
    """Fewest sites a session may have at any phase, survivors included: ``max(3, min_cohort, min_sites)``."""
    return max(MIN_COHORT_FLOOR, spec.secure_aggregation.min_cohort, spec.rounds.min_sites)


def session_params(spec: task_pb2.TaskSpec, *, task_id: str, round_number: int, cohort: tuple[str, ...],
                   model_hash_hex: str, vector_length: int, nonce: bytes | None = None,
                   quantizer: Quantizer | None = None, layout_digest: bytes = b"") -> SessionParams:
    """One round's session parameters from the task's settings (``quantizer``: the session layout's, see
    :func:`layout_for`; default the task's in the 32-bit ring, unweighted); raises SecAggConfigError when the
    library refuses them for this cohort (e.g. a fixed threshold with too many or too few holders)."""
    cfg = spec.secure_aggregation
    kw: dict[str, Any] = {} if nonce is None else {"nonce": nonce}
    return SessionParams(task_id=task_id, round=round_number, cohort=cohort, model_hash=bytes.fromhex(model_hash_hex),
                         vector_length=vector_length, quantizer=quantizer or quantizer_of(cfg),
                         degree=cfg.degree or None, threshold=cfg.threshold, layout_digest=layout_digest, **kw)


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
    if cfg.weighting not in ("", *WEIGHTINGS):
        p.append(f"secure_aggregation.weighting must be \"samples\" or \"uniform\", got {cfg.weighting!r}")
    if not 0 <= cfg.weight_cap <= MAX_WEIGHT_CAP:
        p.append(f"secure_aggregation.weight_cap must be in [1, {MAX_WEIGHT_CAP}] (0 = {DEFAULT_WEIGHT_CAP})")
    if not (math.isfinite(cfg.metric_clip) and cfg.metric_clip >= 0):
        p.append("secure_aggregation.metric_clip must be a positive number (the largest |metric| summed)")
    n0 = floor_of(spec)
    try:
        if not dp_plan.privacy_problems(spec):  # a distributed-DP plan that cannot be made is the privacy check's
            layout = layout_for(spec, ("check",), ((1,),), n0, ("metric",))
            session_params(spec, task_id="check", round_number=1, cohort=tuple(f"site-{i}" for i in range(n0)),
                           model_hash_hex="00" * 32, vector_length=layout.length, quantizer=layout.quantizer)
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
