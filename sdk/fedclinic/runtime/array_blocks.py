"""Large arrays a block at a time, with a memory-mapped block's pages dropped from the process once it is used.

A read-only memory map (``np.memmap`` mode ``"r"``: the agent's tensor cache, a spilled update, a mapped package)
costs no memory until it is read, but every page read stays in the process's resident set for as long as the
map is alive: reading a whole 262 MB tensor through its map adds 262 MB to the peak even when the reader only
needs one block at a time. :func:`flat_blocks` walks same-sized arrays in equal C-order blocks (views, no copy
for C-contiguous arrays) and, after the caller has handled each block, tells the kernel that the block's
mapped pages are not needed (``madvise(MADV_DONTNEED)``). For a read-only file map that only unmaps them from
this process: the file's data is untouched, it stays in the page cache, and a later read maps it again. Maps
that can be written (``"r+"``, ``"c"``, ``"w+"``) and arrays in ordinary memory are never advised.
"""

from __future__ import annotations

import mmap
from typing import Iterator, Sequence

import numpy as np

#: bytes of the largest array per block (a few MB: large enough for numpy's loops, small beside a tensor)
BLOCK_BYTES = 8 << 20

__all__ = ["BLOCK_BYTES", "flat_blocks", "release_mapped"]


def flat_blocks(arrays: Sequence[np.ndarray], block_bytes: int = BLOCK_BYTES) -> Iterator[tuple[np.ndarray, ...]]:
    """Yield ``(a[i:j], b[i:j], ...)`` over the flattened (C-order) ``arrays``, which must have the same number
    of elements, with ``j - i`` elements per block (``block_bytes`` of the widest dtype; the last block shorter).
    Each block is a view where the array is C-contiguous (a block of an output array may be written), else of
    a contiguous copy made once (read it only). When the caller asks for the next block, the previous block's
    pages of a read-only memory map are released (:func:`release_mapped`)."""
    flats = [_flat(np.asarray(a)) for a in arrays]
    sizes = {f.size for f in flats}
    if len(sizes) > 1:
        raise ValueError(f"flat_blocks needs arrays of one size, got sizes {sorted(sizes)}")
    size = sizes.pop() if sizes else 0
    width = max((f.itemsize for f in flats), default=1)
    step = max(1, block_bytes // width)
    for start in range(0, size, step):
        blocks = tuple(f[start:start + step] for f in flats)
        yield blocks
        for block in blocks:
            release_mapped(block)


def release_mapped(block: np.ndarray) -> bool:
    """Drop the pages under ``block`` from this process when it is a view of a read-only memory map (True);
    anything else is left alone (False). The pages at the block's two ends are whole pages that may hold a
    neighbour's bytes too: they are mapped again when read."""
    mapping = _read_only_map(block)
    if mapping is None or block.nbytes == 0:
        return False
    origin = np.frombuffer(mapping, dtype=np.uint8).__array_interface__["data"][0]
    offset = block.__array_interface__["data"][0] - origin
    page = mmap.PAGESIZE
    begin = offset // page * page
    end = min(-(-(offset + block.nbytes) // page) * page, len(mapping))
    if end > begin:
        mapping.madvise(mmap.MADV_DONTNEED, begin, end - begin)
    return True


def _flat(array: np.ndarray) -> np.ndarray:
    """A 1-D C-order view of ``array`` (writes through it reach the array); a copy only when it is not C-contiguous."""
    return array.reshape(-1) if array.flags.c_contiguous else np.ascontiguousarray(array).reshape(-1)


def _read_only_map(array: np.ndarray) -> mmap.mmap | None:
    """The ``mmap`` under ``array`` when the nearest ``np.memmap`` in its base chain was opened read-only."""
    mode = None
    obj: object = array
    while isinstance(obj, np.ndarray):
        if mode is None and isinstance(obj, np.memmap):
            mode = obj.mode
        obj = obj.base
    return obj if isinstance(obj, mmap.mmap) and mode == "r" else None
