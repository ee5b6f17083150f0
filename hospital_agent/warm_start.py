"""Importing the training stack at start-up, not in the first round (``preload_training_stack``).

A round's first step in a fresh agent process is to import torch's model stack (Hugging Face ``transformers``,
fedclinic's model families and trainer): several seconds of CPU that the first round otherwise waits for. With
``preload_training_stack = true`` (the default) the agent imports it when it starts, before it connects: in a
federation that starts together (``fedclinic demo``), that is while the scientist's client packages and uploads
the model. It runs in the main thread, before any work: importing ``transformers`` from two threads at once can
fail half-way (its lazy module raises ImportError for a name still loading in the other thread).

After the imports it freezes the garbage collector's view of what exists (``gc.freeze``): the modules' objects
(about a million with transformers) live as long as the process, and every full collection during training would
walk them all again.
"""

from __future__ import annotations

import gc
import importlib
import time

import structlog

log = structlog.get_logger("fedclinic.agent")

#: what a training round imports first (the families' shared modules; each family's own module is small)
MODULES = ("fedclinic.training.trainer", "fedclinic.models", "transformers.modeling_utils")


def preload_training_stack() -> bool:
    """Import :data:`MODULES` now; log ``training stack preloaded`` with the seconds it took and return True, or
    log the module that failed and return False (a round then imports and reports it as usual)."""
    started = time.monotonic()
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a preload never stops the agent; the round reports it
            log.warning("training stack not preloaded", module=name, error=str(exc))
            return False
    gc.collect()
    gc.freeze()  # the imported objects stay for the process's life: out of every later collection (docstring)
    log.info("training stack preloaded", seconds=round(time.monotonic() - started, 2))
    return True


__all__ = ["MODULES", "preload_training_stack"]
