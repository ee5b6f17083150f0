"""Start several processes of one program on one host without each importing its stack again: a fork server.

A hospital agent spends several CPU seconds importing torch (and, with ``preload_training_stack``, transformers)
before it does anything. In production every agent runs on its own hospital's machine, so that cost is paid in
parallel; a :class:`~fedclinic.federation.local_federation.LocalFederation` (the demo, the tests, the overhead
bench) runs all its agents on one host, where N agents would import the same modules N times. The fork server
imports them once and forks each agent from that warm process (copy-on-write: the agents share those pages too).

Two halves:

* :class:`ForkServer` (the owner's side) starts ``python -m fedclinic.federation.fork_server --import MOD ...``,
  asks it for processes (:meth:`ForkServer.spawn`, which does not wait for the server's imports: the requests
  queue on its pipe and the owner goes on, e.g. to package a model while the agents' stack is imported) and
  returns a :class:`ForkedProcess` for each: the part of :class:`subprocess.Popen`'s interface a federation uses
  (``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``), with Popen's
  conventions (``returncode`` is the exit status, or ``-N`` for a process ended by signal N).
* :func:`main` (the server): a single-threaded loop over its request pipe and a pidfd per child. Each request
  names an entry point (``package.module:function``), its arguments, a log file and a working directory; the
  server forks, answers with the child's pid, and reports the child's exit status when its pidfd says it ended.

A forked child starts as a fresh interpreter would, as far as the entry point can tell: its own session
(``setsid``, as ``start_new_session=True`` gives), stdin from /dev/null, stdout and stderr appended to its log
file (unbuffered), the default handlers for SIGTERM/SIGINT/SIGHUP/SIGCHLD, fresh seeds for Python's, numpy's and
torch's global generators, ``sys.argv`` as ``python -m MODULE ARGS`` sets it; it exits through the interpreter's
normal shutdown (``atexit``, non-daemon threads joined) with the entry point's return value as its status. Its
environment is the server's, which the owner sets once for all its children (modules read some variables at
import time: ``OMP_NUM_THREADS``, ``HF_HUB_OFFLINE``).

No child outlives the server: each asks the kernel for SIGTERM when the server dies (``PR_SET_PDEATHSIG``), and a
server whose request pipe closes (its owner exited or crashed) sends SIGTERM to its children, waits up to
``--grace`` seconds, SIGKILLs what is left and exits. The protocol is JSON lines on the server's stdin/stdout
(loopback of one host, between processes of one user; never a network path).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

#: ``prctl(PR_SET_PDEATHSIG, sig)``: the signal the kernel sends this process when its parent thread dies
_PR_SET_PDEATHSIG = 1
#: the status reported for a child whose end the server could not report (the server itself died first)
UNKNOWN_STATUS = 255


class ForkServerError(RuntimeError):
    """The fork server did not start, or refused or could not serve a request (the message says which)."""


# the owner's side ------------------------------------------------------------------------------------------------
class ForkedProcess:
    """A process the fork server forked: the part of :class:`subprocess.Popen` a federation uses.

    It exists from the moment it was asked for (:meth:`ForkServer.spawn` does not wait for the server): ``pid``
    waits until the server has forked it (ForkServerError when it could not), ``poll`` says None while it
    starts. Signals go through a pidfd opened right after the fork (never to a recycled pid); the exit status
    comes from the server, which is the child's parent and reaps it."""

    #: how long ``pid`` and ``send_signal`` wait for the server to fork a requested child (its imports first)
    START_TIMEOUT_S = 600.0

    def __init__(self, server: "ForkServer", args: list[str], log: Path) -> None:
        self.args = args
        self.returncode: int | None = None
        self._server = server
        self._log = log
        self._pid: int | None = None
        self._pidfd: int | None = None
        self._start_error = ""   # why the server did not fork it (then returncode is UNKNOWN_STATUS)

    @property
    def pid(self) -> int:
        """The child's pid, once the server forked it (waits up to :attr:`START_TIMEOUT_S`); ForkServerError
        when the server could not start it."""
        self._server._wait_started(self, self.START_TIMEOUT_S)
        if self._pid is None:
            raise ForkServerError(self._start_error)
        return self._pid

    def poll(self) -> int | None:
        """The exit status if the process has ended (and the server reported it), else None (also while it
        starts)."""
        self._server._settle(self)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the process to end; :class:`subprocess.TimeoutExpired` after ``timeout`` seconds."""
        if not self._server._wait_for(self, timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` unless the process has ended (as Popen does); one still being started is waited for."""
        self._server._wait_started(self, self.START_TIMEOUT_S)
        if self.poll() is not None or self._pidfd is None:
            return
        try:
            signal.pidfd_send_signal(self._pidfd, sig)
        except ProcessLookupError:  # ended since the poll: its status is on its way
            pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    # called by the server's reader with the server's condition held
    def _started(self, pid: int) -> None:
        self._pid = pid
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # already ended and reaped: its status is on its way
            self._pidfd = None

    def _not_started(self, reason: str) -> None:
        """The server did not fork it: its status is UNKNOWN_STATUS and ``reason`` goes to its log (where its
        owner looks when it ends)."""
        self._start_error = reason
        self.returncode = UNKNOWN_STATUS
        try:
            with open(self._log, "a") as fh:
                fh.write(f"fedclinic fork server: {reason}\n")
        except OSError:
            pass

    def _ended(self, returncode: int) -> None:
        self.returncode = returncode
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _gone_unreported(self) -> bool:
        """Has the process ended although the server can no longer report its status (it died)?"""
        if self._pidfd is None:
            return True
        readable, _, _ = select.select([self._pidfd], [], [], 0)
        return bool(readable)

    def __repr__(self) -> str:
        return f"<ForkedProcess pid={self._pid} returncode={self.returncode}>"


class ForkServer:
    """Owner of one fork server process (module docstring).

    ``imports``: the modules the server imports before it forks anything (``MOD`` or ``MOD:ATTR`` where ``ATTR``
    is a list of module names, e.g. ``hospital_agent.warm_start:MODULES``); one that fails to import is logged in
    the server's log and skipped (a child then imports it itself, and meets the same error where it belongs).
    ``env``: the environment of the server and so of every child. ``log``: the server's own stderr."""

    def __init__(self, imports: list[str], *, env: dict[str, str], log: Path, cwd: Path,
                 grace_s: float = 20.0) -> None:
        self.imports = list(imports)
        self._log_path = log
        self._lock = threading.Lock()            # requests are written (and queued in _starting) one at a time
        self._changed = threading.Condition()    # a reply or an exit arrived, or the server ended
        self._starting: collections.deque[ForkedProcess] = collections.deque()  # asked for, not yet answered
        self._replies: list[dict[str, Any]] = []  # answers to no request of spawn's (a malformed line's refusal)
        self._children: dict[int, ForkedProcess] = {}
        self._server_gone = False
        self._ready = False
        with open(log, "ab") as err:
            self._proc = subprocess.Popen(
                [sys.executable, "-u", "-m", "fedclinic.federation.fork_server", "--grace", str(grace_s),
                 *[a for mod in self.imports for a in ("--import", mod)]],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, cwd=cwd,
                start_new_session=True)
        self._reader = threading.Thread(target=self._read_replies, name="fork-server-replies", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def wait_ready(self, timeout: float) -> None:
        """Wait until the server has imported its modules (at once when it has); :class:`ForkServerError` if it
        ended or took longer. Not needed before :meth:`spawn`, which queues its request behind the imports."""
        self._await(lambda: self._ready, timeout, "the fork server to import its modules")

    def spawn(self, entry: str, args: list[str], *, log: Path, cwd: Path) -> ForkedProcess:
        """Ask for a child that runs ``entry`` (``package.module:function``, called with ``args``; its return value
        is the exit status), appending its stdout and stderr to ``log``, in ``cwd``. Returns at once, while the
        server may still be importing: the child is forked when the server is ready (``ForkedProcess.pid`` waits
        for that). ForkServerError when the server has already ended."""
        request = {"entry": entry, "args": args, "log": str(log), "cwd": str(cwd)}
        child = ForkedProcess(self, [entry, *args], log)
        with open(log, "ab"):  # the log exists from now on, as a Popen'd process's does (readers may look at once)
            pass
        with self._lock:
            if self._proc.stdin is None or self._proc.stdin.closed or self._server_gone:
                raise ForkServerError(f"the fork server has ended; see {self._log_path}")
            with self._changed:
                self._starting.append(child)  # before the write: the answer may come back at once
            try:
                self._proc.stdin.write((json.dumps(request) + "\n").encode())
                self._proc.stdin.flush()
            except (BrokenPipeError, OSError) as exc:
                with self._changed:
                    self._starting.remove(child)
                raise ForkServerError(f"the fork server has ended ({exc}); see {self._log_path}") from None
        return child

    def close(self, timeout: float = 30) -> None:
        """Close the request pipe: the server stops what still runs (SIGTERM, then SIGKILL after its grace) and
        exits. Stop the children first (``terminate`` and ``wait``) to see how each ended."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)
        self._reader.join(timeout=5)

    # replies ---------------------------------------------------------------------------------------------------
    def _await(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        """Wait until ``done()`` (read under the server's condition, which the reader notifies); ForkServerError
        naming ``what`` when the server ended first or ``timeout`` seconds passed."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not done():
                left = deadline - time.monotonic()
                if self._server_gone:
                    raise ForkServerError(f"the fork server ended (exit status {self._proc.poll()}) while waiting "
                                          f"for {what}; see {self._log_path}")
                if left <= 0:
                    raise ForkServerError(f"timed out after {timeout:g} s waiting for {what}; see {self._log_path}")
                self._changed.wait(left)

    def _reply(self, timeout: float, what: str) -> dict[str, Any]:
        """The next answer that belongs to no request of :meth:`spawn` (e.g. the refusal of a malformed line)."""
        with self._changed:
            self._await(lambda: bool(self._replies), timeout, what)
            return self._replies.pop(0)

    def _read_replies(self) -> None:
        """The server's messages, in order: ``ready`` once, then per request its ``pid`` or ``error`` (requests are
        answered in the order they were written), and ``exited`` for a child that ended (always after its pid)."""
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            message = json.loads(line)
            with self._changed:
                if "exited" in message:
                    child = self._children.get(int(message["exited"]))
                    if child is not None:
                        child._ended(int(message["returncode"]))
                elif "ready" in message:
                    self._ready = True
                elif self._starting and ("pid" in message or "error" in message):
                    child = self._starting.popleft()
                    if "pid" in message:
                        child._started(int(message["pid"]))
                        self._children[int(message["pid"])] = child
                    else:
                        child._not_started(f"could not start {child.args[0]}: {message['error']}")
                else:
                    self._replies.append(message)
                self._changed.notify_all()
        with self._changed:
            self._server_gone = True
            for child in self._starting:
                child._not_started(f"the fork server ended (exit status {self._proc.poll()}) before it started "
                                   f"{child.args[0]}; see {self._log_path}")
            self._starting.clear()
            self._changed.notify_all()

    def _wait_started(self, child: ForkedProcess, timeout: float) -> None:
        """Wait until the server answered ``child``'s request (forked it, or could not: the reader answers every
        pending request when the server ends); ForkServerError after ``timeout`` seconds."""
        self._await(lambda: child not in self._starting, timeout, f"the fork server to start {child.args[0]}")

    def _settle(self, child: ForkedProcess) -> None:
        """Without a server to report it, a child that ended gets :data:`UNKNOWN_STATUS`."""
        with self._changed:
            if child.returncode is None and self._server_gone and child._gone_unreported():
                child._ended(UNKNOWN_STATUS)

    def _wait_for(self, child: ForkedProcess, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while True:
                self._settle(child)
                if child.returncode is not None:
                    return True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                if self._server_gone:  # nobody will notify: look at the pidfd again every 0.1 s
                    left = 0.1 if left is None else min(left, 0.1)
                self._changed.wait(left)


# the server ------------------------------------------------------------------------------------------------------
def _import_all(names: list[str]) -> None:
    for name in names:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
            for sub in (getattr(module, attr) if attr else ()):
                importlib.import_module(sub)
        except Exception as exc:  # noqa: BLE001 - a child imports it again and meets the error where it belongs
            print(f"fork server: could not import {name}: {type(exc).__name__}: {exc}", file=sys.stderr)


def _write(fd: int, message: dict[str, Any]) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


def _status(wait_status: int) -> int:
    """Popen's convention: the exit code, or -N for a process ended by signal N."""
    return os.waitstatus_to_exitcode(wait_status)


def _serve(requests: int, replies: int, grace_s: float) -> dict[str, Any] | None:
    """The server's loop. Returns None when the request pipe closed (after stopping every child), or, in a
    forked child, the request it is to run."""
    children: dict[int, int] = {}  # pidfd -> pid
    pending = b""
    while True:
        readable, _, _ = select.select([requests, *children], [], [])
        for fd in readable:
            if fd in children:
                pid = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                _write(replies, {"exited": pid, "returncode": _status(status)})
                continue
            chunk = os.read(requests, 65536)
            if not chunk:
                _stop_children(children, grace_s)
                return None
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                try:
                    request = json.loads(line)
                    if not isinstance(request, dict) or not {"entry", "args", "log", "cwd"} <= request.keys():
                        raise ValueError("a request names entry, args, log and cwd")
                except ValueError as exc:
                    _write(replies, {"error": f"not a request: {exc}"})
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                try:
                    pid = os.fork()
                except OSError as exc:
                    _write(replies, {"error": f"fork failed: {exc}"})
                    continue
                if pid == 0:
                    for pidfd in children:
                        os.close(pidfd)
                    os.close(requests)
                    os.close(replies)
                    return request
                children[os.pidfd_open(pid)] = pid
                _write(replies, {"pid": pid})


def _stop_children(children: dict[int, int], grace_s: float) -> None:
    for pid in children.values():
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while children:
        left = deadline - time.monotonic()
        readable, _, _ = select.select(list(children), [], [], max(left, 0))
        if not readable:
            for pid in children.values():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            deadline = float("inf")
            continue
        for fd in readable:
            os.waitpid(children.pop(fd), 0)
            os.close(fd)


def _become_child(request: dict[str, Any]) -> int:
    """In the forked child: set the process up as a fresh interpreter would be, then run the entry point."""
    os.setsid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: a child may then outlive a crashed server
        pass
    if os.getppid() == 1:  # the server died between the fork and the prctl
        return UNKNOWN_STATUS
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.chdir(request["cwd"])
    _reseed()
    module_name, _, function = request["entry"].partition(":")
    module = importlib.import_module(module_name)
    sys.argv = [getattr(module, "__file__", module_name) or module_name, *request["args"]]
    result = getattr(module, function)(list(request["args"]))
    return int(result or 0)


def _reseed() -> None:
    """Fresh seeds for the global generators a fork would otherwise share (Python's ``random`` reseeds itself)."""
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedclinic.federation.fork_server",
                                     description="Fork processes from one warm interpreter (for one owner).")
    parser.add_argument("--import", dest="imports", action="append", default=[],
                        help="a module (MOD) or a list of modules (MOD:ATTR) to import before forking")
    parser.add_argument("--grace", type=float, default=20.0,
                        help="seconds the children get to stop after SIGTERM when the request pipe closes")
    args = parser.parse_args(argv)
    # the protocol keeps the pipes on fds of its own; fds 0 and 1 go to /dev/null and the log (stderr)
    requests, replies = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    _import_all(args.imports)
    # what the imports built stays for the children's lifetime: keep it out of their garbage collections (which
    # would otherwise walk it, and touch every page of it: copy-on-write copies)
    gc.collect()
    gc.freeze()
    _write(replies, {"ready": True, "imported": args.imports})
    request = _serve(requests, replies, args.grace)
    if request is None:
        return 0
    return _become_child(request)


if __name__ == "__main__":
    sys.exit(main())
