"""Ends client streams that send nothing for too long: one watchdog thread for all calls.

A request iterator wrapped by :meth:`IdleWatch.watch` arms a deadline while the handler waits for the caller's
next message and disarms it when the message arrives (time the handler spends on a message does not count).
When a deadline passes, the call is cancelled with DEADLINE_EXCEEDED and a message saying what happened: the
handler thread blocked in ``next()`` is released at once (its read raises ``grpc.RpcError``), so the handler's
own cleanup runs (a partial update's spill file, a submission's blob writers) and the worker thread is free.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterator, TypeVar

import grpc
import structlog
from grpc._cython import cygrpc  # the call's own cancel-with-status (grpc_call_cancel_with_status)

log = structlog.get_logger("fedclinic.aggregator.limits")

T = TypeVar("T")


def end_call(context: grpc.ServicerContext, message: str) -> None:
    """Cancel the call now with DEADLINE_EXCEEDED and ``message`` (from any thread). gRPC's public
    ``ServicerContext.cancel`` can only send CANCELLED; the call object underneath can send a status, and is
    used when present."""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    try:
        call.cancel(cygrpc.StatusCode.deadline_exceeded, message)
    except Exception:  # noqa: BLE001 - another gRPC build: the public cancel (the caller sees CANCELLED)
        context.cancel()


class IdleWatch:
    """The watchdog (module docstring). ``on_idle(method, peer)`` is called for each call it ends."""

    def __init__(self, idle_timeout_s: float, on_idle: Callable[[str, str], None] | None = None) -> None:
        self.idle_timeout_s = idle_timeout_s
        self.on_idle = on_idle
        self._lock = threading.Condition()
        self._armed: dict[int, tuple] = {}  # token -> (deadline, context, method, peer, before_end)
        self._next_token = 0
        self._thread: threading.Thread | None = None

    def watch(self, messages: Iterator[T], context: grpc.ServicerContext, method: str, peer: str,
              before_end: Callable[[], None] | None = None) -> Iterator[T]:
        """``messages`` with the idle deadline armed while each next message is awaited; ``before_end`` is
        called (on the watchdog thread) just before an idle call is ended."""
        with self._lock:
            self._next_token += 1
            token = self._next_token
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="idle-watch", daemon=True)
                self._thread.start()
        try:
            while True:
                self._arm(token, context, method, peer, before_end)
                try:
                    message = next(messages)
                except StopIteration:
                    return
                finally:
                    self._disarm(token)
                yield message
        finally:
            self._disarm(token)

    def _arm(self, token: int, context, method: str, peer: str, before_end) -> None:
        with self._lock:
            self._armed[token] = (time.monotonic() + self.idle_timeout_s, context, method, peer, before_end)
            self._lock.notify()

    def _disarm(self, token: int) -> None:
        with self._lock:
            self._armed.pop(token, None)

    def _run(self) -> None:
        while True:
            expired = []
            with self._lock:
                now = time.monotonic()
                for token, (deadline, context, method, peer, before_end) in list(self._armed.items()):
                    if deadline <= now:
                        expired.append((context, method, peer, before_end))
                        del self._armed[token]
                soonest = min((d for d, *_ in self._armed.values()), default=now + 3600)
                if not expired:
                    self._lock.wait(max(0.01, soonest - now))
            for context, method, peer, before_end in expired:
                log.warning("idle stream ended", method=method, peer=peer, idle_timeout_s=self.idle_timeout_s)
                if before_end is not None:
                    before_end()
                end_call(context, f"this stream sent nothing for {self.idle_timeout_s:g} s and was ended by the "
                                  "aggregator (idle timeout); nothing of it was kept. Send the whole stream without "
                                  "pausing, and retry")
                if self.on_idle is not None:
                    self.on_idle(method, peer)
