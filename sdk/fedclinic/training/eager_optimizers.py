"""torch.optim optimizers run eagerly without importing torch's compiler.

In torch 2.x every ``Optimizer`` method that a training loop calls reaches ``torch._dynamo`` on its first use
in a process, although nothing is compiled: ``add_param_group`` (so the constructor), ``zero_grad`` and the
functional kernels (``torch.optim.adamw.adamw``...) are wrapped by ``torch._compile._disable_dynamo``, whose
first call imports the compiler to build its "do not trace" wrapper, and ``step`` is wrapped by
``_use_grad_for_differentiable``, which imports it at every call to mark a graph break. That import (sympy, the
FX symbolic shapes, dynamo's tracer) costs a process about as much CPU as importing torch itself (1.3 s quiet,
1.8-2.4 s under load on a 2-core box). In eager mode it changes nothing: outside ``torch.compile`` the disabled
wrapper just calls the function and the graph break is a no-op.

Who is spared: a process that trains a model of our own (logistic regression, BiLSTM, FedNER, image and feature
models). A process that imports a Hugging Face model class imports the compiler anyway (transformers decorates
a class with ``torch.compiler.disable`` at import time), so for BERT-style models this module changes nothing.

:func:`prepare` (called by :func:`~fedclinic.training.optimizers.make_optimizer`) fills the disabled wrappers'
own cache with the plain function, and :func:`step` runs ``optimizer.step()``'s body under ``torch.no_grad()``
(what ``_use_grad_for_differentiable`` does for a non-differentiable optimizer) inside the profiler range of
torch's step wrapper. The arithmetic is torch's own: the parameters and the optimizer state are bit-identical to
``optimizer.step()`` (tests/unit/training/test_eager_optimizers.py).

Where this does not apply, torch's own path is taken, never a guess:

- ``torch._dynamo`` is already imported (a process that compiles, exports or holds a Hugging Face model):
  :func:`prepare` changes nothing, so whatever that process compiles keeps torch's "do not trace" wrappers;
- a differentiable optimizer, a step hook registered on it or globally, or an optimizer whose ``step`` is not
  wrapped the way this module knows (another torch version, Opacus' DP optimizers, our own SelfAdam):
  :func:`step` calls ``optimizer.step()``.

A process that prepared the optimizers must not later ``torch.compile`` a training step that calls them: the
filled caches would let the compiler trace into those methods. fedclinic never compiles a training step.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: the attribute on which torch._compile._disable_dynamo caches its wrapper of a function (on the function)
_CACHE_ATTRIBUTE = "__dynamo_disable"

_prepared = False


def prepare() -> None:
    """Fill the "do not trace" caches of torch.optim's wrapped methods and kernels with the plain functions, once
    per process, unless the compiler is already imported here (module docstring). Never raises on an unknown
    torch layout: what it does not recognise is left to torch."""
    global _prepared
    if _prepared or "torch._dynamo" in sys.modules:
        return
    _prepared = True
    import importlib
    import pkgutil

    import torch._compile
    import torch.optim

    inner_code = torch._compile._disable_dynamo(_probe).__code__
    done: set[int] = set()

    def fill(fn: Any) -> None:
        if callable(fn) and id(fn) not in done:
            done.add(id(fn))
            try:
                setattr(fn, _CACHE_ATTRIBUTE, fn)
            except (AttributeError, TypeError):
                pass

    def visit(obj: Any) -> None:
        code = getattr(obj, "__code__", None)
        if code is None:
            return
        if code is inner_code:  # @torch._disable_dynamo: its closure's ``fn`` is the wrapped function
            fill(_closure_value(obj, "fn"))
            return
        for cell in obj.__closure__ or ():  # e.g. _disable_dynamo_if_unsupported's ``maybe_fallback``
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if getattr(value, "__code__", None) is inner_code:
                fill(_closure_value(value, "fn"))

    modules = [torch.optim]
    for info in pkgutil.iter_modules(torch.optim.__path__):
        try:
            modules.append(importlib.import_module(f"torch.optim.{info.name}"))
        except Exception:  # noqa: BLE001 - an optional optimizer module that fails to import is not ours to fix
            continue
    for module in modules:
        for value in list(vars(module).values()):
            if isinstance(value, type) and issubclass(value, torch.optim.Optimizer):
                for klass in value.__mro__:
                    for attr in vars(klass).values():
                        visit(attr)
            else:
                visit(value)


def step(optimizer: "torch.optim.Optimizer") -> None:
    """``optimizer.step()`` without importing torch's compiler (module docstring); bit-identical to it."""
    body = _plain_step(optimizer)
    if body is None or _has_step_hooks(optimizer):
        optimizer.step()
        return
    import torch

    with torch.autograd.profiler.record_function(f"Optimizer.step#{type(optimizer).__name__}.step"):
        with torch.no_grad():
            body(optimizer)
        optimizer._optimizer_step_code()


def _has_step_hooks(optimizer: "torch.optim.Optimizer") -> bool:
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    return bool(_global_optimizer_pre_hooks or _global_optimizer_post_hooks
                or optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks)


def _plain_step(optimizer: "torch.optim.Optimizer") -> Callable[[Any], Any] | None:
    """The body of ``type(optimizer).step`` under torch's two wrappers (step hooks outside, then
    ``_use_grad_for_differentiable``), or None when the optimizer or its step is not the kind this module
    knows."""
    if optimizer.defaults.get("differentiable", False) is not False:
        return None
    hooked = type(optimizer).step
    if not getattr(hooked, "hooked", False):
        return None
    use_grad = getattr(hooked, "__wrapped__", None)
    if getattr(getattr(use_grad, "__code__", None), "co_name", None) != "_use_grad":
        return None
    body = getattr(use_grad, "__wrapped__", None)
    return body if callable(body) else None


def _closure_value(fn: Any, name: str) -> Any:
    try:
        return fn.__closure__[fn.__code__.co_freevars.index(name)].cell_contents
    except (ValueError, IndexError, TypeError, AttributeError):
        return None


def _probe() -> None:
    """A function to wrap once, to learn the code object of torch's "do not trace" wrapper."""
