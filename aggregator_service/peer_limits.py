"""Per-peer limits on every call of every service: what one certificate may hold of the aggregator.

:class:`PeerLimits` is a server interceptor, listed after the auth interceptor (so the caller's certificate
identity is known and valid). For each call it

1. classifies the method (:data:`METHOD_CLASS`: work stream, upload, download, unary) and takes a slot of the
   caller's identity (role and name) in that class, and for the three long-lived classes one of the global
   long-lived slots (``max_workers - unary_reserve``, so unary calls always find a worker thread); a call over
   either limit is refused at once with RESOURCE_EXHAUSTED and a message that says what to do. The slot is
   given back when the call ends (a streaming response: when its generator is closed);
2. applies the field limits (:class:`~aggregator_service.field_limits.FieldLimits`) to the request, or to each
   message of a request stream, before the handler sees it;
3. puts a request stream under the idle watchdog (:class:`~aggregator_service.idle_watch.IdleWatch`).

Refusals are counted with ``count(kind)`` (the metrics): ``concurrency``, ``long_lived``, ``field``, ``idle``.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Callable, Iterator

import grpc
import structlog

from fedclinic.errors import Refused
from fedclinic.pki import PkiError
from fedclinic.transport.handler_wrapping import rewrap
from fedclinic.transport.request_parsing import UNPARSABLE

from aggregator_service.auth import peer_identity
from aggregator_service.field_limits import FieldLimits
from aggregator_service.idle_watch import IdleWatch
from aggregator_service.limits import Limits

log = structlog.get_logger("fedclinic.aggregator.limits")

WORK, UPLOAD, DOWNLOAD, UNARY = "work stream", "upload", "download", "unary call"
#: the class of every method; a method not listed is classed by its shape (request stream: upload, response
#: stream: work stream, else unary)
METHOD_CLASS: dict[str, str] = {
    "/fedclinic.v1.AgentService/WatchWork": WORK,
    "/fedclinic.v1.Control/WatchTask": WORK,
    "/grpc.health.v1.Health/Watch": WORK,
    "/fedclinic.v1.AgentService/SubmitUpdate": UPLOAD,
    "/fedclinic.v1.Control/SubmitTask": UPLOAD,
    "/fedclinic.v1.AgentService/FetchModel": DOWNLOAD,
    "/fedclinic.v1.Control/FetchModel": DOWNLOAD,
    "/fedclinic.v1.Control/FetchTaskBlob": DOWNLOAD,
}
_WHAT_TO_DO = {WORK: "close one (an agent needs one work stream) before opening another",
               UPLOAD: "wait for one to finish, then retry",
               DOWNLOAD: "wait for one to finish, then retry",
               UNARY: "wait for an answer before sending more, then retry"}


class PeerLimits(grpc.ServerInterceptor):
    """The per-peer limits interceptor (module docstring)."""

    def __init__(self, limits: Limits, max_workers: int, count: Callable[[str], None] | None = None) -> None:
        self.limits = limits
        self.long_lived_cap = limits.long_lived_cap(max_workers)
        self.fields = FieldLimits(limits)
        self.count = count or (lambda _kind: None)
        self.idle = IdleWatch(limits.idle_timeout_s, on_idle=lambda _m, _p: self.count("idle"))
        self.per_peer = {WORK: limits.work_streams_per_peer, UPLOAD: limits.uploads_per_peer,
                         DOWNLOAD: limits.downloads_per_peer, UNARY: limits.unary_per_peer}
        self._lock = threading.Lock()
        self._held: Counter[tuple[str, str]] = Counter()
        self._long_lived = 0

    # slots -------------------------------------------------------------------------------------------------
    def held(self, peer: str, kind: str) -> int:
        """Calls of class ``kind`` that ``peer`` ("role name") holds now."""
        with self._lock:
            return self._held[(peer, kind)]

    def acquire(self, peer: str, kind: str) -> None:
        """Take a slot of ``peer`` in class ``kind`` (and a long-lived one); Refused RESOURCE_EXHAUSTED if full."""
        limit = self.per_peer[kind]
        with self._lock:
            if self._held[(peer, kind)] >= limit:
                self.count("concurrency")
                raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"at most {limit} concurrent {kind}s per certificate ({peer}) are allowed and this one "
                              f"holds {limit}; {_WHAT_TO_DO[kind]}")
            if kind != UNARY and self._long_lived >= self.long_lived_cap:
                self.count("long_lived")
                raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"the aggregator holds its maximum of {self.long_lived_cap} streams and transfers of all "
                              "peers; retry in a little while (its operator can raise max_workers)")
            self._held[(peer, kind)] += 1
            if kind != UNARY:
                self._long_lived += 1

    def release(self, peer: str, kind: str) -> None:
        with self._lock:
            self._held[(peer, kind)] -= 1
            if self._held[(peer, kind)] <= 0:
                del self._held[(peer, kind)]
            if kind != UNARY:
                self._long_lived -= 1

    # the interceptor ---------------------------------------------------------------------------------------
    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        kind = METHOD_CLASS.get(method) or (UPLOAD if handler.request_streaming else
                                            WORK if handler.response_streaming else UNARY)
        return _wrap(self, handler, method, kind)

    def begin(self, context: grpc.ServicerContext, kind: str) -> "_Slot":
        """Take the call's slot (abort RESOURCE_EXHAUSTED if none)."""
        try:
            ident = peer_identity(context)
            peer = f"{ident.role} {ident.name}"
        except PkiError:  # the auth interceptor refuses such a call before it gets here
            peer = "unauthenticated"
        try:
            self.acquire(peer, kind)
        except Refused as exc:
            log.warning("call refused: limit", peer=peer, kind=kind, reason=exc.message)
            context.abort(exc.code, exc.message)
        return _Slot(self, peer, kind)

    def checked(self, message, context: grpc.ServicerContext):
        """``message`` within the field limits (free text truncated), or the call aborted INVALID_ARGUMENT."""
        if message is UNPARSABLE:  # refused by the parse check (fedclinic.transport.request_parsing)
            return message
        try:
            self.fields.apply(message)
        except Refused as exc:
            self.count("field")
            context.abort(exc.code, exc.message)
        return message

    def request_stream(self, messages: Iterator, context: grpc.ServicerContext, method: str,
                       slot: "_Slot") -> Iterator:
        for message in self.idle.watch(messages, context, method, slot.peer, before_end=slot.release):
            yield self.checked(message, context)


class _Slot:
    """One call's slot; :meth:`release` frees it once, whichever comes first: the handler's end, or the idle
    watchdog ending the call (before the caller sees the status, so its retry finds the slot free)."""

    def __init__(self, limits: PeerLimits, peer: str, kind: str) -> None:
        self.limits, self.peer, self.kind = limits, peer, kind
        self._released = False
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self.limits.release(self.peer, self.kind)


def _wrap(limits: PeerLimits, handler: grpc.RpcMethodHandler, method: str, kind: str) -> grpc.RpcMethodHandler:
    def request_of(request, context, slot):
        if handler.request_streaming:
            return limits.request_stream(request, context, method, slot)
        return limits.checked(request, context)

    def unary(behavior):
        def inner(request, context):
            slot = limits.begin(context, kind)
            try:
                return behavior(request_of(request, context, slot), context)
            finally:
                slot.release()
        return inner

    def streaming(behavior):
        def inner(request, context):
            slot = limits.begin(context, kind)
            try:
                responses = behavior(request_of(request, context, slot), context)
                try:
                    yield from responses
                finally:
                    close = getattr(responses, "close", None)
                    if close is not None:
                        close()
            finally:
                slot.release()
        return inner

    return rewrap(handler, unary=unary, streaming=streaming)
