"""Top-k sparsification: send the ``k`` largest-magnitude elements, their positions, and nothing else.

Math: ``S`` = the indices of the ``k`` largest ``|x_i|`` (ties broken deterministically for a given input),
``k = min(n, k)`` or ``k = ceil(fraction * n)``. Decoding gives ``x̂_i = V(x)_i`` for ``i`` in ``S`` and
``x̂_i = 0`` otherwise, where ``V`` is the value codec applied to the kept values in index order (``fp32``
by default: exact; ``int8``, ``int4``, ``fp16`` or ``bf16`` with their own bounds). Error bound::

    |x̂_i - x_i| = |x_i| <= t_k           for i not in S  (t_k = k-th largest |x|)
    |x̂_i - x_i| <= bound_V(x_S)_i        for i in S      (0 with fp32 values)

and in norm ``||x̂ - x||^2 <= (1 - k/n) ||x||^2 + ||bound_V||^2``: the contraction that error feedback
(:class:`~fedclinic.codecs.feedback.ErrorFeedback`) turns into an unbiased-over-time update.

Index encodings (``idx=``), all of the strictly increasing flat indices ``i_0 < i_1 < ...`` through the
gaps ``g_0 = i_0``, ``g_j = i_j - i_{j-1} - 1 >= 0``:

- ``varint`` (default): each gap as LEB128 (7 bits per byte, high bit = more bytes follow, at most 5
  bytes). At density ``p`` gaps average ``1/p``: about 1.3 bytes per index at 1 %.
- ``delta``: each gap as little-endian uint32 (4 bytes; compresses well downstream).
- ``raw``: each index as little-endian uint32 (4 bytes).

Payload: the index bytes (``params["idx_bytes"]`` of them), then the value codec's payload for a tensor of
shape ``[k]``; ``params["values"]`` holds the value codec's params. Decoding checks that exactly ``k``
indices are present, strictly increasing and below ``n`` before anything is written, then scatter-adds one
chunk of (index, value) pairs at a time: no dense temporary.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt

from fedclinic.codecs.base import (MAX_ELEMENTS, Codec, DenseReader, Params, Reader, Selection, check_length,
                                   open_unvalidated, param_int, param_str, register)
from fedclinic.codecs.errors import CodecSpecError, IntegrityError
from fedclinic.codecs.floats import FP32

IndexEncoding = Literal["varint", "delta", "raw"]
INDEX_ENCODINGS: tuple[str, ...] = ("varint", "delta", "raw")
_SAMPLE = 1 << 16


# ------------------------------------------------------------------------------------------------- selection

def top_k_indices(flat: npt.NDArray[np.float32], k: int) -> npt.NDArray[np.int64]:
    """Sorted flat indices of the ``k`` largest ``|flat|`` (deterministic for a given input).

    For large inputs a strided sample estimates a threshold below the k-th magnitude; only candidates at or
    above it are partitioned. The result is exact: if fewer than ``k`` candidates pass, the full array is
    partitioned instead."""
    n = flat.size
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    if k >= n:
        return np.arange(n, dtype=np.int64)
    mag = np.abs(flat)
    if n >= 8 * _SAMPLE and k <= n // 8:
        stride = n // _SAMPLE
        sample = mag[::stride]
        # keep ~2x the expected count (plus slack for sampling noise): rank of the threshold in the sample
        rank = min(sample.size - 1, int(2 * k / n * sample.size) + 64)
        thr = np.partition(sample, sample.size - 1 - rank)[sample.size - 1 - rank]
        cand = np.flatnonzero(mag >= thr)
        if cand.size >= k:
            sub = np.argpartition(mag[cand], cand.size - k)[cand.size - k:]
            return np.sort(cand[sub])
    return np.sort(np.argpartition(mag, n - k)[n - k:]).astype(np.int64)


# ---------------------------------------------------------------------------------------------- index coding

def varint_encode(gaps: npt.NDArray[np.integer]) -> bytes:
    """LEB128 bytes of non-negative integers below 2^32."""
    g = gaps.astype(np.uint64)
    nbytes = np.ones(g.size, dtype=np.int64)
    for p in range(1, 5):
        nbytes += g >= np.uint64(1 << (7 * p))
    ends = np.cumsum(nbytes)
    starts = ends - nbytes
    out = np.empty(int(ends[-1]) if g.size else 0, dtype=np.uint8)
    for p in range(5):
        sel = nbytes > p
        if not sel.any():
            break
        byte = ((g[sel] >> np.uint64(7 * p)) & np.uint64(0x7F)).astype(np.uint8)
        byte[nbytes[sel] > p + 1] |= np.uint8(0x80)
        out[starts[sel] + p] = byte
    return out.tobytes()


def _varint_decode(buf: npt.NDArray[np.uint8], count: int, pos: int) -> tuple[npt.NDArray[np.int64], int]:
    """``count`` LEB128 numbers from ``buf[pos:]``; returns them and the new position."""
    window = buf[pos:pos + 2 * count + 16]  # enough unless gaps average > 2^7: then up to 5 bytes each
    ends = np.flatnonzero(window < 0x80)
    if ends.size < count and window.size < buf.size - pos:
        window = buf[pos:pos + 5 * count]
        ends = np.flatnonzero(window < 0x80)
    if ends.size < count:
        raise IntegrityError(f"topk payload: index stream ends after {ends.size} of the expected varints at "
                             f"byte {pos} (truncated or corrupt)")
    ends = ends[:count]
    starts = np.empty(count, dtype=np.int64)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if lengths.max() > 5:
        raise IntegrityError(f"topk payload: a varint index gap is longer than 5 bytes near byte {pos} (corrupt)")
    used = window[:int(ends[-1]) + 1]
    shift = (np.arange(used.size, dtype=np.int64) - np.repeat(starts, lengths)) * 7
    contrib = (used & np.uint8(0x7F)).astype(np.int64) << shift
    vals = np.add.reduceat(contrib, starts)
    if vals.max() > 0xFFFFFFFF:
        raise IntegrityError(f"topk payload: a varint index gap exceeds 2^32 - 1 near byte {pos} (corrupt)")
    return vals, pos + used.size


class _TopKReader(Reader):
    def __init__(self, n: int, k: int, idx: str, ibuf: npt.NDArray[np.uint8], values: DenseReader) -> None:
        self.n, self.k, self.idx, self.ibuf, self.vals = n, k, idx, ibuf, values
        self.step = values.step

    def _index_chunks(self) -> Iterator[tuple[int, npt.NDArray[np.int64]]]:
        """(j, indices j..j+m-1) in chunks of ``step``, fully checked: strictly increasing, < n, all bytes used."""
        last, pos = -1, 0
        for j in range(0, self.k, self.step):
            m = min(self.step, self.k - j)
            if self.idx == "varint":
                gaps, pos = _varint_decode(self.ibuf, m, pos)
                ix = last + np.cumsum(gaps + 1)
            else:
                word = self.ibuf[4 * j:4 * (j + m)].view("<u4").astype(np.int64)
                if self.idx == "delta":
                    ix = last + np.cumsum(word + 1)
                else:
                    ix = word
                    if ix[0] <= last or (m > 1 and not (np.diff(ix) > 0).all()):
                        raise IntegrityError("topk payload: raw indices are not strictly increasing (corrupt)")
            if ix[-1] >= self.n:
                raise IntegrityError(f"topk payload: index {int(ix[-1])} is out of range for a tensor of {self.n} "
                                     f"elements (corrupt)")
            last = int(ix[-1])
            yield j, ix
        if self.idx == "varint" and pos != self.ibuf.size:
            raise IntegrityError(f"topk payload: {self.ibuf.size - pos} stray bytes after the {self.k} varint "
                                 f"indices (corrupt)")

    def validate(self) -> None:
        for _ in self._index_chunks():
            pass
        self.vals.validate()

    def chunks(self) -> Iterator[tuple[Selection, npt.NDArray[np.float32]]]:
        for j, ix in self._index_chunks():
            yield ix, self.vals.values(j, j + ix.size)


@register
@dataclass(frozen=True)
class TopK(Codec):
    """Top-k sparsification with a value codec for the kept values; see the module docstring.

    Give exactly one of ``fraction`` (in (0, 1]: ``k = ceil(fraction * n)``) and ``k`` (>= 1)."""

    fraction: float | None = None
    k: int | None = None
    idx: IndexEncoding = "varint"
    values: Codec = field(default_factory=FP32)

    name: ClassVar[str] = "topk"
    kind: ClassVar[Literal["value", "sparsifier"]] = "sparsifier"
    bound: ClassVar[str] = ("|x̂_i - x_i| = |x_i| <= k-th largest |x| for unsent i; the value codec's bound for sent "
                            "i (exact with fp32); index bytes: ~1.3/kept element at 1 % (varint) or 4 (delta, raw)")

    def __post_init__(self) -> None:
        if (self.fraction is None) == (self.k is None):
            raise CodecSpecError("topk: give exactly one of fraction (e.g. topk:0.01) and k (e.g. topk:k=1000)")
        if self.fraction is not None:
            if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)) or not (
                    0 < self.fraction <= 1) or not math.isfinite(self.fraction):
                raise CodecSpecError(f"topk: fraction must be in (0, 1], got {self.fraction!r}")
            object.__setattr__(self, "fraction", float(self.fraction))
        if self.k is not None and (isinstance(self.k, bool) or not isinstance(self.k, int) or not
                                   1 <= self.k <= MAX_ELEMENTS):
            raise CodecSpecError(f"topk: k must be an integer in [1, {MAX_ELEMENTS}], got {self.k!r}")
        if self.idx not in INDEX_ENCODINGS:
            raise CodecSpecError(f"topk: idx must be one of {list(INDEX_ENCODINGS)}, got {self.idx!r}")
        if not isinstance(self.values, Codec) or self.values.kind != "value":
            raise CodecSpecError(f"topk: the kept values need a value codec (fp32, fp16, bf16, int8, int4), got "
                                 f"{self.values!r}")

    @property
    def needs_rng(self) -> bool:
        return self.values.needs_rng

    @property
    def spec(self) -> str:
        size = f"fraction={self.fraction!r}" if self.fraction is not None else f"k={self.k}"
        return f"topk:{size},idx={self.idx}+{self.values.spec}"

    def k_for(self, n: int) -> int:
        """Number of elements kept from a tensor of ``n``."""
        if self.k is not None:
            return min(n, self.k)
        assert self.fraction is not None
        return min(n, math.ceil(self.fraction * n))

    def _encode_flat(self, flat: npt.NDArray[np.float32], rng: np.random.Generator | None) -> tuple[bytes, Params]:
        k = self.k_for(flat.size)
        ix = top_k_indices(flat, k)
        if self.idx == "raw":
            ibytes = ix.astype("<u4").tobytes()
        else:
            gaps = np.diff(ix, prepend=-1) - 1
            ibytes = varint_encode(gaps) if self.idx == "varint" else gaps.astype("<u4").tobytes()
        inner = self.values.encode(flat[ix], rng=rng)
        return ibytes + inner.payload, {"k": k, "idx": self.idx, "idx_bytes": len(ibytes), "values": inner.params}

    @classmethod
    def _param_keys(cls) -> frozenset[str]:
        return frozenset({"k", "idx", "idx_bytes", "values"})

    @classmethod
    def _reader(cls, buf: npt.NDArray[np.uint8], params: Mapping[str, Any], n: int, chunk: int) -> _TopKReader:
        k = param_int(params, "k", "topk", 0, n)
        idx = param_str(params, "idx", "topk", INDEX_ENCODINGS)
        ib = param_int(params, "idx_bytes", "topk", 0, buf.size)
        if idx != "varint":
            check_length(buf[:ib], 4 * k, "topk index", f"{k} uint32 indices (idx_bytes={ib})")
        elif not k <= ib <= 5 * k:
            raise IntegrityError(f"topk payload: idx_bytes={ib} cannot hold {k} varint indices (corrupt)")
        inner = params.get("values")
        if not isinstance(inner, Mapping) or inner.get("codec") == "topk":
            raise IntegrityError(f"topk payload: params['values'] must be a value codec's params, got {inner!r}")
        if inner.get("shape") != [k]:
            raise IntegrityError(f"topk payload: values shape {inner.get('shape')!r} does not match k={k}")
        values = open_unvalidated(memoryview(buf[ib:]), inner, chunk=chunk)  # validated by _TopKReader
        assert isinstance(values, DenseReader)
        return _TopKReader(n, k, idx, buf[:ib], values)

    def _bound_flat(self, flat: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        ix = top_k_indices(flat.astype(np.float32), self.k_for(flat.size))
        bound = np.abs(flat)
        if ix.size:
            bound[ix] = self.values.error_bound(flat[ix].astype(np.float32))
        return bound
