"""Mixed precision for local training: which autocast dtype a round runs in, and whether it needs loss scaling.

``TrainConfig.mixed_precision`` turns autocast on; ``TrainConfig.autocast_dtype`` chooses its dtype:

==========  =====================================================  ==========================================
dtype       on CUDA                                                on the CPU
==========  =====================================================  ==========================================
``auto``    bf16 where the GPU supports it, else fp16 + GradScaler  no autocast (float32; the long-standing
                                                                   behaviour of ``mixed_precision`` there)
``bf16``    bf16 (ConfigError on a GPU without bf16)               bf16 autocast
``fp16``    fp16 + GradScaler                                      fp16 autocast + GradScaler
==========  =====================================================  ==========================================

bf16 keeps float32's exponent range, so it needs no loss scaling; fp16's narrower range makes small gradients
underflow, so its loss is multiplied by a dynamic scale before ``backward`` and the gradients unscaled before
clipping (``torch.amp.GradScaler``: a step whose gradients hold Inf/NaN is skipped and the scale halved).
Parameters, optimizer state and the update stay float32 in every mode: autocast only changes the dtype that
matmuls and convolutions compute in. DP-SGD refuses mixed precision (:mod:`fedclinic.privacy.dp_sgd`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, ContextManager

from fedclinic.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: the values of ``TrainConfig.autocast_dtype``
AUTOCAST_DTYPES = ("auto", "bf16", "fp16")


def check_autocast_dtype(value: Any) -> list[str]:
    """The problems of an ``autocast_dtype`` setting (empty when valid), phrased for a config error."""
    if not isinstance(value, str) or value not in AUTOCAST_DTYPES:
        return [f"autocast_dtype must be one of {', '.join(repr(v) for v in AUTOCAST_DTYPES)}, got {value!r}"]
    return []


def autocast_for(device: "torch.device", enabled: bool, dtype: str = "auto"
                 ) -> tuple[Callable[[], ContextManager], "torch.amp.GradScaler | None"]:
    """``(context factory, scaler)`` for a training loop on ``device`` (the table in the module docstring);
    ``scaler`` is None where no loss scaling is needed. ConfigError for an unknown dtype, or bf16 asked of a
    GPU without bf16 support."""
    import torch

    problems = check_autocast_dtype(dtype)
    if problems:
        raise ConfigError(problems[0])
    if not enabled:
        return contextlib.nullcontext, None
    kind = device.type
    if kind == "cuda":
        if dtype == "auto":
            dtype = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        elif dtype == "bf16" and not torch.cuda.is_bf16_supported():
            raise ConfigError(f"autocast_dtype 'bf16' asked, but {torch.cuda.get_device_name(device)} does not "
                              "support bfloat16; use 'fp16' (with loss scaling) or 'auto'")
    elif kind != "cpu" or dtype == "auto":
        return contextlib.nullcontext, None
    if dtype == "bf16":
        return (lambda: torch.autocast(kind, dtype=torch.bfloat16)), None
    return (lambda: torch.autocast(kind, dtype=torch.float16)), torch.amp.GradScaler(kind)


__all__ = ["AUTOCAST_DTYPES", "autocast_for", "check_autocast_dtype"]
