"""The optimizer step fused into the backward pass (``TrainConfig.step_in_backward``).

The ordinary step keeps every trained parameter's gradient until ``optimizer.step()``: the weights and their
gradients (one more model) are alive together at the end of the backward pass. Here each trained parameter gets
an optimizer of its own and a ``Tensor.register_post_accumulate_grad_hook``: as soon as autograd has accumulated
the parameter's gradient for the batch (every use of a shared weight included), the hook applies that
parameter's update and frees the gradient. At most the gradients of the tensors in flight are alive, not all.

This is the ordinary step, for every optimizer in :mod:`fedclinic.training.optimizers`, exactly when a
parameter's update depends on its own gradient and state only: SGD (with L2 weight decay), Adam / AdamW and
FLCMC's Adam keep per-parameter moments, so one optimizer per parameter computes what one optimizer over all of
them does. It is not with anything that needs every gradient first or acts between backward and step
(global-norm clipping, the proximal term, a carried optimizer state, DP-SGD, fp16 loss scaling, the data-parallel
all-reduce): ``fedclinic.spec.capabilities.step_in_backward_problems`` refuses those settings in a task and
:func:`fused_conflicts` the site-side ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from fedclinic.errors import ConfigError
from fedclinic.training import eager_optimizers
from fedclinic.training.optimizers import make_optimizer

if TYPE_CHECKING:  # pragma: no cover
    import torch


def fused_conflicts(*, data_parallel: bool, loss_scaling: bool) -> None:
    """Raise ConfigError naming the site-side settings the fused step cannot run with (none: return)."""
    conflicts = []
    if data_parallel:
        conflicts.append("training on several devices (the agent's `devices`: gradients are all-reduced after "
                         "the backward pass)")
    if loss_scaling:
        conflicts.append("fp16 mixed precision (its loss scaling checks every gradient before the step; use bf16 "
                         "or turn mixed_precision off)")
    if conflicts:
        raise ConfigError("step_in_backward (the optimizer step fused into the backward pass) cannot run with "
                          + "; ".join(conflicts) + "; change those settings or set step_in_backward = false")


class BackwardStepper:
    """Per-parameter optimizers stepped from post-accumulate-grad hooks; a context manager that removes them.

    Inside the context every ``loss.backward()`` over the parameters also takes the optimizer step and leaves
    ``p.grad`` as None for every stepped parameter. ``steps`` counts the hook calls (one per parameter and batch).
    """

    def __init__(self, optimizer: str, params: Sequence["torch.nn.Parameter"], *, lr: float,
                 weight_decay: float = 0.0) -> None:
        self._optimizers = [make_optimizer(optimizer, [p], lr=lr, weight_decay=weight_decay) for p in params]
        self._params = list(params)
        self._handles: list = []
        self.steps = 0

    def __enter__(self) -> "BackwardStepper":
        for p, opt in zip(self._params, self._optimizers):
            self._handles.append(p.register_post_accumulate_grad_hook(self._hook(opt)))
        return self

    def _hook(self, opt: "torch.optim.Optimizer"):
        def step(p: "torch.Tensor") -> None:
            eager_optimizers.step(opt)
            p.grad = None
            self.steps += 1
        return step

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for p in self._params:
            p.grad = None
