"""Named crash points for fault-injection tests (inactive unless FEDCLINIC_FAILPOINTS is set).

``FEDCLINIC_FAILPOINTS="agent.upload.chunk:3,agent.after-receipt"`` makes the process exit abruptly
(``os._exit(97)``, like a power cut: no cleanup, no flush) the 3rd time ``agent.upload.chunk`` is reached and
the first time ``agent.after-receipt`` is. The integration tests use this to crash a real agent at an exact
point of the upload protocol instead of racing a timer.
"""

from __future__ import annotations

import os
import threading

_counts: dict[str, int] = {}
_lock = threading.Lock()


def _armed() -> dict[str, int]:
    spec = os.environ.get("FEDCLINIC_FAILPOINTS", "")
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, n = part.partition(":")
        out[name] = int(n or 1)
    return out


def failpoint(name: str) -> None:
    """Exit the process here if the failpoint ``name`` is armed and its count is reached."""
    armed = _armed()
    if name not in armed:
        return
    with _lock:
        _counts[name] = _counts.get(name, 0) + 1
        if _counts[name] >= armed[name]:
            os._exit(97)
