"""Entry points the fork server's tests run in forked children (tests/integration/test_fork_server.py)."""

from __future__ import annotations

import json
import os
import signal
import sys


def report(args: list[str]) -> int:
    """Print what a fresh process would know about itself as one JSON line; exit with status ``args[0]``."""
    import numpy
    import torch

    facts = {"pid": os.getpid(), "sid": os.getsid(0), "argv": sys.argv[1:], "cwd": os.getcwd(),
             "stdin": os.readlink("/proc/self/fd/0"), "numpy": int(numpy.random.randint(0, 2**31)),
             "torch": int(torch.randint(0, 2**31, (1,)).item()), "env": os.environ.get("FORK_TEST_MARK", ""),
             "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL}
    print(json.dumps(facts))
    print("to stderr", file=sys.stderr)
    return int(args[0])


def wait_for_signal(args: list[str]) -> int:
    """Say it is ready (a line in its log) and wait for a signal with the default handlers."""
    print("ready", flush=True)
    while True:
        signal.pause()


def stop_cleanly_on_sigterm(args: list[str]) -> int:
    """Handle SIGTERM as an agent does: finish, write ``args[0]``, return 0."""
    stopped = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(True))
    print("ready", flush=True)
    while not stopped:
        signal.pause()
    with open(args[0], "w") as fh:
        fh.write("stopped cleanly")
    return 0


def fail(args: list[str]) -> int:
    raise RuntimeError("an entry point that fails")
