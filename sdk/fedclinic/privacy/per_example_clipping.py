"""Clipped sum of per-example gradients by differentiating each example alone (the definition, for any model).

DP-SGD's clipped sum (Abadi et al. 2016, Algorithm 1, lines "compute gradient" and "clip gradient")::

    S = sum_b min(1, C / ||g_b||) g_b,        g_b = grad_theta l(x_b)

:class:`PerExampleClipping` computes ``g_b`` literally: for each example ``b`` of a batch, the per-example
objective runs on ``x_b`` alone (the batch's row ``b``: every input tensor sliced ``[b:b+1]``) and
``torch.autograd.grad`` gives ``g_b``. This is exact for every model whose output for an example depends on that
example only, whatever its layers are -- LSTMs over packed sequences (cuDNN's included: autograd differentiates
the kernel that ran), ``EmbeddingBag`` with per-token weights, convolutions, CRFs, LoRA adapters -- and needs no
per-layer rule, so it covers the models ghost clipping (:mod:`fedclinic.privacy.ghost`) and Opacus' grad samplers
do not. Its cost is one forward and one backward pass per example (the same arithmetic as the batch, in B small
passes) and one gradient-sized accumulator per trained tensor; memory does not grow with the batch.

What it needs from the model, and what :mod:`fedclinic.privacy.dp_sgd` ensures:

- rows do not interact. Batch normalisation in training mode normalises each example with statistics of the whole
  batch, so an example's output (and gradient) depends on the other examples and "the gradient of example b" is
  undefined: its sensitivity cannot be bounded by clipping it. A private round therefore runs every batch-norm
  layer in inference mode (running statistics fixed, as Opacus requires by refusing train-mode BatchNorm), where
  it is a fixed per-channel affine map; its affine weight and bias, when trained, get exact per-example gradients.
- the padding of a batch does not change an example's loss (true of fedclinic's families: padded positions are
  masked, packed or zero-weighted), so row ``b`` of a padded batch is example ``b``.

Same interface as :class:`~fedclinic.privacy.ghost.GhostClipping` (``recording()``, ``add_clipped_sum(losses)``,
``close()``), with the forward pass wrapped by :meth:`objective`: the wrapped objective computes and clips the
per-example gradients as it goes and returns the (detached) losses, which :meth:`add_clipped_sum` then turns
into ``p.grad += S``.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch


class PerExampleClipping:
    """``S`` (module docstring) added to ``p.grad`` of ``params``. Use::

        clip = PerExampleClipping(module, params, max_grad_norm)
        per_example = clip.objective(objective)          # objective: a PerExampleObjective
        with clip.recording():
            losses = per_example(inputs, targets)        # [B]; differentiates each example alone
        norms = clip.add_clipped_sum(losses)             # p.grad += S; ||g_b|| [B]
    """

    def __init__(self, module: "torch.nn.Module", params: Sequence["torch.nn.Parameter"], max_grad_norm: float):
        self.module = module
        self.params = list(params)
        self.max_grad_norm = float(max_grad_norm)
        self._sum: list["torch.Tensor"] | None = None
        self._norms: list["torch.Tensor"] = []

    def recording(self):
        """A no-op context (the wrapped objective does the work); kept for GhostClipping's interface."""
        return nullcontext()

    def objective(self, objective: Any) -> "_Wrapped":
        """``objective`` (with ``per_example(inputs, targets) -> [B]`` and, optionally, the CRF's
        ``take_parameter_copies()``) wrapped so that its ``per_example`` clips as it goes."""
        return _Wrapped(self, objective)

    def _add_example(self, objective: Any, inputs: tuple, targets: "torch.Tensor") -> "torch.Tensor":
        """Example ``inputs``/``targets`` (batch of one): add ``min(1, C/||g||) g`` to the running sum; its loss."""
        import torch

        loss = objective.per_example(inputs, targets)
        copies = objective.take_parameter_copies() if hasattr(objective, "take_parameter_copies") else {}
        wrt = [copies.get(id(p), p) for p in self.params]  # a per-example copy stands for its parameter
        grads = torch.autograd.grad(loss.sum(), wrt, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g.reshape(p.shape) for g, p in zip(grads, self.params)]
        norm = torch.sqrt(sum(g.double().square().sum() for g in grads))
        coef = float(torch.clamp(self.max_grad_norm / norm.clamp(min=1e-12), max=1.0))
        if self._sum is None:
            self._sum = [g * coef for g in grads]
        else:
            for acc, g in zip(self._sum, grads):
                acc.add_(g, alpha=coef)
        self._norms.append(norm.float())
        return loss.detach().reshape(-1)

    def add_clipped_sum(self, losses: "torch.Tensor", groups: "torch.Tensor | None" = None) -> "torch.Tensor":
        """Add the clipped sum of the examples since the last call to ``p.grad`` (None counts as zero); return
        their gradient norms ``[B]``. ``groups`` (GhostClipping's per-patient form) must be None: each example was
        clipped alone as it was differentiated."""
        import torch

        if groups is not None:
            raise ValueError("the per-example loop clips each example alone; it cannot clip groups of examples")
        if losses.dim() != 1 or len(losses) != len(self._norms):
            raise ValueError(f"add_clipped_sum needs the wrapped objective's {len(self._norms)} losses, got shape "
                             f"{tuple(losses.shape)}")
        for p, s in zip(self.params, self._sum or ()):
            p.grad = s if p.grad is None else p.grad.add_(s)
        norms = torch.stack(self._norms) if self._norms else torch.zeros(0)
        self._sum, self._norms = None, []
        return norms

    def close(self) -> None:
        self._sum, self._norms = None, []


class _Wrapped:
    """A per-example objective whose ``per_example`` differentiates and clips row by row (see the class above)."""

    def __init__(self, clip: PerExampleClipping, objective: Any) -> None:
        self.clip, self.inner = clip, objective

    def per_example(self, inputs: tuple["torch.Tensor", ...], targets: "torch.Tensor") -> "torch.Tensor":
        import torch

        rows = [self.clip._add_example(self.inner, tuple(t[b:b + 1] for t in inputs), targets[b:b + 1])
                for b in range(int(targets.shape[0]))]
        return torch.cat(rows) if rows else torch.zeros(0)


__all__ = ["PerExampleClipping"]
