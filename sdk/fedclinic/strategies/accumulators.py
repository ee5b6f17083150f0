"""The per-tensor float32 accumulators of a linear strategy, held in memory or spilled to files.

A linear strategy (FedAvg and the strategies built on it) keeps one flat float32 accumulator per transmitted
tensor for the whole round. In memory that is one model-sized buffer (4.4 GB for a 1.1-billion-parameter
model). :class:`Accumulators` with a ``folder`` keeps each tensor's accumulator in a file of its own instead
and holds at most one tensor's accumulator in memory at a time: a strategy :meth:`~Accumulators.load`\\ s it,
adds an update's tensor into it and :meth:`~Accumulators.store`\\ s it back, so the resident memory of a fold
is bounded by the largest tensor (plus the strategy's scratch block), never by the model. The files go
through the page cache, which the kernel reclaims as it needs; they are not the process's memory.

:meth:`~Accumulators.result` turns a finished accumulator into what ``Strategy.finalize`` returns: the array
itself in memory, or a :class:`~fedclinic.strategies.tensorsource.FileTensor` over a result file when spilled
(its reader streams it block by block, e.g. into the blob store).

The files are scratch: a process that restarts rebuilds its accumulators from the durable updates
(``aggregator_service.folding``), so nothing here is fsync'd, and a new set of accumulators starts empty.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from fedclinic.strategies.tensorsource import FileTensor

__all__ = ["Accumulators"]


class Accumulators:
    """Flat float32 accumulators by tensor name; in memory (``folder`` None) or one file per tensor."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder
        self._arrays: dict[str, np.ndarray] = {}
        self._files: dict[str, Path] = {}
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)  # an earlier set's leftovers are not this round's sums
            folder.mkdir(parents=True)

    @property
    def spilled(self) -> bool:
        return self.folder is not None

    def names(self) -> list[str]:
        """The tensors that have an accumulator, in the order they got one."""
        return list(self._files if self.spilled else self._arrays)

    def __contains__(self, name: str) -> bool:
        return name in (self._files if self.spilled else self._arrays)

    def __len__(self) -> int:
        return len(self._files if self.spilled else self._arrays)

    def load(self, name: str, size: int) -> np.ndarray:
        """Tensor ``name``'s accumulator (1-D float32 of ``size`` values, zeros the first time). In memory it is
        the accumulator itself; spilled it is a copy read from its file, written back by :meth:`store`."""
        if not self.spilled:
            acc = self._arrays.get(name)
            if acc is None:
                acc = self._arrays[name] = np.zeros(size, np.float32)
            return acc
        path = self._files.get(name)
        if path is None:
            return np.zeros(size, np.float32)
        acc = np.fromfile(path, dtype=np.float32)
        if acc.size != size:  # only this class writes these files: a size change is a bug, not input
            raise RuntimeError(f"accumulator file {path} holds {acc.size} values, expected {size}")
        return acc

    def store(self, name: str, acc: np.ndarray) -> None:
        """Keep ``acc`` as tensor ``name``'s accumulator (spilled: write it to its file; the caller drops it)."""
        if not self.spilled:
            self._arrays[name] = acc
            return
        path = self._files.get(name)
        if path is None:
            assert self.folder is not None
            path = self._files[name] = self.folder / f"{len(self._files)}.f32"
        _write(path, acc)

    def result(self, name: str, arr: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | FileTensor:
        """The finished float32 tensor ``name`` (``arr`` flat): ``arr`` reshaped in memory, or written to a result
        file and returned as a FileTensor when spilled."""
        if not self.spilled:
            return arr.reshape(shape)
        assert self.folder is not None
        path = self.folder / f"{self.names().index(name)}.result.f32"
        _write(path, arr)
        return FileTensor(path, 0, "float32", tuple(shape))

    def clear(self) -> None:
        """Forget every accumulator (the files stay until the folder is removed or reused)."""
        self._arrays = {}
        self._files = {}


def _write(path: Path, arr: np.ndarray) -> None:
    with open(path, "wb") as fh:
        fh.write(memoryview(np.ascontiguousarray(arr, dtype=np.float32)).cast("B"))
