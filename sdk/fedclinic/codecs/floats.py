"""Element-wise float codecs: ``fp32`` (identity), ``fp16`` (IEEE half) and ``bf16`` (bfloat16).

Payloads are little-endian arrays of the target type, one element per tensor element, in C order.

- ``fp32``: the raw bytes. Error 0.
- ``fp16``: numpy's IEEE round-to-nearest-even cast. With unit roundoff ``u = 2^-11`` and smallest
  subnormal ``2^-24``: ``|x̂ - x| <= 2^-11 |x| + 2^-25``. Values with ``|x| >= 65520`` would round to
  infinity and are refused (use ``bf16`` or ``fp32``); ``65504 < |x| < 65520`` round to ``±65504``, inside
  the bound.
- ``bf16``: the top 16 bits of the float32 pattern, rounded to nearest even by bit manipulation (numpy has
  no bfloat16): ``h = (b + 0x7FFF + ((b >> 16) & 1)) >> 16`` for the uint32 pattern ``b``; decoding is
  ``h << 16``. bf16 keeps float32's exponent range and 8 significant bits, so ``u = 2^-8`` and its smallest
  subnormal is ``2^-133``: ``|x̂ - x| <= 2^-8 |x| + 2^-134``. Values within half a bf16 step of float32's
  maximum (``|x| >= 3.3962e38``) would round to infinity and are refused.

Decoding refuses payloads that hold NaN or Inf (:class:`~fedclinic.errors.IntegrityError`): an accumulator
must never be poisoned by one site.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt

from fedclinic.codecs.base import Codec, DenseReader, Params, check_length, register
from fedclinic.codecs.errors import CodecInputError, IntegrityError

_ENC_CHUNK = 1 << 16


def _first_nonfinite(name: str, bad: npt.NDArray[np.bool_], start: int) -> IntegrityError:
    i = start + int(np.flatnonzero(bad)[0])
    return IntegrityError(f"{name} payload holds a NaN/Inf at flat index {i}; a sender never encodes one, "
                          f"so the payload is corrupt (refused before touching the accumulator)")


class _FloatReader(DenseReader):
    def __init__(self, name: str, arr: npt.NDArray[Any], n: int, chunk: int) -> None:
        self.name, self.arr, self.n = name, arr, n
        self.step = chunk

    def _nonfinite(self, part: npt.NDArray[Any]) -> npt.NDArray[np.bool_]:
        return ~np.isfinite(part)

    def validate(self) -> None:
        for a in range(0, self.n, self.step):
            bad = self._nonfinite(self.arr[a:a + self.step])
            if bad.any():
                raise _first_nonfinite(self.name, bad, a)

    def values(self, start: int, stop: int) -> npt.NDArray[np.float32]:
        return self.arr[start:stop].astype(np.float32)


@register
@dataclass(frozen=True)
class FP32(Codec):
    """Identity: the float32 bytes. ``|x̂ - x| = 0``."""

    name: ClassVar[str] = "fp32"
    kind: ClassVar[Literal["value", "sparsifier"]] = "value"
    bound: ClassVar[str] = "exact: |x̂ - x| = 0 (4 bytes/element)"

    @property
    def spec(self) -> str:
        return "fp32"

    def _encode_flat(self, flat: npt.NDArray[np.float32], rng: np.random.Generator | None) -> tuple[bytes, Params]:
        return flat.astype("<f4", copy=False).tobytes(), {}

    @classmethod
    def _param_keys(cls) -> frozenset[str]:
        return frozenset()

    @classmethod
    def _reader(cls, buf: npt.NDArray[np.uint8], params: Mapping[str, Any], n: int, chunk: int) -> _FloatReader:
        check_length(buf, 4 * n, "fp32", f"{n} float32 values")
        return _FloatReader("fp32", buf.view("<f4"), n, chunk)

    def _bound_flat(self, flat: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        return np.zeros_like(flat)


class _FP16Reader(_FloatReader):
    def _nonfinite(self, part: npt.NDArray[Any]) -> npt.NDArray[np.bool_]:
        return (part.view("<u2") & np.uint16(0x7C00)) == np.uint16(0x7C00)  # exponent all ones: Inf or NaN


@register
@dataclass(frozen=True)
class FP16(Codec):
    """IEEE half precision, round to nearest even. ``|x̂ - x| <= 2^-11 |x| + 2^-25``; refuses ``|x| >= 65520``."""

    name: ClassVar[str] = "fp16"
    kind: ClassVar[Literal["value", "sparsifier"]] = "value"
    bound: ClassVar[str] = "|x̂ - x| <= 2^-11 |x| + 2^-25 (2 bytes/element); refuses |x| >= 65520"

    @property
    def spec(self) -> str:
        return "fp16"

    def _encode_flat(self, flat: npt.NDArray[np.float32], rng: np.random.Generator | None) -> tuple[bytes, Params]:
        with np.errstate(over="ignore"):
            h = flat.astype("<f2")
        bad = (h.view("<u2") & np.uint16(0x7C00)) == np.uint16(0x7C00)  # exponent all ones (float16 math is slow)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise CodecInputError(f"codec 'fp16': value {float(flat[i])!r} at flat index {i} is outside fp16's range "
                                  f"(|x| < 65520); use bf16 or fp32 for this tensor")
        return h.tobytes(), {}

    @classmethod
    def _param_keys(cls) -> frozenset[str]:
        return frozenset()

    @classmethod
    def _reader(cls, buf: npt.NDArray[np.uint8], params: Mapping[str, Any], n: int, chunk: int) -> _FloatReader:
        check_length(buf, 2 * n, "fp16", f"{n} float16 values")
        return _FP16Reader("fp16", buf.view("<f2"), n, chunk)

    def _bound_flat(self, flat: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        return np.abs(flat) * 2.0 ** -11 + 2.0 ** -25


class _BF16Reader(_FloatReader):
    def _nonfinite(self, part: npt.NDArray[Any]) -> npt.NDArray[np.bool_]:
        return (part & np.uint16(0x7F80)) == np.uint16(0x7F80)  # exponent all ones: Inf or NaN

    def values(self, start: int, stop: int) -> npt.NDArray[np.float32]:
        wide = self.arr[start:stop].astype(np.uint32)
        wide <<= np.uint32(16)
        return wide.view(np.float32)


def bf16_bits(flat: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    """bfloat16 bit patterns of float32 values, rounded to nearest even (finite inputs; overflow gives Inf)."""
    b = flat.astype("<f4", copy=False).view("<u4")
    lsb = (b >> np.uint32(16)) & np.uint32(1)
    return ((b + np.uint32(0x7FFF) + lsb) >> np.uint32(16)).astype("<u2")


@register
@dataclass(frozen=True)
class BF16(Codec):
    """bfloat16 by round-to-nearest-even of the top 16 bits. ``|x̂ - x| <= 2^-8 |x| + 2^-134``."""

    name: ClassVar[str] = "bf16"
    kind: ClassVar[Literal["value", "sparsifier"]] = "value"
    bound: ClassVar[str] = "|x̂ - x| <= 2^-8 |x| + 2^-134 (2 bytes/element); refuses |x| >= 3.3962e38"

    @property
    def spec(self) -> str:
        return "bf16"

    def _encode_flat(self, flat: npt.NDArray[np.float32], rng: np.random.Generator | None) -> tuple[bytes, Params]:
        out = np.empty(flat.size, dtype="<u2")
        for a in range(0, flat.size, _ENC_CHUNK):
            h = bf16_bits(flat[a:a + _ENC_CHUNK])
            bad = (h & np.uint16(0x7F80)) == np.uint16(0x7F80)
            if bad.any():
                i = a + int(np.flatnonzero(bad)[0])
                raise CodecInputError(f"codec 'bf16': value {float(flat[i])!r} at flat index {i} rounds to infinity in "
                                      f"bfloat16 (|x| >= 3.3962e38); use fp32 for this tensor")
            out[a:a + h.size] = h
        return out.tobytes(), {}

    @classmethod
    def _param_keys(cls) -> frozenset[str]:
        return frozenset()

    @classmethod
    def _reader(cls, buf: npt.NDArray[np.uint8], params: Mapping[str, Any], n: int, chunk: int) -> _BF16Reader:
        check_length(buf, 2 * n, "bf16", f"{n} bfloat16 values")
        return _BF16Reader("bf16", buf.view("<u2"), n, chunk)

    def _bound_flat(self, flat: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        return np.abs(flat) * 2.0 ** -8 + 2.0 ** -134
