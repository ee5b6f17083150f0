"""A round's model recomputed from what the sites committed: the published updates of a plain round, or the
unmasked sum of a secure one, run through the task's own strategy on the round's base model.

Only strategies whose result is a function of the round's base model and the signed updates are recomputed
(:data:`RECOMPUTABLE`); a strategy with server state carried between rounds (momentum, adaptive moments), with
server-side noise or with weights taken from unsigned metrics is reported as not recomputed, and so is a round
broadcast under a downlink codec. Streaming float sums depend on arrival order at the last bit, so a recomputed
model matches when every value is within :func:`tolerance` of the published one.
"""

from __future__ import annotations

import json
from typing import Callable, Mapping

import numpy as np

from fedclinic.codecs import decode
from fedclinic.errors import IntegrityError
from fedclinic.proto import control_pb2, task_pb2
from fedclinic.secagg.errors import SecAggError
from fedclinic.secagg.task_config import layout_for
from fedclinic.spec.validation import strategy_of
from fedclinic.strategies import FedAvg
from fedclinic.transport import codec_wire
from fedclinic.verification.round_statement import RoundStatement

RECOMPUTABLE = frozenset({FedAvg.name})
"""Strategies whose round result the verifier recomputes exactly (up to float summation order)."""


def why_not_recomputed(spec: task_pb2.TaskSpec, rec: control_pb2.RoundRecords) -> str:
    """Why round ``rec`` cannot be recomputed ("" when it can)."""
    name = spec.strategy or FedAvg.name
    if name not in RECOMPUTABLE:
        return f"not recomputed: strategy {name} (only {', '.join(sorted(RECOMPUTABLE))} is recomputed)"
    if not codec_wire.is_raw(spec.update.downlink_codec or "raw"):
        return f"not recomputed: the model is broadcast under downlink codec {spec.update.downlink_codec!r}"
    if not rec.model_hash:
        return "not recomputed: the round published no model"
    if not rec.secure and not rec.updates_published:
        return "not recomputed: the task does not publish its updates ([verification] publish_updates = false)"
    return ""


def decode_update(st: RoundStatement, payload: Callable[[str, str], bytes]) -> dict[str, np.ndarray]:
    """The float32 deltas of ``st``'s update; ``payload(sha256, what)`` gives each tensor's checked bytes."""
    out: dict[str, np.ndarray] = {}
    for t in st.tensors:
        name, shape = str(t["name"]), tuple(int(d) for d in t["shape"])
        data = payload(str(t["sha256"]), f"tensor {name!r} of {st.site}'s update")
        codec = codec_wire.task_codec(str(t["codec"]))
        if codec is None:
            if t["dtype"] != "float32" or len(data) != 4 * int(np.prod(shape, dtype=np.int64)):
                raise IntegrityError(f"tensor {name!r} of {st.site}'s update is not a float32 {list(shape)}")
            out[name] = np.frombuffer(data, dtype="<f4").reshape(shape)
        else:
            params = codec_wire.params_of(name, codec, list(shape), dict(t["codec_params"]))
            out[name] = decode(data, params).reshape(shape)
    return out


def plain_round(spec: task_pb2.TaskSpec, base: Mapping[str, np.ndarray], updates: list[tuple[RoundStatement,
                dict[str, np.ndarray]]]) -> dict[str, np.ndarray]:
    """The round's model from ``base`` and the sites' (statement, deltas), weighted by their signed sample counts."""
    strategy = strategy_of(spec)
    strategy.begin(dict(base))
    for st, deltas in updates:
        strategy.accept(deltas, strategy.weight_for(st.num_samples, {}), site=st.site)
    return {**base, **strategy.finalize()}


def secure_round(spec: task_pb2.TaskSpec, base: Mapping[str, np.ndarray], rec: control_pb2.RoundRecords,
                 ring_sum: bytes) -> dict[str, np.ndarray]:
    """The round's model from ``base`` and the published ring sum, as the aggregator makes it: the session's
    input layout rebuilt from the task and the published parameters (tensors, cohort size, metric names;
    :func:`fedclinic.secagg.task_config.layout_for`; a top-k task's shared index set from the published seed),
    the sample-weighted mean of each tensor some survivor sent
    decoded from the sum, and handed to the strategy as one update of weight 1."""
    params = json.loads(rec.secure_params_json)
    if len(rec.survivors) < 1:
        raise IntegrityError(f"round {rec.round}: the secure sum names no survivors")
    names = tuple(str(n) for n in params["names"])
    shapes = tuple(tuple(int(d) for d in shape) for shape in params["shapes"])
    try:
        layout = layout_for(spec, names, shapes, int(params.get("cohort", len(rec.survivors))),
                            tuple(str(n) for n in params.get("metric_names", ())),
                            index_seed=bytes.fromhex(str(params.get("index_seed", ""))))
        total = np.frombuffer(ring_sum, dtype=layout.quantizer.dtype.newbyteorder("<")).astype(layout.quantizer.dtype)
        decoded = layout.decode(total)
    except (SecAggError, ValueError) as exc:
        raise IntegrityError(f"round {rec.round}: the published secure sum does not fit its layout: {exc}") from None
    deltas = {name: mean.reshape(dict(zip(names, shapes))[name]) for name, mean in decoded.tensors.items()}
    strategy = strategy_of(spec)
    strategy.begin(dict(base))
    strategy.accept(deltas, 1.0, site="secure-aggregate")
    return {**base, **strategy.finalize()}


def tolerance(reference: np.ndarray) -> float:
    """How far a recomputed value may be from the published one: float32 summation-order noise."""
    scale = float(np.max(np.abs(reference))) if reference.size else 0.0
    return 1e-5 * max(1.0, scale)


def differences(recomputed: Mapping[str, np.ndarray], published: Mapping[str, np.ndarray]) -> list[str]:
    """The tensors where ``published`` is not ``recomputed`` (each with its largest difference)."""
    out = []
    for name in sorted(set(recomputed) | set(published)):
        a, b = recomputed.get(name), published.get(name)
        if a is None or b is None or a.shape != b.shape:
            out.append(f"{name!r} (missing or of another shape)")
            continue
        if a.dtype.kind != "f":
            if not np.array_equal(a, b):
                out.append(f"{name!r} (changed)")
            continue
        diff = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.size else 0.0
        if not diff <= tolerance(a):
            out.append(f"{name!r} (off by up to {diff:.3g})")
    return out


__all__ = ["RECOMPUTABLE", "decode_update", "differences", "plain_round", "secure_round", "tolerance",
           "why_not_recomputed"]
