"""Tensors a strategy reads block by block, so aggregation memory stays O(model) + O(block).

A strategy receives tensors either as numpy arrays (the simulator) or as :class:`FileTensor` (the
aggregator: a tensor inside an update spill file or a blob). :func:`blocks` yields float32 blocks of
either kind into a caller-owned scratch buffer; a file tensor is read with ``readinto`` (one copy from the
page cache, no mapping), so a 100 MB update never becomes 100 MB of resident memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Union

import numpy as np


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


TensorLike = Union[np.ndarray, FileTensor]


def blocks(x: TensorLike, scratch: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """Yield (start, block) over the flattened tensor as float32, each block living in ``scratch``."""
    n_block = scratch.size
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
