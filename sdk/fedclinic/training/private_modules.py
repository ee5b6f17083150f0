"""FedNER's private modules: tensors a site trains but never sends, kept at the site between rounds.

A task declares ``private_patterns`` (full-match regular expressions over tensor names, see
``fedclinic.models.fedner.PAPER_PRIVATE_PATTERNS``). In round r a site holding private values p_r trains on
(global shared tensors of round r, p_r); it sends the delta of the shared tensors only and keeps the trained
private values p_{r+1} for its next round, its evaluations and its exports. The aggregator never receives,
averages or changes a private tensor: the global model holds their initial values.

This module is the one implementation of that rule, used by the simulator, the agent and the aggregator:
``private_names`` resolves the patterns, ``outgoing_problems`` is the agent's last check before anything leaves,
and ``PrivateStore`` keeps a site's values on disk (one safetensors file per task, mode 0600, written
atomically) so they survive an agent restart.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from fedclinic.runtime.durable_file import write_atomically
from fedclinic.errors import ConfigError, IntegrityError
from fedclinic.runtime.safetensors_file import safetensors_with_metadata
from fedclinic.spec.selection import private_names  # noqa: F401  (re-exported: the name rule lives with selection)

FORMAT = "fedclinic-private-modules/1"


def outgoing_problems(outgoing: Iterable[str], private: Iterable[str]) -> list[str]:
    """The private tensors among ``outgoing`` (what an update or a masked vector would carry), each as a
    message; [] when none. The agent refuses to send anything while this is not empty."""
    private = set(private)
    return [f"tensor {n!r} is private to the site (the task's private_patterns) and may not leave it"
            for n in outgoing if n in private]


class PrivateStore:
    """A site's private tensors per task, under ``folder`` (``<task_id>.safetensors``, mode 0600).

    Each save replaces the file atomically, so a crash leaves either the previous round's values or the new
    ones, never a mix. The metadata records the round that produced them."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)

    def path(self, task_id: str) -> Path:
        if not task_id or "/" in task_id or task_id.startswith("."):
            raise ConfigError(f"task id {task_id!r} cannot name a private-modules file")
        return self.folder / f"{task_id}.safetensors"

    def save(self, task_id: str, round_: int, tensors: Mapping[str, np.ndarray]) -> Path:
        import safetensors.numpy

        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        arrays = {name: np.ascontiguousarray(arr) for name, arr in tensors.items()}
        meta = {"format": FORMAT, "task_id": task_id, "round": str(int(round_))}
        path = self.path(task_id)
        write_atomically(path, safetensors.numpy.save(arrays, metadata=meta), mode=0o600)
        return path

    def load(self, task_id: str, expected: Mapping[str, tuple[tuple[int, ...], np.dtype]] | None = None
             ) -> tuple[dict[str, np.ndarray], int] | None:
        """``(tensors, round)`` saved for ``task_id``, or None when this site has none yet.

        ``expected`` (name -> (shape, dtype)) is the model's private set: any other name, shape or dtype is an
        IntegrityError naming the file, so values from another model are never loaded into this one. The file
        is left as it is in every error case."""
        path = self.path(task_id)
        if not path.exists():
            return None
        data = path.read_bytes()
        what = (f"private-modules file {str(path)!r} is unusable ({{}}); restore it from the agent's backup, or move "
                "it away to restart this task's private modules from the global model's initial values")
        try:
            tensors, meta = safetensors_with_metadata(data)
        except Exception as e:  # safetensors raises its own error types for malformed files
            raise IntegrityError(what.format(f"{type(e).__name__}: {e}")) from None
        if meta.get("format") != FORMAT or meta.get("task_id") != task_id:
            raise IntegrityError(what.format(f"it holds format {meta.get('format')!r} of task {meta.get('task_id')!r}"))
        if expected is not None:
            if set(tensors) != set(expected):
                raise IntegrityError(what.format(f"it holds tensors {sorted(tensors)[:4]}..., the model's private set "
                                                 f"is {sorted(expected)[:4]}..."))
            for name, (shape, dtype) in expected.items():
                arr = tensors[name]
                if tuple(arr.shape) != tuple(shape) or arr.dtype != np.dtype(dtype):
                    raise IntegrityError(what.format(f"tensor {name!r} is {arr.dtype}{list(arr.shape)}, the model's "
                                                     f"is {np.dtype(dtype)}{list(shape)}"))
        for name, arr in tensors.items():
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                raise IntegrityError(what.format(f"tensor {name!r} is not finite"))
        return tensors, int(meta.get("round", "0"))
