"""Tensors a strategy reads block by block, so aggregation memory stays O(model) + O(block).

A strategy receives tensors either as numpy arrays (the simulator) or as :class:`FileTensor` (the
aggregator: a tensor inside an update spill file or a blob). :func:`blocks` yields float32 blocks of
either kind into a caller-owned scratch buffer; a file tensor is read with ``readinto`` (one copy from the
page cache, no mapping), so a 100 MB update never becomes 100 MB of resident memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Union

import numpy as np

from fedclinic.codecs import decode, open_payload


@dataclass(frozen=True)
class FileTensor:
    path: Path
    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def read(self) -> np.ndarray:
        """The whole tensor in memory (for small tensors and tests)."""
        return np.fromfile(self.path, dtype=np.dtype(self.dtype), count=self.size, offset=self.offset).reshape(self.shape)


@dataclass(frozen=True)
class EncodedTensor:
    """A float32 delta stored encoded (an update codec's payload, :mod:`fedclinic.codecs`) inside a file:
    ``nbytes`` payload bytes at ``offset``, decoded with ``params`` (JSON text). Linear strategies add it
    into their accumulator with :func:`fedclinic.codecs.decode_into` (see ``fedavg.weighted_add``); the
    others read it through :func:`blocks`, decoded block by block."""

    path: Path
    offset: int
    nbytes: int
    params: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def payload(self) -> bytes:
        with open(self.path, "rb", buffering=0) as fh:
            fh.seek(self.offset)
            data = fh.read(self.nbytes)
        if len(data) != self.nbytes:
            raise EOFError(f"{self.path} ended inside an encoded tensor (offset {self.offset}, {self.nbytes} bytes)")
        return data

    def decoded_params(self) -> dict:
        return json.loads(self.params)

    def read(self) -> np.ndarray:
        """The whole decoded tensor in memory (for small tensors and tests)."""
        return decode(self.payload(), self.decoded_params()).reshape(self.shape)


TensorLike = Union[np.ndarray, FileTensor, EncodedTensor]


def dense_blocks(chunks: Iterable[tuple[slice | np.ndarray, np.ndarray]], total: int, scratch: np.ndarray
                 ) -> Iterator[tuple[int, np.ndarray]]:
    """Turn a codec reader's ``(where, values)`` chunks (contiguous slices in order, or strictly increasing
    index arrays) into dense ``(start, block)`` pieces of ``scratch.size`` elements, zeros where nothing was
    sent; each block lives in ``scratch`` (the caller may change it)."""
    width = scratch.size
    start = 0
    scratch[:min(width, total)] = 0
    for where, vals in chunks:
        if isinstance(where, slice):
            pos, i = where.start, 0
            while i < vals.size:
                while pos >= start + width:
                    yield start, scratch[:width]
                    start += width
                    scratch[:min(width, total - start)] = 0
                m = min(vals.size - i, start + width - pos)
                scratch[pos - start:pos - start + m] = vals[i:i + m]
                pos, i = pos + m, i + m
        else:
            i = 0
            while i < where.size:
                while where[i] >= start + width:
                    yield start, scratch[:width]
                    start += width
                    scratch[:min(width, total - start)] = 0
                j = i + int(np.searchsorted(where[i:], start + width))
                scratch[where[i:j] - start] = vals[i:j]
                i = j
    while start < total:
        yield start, scratch[:min(width, total - start)]
        start += width
        scratch[:min(width, max(total - start, 0))] = 0


def blocks(x: TensorLike, scratch: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """Yield (start, block) over the flattened tensor as float32, each block living in ``scratch``."""
    n_block = scratch.size
    if isinstance(x, EncodedTensor):
        reader = open_payload(x.payload(), x.decoded_params(), chunk=n_block)
        yield from dense_blocks(reader.chunks(), x.size, scratch)
        return
    if isinstance(x, FileTensor):
        if np.dtype(x.dtype) != np.float32:
            flat = x.read().reshape(-1)
            yield from blocks(flat, scratch)
            return
        total = x.size
        with open(x.path, "rb", buffering=0) as fh:
            fh.seek(x.offset)
            raw = memoryview(scratch).cast("B")
            for start in range(0, total, n_block):
                n = min(n_block, total - start)
                got = fh.readinto(raw[: n * 4])
                if got != n * 4:
                    raise EOFError(f"{x.path} ended inside a tensor (offset {x.offset}, {total} values)")
                yield start, scratch[:n]
        return
    flat = x.reshape(-1)
    for start in range(0, flat.size, n_block):
        stop = min(start + n_block, flat.size)
        out = scratch[: stop - start]
        np.copyto(out, flat[start:stop], casting="unsafe")
        yield start, out


def squared_norm(x: TensorLike, scratch: np.ndarray) -> float:
    """||x||^2 over the flattened tensor, read block by block (float32 BLAS dot per block, summed in float64)."""
    return sum(float(np.dot(block, block)) for _, block in blocks(x, scratch))
