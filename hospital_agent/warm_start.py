"""Importing the training stack at start-up, off the first round's critical path (``preload_training_stack``).

A round's first step in a fresh agent process is to import torch's model stack (Hugging Face ``transformers``,
fedclinic's model families and trainer): several seconds of CPU that the first round otherwise waits for. With
``preload_training_stack = true`` (the default) the agent imports it in a background thread as soon as it starts,
while it connects and waits for work; a round that starts meanwhile waits on Python's import lock for the modules
still loading, exactly as it would have imported them itself.
"""

from __future__ import annotations

import importlib
import threading
import time

import structlog

log = structlog.get_logger("fedclinic.agent")

#: what a training round imports first (the families' shared modules; each family's own module is small)
MODULES = ("fedclinic.training.trainer", "fedclinic.models", "transformers.modeling_utils")


def preload_training_stack() -> threading.Thread:
    """Start importing :data:`MODULES` in a daemon thread (returned); logs ``training stack preloaded`` with the
    seconds it took, or the module that failed (a round then imports and reports it as usual)."""

    def load() -> None:
        started = time.monotonic()
        for name in MODULES:
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - a preload never stops the agent; the round reports it
                log.warning("training stack not preloaded", module=name, error=str(exc))
                return
        log.info("training stack preloaded", seconds=round(time.monotonic() - started, 2))

    thread = threading.Thread(target=load, name="preload-training-stack", daemon=True)
    thread.start()
    return thread


__all__ = ["MODULES", "preload_training_stack"]
