"""Fixed-point quantization of float updates into the ring Z_{2^r} (r = ``ring_bits``: 16, 32 or 64), and back.

Math (``c`` = ``clip``, ``L = 2^bits - 1`` levels, ``s = L / (2c)`` levels per unit, ``step = 1/s``)::

    v_i  = clip(x_i * s + c * s, 0, L)         = (clip(x_i, -c, c) + c) * s, in [0, L] exactly
    q_i  = round(v_i)                          in {0, ..., L}      (uint32)
    S    = sum over m survivors of q_i         (computed mod 2^32; exact when m * L <= 2^32 - 1)
    out  = S * step - m * c                    (dequantize by the number of survivors m)

Rounding (choose with ``rounding``):

- ``"nearest"``: ``q = floor(v + 1/2)``; ``|q - v| <= 1/2``. Deterministic, but biased for values that sit
  systematically between two levels.
- ``"stochastic"`` (default): ``q = floor(v) + [u < frac(v) * 2^32]`` with ``u`` a uniform 32-bit word
  from an AES-256-CTR keystream under a fresh random key. ``P(round up) = ceil(frac(v) 2^32) / 2^32``, so
  ``E[q] = v`` up to ``2^-32`` of a level (unbiased for all practical purposes) and ``|q - v| < 1``.
  Unbiased rounding is what keeps repeated rounds of quantized FedAvg from drifting.

Overflow: the survivors' sum must not wrap, i.e. ``m * W * L <= R`` with ``W = weight_cap`` (the largest
integer a site may multiply its quantized input by: its capped sample count, 1 for uniform weights; see
:mod:`fedclinic.secagg.vector_layout`) and ``R = min(2^r - 1, 2^53)`` (2^53: every sum converts to float64
exactly); :meth:`Quantizer.check_cohort` refuses any cohort whose size could break this (the cohort bounds the
survivors). :func:`ring_for` picks the narrowest ring that holds a cohort's sums: the masked vector travels in
that width (e.g. ``uint16`` for 8-bit quantization, uniform weights and up to 257 sites: half the bytes of
``uint32``).

Error bound (per coordinate, documented and tested)::

    |out - sum_i clip(x_i)| <= m * (rho + 2^-19) * step + 2^-24 * |sum_i clip(x_i)|

with ``rho = 1/2`` (nearest) or ``1`` (stochastic). ``m * rho * step`` is the rounding error of the m
inputs; the ``2^-19`` per client covers float64 arithmetic in quantize/dequantize (``bits <= 24`` keeps it
below ``2^-20`` of a step) and ``2^-24 |.|`` is the final rounding to float32. Values outside ``[-c, c]``
are clipped first; the bound is against the clipped inputs, so choose ``c`` from the update clipping
norm (a delta clipped to L2 norm C has every coordinate in [-C, C]).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fedclinic.secagg.errors import SecAggConfigError, SecAggInputError

RING_MAX = (1 << 32) - 1
"""Largest value of the default ring Z_{2^32}."""

RING_BITS = (16, 32, 64)
"""The ring widths a session may use; the masked vector's dtype is ``uint<r>``."""

EXACT_MAX = (1 << 53) - 1
"""Largest sum a 64-bit ring may reach: every such sum converts to float64 exactly."""

_DTYPES = {16: np.dtype(np.uint16), 32: np.dtype(np.uint32), 64: np.dtype(np.uint64)}

MAX_BITS = 24
"""Largest supported precision: keeps float64 quantization arithmetic within 2^-20 of a level."""

_CHUNK = 1 << 16

Rounding = Literal["stochastic", "nearest"]


@dataclass(frozen=True)
class Quantizer:
    """Map ``[-clip, clip]`` onto ``2^bits`` levels in Z_{2^32}; see the module docstring for the math."""

    clip: float = 1.0
    bits: int = 20
    rounding: Rounding = "stochastic"
    ring_bits: int = 32
    weight_cap: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.clip, (int, float)) and math.isfinite(self.clip) and self.clip > 0):
            raise SecAggConfigError(f"quantization clip must be a finite positive number, got {self.clip!r}")
        object.__setattr__(self, "clip", float(self.clip))
        if not (isinstance(self.bits, int) and 1 <= self.bits <= MAX_BITS):
            raise SecAggConfigError(f"quantization bits must be an integer in [1, {MAX_BITS}], got {self.bits!r}")
        if self.rounding not in ("stochastic", "nearest"):
            raise SecAggConfigError(f"rounding must be 'stochastic' or 'nearest', got {self.rounding!r}")
        if self.ring_bits not in RING_BITS:
            raise SecAggConfigError(f"ring_bits must be one of {RING_BITS}, got {self.ring_bits!r}")
        if not (isinstance(self.weight_cap, int) and not isinstance(self.weight_cap, bool)
                and 1 <= self.weight_cap <= (1 << 24)):
            raise SecAggConfigError(f"weight_cap must be an integer in [1, 2^24], got {self.weight_cap!r}")
        if self.levels * self.weight_cap > self.ring_max:
            raise SecAggConfigError(f"{self.bits}-bit inputs weighted up to {self.weight_cap} do not fit one "
                                    f"{self.ring_bits}-bit ring element; use a wider ring or fewer bits")

    @property
    def dtype(self) -> np.dtype:
        """The ring's numpy dtype (``uint16``, ``uint32`` or ``uint64``): the masked vector's wire type."""
        return _DTYPES[self.ring_bits]

    @property
    def ring_max(self) -> int:
        """Largest sum the ring holds without wrapping (and converts to float64 exactly)."""
        return min((1 << self.ring_bits) - 1, EXACT_MAX)

    @property
    def levels(self) -> int:
        """``L = 2^bits - 1``: the largest quantized value of one client."""
        return (1 << self.bits) - 1

    @property
    def scale(self) -> float:
        """``s = L / (2 clip)``: levels per unit."""
        return self.levels / (2.0 * self.clip)

    @property
    def step(self) -> float:
        """``1/s``: the value of one level."""
        return 2.0 * self.clip / self.levels

    @property
    def max_clients(self) -> int:
        """Largest number of summed inputs that cannot wrap: ``floor(R / (W * L))``."""
        return self.ring_max // (self.levels * self.weight_cap)

    def check_cohort(self, n: int) -> None:
        """Refuse a cohort of ``n`` clients whose (weighted) summed inputs could wrap the ring."""
        if n * self.levels * self.weight_cap > self.ring_max:
            cap = self.ring_max // max(1, n * self.weight_cap)
            fits = [b for b in range(1, MAX_BITS + 1) if (1 << b) - 1 <= cap]
            weighted = f" x weights up to {self.weight_cap}" if self.weight_cap > 1 else ""
            raise SecAggConfigError(
                f"{n} clients x {self.levels} quantization levels ({self.bits} bits){weighted} can exceed "
                f"{self.ring_max} and wrap the {self.ring_bits}-bit masked sum; use at most "
                f"{max(fits) if fits else 0} bits for this cohort or at most {self.max_clients} clients")

    def error_bound(self, count: int, magnitude: float | np.ndarray | None = None) -> float | np.ndarray:
        """Per-coordinate bound on ``|dequantize(sum) - sum of clipped inputs|`` for ``count`` inputs.

        ``magnitude`` is ``|sum of clipped inputs|`` per coordinate (scalar or array); by default the worst
        case ``count * clip`` is used, so ``error_bound(count)`` holds for every coordinate.
        """
        rho = 0.5 if self.rounding == "nearest" else 1.0
        mag = count * self.clip if magnitude is None else np.abs(magnitude)
        return count * (rho + 2.0 ** -19) * self.step + 2.0 ** -24 * mag

    def quantize(self, x: np.ndarray, *, seed: bytes | None = None) -> np.ndarray:
        """Clip, scale and round a 1-D float vector to ``uint32`` values in ``[0, L]``.

        ``seed`` (32 bytes) fixes the stochastic-rounding keystream for reproducible tests; by default a
        fresh key from the OS CSPRNG is used. Raises :class:`SecAggInputError` for non-float, non-1-D or
        non-finite input.
        """
        arr = np.asarray(x)
        if arr.ndim != 1 or arr.dtype.kind != "f":
            raise SecAggInputError(f"quantize expects a 1-D float vector, got shape {arr.shape} dtype {arr.dtype}")
        n = arr.size
        out = np.empty(n, dtype=np.uint32)
        chunk = max(1, min(_CHUNK, n))
        v = np.empty(chunk, dtype=np.float64)
        lo = np.empty(chunk, dtype=np.float64)
        s = self.scale
        c = self.clip
        stochastic = self.rounding == "stochastic"
        if stochastic:
            key = os.urandom(32) if seed is None else seed
            if len(key) != 32:
                raise SecAggInputError("the stochastic-rounding seed must be 32 bytes")
            enc = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
            zeros = memoryview(bytes(4 * chunk))
            buf = bytearray(4 * chunk + 16)
            words = np.frombuffer(buf, dtype="<u4", count=chunk)
        offset, top = c * s, float(self.levels)
        for start in range(0, n, chunk):
            m = min(chunk, n - start)
            vc, lc = v[:m], lo[:m]
            np.multiply(arr[start:start + m], s, out=vc, dtype=np.float64)  # float64 loop, not float32
            if not math.isfinite(float(vc.sum())):  # one reduction instead of an isfinite mask per chunk
                bad = start + int(np.flatnonzero(~np.isfinite(vc))[0])
                raise SecAggInputError(f"update has a non-finite value at index {bad}; secure aggregation needs "
                                       "finite values (check training for divergence)")
            vc += offset
            np.clip(vc, 0.0, top, out=vc)     # clip in the scaled domain: v is in [0, L] exactly
            if stochastic:
                np.floor(vc, out=lc)
                vc -= lc                      # frac(v) in [0, 1), exact (Sterbenz)
                vc *= 4294967296.0            # frac * 2^32, exact in float64
                enc.update_into(zeros[:4 * m], buf)
                lc += np.less(words[:m], vc)  # round up with probability ceil(frac * 2^32) / 2^32
                out[start:start + m] = lc
            else:
                vc += 0.5
                np.floor(vc, out=vc)
                out[start:start + m] = vc
        return out

    def dequantize(self, total: np.ndarray, count: int, *, out: np.ndarray | None = None) -> np.ndarray:
        """``total * step - count * clip`` as float32, for the (unwrapped) sum of ``count`` quantized inputs.

        Computed in float64 and rounded to float32 once. ``out`` (a float32 vector of the same length, e.g.
        a slice of a larger result) receives the values if given; it is returned either way.
        """
        if not isinstance(total, np.ndarray) or total.dtype not in _DTYPES.values() or total.ndim != 1:
            raise TypeError("dequantize expects the 1-D unsigned ring sum (uint16, uint32 or uint64)")
        if count < 1:
            raise ValueError("dequantize needs the number of summed inputs (>= 1)")
        self.check_cohort(count)
        if out is None:
            out = np.empty(total.size, dtype=np.float32)
        elif not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != total.shape:
            raise TypeError(f"dequantize writes into a float32 vector of {total.size} values")
        chunk = max(1, min(_CHUNK, total.size))
        tmp = np.empty(chunk, dtype=np.float64)
        offset, step = count * self.clip, self.step
        for start in range(0, total.size, chunk):
            m = min(chunk, total.size - start)
            t = tmp[:m]
            t[...] = total[start:start + m]  # exact: a ring sum is below 2^53 (a plain cast beats a mixed-type multiply)
            t *= step
            np.subtract(t, offset, out=out[start:start + m])  # float64 arithmetic, one rounding to float32
        return out


def ring_for(levels: int, weight_cap: int, cohort: int) -> int:
    """The narrowest ring width of :data:`RING_BITS` whose sums of ``cohort`` inputs of at most
    ``levels * weight_cap`` cannot wrap; raises SecAggConfigError when even 64 bits (2^53, exact) cannot."""
    for r in RING_BITS:
        if cohort * levels * weight_cap <= min((1 << r) - 1, EXACT_MAX):
            return r
    raise SecAggConfigError(f"{cohort} clients x {levels} levels x weights up to {weight_cap} exceed 2^53: lower "
                            "the quantization bits or the weight cap")
