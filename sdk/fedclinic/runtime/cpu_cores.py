"""How many CPU cores this process may use, and how to share them between processes on one host."""

from __future__ import annotations

import os


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS reports one, else ``os.cpu_count()``),
    at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - macOS, Windows: no affinity call
        return max(1, os.cpu_count() or 1)


def cores_per_process(processes: int, cores: int | None = None) -> int:
    """Each of ``processes`` processes' share of ``cores`` (default: :func:`available_cores`):
    ``max(1, cores // processes)``, so that together they do not oversubscribe the host."""
    total = available_cores() if cores is None else cores
    return max(1, total // max(1, processes))


__all__ = ["available_cores", "cores_per_process"]
