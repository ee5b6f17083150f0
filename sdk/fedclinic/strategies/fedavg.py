"""Sample-weighted federated averaging over deltas, streamed.

For each tensor k, over the sites S_k that sent it, with weights n_i (local sample counts)::

    w_k <- w_k + eta * sum_{i in S_k} n_i * d_{i,k} / sum_{i in S_k} n_i

where d_{i,k} = local_{i,k} - global_k and eta is the server step size (1.0 = plain FedAvg). A tensor no
site sent is left unchanged. Accumulation is in float32 (the model dtype); the sum is arrival-order
dependent at the last bit, as every streaming float sum is.

Memory: one float32 accumulator per transmitted tensor plus a fixed 1 MiB scratch block, so it does not
grow with the number of sites. After :meth:`FedAvg.spill_to` the accumulators live in files
(:class:`~fedclinic.strategies.accumulators.Accumulators`) and at most one tensor's accumulator is in memory at
a time: the aggregator's fold then needs the largest tensor, not the model, in memory. Updates and the global model are read block by block (arrays or
:class:`FileTensor`), each block is scaled in the scratch buffer and added into the accumulator: memory
bandwidth bound, no full-size temporary, no memory-mapped update pinned in RAM.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Mapping

import numpy as np

from fedclinic.errors import IntegrityError
from fedclinic.strategies.base import Strategy
from fedclinic.codecs import decode_into
from fedclinic.strategies.accumulators import Accumulators
from fedclinic.strategies.tensorsource import EncodedTensor, TensorLike, blocks

_BLOCK = 1 << 18  # float32 elements per block: 1 MiB, stays in L2


class FedAvg(Strategy):
    name: ClassVar[str] = "fedavg"

    def __init__(self, server_lr: float = 1.0) -> None:
        self.server_lr = float(server_lr)
        self._global: Mapping[str, np.ndarray] = {}
        self._spill: Path | None = None
        self._acc = Accumulators()
        self._weight: dict[str, float] = {}
        self._scratch = np.empty(_BLOCK, dtype=np.float32)

    def spill_to(self, folder: Path | None) -> None:
        """Keep the round's accumulators in files under ``folder`` (emptied by :meth:`begin`), one tensor in
        memory at a time; None keeps them in memory (the default). Call before :meth:`begin`."""
        self._spill = folder

    def begin(self, global_tensors: Mapping[str, TensorLike]) -> None:
        self._global = global_tensors
        self._acc = Accumulators(self._spill)
        self._weight = {}

    def accept(self, update: Mapping[str, TensorLike], weight: float, *, site: str) -> None:
        check_update(self._global, update, site, weight)
        self._add(update, float(weight), 1.0)

    def _add(self, update: Mapping[str, TensorLike], weight: float, scale: float) -> None:
        """Fold a validated update: acc += weight * scale * delta; the tensor's weight total grows by weight."""
        for name, delta in update.items():
            acc = self._acc.load(name, int(np.prod(self._global[name].shape, dtype=np.int64)))
            weighted_add(acc, delta, weight * scale, self._scratch)
            self._acc.store(name, acc)
            del acc  # spilled: the next tensor's accumulator replaces this one in memory, not beside it
            self._weight[name] = self._weight.get(name, 0.0) + weight

    def partial_updates_problem(self) -> str:
        return ""  # each tensor has its own weight total: the mean over the sites that sent it

    def finalize(self) -> dict[str, TensorLike]:
        """The new tensors: arrays, or FileTensors over result files when spilled (:meth:`spill_to`)."""
        out: dict[str, TensorLike] = {}
        for name in self._acc.names():
            ref = self._global[name]
            acc = self._acc.load(name, int(np.prod(ref.shape, dtype=np.int64)))
            acc *= np.float32(1.0 / self._weight[name])  # acc is now the weighted mean delta
            self._server_step(name, acc)                 # ... and now the step to apply
            for start, block in blocks(ref, self._scratch):
                acc[start:start + block.size] += block
            if np.dtype(ref.dtype) == np.float32:
                out[name] = self._acc.result(name, acc, tuple(ref.shape))
            else:
                out[name] = acc.reshape(ref.shape).astype(ref.dtype)
            del acc
        self._acc.clear()
        return out

    def _server_step(self, name: str, mean_delta: np.ndarray) -> None:
        """Turn the weighted mean delta of tensor ``name`` into the step added to the global (in place)."""
        mean_delta *= np.float32(self.server_lr)


def check_update(global_tensors: Mapping[str, TensorLike], update: Mapping[str, TensorLike], site: str,
                 weight: float = 1.0) -> None:
    """Refuse an update before anything is folded: positive weight, known tensors, matching shapes."""
    if not weight > 0:
        raise IntegrityError(f"update from {site} has non-positive weight {weight}")
    for name, delta in update.items():
        ref = global_tensors.get(name)
        if ref is None:
            raise IntegrityError(f"update from {site} carries unknown tensor {name!r}")
        if tuple(delta.shape) != tuple(ref.shape):
            raise IntegrityError(f"update from {site}: tensor {name!r} has shape {tuple(delta.shape)}, model has "
                                 f"{tuple(ref.shape)}")


def weighted_add(acc: np.ndarray, x: TensorLike, weight: float, scratch: np.ndarray) -> None:
    """acc += weight * x over the flattened tensor, blockwise through ``scratch`` (acc is 1-D float32)."""
    if isinstance(x, EncodedTensor):  # decoded straight into the accumulator, one chunk at a time
        decode_into(acc, x.payload(), x.decoded_params(), float(np.float32(weight)), chunk=scratch.size)
        return
    w = np.float32(weight)
    for start, block in blocks(x, scratch):
        block *= w
        target = acc[start:start + block.size]
        np.add(target, block, out=target)
