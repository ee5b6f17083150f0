"""Opacus' ``DPOptimizer`` with its Gaussian noise from fedclinic's CSPRNG instead of a torch generator.

Opacus draws the noise of ``DPOptimizer.add_noise`` with ``torch.normal`` from a ``torch.Generator`` (a Mersenne
Twister; its ``secure_mode`` needs the unmaintained torchcsprng). :class:`SecureDPOptimizer` overrides only
``add_noise``: for every parameter, ``p.grad = p.summed_grad + N(0, (sigma C)^2 I)`` with the noise from
:class:`fedclinic.privacy.tensor_noise.TensorNoise`. Clipping and accumulation (``clip_and_accumulate``), skipped
steps (``signal_skip_step``), the scaling by the expected batch size and the step hook that the accountant
attaches run as in Opacus, so the clipped sum and the accountant's view of each step are unchanged.
"""

from __future__ import annotations

from typing import Any

from opacus.optimizers import DPOptimizer
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
from torch.optim import Optimizer

from fedclinic.privacy.tensor_noise import TensorNoise


class SecureDPOptimizer(DPOptimizer):
    """``DPOptimizer`` whose ``add_noise`` draws from ``noise`` (a :class:`TensorNoise`); other arguments as
    Opacus' (``generator`` and ``secure_mode`` are not taken: the noise source replaces both)."""

    def __init__(self, optimizer: Optimizer, *, noise: TensorNoise, **kwargs: Any) -> None:
        if "generator" in kwargs or "secure_mode" in kwargs:
            raise TypeError("SecureDPOptimizer draws its noise from `noise`; do not pass generator or secure_mode")
        super().__init__(optimizer, **kwargs)
        self.noise = noise

    def add_noise(self) -> None:
        """``p.grad = p.summed_grad + N(0, (noise_multiplier * max_grad_norm)^2 I)`` for every parameter."""
        std = self.noise_multiplier * self.max_grad_norm
        for p in self.params:
            _check_processed_flag(p.summed_grad)
            p.grad = (p.summed_grad + self.noise.like(p.summed_grad, std)).view_as(p)
            _mark_as_processed(p.summed_grad)
