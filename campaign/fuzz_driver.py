"""Firing fuzz cases at the rig and judging the answers.

:class:`CaseFirer` sends each :class:`~campaign.fuzz_cases.RpcCase` on the caller identity's channel (requests as
wire bytes, so a damaged message reaches the server's parser) or each :class:`~campaign.fuzz_http.HttpCase` over
a socket, from a small thread pool (server-streaming calls wait on their deadline), and counts the answers per
service, per identity and per status. What counts as a **finding**:

- gRPC status ``UNKNOWN`` or ``INTERNAL`` (an exception no handler mapped), an HTTP 5xx;
- a call with a request the server must answer (unary or client-streaming) still running at its deadline
  (``DEADLINE_EXCEEDED``), an HTTP request with no answer within its deadline; a server-streaming call
  (WatchWork, WatchTask, FetchModel) may run into its short deadline: that is its normal end here;
- ``UNAVAILABLE`` is a finding only if the process is then found dead (checked after each batch, with new
  tracebacks in its log).

``RESOURCE_EXHAUSTED``, ``PERMISSION_DENIED``, ``INVALID_ARGUMENT`` and the rest are normal refusals.
"""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import grpc

from campaign.fuzz_cases import RpcCase
from campaign.fuzz_http import HttpCase, send
from campaign.fuzz_rig import IDENTITIES

#: deadlines (s): a call that must be answered, a server stream read for at most STREAM_ITEMS messages
CALL_DEADLINE = 20.0
STREAM_DEADLINE = 0.5
STREAM_ITEMS = 3
FINDING_CODES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
#: HTTP answers that are findings: an unhandled exception (500) or none within the deadline; 501 (a method
#: the server does not implement), 505, 4xx and a closed connection without a status line (an HTTP/0.9-style
#: or unparseable request line) are refusals
HTTP_FINDINGS = {"500", "timeout"}


def _identity(b: bytes) -> bytes:
    return b


class _Abort(Exception):
    """Raised by a request iterator: the client cancels its stream there."""


def _requests(case: RpcCase):
    for i, r in enumerate(case.requests):
        if case.abort_after is not None and i == case.abort_after:
            raise _Abort()
        yield r


class CaseFirer:
    """Fires cases and keeps the counts and findings (module docstring)."""

    def __init__(self, channels: dict[str, dict[str, grpc.Channel]], http_port: int, workers: int = 12) -> None:
        #: service ("agent", "control", "inference") -> identity -> channel
        self.channels = channels
        self.http_port = http_port
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fuzz")
        self._slots = threading.BoundedSemaphore(workers * 2)
        self._lock = threading.Lock()
        self.cases: Counter = Counter()            # service -> cases
        self.by_role: Counter = Counter()          # (service, role) -> cases
        self.statuses: Counter = Counter()         # (service, status) -> count
        #: "service: what happened" -> [count, one case that did it]
        self.findings: dict[str, list] = {}
        #: called with (update_id, task_id, round, site) for each acknowledged, non-duplicate update receipt
        self.on_ack: Callable[[str, str, int, str], None] | None = None
        self._callables: dict[tuple, Callable] = {}

    # firing -----------------------------------------------------------------------------------------------
    def fire(self, case: RpcCase | HttpCase) -> None:
        """Queue ``case`` (blocks while the pool is full)."""
        self._slots.acquire()
        future = self.pool.submit(self._run, case)
        future.add_done_callback(lambda _f: self._slots.release())

    def drain(self) -> None:
        """Wait until every queued case has been answered."""
        for _ in range(self._slots._initial_value):  # type: ignore[attr-defined]
            self._slots.acquire()
        for _ in range(self._slots._initial_value):  # type: ignore[attr-defined]
            self._slots.release()

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def _run(self, case: RpcCase | HttpCase) -> None:
        try:
            if isinstance(case, HttpCase):
                status = send(self.http_port, case)
                bad = status in HTTP_FINDINGS
                self._record("http", "none", status, case, finding=(f"HTTP {status}", case.describe()) if bad else None)
            else:
                self._run_rpc(case)
        except Exception as exc:  # noqa: BLE001 - a fuzzer bug must show, not kill the pool thread silently
            self._record(getattr(case, "service", "http"), "?", "fuzzer-error", case,
                         finding=(f"the fuzzer itself failed: {type(exc).__name__}: {exc}", ""))

    def _callable(self, case: RpcCase) -> Callable:
        key = (case.service, case.identity, case.method)
        fn = self._callables.get(key)
        if fn is None:
            ch = self.channels[case.service][case.identity]
            kind = {(False, False): ch.unary_unary, (False, True): ch.unary_stream,
                    (True, False): ch.stream_unary, (True, True): ch.stream_stream}[
                (case.request_stream, case.response_stream)]
            fn = kind(case.method, request_serializer=_identity, response_deserializer=_identity)
            self._callables[key] = fn
        return fn

    def _run_rpc(self, case: RpcCase) -> None:
        fn = self._callable(case)
        try:
            if case.response_stream:
                call = fn(case.requests[0], timeout=STREAM_DEADLINE)
                try:
                    for i, _ in enumerate(call):
                        if i + 1 >= STREAM_ITEMS:
                            break
                finally:
                    call.cancel()
                code = grpc.StatusCode.OK
            elif case.request_stream:
                reply = fn(_requests(case), timeout=CALL_DEADLINE)
                code = grpc.StatusCode.OK
                self._maybe_ack(case, reply)
            else:
                fn(case.requests[0], timeout=CALL_DEADLINE)
                code = grpc.StatusCode.OK
            details = ""
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
        finding = None
        status = code.name
        if case.abort_after is not None and code == grpc.StatusCode.UNKNOWN and "iterating requests" in details:
            status = "CANCELLED by the client"  # our request iterator raised: grpc cancels the call client-side
        elif code in FINDING_CODES:
            finding = (f"{code.name} {details[:120]!r} from {case.method}", case.describe())
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED and not case.response_stream:
            finding = (f"no answer within {CALL_DEADLINE:g} s (a hang) from {case.method}", case.describe())
        self._record(case.service, IDENTITIES.get(case.identity, case.identity), status, case, finding)

    def _maybe_ack(self, case: RpcCase, reply: bytes) -> None:
        if case.method.endswith("/SubmitUpdate") and self.on_ack is not None:
            from fedclinic.proto import agent_pb2

            receipt = agent_pb2.UpdateReceipt.FromString(reply)
            if receipt.update_id and not receipt.duplicate:
                header = None
                for raw in case.requests:
                    try:
                        chunk = agent_pb2.UpdateChunk.FromString(raw)
                    except Exception:  # noqa: BLE001 - a damaged chunk: not the header the server took
                        continue
                    if chunk.WhichOneof("item") == "header":
                        header = chunk.header
                        break
                task = header.task_id if header is not None else "?"
                self.on_ack(receipt.update_id, task, receipt.round, case.identity)

    def _record(self, service: str, role: str, status: str, case, finding: tuple[str, str] | None) -> None:
        with self._lock:
            self.cases[service] += 1
            self.by_role[(service, role)] += 1
            self.statuses[(service, status)] += 1
            if finding is not None:
                entry = self.findings.setdefault(f"{service}: {finding[0]}", [0, finding[1]])
                entry[0] += 1

    def finding_lines(self) -> list[str]:
        """One line per kind of finding: how often, and one case that did it."""
        return [f"{what} ({n}x), e.g. {example}" for what, (n, example) in
                sorted(self.findings.items(), key=lambda kv: -kv[1][0])]
