"""Named crash points for fault-injection tests (inactive unless FEDCLINIC_FAILPOINTS is set).

``FEDCLINIC_FAILPOINTS="agent.upload.chunk:3,agent.after-receipt"`` makes the process exit abruptly
(``os._exit(97)``, like a power cut: no cleanup, no flush) the 3rd time ``agent.upload.chunk`` is reached and
the first time ``agent.after-receipt`` is. The integration tests use this to crash a real agent at an exact
point of the upload protocol instead of racing a timer.

``FEDCLINIC_FAILPOINT_PAUSE=/path/to/marker`` turns the exit into a stop: the thread that reaches the armed point
writes ``name pid`` to the marker file (atomically) and blocks there for good, so that a test can wait for the
file and send the process a real ``SIGKILL`` at that exact point (the other threads go on meanwhile, as they would
in the instant before a kill).

``FEDCLINIC_DISK_FULL=/path/to/flag`` makes every write through the one durable-write layer
(:mod:`fedclinic.runtime.durable_file`: blobs, update spill files, atomically replaced files) fail with
``OSError(ENOSPC)`` while that flag file exists: a full disk for hosts where the campaign cannot mount a small
tmpfs (not root). SQLite and plain ``open()`` writes are not covered; a real full disk covers everything.
"""

from __future__ import annotations

import errno
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
    """Exit the process here (or stop this thread here: module docstring) if the failpoint ``name`` is armed and
    its count is reached."""
    armed = _armed()
    if name not in armed:
        return
    with _lock:
        _counts[name] = _counts.get(name, 0) + 1
        reached = _counts[name] >= armed[name]
        if reached and not os.environ.get("FEDCLINIC_FAILPOINT_PAUSE"):
            os._exit(97)
    if reached:
        _pause_here(name, os.environ["FEDCLINIC_FAILPOINT_PAUSE"])


def _pause_here(name: str, marker: str) -> None:
    """Publish that ``name`` was reached, then block this thread until the process is killed."""
    tmp = f"{marker}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{name} {os.getpid()}\n")
    os.replace(tmp, marker)
    threading.Event().wait()


def disk_full() -> None:
    """Raise ``OSError(ENOSPC)`` while the flag file named by ``FEDCLINIC_DISK_FULL`` exists (module docstring)."""
    flag = os.environ.get("FEDCLINIC_DISK_FULL")
    if flag and os.path.exists(flag):
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected: FEDCLINIC_DISK_FULL)")
