"""Blockwise absmax quantization: ``int8`` (levels ``L = 127``) and ``int4`` (``L = 7``, two per byte).

Math, per block ``b`` of ``B`` consecutive elements (C order; the last block may be shorter)::

    A_b = max_i |x_i|                     block absmax
    s_b = ceil_grid(A_b / L)              the smallest float32 (scale=fp32) or float16 (scale=fp16) >= A_b / L,
                                          so |x_i| <= L * s_b and no value clips (for float32, a scale with
                                          fl(L * s_b) = Inf is stepped down one ulp: decoded values stay finite)
    v_i = x_i / s_b                       float32 division
    q_i = clip(round(v_i), -L, L)         rounding=nearest: round half to even, |q_i - v_i| <= 1/2
        = clip(floor(v_i + u_i), -L, L)   rounding=stochastic: u_i ~ U[0, 1) from the caller's Generator,
                                          P(q_i = floor(v_i) + 1) = frac(v_i), so E[q_i] = v_i
    x̂_i = fl32(q_i * s_b)                 decode

Unbiasedness (stochastic): ``E[x̂_i] = x_i`` up to float32 arithmetic: the division, the sum ``v + u`` and
the product each round to float32 (relative ``2^-24``) and ``u`` has 24-bit granularity, so the bias is at
most ``2^-22 (|x_i| + s_b)``, far below the rounding noise (standard deviation up to ``s_b / 2``).

Error bound (every rng; ``rho = 1/2`` nearest, ``1`` stochastic; ``(u_s, m_s)`` = ``(2^-24, 2^-149)`` for
scale=fp32 and ``(2^-11, 2^-24)`` for scale=fp16: unit roundoff and smallest subnormal of the scale type)::

    |x̂_i - x_i| <= (rho + 2^-22) S_b + 2^-22 (A_b + |x_i|) + 2^-149,   S_b = (A_b / L) (1 + 2 u_s) + m_s

``S_b`` bounds the stored scale (rounded up by at most one ulp, or one subnormal step), ``rho S_b`` is the
rounding to a level, the ``2^-22`` terms are the three float32 roundings (and the one-ulp step down near
float32's maximum), ``2^-149`` a subnormal product. A block of zeros is exact. scale=fp16 refuses blocks
with ``A_b / L > 65504``.

Payload: ``ceil(n / B)`` scales (little-endian float32 or float16), then the codes: int8 one byte each
(two's complement); int4 two per byte, element ``2j`` in the low nibble and ``2j + 1`` in the high nibble,
stored as ``q + 8`` (1..15; an odd tail is padded with ``8``, i.e. 0). Bytes per element:
``1 + bytes(scale) / B`` (int8) and ``1/2 + bytes(scale) / B`` (int4).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt

from fedclinic.codecs.base import Codec, DenseReader, Params, check_length, param_int, param_str, register
from fedclinic.codecs.errors import CodecInputError, CodecSpecError, IntegrityError

MAX_BLOCK = 1 << 20
_ENC_CHUNK = 1 << 16
# scale dtype: (numpy dtype, bytes, unit roundoff u_s, smallest subnormal m_s)
_SCALE = {"fp32": ("<f4", 4, 2.0 ** -24, 2.0 ** -149),
          "fp16": ("<f2", 2, 2.0 ** -11, 2.0 ** -24)}

Rounding = Literal["stochastic", "nearest"]
ScaleDtype = Literal["fp32", "fp16"]


def _step(chunk: int, block: int) -> int:
    """Elements per decode step: a whole number of blocks, even (int4 nibble pairs), about ``chunk``."""
    per = max(1, chunk // block) * block
    return per if per % 2 == 0 else 2 * per


class _QuantReader(DenseReader):
    def __init__(self, codec: str, levels: int, block: int, scales: npt.NDArray[np.float32],
                 codes: npt.NDArray[Any], n: int, chunk: int) -> None:
        self.codec, self.levels, self.block, self.scales, self.codes, self.n = codec, levels, block, scales, codes, n
        self.step = _step(chunk, block)

    def validate(self) -> None:
        s = self.scales
        with np.errstate(over="ignore"):
            bad = ~np.isfinite(s) | (s < 0) | ~np.isfinite(s * np.float32(self.levels))
        if bad.any():
            b = int(np.flatnonzero(bad)[0])
            raise IntegrityError(f"{self.codec} payload: scale of block {b} is {float(s[b])!r}; scales are finite, "
                                 f">= 0 and L * scale is finite, so the payload is corrupt")

    def _codes(self, start: int, stop: int) -> npt.NDArray[Any]:
        return self.codes[start:stop]

    def values(self, start: int, stop: int) -> npt.NDArray[np.float32]:
        q = self._codes(start, stop)
        m, B = stop - start, self.block
        full, b0 = m // B, start // B
        out = np.empty(m, dtype=np.float32)
        if full:
            np.multiply(q[:full * B].reshape(full, B), self.scales[b0:b0 + full, None],
                        out=out[:full * B].reshape(full, B), dtype=np.float32)
        if m > full * B:
            np.multiply(q[full * B:], self.scales[b0 + full], out=out[full * B:], dtype=np.float32)
        return out


class _Int4Reader(_QuantReader):
    def _codes(self, start: int, stop: int) -> npt.NDArray[Any]:
        packed = self.codes[start // 2:(stop + 1) // 2]
        nib = np.empty(2 * packed.size, dtype=np.int8)
        nib[0::2] = packed & np.uint8(0x0F)
        nib[1::2] = packed >> np.uint8(4)
        nib -= np.int8(8)
        return nib[:stop - start]


@dataclass(frozen=True)
class _BlockQuant(Codec):
    block: int = 128
    scale: ScaleDtype = "fp32"
    rounding: Rounding = "stochastic"

    kind: ClassVar[Literal["value", "sparsifier"]] = "value"
    levels: ClassVar[int]

    def __post_init__(self) -> None:
        if isinstance(self.block, bool) or not isinstance(self.block, int) or not 1 <= self.block <= MAX_BLOCK:
            raise CodecSpecError(f"{self.name}: block must be an integer in [1, {MAX_BLOCK}], got {self.block!r}")
        if self.scale not in _SCALE:
            raise CodecSpecError(f"{self.name}: scale must be fp32 or fp16, got {self.scale!r}")
        if self.rounding not in ("stochastic", "nearest"):
            raise CodecSpecError(f"{self.name}: rounding must be stochastic or nearest, got {self.rounding!r}")

    @property
    def needs_rng(self) -> bool:
        return self.rounding == "stochastic"

    @property
    def spec(self) -> str:
        return f"{self.name}:block={self.block},scale={self.scale},rounding={self.rounding}"

    def _scales(self, absmax: npt.NDArray[np.float32]) -> npt.NDArray[Any]:
        """Smallest scale-dtype values >= absmax / L (see the module docstring)."""
        dt = _SCALE[self.scale][0]
        want = absmax.astype(np.float64) / self.levels
        with np.errstate(over="ignore"):
            s = want.astype(dt)
            low = s.astype(np.float64) < want
            if low.any():
                s[low] = np.nextafter(s[low], np.asarray(np.inf, dtype=dt))
            if self.scale == "fp16":
                if not np.isfinite(s).all():
                    b = int(np.flatnonzero(~np.isfinite(s))[0])
                    raise CodecInputError(f"codec {self.spec!r}: a block has absmax {float(absmax[b])!r}, too large for "
                                          f"a float16 scale (absmax <= {65504 * self.levels}); use scale=fp32")
            else:
                over = ~np.isfinite(s * np.float32(self.levels))
                if over.any():
                    s[over] = np.nextafter(s[over], np.float32(0))  # now <= A_b / L <= max / L: finite
        return s

    def _encode_flat(self, flat: npt.NDArray[np.float32], rng: np.random.Generator | None) -> tuple[bytes, Params]:
        n, B, L = flat.size, self.block, self.levels
        nb = -(-n // B)
        dt, ssize, _, _ = _SCALE[self.scale]
        scales = np.empty(nb, dtype=dt)
        codes = np.empty(n if L == 127 else (n + 1) // 2, dtype=np.int8 if L == 127 else np.uint8)
        step = _step(_ENC_CHUNK, B)
        for a in range(0, n, step):
            part = flat[a:a + step]
            m = part.size
            nblk = -(-m // B)
            if m % B:
                padded = np.zeros(nblk * B, dtype=np.float32)
                padded[:m] = part
                part = padded
            blocks = part.reshape(nblk, B)
            s = self._scales(np.max(np.abs(blocks), axis=1))
            scales[a // B:a // B + nblk] = s
            s32 = s.astype(np.float32)
            s32[s32 == 0] = 1  # all-zero blocks: any divisor gives q = 0
            v = blocks / s32[:, None]
            if self.rounding == "stochastic":
                assert rng is not None
                v += rng.random(v.shape, dtype=np.float32)
                np.floor(v, out=v)
            else:
                np.rint(v, out=v)
            np.clip(v, -L, L, out=v)
            q = v.reshape(-1)[:m].astype(np.int8)
            if L == 127:
                codes[a:a + m] = q
            else:
                nib = (q + np.int8(8)).astype(np.uint8)
                if m % 2:
                    nib = np.append(nib, np.uint8(8))
                codes[a // 2:a // 2 + nib.size // 2] = nib[0::2] | (nib[1::2] << np.uint8(4))
        return scales.tobytes() + codes.tobytes(), {"block": B, "scale": self.scale}

    @classmethod
    def _param_keys(cls) -> frozenset[str]:
        return frozenset({"block", "scale"})

    @classmethod
    def _reader(cls, buf: npt.NDArray[np.uint8], params: Mapping[str, Any], n: int, chunk: int) -> _QuantReader:
        B = param_int(params, "block", cls.name, 1, MAX_BLOCK)
        scale = param_str(params, "scale", cls.name, tuple(_SCALE))
        dt, ssize, _, _ = _SCALE[scale]
        nb = -(-n // B)
        code_bytes = n if cls.levels == 127 else (n + 1) // 2
        check_length(buf, nb * ssize + code_bytes, cls.name,
                     f"{n} elements in {nb} blocks of {B} with {scale} scales")
        scales = buf[:nb * ssize].view(dt).astype(np.float32)
        codes = buf[nb * ssize:]
        if cls.levels == 127:
            return _QuantReader(cls.name, 127, B, scales, codes.view(np.int8), n, chunk)
        return _Int4Reader(cls.name, 7, B, scales, codes, n, chunk)

    def _bound_flat(self, flat: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        n, B = flat.size, self.block
        if n == 0:
            return flat.copy()
        _, _, u_s, m_s = _SCALE[self.scale]
        rho = 0.5 if self.rounding == "nearest" else 1.0
        nb = -(-n // B)
        padded = np.zeros(nb * B)
        padded[:n] = np.abs(flat)
        A = np.repeat(padded.reshape(nb, B).max(axis=1), B)[:n]
        S = A / self.levels * (1 + 2 * u_s) + m_s
        bound = (rho + 2.0 ** -22) * S + 2.0 ** -22 * (A + np.abs(flat)) + 2.0 ** -149
        return np.where(A == 0, 0.0, bound)

    def bytes_per_element(self) -> float:
        """Payload bytes per element for large tensors: code bytes plus the scale amortized over a block."""
        code = 1.0 if self.levels == 127 else 0.5
        return code + _SCALE[self.scale][1] / self.block


@register
@dataclass(frozen=True)
class Int8(_BlockQuant):
    """Blockwise absmax int8 (levels -127..127); see the module docstring for the math and the bound."""

    name: ClassVar[str] = "int8"
    levels: ClassVar[int] = 127
    bound: ClassVar[str] = ("|x̂ - x| <= (rho + 2^-22) S_b + 2^-22 (A_b + |x|) + 2^-149, S_b ~ A_b / 127 (block absmax "
                            "A_b; rho = 1/2 nearest, 1 stochastic, unbiased); 1 + 4/block bytes/element")


@register
@dataclass(frozen=True)
class Int4(_BlockQuant):
    """Blockwise absmax int4 (levels -7..7, two per byte); see the module docstring for the math and the bound."""

    name: ClassVar[str] = "int4"
    levels: ClassVar[int] = 7
    bound: ClassVar[str] = ("|x̂ - x| <= (rho + 2^-22) S_b + 2^-22 (A_b + |x|) + 2^-149, S_b ~ A_b / 7 (block absmax "
                            "A_b; rho = 1/2 nearest, 1 stochastic, unbiased); 0.5 + 4/block bytes/element")


__all__ = ["Int4", "Int8", "MAX_BLOCK"]
