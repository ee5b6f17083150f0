"""Data-parallel training over a torch.distributed process group: the trainer's one hook for several processes.

A site round run on ``W`` processes (ranks ``0..W-1``, :mod:`fedclinic.federation.distributed_round`) trains
the same model on the same global batches as one process: every rank holds the whole encoded dataset and the
same initial weights, draws the same shuffling order from the same seeded generator, and takes its shard of
each global batch ``B`` (``B.tensor_split(W)[rank]``: contiguous, sizes differing by at most one; a rank whose
shard is empty -- a last batch smaller than ``W`` -- contributes zero). The loss of a batch is a mean over
*units* (examples; answer tokens for the causal LM; labelled tokens for token classification without a CRF),
so with ``u_r`` units on rank ``r`` and ``U = sum_r u_r``::

    L_r   = mean loss over rank r's units  * (u_r / U)
    grad  = all_reduce_sum_r grad(L_r) = grad(mean loss over the U units of B)     (the 1-process gradient)

One ``all_reduce`` per step carries every trained tensor's gradient and the batch's loss (DDP's gradient
averaging, in one bucket, with the weights that make an uneven batch exact). Clipping, FedProx and the
optimizer then run on every rank on the same gradient, so the replicas stay equal and rank 0's tensors are the
update. Equal up to floating-point summation order (1e-6 relative in tests). Dropout draws per rank from the
same seed, so with dropout the update is equal in distribution, not bit for bit.

DP-SGD (:mod:`fedclinic.privacy.dp_sgd`, ghost and loop clipping): every rank keys the Poisson sampler and the
noise with the same entropy (:meth:`DataParallel.shared_entropy`: rank 0's, from the OS), so every rank draws
the same sample and the same noise; each clips its shard's examples and :meth:`DataParallel.sum_gradients`
adds the clipped sums before the noise. The clipped sum, the noise and ``(sigma, q, steps)`` -- the accounting
-- are those of one process.

:func:`active` installs a :class:`DataParallel` for the trainer (a context variable); with none installed the
trainer runs exactly as before.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:  # pragma: no cover
    import torch

_CURRENT: contextvars.ContextVar["DataParallel | None"] = contextvars.ContextVar("fedclinic_data_parallel",
                                                                                 default=None)


def current() -> "DataParallel | None":
    """The data-parallel group the trainer runs in; None: one process (the default)."""
    return _CURRENT.get()


@contextlib.contextmanager
def active(group: "DataParallel") -> Iterator["DataParallel"]:
    """Make ``group`` the trainer's data-parallel group inside the ``with`` block."""
    token = _CURRENT.set(group)
    try:
        yield group
    finally:
        _CURRENT.reset(token)


def loss_units(loaded: Any, targets: "torch.Tensor") -> int:
    """How many units a batch's loss is the mean over: the family's ``loss_units(targets)`` when it defines one
    (answer tokens, labelled tokens), else the batch's examples."""
    own = getattr(loaded, "loss_units", None)
    return int(own(targets)) if own is not None else int(targets.shape[0])


class DataParallel:
    """This process's place in an initialised ``torch.distributed`` default group (see the module docstring)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DataParallel needs an initialised torch.distributed process group")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    # -- sharding ---------------------------------------------------------------------------------------------

    def shard(self, idx: "torch.Tensor") -> "torch.Tensor":
        """This rank's contiguous part of a global batch's row indices (possibly empty)."""
        return idx.tensor_split(self.world)[self.rank]

    def batches(self, data: Any, order: "torch.Tensor", batch_size: int, device: "torch.device"
                ) -> Iterator[tuple[Any, Any, int]]:
        """``(inputs, targets, global_rows)`` of this rank's shard of each global batch of ``order``;
        ``(None, None, rows)`` where the shard is empty."""
        for start in range(0, len(order), batch_size):
            part = self.shard(order[start:start + batch_size])
            rows = min(batch_size, len(order) - start)
            if len(part) == 0:
                yield None, None, rows
            else:
                inputs, y = data.batch(part, device)
                yield inputs, y, rows

    # -- the gradient -----------------------------------------------------------------------------------------

    def weighted_loss(self, loaded: Any, loss_fn: Callable, inputs: Any, y: Any, params: list
                      ) -> "torch.Tensor":
        """This rank's term ``L_r = mean loss * u_r / U`` of the global batch's mean loss (zero, still attached
        to ``params``, for an empty shard)."""
        import torch
        import torch.distributed as dist

        units = 0 if y is None else loss_units(loaded, y)
        total = torch.tensor([float(units)], dtype=torch.float64, device=comm_device())
        dist.all_reduce(total)
        if units == 0:
            return sum((p.sum() * 0.0 for p in params), torch.zeros((), device=params[0].device))
        return loss_fn(inputs, y) * (units / float(total.item()))

    def all_reduce(self, params: list, loss: "torch.Tensor") -> "torch.Tensor":
        """Sum every rank's gradients of ``params`` (None counts as zero, and is replaced by the sum) and
        ``loss`` in one collective; returns the summed loss (the global batch's mean loss)."""
        import torch
        import torch.distributed as dist

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads] + [loss.detach().reshape(1).float()])
        dist.all_reduce(flat)
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(p).to(p.dtype)
            offset += n
        return flat[offset]

    def sum_gradients(self, params: list, value: float) -> float:
        """DP-SGD: add every rank's clipped sums (``p.grad``, None = zero) and ``value`` (the shard's summed
        loss); returns the summed value."""
        import torch

        return float(self.all_reduce(params, torch.tensor(float(value), device=params[0].device)))

    # -- shared randomness --------------------------------------------------------------------------------------

    def shared_entropy(self, entropy: int | None) -> int | None:
        """The DP-SGD keystreams' entropy every rank uses: the caller's (a replayed test round), else 252 bits
        rank 0 draws from the operating system (4 x 63 bits) and broadcasts (the same strength as a single process's key)."""
        import torch
        import torch.distributed as dist

        if entropy is not None:
            return entropy
        words = torch.zeros(4, dtype=torch.int64)
        if self.rank == 0:
            raw = os.urandom(32)
            words = torch.tensor([int.from_bytes(raw[i:i + 8], "little") >> 1 for i in range(0, 32, 8)],
                                 dtype=torch.int64)
        words = words.to(comm_device())
        dist.broadcast(words, src=0)
        return sum(int(w) << (63 * i) for i, w in enumerate(words.tolist()))


def comm_device() -> "torch.device":
    """Where the default group's collectives take their tensors: the current GPU under NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


__all__ = ["DataParallel", "active", "comm_device", "current", "loss_units"]
