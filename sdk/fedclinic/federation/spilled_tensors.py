"""A site's update kept in files, one tensor at a time, instead of as arrays in memory.

The agent computes a round's delta tensor by tensor (``trainer.compute_delta(..., into=SpilledTensors(folder))``):
each difference is written to its own ``.npy`` file block by block as it is computed
(:meth:`SpilledTensors.put_blocks`), so neither the delta (a second model) nor one large tensor's whole difference
sits beside the trained module. A lookup memory-maps one file (read-only, ``allow_pickle=False``); the update's
hashing and its outbox entry read it a block at a time (``fedclinic.runtime.array_blocks``: the pages read are
released as they go).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

import numpy as np

from fedclinic.runtime.array_blocks import flat_blocks


class SpilledTensors(Mapping[str, np.ndarray]):
    """float32 tensors by name, one ``.npy`` file each in ``folder`` (emptied on creation), in insertion order."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True, mode=0o700)
        self._files: dict[str, Path] = {}

    def __setitem__(self, name: str, array: np.ndarray) -> None:
        """Write ``array`` to its file now (the caller may drop it); a name is written once."""
        array = np.asarray(array)
        self.put_blocks(name, array.shape, array.dtype, (block for (block,) in flat_blocks([array])))

    def put_blocks(self, name: str, shape: Sequence[int], dtype: "np.typing.DTypeLike",
                   blocks: Iterable[np.ndarray]) -> None:
        """Write the tensor ``name`` of ``shape`` and ``dtype`` from its C-order ``blocks`` (each a flat array of
        ``dtype``, in order, the sizes adding up to the tensor's), one block in memory at a time; a name is
        written once. ValueError (and nothing is recorded) when the blocks do not add up to the shape."""
        if name in self._files:
            raise KeyError(f"tensor {name!r} is already spilled")
        dtype = np.dtype(dtype)
        shape = tuple(int(n) for n in shape)
        path = self.folder / f"{len(self._files)}.npy"
        written = 0
        with open(path, "wb") as fh:
            np.lib.format.write_array_header_1_0(
                fh, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape})
            for block in blocks:
                block = np.ascontiguousarray(block, dtype=dtype)
                fh.write(memoryview(block.reshape(-1)).cast("B"))
                written += block.size
        if written != math.prod(shape):
            path.unlink()
            raise ValueError(f"tensor {name!r}: the blocks hold {written} elements, its shape {shape} "
                             f"{math.prod(shape)}")
        self._files[name] = path

    def __getitem__(self, name: str) -> np.ndarray:
        return np.load(self._files[name], mmap_mode="r", allow_pickle=False)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    def remove(self) -> None:
        """Delete the folder (arrays already returned stay valid until dropped: their mappings outlive the files)."""
        shutil.rmtree(self.folder, ignore_errors=True)


__all__ = ["SpilledTensors"]
