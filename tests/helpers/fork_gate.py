"""A module the fork server's tests make it import (tests/integration/test_fork_server.py): its import holds the server
in its imports until the test writes a word into the FIFO named by ``FORK_GATE``, then goes on, or ends the server
(status 3) when the word is ``exit``. It waits on the FIFO with select and a deadline (60 s), never on a sleep."""

from __future__ import annotations

import os
import select

_fd = os.open(os.environ["FORK_GATE"], os.O_RDONLY | os.O_NONBLOCK)  # a FIFO: readable once the test writes
_readable, _, _ = select.select([_fd], [], [], 60)
_word = os.read(_fd, 64).decode().strip() if _readable else ""
os.close(_fd)
if _word == "exit":
    os._exit(3)
