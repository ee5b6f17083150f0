"""DP-SGD's Gaussian noise as torch tensors, drawn from the CSPRNG-backed
:class:`~fedclinic.strategies.secure_gaussian.SecureGaussian` (see that module for the method, the keystream and
what it does against floating-point attacks).

:meth:`TensorNoise.like` draws on the CPU in numpy (float64, rounded once to the reference's dtype) and moves the
tensor to the reference's device in one copy. The ghost-clipping step and the Opacus optimizer
(:class:`fedclinic.privacy.secure_dp_optimizer.SecureDPOptimizer`) both take their noise from here.
"""

from __future__ import annotations

import torch

from fedclinic.strategies.secure_gaussian import SecureGaussian, replay_key
from fedclinic.strategies.secure_random import SecureRandom

__all__ = ["SecureGaussian", "SecureRandom", "TensorNoise", "replay_key"]


class TensorNoise:
    """``N(0, std^2)`` tensors from a :class:`SecureGaussian` (a fresh OS-keyed one unless given)."""

    def __init__(self, source: SecureGaussian | None = None) -> None:
        self.source = source if source is not None else SecureGaussian()

    @classmethod
    def replay(cls, entropy: int, purpose: str) -> "TensorNoise":
        """Noise whose stream is fixed by ``(entropy, purpose)``: for tests that replay a round bit for bit."""
        return cls(SecureGaussian.replay(entropy, purpose))

    def tensor(self, shape: tuple[int, ...] | torch.Size, std: float, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> torch.Tensor:
        """A tensor of ``shape`` with independent ``N(0, std^2)`` entries of ``dtype`` on ``device``."""
        if not dtype.is_floating_point or dtype == torch.bfloat16:
            raise ValueError(f"DP noise is drawn for float16/32/64 tensors, got {dtype} (DP-SGD trains in float32)")
        np_dtype = torch.empty((), dtype=dtype).numpy().dtype
        out = torch.from_numpy(self.source.sample(tuple(shape), std, np_dtype))
        return out.to(device) if torch.device(device).type != "cpu" else out

    def like(self, reference: torch.Tensor, std: float) -> torch.Tensor:
        """Noise of ``reference``'s shape, dtype and device."""
        return self.tensor(reference.shape, std, dtype=reference.dtype, device=reference.device)
