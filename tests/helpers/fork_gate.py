"""A module the fork server's tests make it import (tests/integration/test_fork_server.py): its import holds the server
in its imports until the file named by ``FORK_GATE`` exists, then goes on, or ends the server (status 3) when the
file says ``exit``. Waits on the file with a deadline (60 s), never on a fixed sleep."""

from __future__ import annotations

import os
import time

_path = os.environ["FORK_GATE"]
_deadline = time.monotonic() + 60
while not os.path.exists(_path) and time.monotonic() < _deadline:
    time.sleep(0.02)
with open(_path) as _fh:
    if _fh.read().strip() == "exit":
        os._exit(3)
