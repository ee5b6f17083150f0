"""Update codecs on the wire: a task's codec, the codec fields of a ``TensorHeader``, and their checks.

The codec library (:mod:`fedclinic.codecs`) is transport-free; this module is what the agent and the
aggregator share to put its payloads into ``SubmitUpdate``:

- A task declares ``UpdateConfig.codec``: ``"raw"`` (or empty) for plain little-endian float32 deltas, or
  a codec spec such as ``"topk:0.05+int8"`` (:func:`fedclinic.codecs.parse_codec`). :func:`task_codec`
  parses it; :func:`canonical` gives the canonical spec string both ends compare.
- An encoded tensor travels with ``TensorHeader.codec`` = the task's canonical spec, ``dtype = "float32"``
  and ``shape`` of the decoded delta, ``encoded_nbytes`` / ``sha256`` of the payload, and
  ``codec_params`` = the payload's params (:class:`fedclinic.codecs.Encoded`) except ``codec`` and
  ``shape`` (which the header already carries), each value as compact JSON (e.g. ``k -> "512"``,
  ``values -> '{"block":128,"codec":"int8","scale":"fp32","shape":[512]}'``).
- :func:`params_of` rebuilds the params from a header and checks them against the task's codec (same
  stages, block size, scale layout, index coding, ``k``), so a site can only send what the task declared.
- :func:`tensor_rng` is the generator a site uses for stochastic rounding of one tensor: seeded from the
  task, round, site and tensor name, so an update can be replayed bit for bit.
- Error feedback (top-k) keeps its residual per task at the site (:func:`uses_error_feedback`).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import numpy as np

from fedclinic.codecs import FP32, Codec, CodecSpecError, Encoded, Int4, Int8, TopK, parse_codec, stage_names
from fedclinic.errors import IntegrityError

RAW = "raw"
#: largest encoded payload accepted per decoded element (int8 with block=1 needs 5; top-k 5 + 4 per kept one)
MAX_BYTES_PER_ELEMENT = 16


def is_raw(spec: str) -> bool:
    return spec in ("", RAW)


def task_codec(spec: str) -> Codec | None:
    """The codec of a task's ``UpdateConfig.codec`` (None for raw float32); CodecSpecError if unparsable."""
    return None if is_raw(spec) else parse_codec(spec)


def canonical(spec: str) -> str:
    """Canonical spec string (``"raw"`` for raw): what ``TensorHeader.codec`` must equal."""
    codec = task_codec(spec)
    return RAW if codec is None else codec.spec


def needed_codecs(spec: str) -> tuple[str, ...]:
    """Codec ids a site must announce at ``Hello`` to take a task with this codec (empty for raw)."""
    codec = task_codec(spec)
    return () if codec is None else stage_names(codec)


def uses_error_feedback(codec: Codec | None) -> bool:
    """Whether sites keep an error-feedback residual for this codec (sparsifiers: what is not sent is kept)."""
    return isinstance(codec, TopK)


def spec_problems(spec: str, *, secure_aggregation: bool) -> list[str]:
    """Why a task's codec cannot be used (empty when it can).

    With secure aggregation only ``topk:F`` (a fraction, fp32 kept values) runs: every site sends the same
    shared random ``ceil(F * P)`` coordinates (:mod:`fedclinic.secagg.vector_layout`), which reveal nothing about
    any site. Refused: value codecs (int8/int4/fp16/bf16: secure aggregation's own quantizer already decides the
    precision, ``secure_aggregation.bits``), top-k with a value codec (the same reason), and top-k by count
    (``topk:k=N``: the set is a fraction of the whole update vector, not of each tensor)."""
    try:
        codec = task_codec(spec)
    except CodecSpecError as exc:
        return [f"update codec: {exc}"]
    if codec is None or not secure_aggregation:
        return []
    quantizer = ("the masked vector is already quantized by secure aggregation's own quantizer; set its precision "
                 "with secure_aggregation.bits (e.g. bits = 8)")
    if isinstance(codec, TopK):
        if not isinstance(codec.values, FP32):
            why = f"the kept values' codec {codec.values.spec!r}: {quantizer}; use 'topk:{codec.fraction or 0.05:g}'"
        elif codec.fraction is None:
            why = ("under secure aggregation top-k keeps a shared random fraction of the whole update vector, not "
                   "k values per tensor; give a fraction, e.g. 'topk:0.05'")
        else:
            return []
    else:
        why = f"{quantizer}; use codec 'raw' (or 'topk:F' for a shared random fraction F of the coordinates)"
    return [f"update codec {codec.spec!r} cannot be combined with secure aggregation: {why}"]


def tensor_rng(task_id: str, rnd: int, site: str, name: str) -> np.random.Generator:
    """The generator a site uses to encode tensor ``name`` of its round-``rnd`` update (stochastic rounding)."""
    digest = hashlib.sha256(f"fedclinic-codec/1\0{task_id}\0{rnd}\0{site}\0{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:16], "little"))


def header_params(enc: Encoded) -> dict[str, str]:
    """``TensorHeader.codec_params`` of an encoded tensor: every param but codec/shape, as compact JSON."""
    return {k: json.dumps(v, sort_keys=True, separators=(",", ":"), allow_nan=False)
            for k, v in enc.params.items() if k not in ("codec", "shape")}


def check_header(name: str, codec_spec: str, dtype: str, shape: list[int], encoded_nbytes: int) -> None:
    """Self-consistency of an encoded tensor's header (before any byte is read): a parsable codec, float32
    deltas, and a payload size within reach of the shape. IntegrityError says what is wrong."""
    try:
        parse_codec(codec_spec)
    except CodecSpecError as exc:
        raise IntegrityError(f"tensor {name!r}: {exc}") from None
    if dtype != "float32":
        raise IntegrityError(f"tensor {name!r}: encoded deltas decode to float32, header says dtype {dtype!r}")
    n = math.prod(shape)
    limit = MAX_BYTES_PER_ELEMENT * n + 4096
    if not 0 <= encoded_nbytes <= limit:
        raise IntegrityError(f"tensor {name!r}: {encoded_nbytes} encoded bytes declared for {n} elements "
                             f"(at most {limit} for codec {codec_spec!r})")


def params_of(name: str, codec: Codec, shape: list[int], codec_params: dict[str, str]) -> dict[str, Any]:
    """The payload params of an encoded tensor from its header fields, checked against the task's codec.
    IntegrityError names the tensor and the field."""
    params: dict[str, Any] = {"codec": codec.name, "shape": [int(d) for d in shape]}
    for key, text in codec_params.items():
        if key in ("codec", "shape"):
            raise IntegrityError(f"tensor {name!r}: codec_params must not repeat {key!r} (the header carries it)")
        try:
            params[key] = json.loads(text)
        except ValueError:
            raise IntegrityError(f"tensor {name!r}: codec_params[{key!r}] is not JSON: {text[:80]!r}") from None
    _conforms(name, codec, params, math.prod(shape))
    return params


def _conforms(name: str, codec: Codec, params: dict[str, Any], n: int) -> None:
    def bad(field: str, want: Any) -> IntegrityError:
        return IntegrityError(f"tensor {name!r}: codec_params {field} is {params.get(field)!r}, the task's codec "
                              f"{codec.spec!r} gives {want!r}")

    if params.get("codec") != codec.name:
        raise bad("codec", codec.name)
    if isinstance(codec, (Int8, Int4)):
        if params.get("block") != codec.block:
            raise bad("block", codec.block)
        if params.get("scale") != codec.scale:
            raise bad("scale", codec.scale)
    elif isinstance(codec, TopK):
        k = codec.k_for(n)
        if params.get("k") != k:
            raise bad("k", k)
        if params.get("idx") != codec.idx:
            raise bad("idx", codec.idx)
        inner = params.get("values")
        if not isinstance(inner, dict) or inner.get("shape") != [k]:
            raise IntegrityError(f"tensor {name!r}: codec_params values must be the params of the {k} kept values, "
                                 f"got {inner!r}")
        _conforms(name, codec.values, inner, k)
