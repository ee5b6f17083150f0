"""Sharded data-parallel training (FSDP2, ``torch.distributed.fsdp.fully_shard``) for models too large for one device.

Under ``sharding = "fsdp"`` each rank of a distributed site round (:mod:`fedclinic.federation.distributed_round`)
holds ``1/W`` of every parameter, gradient and optimizer moment (DTensors sharded on dim 0). :func:`shard_module`
wraps each transformer block (the Hugging Face model's ``_no_split_modules`` classes), the base model and the
output layer, so a block's full weights exist only while it runs (all-gathered for its forward and backward,
resharded after). A tied output layer (GPT-2, SmolLM2) is refused (:func:`tied_output`): not sharded yet.

The batches and the loss weighting are those of :class:`fedclinic.training.data_parallel.DataParallel`: rank ``r``
takes its contiguous shard of each global batch and its loss is ``mean loss * u_r / U``. FSDP reduce-scatters the
gradients with a *sum* (:meth:`FSDPModule.set_gradient_divide_factor` ``(1.0)`` with
:meth:`~FSDPModule.set_force_sum_reduction_for_comms`: a plain ``SUM``, which gloo and NCCL both have; FSDP's
default averages over the ``W`` ranks)::

    grad shard_r = (sum_r' grad(L_r'))[shard r] = (grad of the global batch's mean loss)[shard r]

so the optimizer step on the shards is the 1-process step on the whole tensors. Every rank must run every forward
(the all-gathers are collectives): a rank whose shard of a batch is empty (a last batch smaller than ``W``) runs
the batch's first row with weight 0. Clipping (``clip_grad_norm_`` over DTensor gradients: the global norm) and
the optimizer run on the shards. :func:`full_tensors` gathers the trained tensors once, to rank 0's CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np

from fedclinic.errors import ConfigError
from fedclinic.training.data_parallel import DataParallel, comm_device, loss_units

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: the families whose models are sharded (Hugging Face causal LMs: transformer blocks named by ``_no_split_modules``)
FAMILIES = ("question-answering",)


def transformer_blocks(module: "torch.nn.Module") -> list["torch.nn.Module"]:
    """The submodules :func:`shard_module` wraps one by one: instances of the classes the Hugging Face model names
    in ``_no_split_modules`` (``LlamaDecoderLayer``, ``GPT2Block``), in module order."""
    names = set(getattr(module, "_no_split_modules", None) or ())
    return [m for m in module.modules() if type(m).__name__ in names]


def shard_module(module: "torch.nn.Module") -> int:
    """Shard a Hugging Face causal LM in place over the default process group: ``fully_shard`` on each transformer
    block, then on ``base_model`` (embeddings, final norm) and on the output layer, each its own FSDP root (the
    family calls them separately, :mod:`fedclinic.models.causal_lm`, never the top module's forward). Gradients are
    reduced with a sum. Returns the number of blocks. ConfigError when the model names no blocks, holds parameters
    outside these modules, or ties its output layer to the input embedding (one parameter cannot be in two roots;
    a group of both modules cannot be a root: not sharded yet)."""
    from torch.distributed.fsdp import fully_shard

    blocks = transformer_blocks(module)
    base = getattr(module, "base_model", None)
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    if not blocks or base is None or base is module or head is None:
        raise ConfigError(f"{type(module).__name__} has no transformer blocks under a base model to shard; use "
                          'sharding = "none"')
    if tied_output(module):
        raise ConfigError(f"{type(module).__name__} ties its output layer to the input embedding, which FSDP "
                          'sharding does not handle yet; use sharding = "none"')
    covered = {id(p) for m in (base, head) for p in m.parameters()}
    loose = [n for n, p in module.named_parameters() if id(p) not in covered]
    if loose:
        raise ConfigError(f"{type(module).__name__} has parameters outside its base model and output layer "
                          f"({loose[:4]}); use sharding = \"none\"")
    for m in [*blocks, base, head]:
        fully_shard(m)
        m.set_gradient_divide_factor(1.0)  # sum over ranks: each rank's loss already carries its weight u_r / U
        m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM), then x / 1.0
    return len(blocks)


def tied_output(module: "torch.nn.Module") -> bool:
    """Whether the model's output layer shares a parameter with its base model (GPT-2's, SmolLM2's tied embedding)."""
    base = getattr(module, "base_model", None)
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    if base is None or head is None:
        return False
    inner = {id(p) for p in base.parameters()}
    return any(id(p) in inner for p in head.parameters())


@dataclass
class _Standin:
    """Targets of a row run only so the collectives line up (an empty shard): its loss counts 0."""

    targets: Any


class ShardedDataParallel(DataParallel):
    """:class:`DataParallel` for a module sharded by :func:`shard_module`: the same shards and weights; FSDP reduces
    the gradients, so :meth:`all_reduce` only sums the loss."""

    def batches(self, data: Any, order: "torch.Tensor", batch_size: int, device: "torch.device"
                ) -> Iterator[tuple[Any, Any, int]]:
        """As :meth:`DataParallel.batches`, but an empty shard is the batch's first row, marked to weigh 0."""
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            part = self.shard(batch)
            if len(part) == 0:
                inputs, y = data.batch(batch[:1], device)
                yield inputs, _Standin(y), len(batch)
            else:
                inputs, y = data.batch(part, device)
                yield inputs, y, len(batch)

    def weighted_loss(self, loaded: Any, loss_fn: Callable, inputs: Any, y: Any, params: list
                      ) -> "torch.Tensor":
        """``mean loss * u_r / U``; a stand-in row runs its forward and weighs 0."""
        import torch
        import torch.distributed as dist

        standin = isinstance(y, _Standin)
        units = 0 if standin else loss_units(loaded, y)
        total = torch.tensor([float(units)], dtype=torch.float64, device=comm_device())
        dist.all_reduce(total)
        loss = loss_fn(inputs, y.targets if standin else y)
        return loss * 0.0 if standin else loss * (units / float(total.item()))

    def all_reduce(self, params: list, loss: "torch.Tensor") -> "torch.Tensor":
        """The global batch's mean loss (the sum of the ranks' weighted losses); the gradients were reduce-scattered
        by FSDP in the backward pass."""
        import torch.distributed as dist

        total = loss.detach().reshape(1).float().to(comm_device())
        dist.all_reduce(total)
        return total[0]


def full_tensors(module: "torch.nn.Module", names: Sequence[str], rank: int) -> dict[str, np.ndarray]:
    """The whole tensors ``names`` of a sharded module as float32 numpy arrays on rank 0 (every rank must call:
    one gather per tensor into rank 0's CPU memory); ``{}`` on the other ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return {}
    out = {}
    for name in names:
        t = state[name].detach()
        out[name] = (t.float() if t.is_floating_point() else t).numpy()
    return out


def sharding_problem(family: str, *, tied: bool, dp: bool, measure_gradient_change: bool) -> str | None:
    """Why a round cannot train sharded (None: it can): FSDP here shards the causal-LM family's blocks, not a tied
    output layer (:func:`tied_output`); DP-SGD and the full-pass gradient-change measure are not sharded."""
    if family not in FAMILIES:
        return f"it shards causal language models ({', '.join(FAMILIES)}), not the {family} family"
    if tied:
        return "the model ties its output layer to its input embedding (GPT-2, SmolLM2), which is not sharded yet"
    if dp:
        return "DP-SGD is not sharded"
    if measure_gradient_change:
        return "the gradient-change measure is not sharded"
    return None


__all__ = ["FAMILIES", "ShardedDataParallel", "full_tensors", "shard_module", "sharding_problem",
           "tied_output", "transformer_blocks"]
