"""A site's update kept in files, one tensor at a time, instead of as arrays in memory.

The agent computes a round's delta tensor by tensor (``trainer.compute_delta(..., into=SpilledTensors(folder))``):
each difference is written to its own ``.npy`` file as soon as it is computed and then dropped, so the delta never
sits beside the trained module as a second model. A lookup memory-maps one file (read-only, ``allow_pickle=False``);
its pages are mapped only while the caller holds the array, so encoding, hashing and writing the update to the
outbox keep one tensor resident at a time.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np


class SpilledTensors(Mapping[str, np.ndarray]):
    """float32 tensors by name, one ``.npy`` file each in ``folder`` (emptied on creation), in insertion order."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True, mode=0o700)
        self._files: dict[str, Path] = {}

    def __setitem__(self, name: str, array: np.ndarray) -> None:
        """Write ``array`` to its file now (the caller may drop it); a name is written once."""
        if name in self._files:
            raise KeyError(f"tensor {name!r} is already spilled")
        path = self.folder / f"{len(self._files)}.npy"
        np.save(path, np.ascontiguousarray(array), allow_pickle=False)
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
