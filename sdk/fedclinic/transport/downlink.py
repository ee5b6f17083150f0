"""Compressed downlink: the global model's change broadcast under a dense codec, bit-identical everywhere.

A task may set ``[update] downlink_codec`` ("fp16", "bf16", "int8" or "int4"). When a round closes, the
aggregator encodes each changed float32 tensor's delta d = new - base with that codec and *defines* the new
global tensor as the decoded one::

    global_r = base + decode(encode(new - base))        (float32, computed by :func:`apply`)

so the aggregator, every agent and the data scientist hold the same bits, and a model hash still names one
model. An agent that holds ``base`` fetches the encoded delta (a quarter of the float32 bytes for int8, an
eighth for int4) and rebuilds ``global_r`` with the same :func:`apply`; it checks the result against the
manifest's sha256 and fetches the full tensor instead when it does not match. An agent without ``base`` (new
to the task, or restarted with an emptied cache) fetches full tensors.

What it costs: each round's change is rounded once, |global_r - new| <= the codec's error bound on d
(e.g. int8 blockwise: max|d| over the block / 254 with nearest rounding, twice that with stochastic rounding;
``Codec.error_bound``). The rounding is not fed back (no server-side error feedback): the next round's sites
train from global_r, so the federation continues from the broadcast model rather than drifting from it.
Sparsifying codecs (top-k) are refused: without error feedback they would drop most of every round's change.
"""

from __future__ import annotations

import hashlib

import numpy as np
import numpy.typing as npt

from fedclinic.codecs import Codec, CodecSpecError, Encoded, parse_codec

#: the dense codecs a downlink may use (the first stage of the spec; their options, e.g. int8:block=64, apply)
DOWNLINK_CODECS = ("fp16", "bf16", "int8", "int4")


def spec_problems(spec: str) -> list[str]:
    """What is wrong with a task's ``downlink_codec`` ("" or "raw" = off), each with what to choose instead."""
    if spec in ("", "raw"):
        return []
    try:
        codec = parse_codec(spec)
    except CodecSpecError as exc:
        return [f"downlink_codec: {exc}"]
    if "+" in codec.spec or codec.name not in DOWNLINK_CODECS:
        return [f"downlink_codec {spec!r} is not a dense codec; the global model's change is broadcast under one of "
                f"{', '.join(DOWNLINK_CODECS)} (sparsifiers would drop most of each round's change)"]
    return []


def downlink_codec(spec: str) -> Codec | None:
    """The codec of a task's ``downlink_codec``; None when the downlink is not compressed."""
    return None if spec in ("", "raw") else parse_codec(spec)


def tensor_rng(task_id: str, rnd: int, name: str) -> np.random.Generator:
    """The generator the aggregator rounds tensor ``name`` of round ``rnd``'s broadcast with: closing the same round
    again (after a crash) gives the same model."""
    digest = hashlib.sha256(f"fedclinic-downlink/1\0{task_id}\0{rnd}\0{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:16], "little"))


def apply(base: npt.ArrayLike, codec: Codec, payload: bytes | memoryview, params: dict) -> npt.NDArray[np.float32]:
    """``base + decode(payload)`` in float32, shaped like ``base``: the one computation the aggregator and the
    agents share, so both get the same bits."""
    base32 = np.asarray(base, dtype=np.float32)
    delta = codec.decode(payload, params).reshape(base32.shape)
    return np.add(base32, delta, dtype=np.float32)


def compress(base: npt.ArrayLike, new: npt.ArrayLike, codec: Codec, rng: np.random.Generator
             ) -> tuple[npt.NDArray[np.float32], Encoded]:
    """The broadcast tensor and its encoded delta: ``(apply(base, encode(new - base)), encoded)``."""
    base32 = np.asarray(base, dtype=np.float32)
    delta = np.subtract(np.asarray(new, dtype=np.float32), base32, dtype=np.float32)
    enc = codec.encode(delta, rng=rng)
    return apply(base32, codec, enc.payload, enc.params), enc
