"""Folding: the streaming accumulators of open rounds.

Each running task with an open round has one :class:`Accumulator`: the task's strategy (``begin`` on the
round's base model, then ``accept`` per update, ``finalize`` when the round closes). With a ``spill_root`` the
strategy keeps its accumulators in files beside the round's spilled updates (``Strategy.spill_to``), so a fold
holds one tensor in memory, not the model; without one (or for a strategy that cannot spill) O(model size).
An update is folded once (by update id), straight from its spill file (:class:`UpdateLayout`: block reads,
encoded tensors decoded while read). Accumulators are in memory only: :meth:`Folding.accumulator` rebuilds
one for the round's base model and the strategy state the previous round stored, and the engine folds the
round's durable updates into it again after a restart. Callers hold the engine's lock.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedclinic.runtime.blobstore import BlobStore
from fedclinic.transport.package import raw_bytes
from fedclinic.spec.validation import strategy_of
from fedclinic.strategies import Strategy
from fedclinic.strategies.tensorsource import EncodedTensor, FileTensor, TensorLike, blocks

from aggregator_service.store import Store, UpdateRecord
from aggregator_service.stored_data import verify_blob


@dataclass
class UpdateLayout:
    """Where each tensor of an update lives inside its spill file."""

    tensors: list[tuple[str, str, tuple[int, ...], int, int]]  # name, dtype, shape, offset, nbytes
    #: name -> codec params (JSON) of tensors stored encoded (an update codec); the others are raw
    encoded: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps([[n, d, list(s), o, b, *([self.encoded[n]] if n in self.encoded else [])]
                           for n, d, s, o, b in self.tensors])

    @classmethod
    def from_json(cls, text: str) -> "UpdateLayout":
        rows = json.loads(text)
        return cls([(r[0], r[1], tuple(r[2]), r[3], r[4]) for r in rows], {r[0]: r[5] for r in rows if len(r) > 5})

    def tensors_in(self, path: Path) -> dict[str, FileTensor | EncodedTensor]:
        """The update's tensors as block-readable file ranges (never loaded whole); encoded ones are decoded
        while they are read (fedclinic.strategies.tensorsource.EncodedTensor)."""
        return {name: (EncodedTensor(path, offset, nbytes, self.encoded[name], shape) if name in self.encoded
                       else FileTensor(path, offset, dtype, shape))
                for name, dtype, shape, offset, nbytes in self.tensors}


@dataclass
class Accumulator:
    """The strategy of one task's open round and the updates folded into it."""

    round: int
    strategy: Strategy
    folded: set[str] = field(default_factory=set)  # update ids

    def fold(self, update_id: str, spill: Path, layout: UpdateLayout, weight: float, site: str) -> None:
        """Fold an update into the strategy (once per update id). A strategy that refuses it (IntegrityError,
        ValueError) is left unchanged (Strategy contract)."""
        if update_id in self.folded:
            return
        self.strategy.accept(layout.tensors_in(spill), float(weight), site=site)
        self.folded.add(update_id)

    def fold_record(self, u: UpdateRecord) -> None:
        """Fold a durable update (recovery)."""
        self.fold(u.update_id, Path(u.spill_path), UpdateLayout.from_json(u.layout),
                  self.strategy.weight_for(u.num_samples, u.metrics), u.site)


class Folding:
    """The accumulators of the open rounds, by task id."""

    def __init__(self, store: Store, blobs: BlobStore, spill_root: Path | None = None) -> None:
        self.store = store
        self.blobs = blobs
        #: where a strategy keeps its accumulators (``<spill_root>/<task>/<round>/accumulator``), one tensor in
        #: memory at a time (Strategy.spill_to); None keeps them in memory
        self.spill_root = spill_root
        self._acc: dict[str, Accumulator] = {}

    def accumulator(self, task_id: str) -> Accumulator:
        """The accumulator of the task's open round (there must be one), built on first use: the strategy
        begins on the round's base model with the state the previous round stored (StoredCopyDamaged when that
        state's blobs are damaged; the base model itself is verified when the round closes)."""
        rnd = self.store.open_round_of(task_id)
        assert rnd is not None
        acc = self._acc.get(task_id)
        if acc is None or acc.round != rnd.round:
            task = self.store.task(task_id)
            manifest = self.store.model(rnd.base_model)
            assert task is not None and manifest is not None
            tensors = {t.name: FileTensor(self.blobs.path(t.sha256), 0, t.dtype, t.shape) for t in manifest.tensors}
            strategy = strategy_of(task.spec)
            strategy.load_state(self._saved_state(task_id, rnd.round - 1))
            if self.spill_root is not None:
                strategy.spill_to(self.spill_root / task_id / str(rnd.round) / "accumulator")
            strategy.begin(tensors)
            acc = self._acc[task_id] = Accumulator(rnd.round, strategy)
        return acc

    def drop(self, task_id: str) -> None:
        """Forget the task's accumulator (its round ended, or it holds an update the store does not)."""
        self._acc.pop(task_id, None)

    def save_state(self, strategy: Strategy) -> dict[str, list]:
        """The strategy's state as blobs: key -> [sha256, dtype, shape] (stored with the closing round)."""
        return {key: [self.blobs.put(raw_bytes(arr)), str(arr.dtype), list(arr.shape)]
                for key, arr in strategy.state().items()}

    def _saved_state(self, task_id: str, rnd: int) -> dict[str, np.ndarray]:
        """The strategy state stored with round ``rnd`` (empty for round 0 or a stateless strategy), each blob
        verified against its hash (StoredCopyDamaged otherwise)."""
        row = self.store.round(task_id, rnd)
        if row is None:
            return {}
        out = {}
        for key, (sha, dtype, shape) in row.strategy_state.items():
            verify_blob(self.blobs, sha, f"strategy state {key!r} of round {rnd}")
            out[key] = np.array(self.blobs.array(sha, dtype, tuple(shape)))
        return out


def put_tensor(blobs: BlobStore, x: TensorLike, block_bytes: int = 1 << 20) -> str:
    """Store a strategy's result tensor as a blob and return its sha256: an array as it is, a float32
    FileTensor streamed through one ``block_bytes`` scratch buffer (never read whole)."""
    if not isinstance(x, FileTensor) or np.dtype(x.dtype) != np.float32:
        return blobs.put(raw_bytes(x.read() if isinstance(x, (FileTensor, EncodedTensor)) else x))
    writer = blobs.writer(None, x.size * 4)
    try:
        for _, block in blocks(x, np.empty(block_bytes // 4, np.float32)):
            writer.write(raw_bytes(block))
    except BaseException:
        writer.abort()
        raise
    return writer.commit()
