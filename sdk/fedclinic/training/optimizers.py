"""Local optimizers a task can choose, and the proximal (perturbation) term they share.

Names, as a task's ``optimizer`` field takes them:

- ``sgd``: theta <- theta - eta * g. With ``proximal_mu`` > 0 it is FedProx's PGD.
- ``adam``, ``adamw``: the framework's ``torch.optim.Adam`` / ``AdamW`` (eps = 1e-8).
- ``self_adam``: Adam written out as FLCMC Eqs. 15-20, with the paper's eps = 1e-8 *outside* the root of
  the bias-corrected second moment::

      m_s = b1 m_{s-1} + (1 - b1) g_s         v_s = b2 v_{s-1} + (1 - b2) g_s^2
      theta_s = theta_{s-1} - eta * (m_s / (1 - b1^s)) / (sqrt(v_s / (1 - b2^s)) + eps)

  s counts this site's optimizer steps (from 1 in every round, or across rounds with
  ``optimizer_state = "keep"``).
- ``padam``: FLCMC's PAdam (Eqs. 21-27). It is ``self_adam`` on the gradient of the perturbed objective
  F_k(theta) + mu/2 ||theta - theta_t||^2, i.e. g_s = grad F_k + mu (theta - theta_t). The pull towards
  the round's global model theta_t goes *through* the moments. With mu = 0 it is exactly ``self_adam``.

The proximal term is added to the gradient by :func:`add_proximal_gradient`, the same way for every
optimizer. ``sgd`` + mu is then PGD, ``adam`` + mu is FedProx with Adam, and ``padam`` is ``self_adam`` + mu.
``weight_decay`` is L2 regularisation added to the gradient (AdamW: decoupled, as torch defines it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

from fedclinic.errors import ConfigError
from fedclinic.spec.capabilities import (  # noqa: F401  (the task-level table, re-exported)
    OPTIMIZER_STATE_POLICIES, OPTIMIZERS, check_optimizer_settings)

if TYPE_CHECKING:  # pragma: no cover
    import torch


def make_optimizer(name: str, params: Sequence["torch.nn.Parameter"], *, lr: float, weight_decay: float = 0.0,
                   betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> "torch.optim.Optimizer":
    """The optimizer called ``name`` over ``params`` (ConfigError for an unknown name). Step it with
    :func:`fedclinic.training.eager_optimizers.step`, which avoids importing torch's compiler."""
    import torch

    from fedclinic.training import eager_optimizers

    eager_optimizers.prepare()

    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    if name in ("self_adam", "padam"):
        return _self_adam_class()(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    raise ConfigError(f"optimizer {name!r} is unknown; choose one of {', '.join(OPTIMIZERS)}")


def add_proximal_gradient(params: Iterable["torch.nn.Parameter"], anchor: Iterable["torch.Tensor"],
                          mu: float) -> None:
    """g <- g + mu * (theta - theta_t) for every parameter with a gradient: the gradient of mu/2 ||theta - theta_t||^2."""
    import torch

    with torch.no_grad():
        for p, a in zip(params, anchor):
            if p.grad is not None:
                p.grad.add_(p.detach() - a, alpha=mu)


_SELF_ADAM = None


def _self_adam_class():
    """Built lazily so that importing this module does not import torch."""
    global _SELF_ADAM
    if _SELF_ADAM is not None:
        return _SELF_ADAM
    import torch

    class SelfAdam(torch.optim.Optimizer):
        """Adam exactly as FLCMC Eqs. 15-20 (see the module docstring); state per parameter: step, m, v."""

        def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                     eps: float = 1e-8, weight_decay: float = 0.0) -> None:
            if not lr > 0 or not eps > 0 or not all(0 <= b < 1 for b in betas) or weight_decay < 0:
                raise ConfigError(f"self_adam: bad settings lr={lr}, betas={betas}, eps={eps}, "
                                  f"weight_decay={weight_decay}")
            super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for group in self.param_groups:
                params = [p for p in group["params"] if p.grad is not None]
                if not params:
                    continue
                b1, b2 = group["betas"]
                lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
                grads = [p.grad for p in params]
                if wd:
                    grads = torch._foreach_add(grads, params, alpha=wd)
                for p in params:
                    if not self.state[p]:
                        self.state[p] = {"step": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)}
                    self.state[p]["step"] += 1
                # tensors that started together share s and step in one batch of foreach kernels; one that
                # joined the trainable set later (its own, smaller s) gets its own batch
                by_step: dict[int, list[int]] = {}
                for i, p in enumerate(params):
                    by_step.setdefault(self.state[p]["step"], []).append(i)
                for s, idx in by_step.items():
                    ps = [params[i] for i in idx]
                    gs = [grads[i] for i in idx]
                    ms = [self.state[p]["m"] for p in ps]
                    vs = [self.state[p]["v"] for p in ps]
                    torch._foreach_lerp_(ms, gs, 1 - b1)                       # Eq. 16: m = b1 m + (1-b1) g
                    torch._foreach_mul_(vs, b2)                                   # Eq. 17
                    torch._foreach_addcmul_(vs, gs, gs, value=1 - b2)
                    denom = torch._foreach_div(vs, 1 - b2 ** s)                   # Eq. 19: v_hat
                    torch._foreach_sqrt_(denom)
                    torch._foreach_add_(denom, eps)                               # sqrt(v_hat) + eps, Eq. 20
                    torch._foreach_addcdiv_(ps, ms, denom, value=-lr / (1 - b1 ** s))  # Eqs. 18, 20
            return loss

    _SELF_ADAM = SelfAdam
    return SelfAdam


__all__ = ["OPTIMIZERS", "OPTIMIZER_STATE_POLICIES", "add_proximal_gradient", "check_optimizer_settings",
           "make_optimizer"]
