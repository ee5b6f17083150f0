"""Byte accounting: encoded size against the raw float32 size, so compression claims are measured facts.

``raw_bytes`` is what the tensor costs as float32 (``4 * prod(shape)``); ``payload_bytes`` the encoded
payload; ``params_bytes`` the params as compact JSON (:func:`params_json`), which travel with the payload.
``ratio = raw_bytes / (payload_bytes + params_bytes)``: the compression factor against plain fp32 deltas.
Wire framing (protobuf headers, chunking, TLS) is counted by the transport, not here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fedclinic.codecs.base import Encoded, param_shape


def params_json(params: Mapping[str, Any]) -> bytes:
    """Canonical compact JSON of codec params (sorted keys, no spaces, UTF-8)."""
    return json.dumps(params, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def fp32_bytes(shape: Iterable[int]) -> int:
    """Bytes of a float32 tensor of this shape."""
    return 4 * math.prod(int(d) for d in shape)


@dataclass(frozen=True)
class ByteCount:
    """Raw float32 bytes against encoded bytes (payload + params JSON); add counts with ``+``."""

    raw_bytes: int
    payload_bytes: int
    params_bytes: int

    @property
    def encoded_bytes(self) -> int:
        return self.payload_bytes + self.params_bytes

    @property
    def ratio(self) -> float:
        """raw / encoded (compression factor vs fp32); ``inf`` for nothing encoded."""
        return self.raw_bytes / self.encoded_bytes if self.encoded_bytes else math.inf

    def __add__(self, other: ByteCount) -> ByteCount:
        return ByteCount(self.raw_bytes + other.raw_bytes, self.payload_bytes + other.payload_bytes,
                         self.params_bytes + other.params_bytes)


def count_bytes(enc: Encoded) -> ByteCount:
    """Byte count of one encoded tensor (raw size from ``params["shape"]``)."""
    shape, _ = param_shape(enc.params, str(enc.params.get("codec")))
    return ByteCount(fp32_bytes(shape), len(enc.payload), len(params_json(enc.params)))


def total_bytes(encoded: Iterable[Encoded]) -> ByteCount:
    """Summed byte count of several encoded tensors (an update)."""
    total = ByteCount(0, 0, 0)
    for enc in encoded:
        total = total + count_bytes(enc)
    return total
