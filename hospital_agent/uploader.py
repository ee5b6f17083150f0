"""Uploads: an update leaves the site only from the durable outbox, with its idempotency key.

``upload(entry)`` streams one outbox entry (header, tensor chunks read from its file, commit) through
``SubmitUpdate``; on the receipt the task's staged error-feedback residual is committed, the upload audited and
the entry removed. A refused update (any status but UNAVAILABLE, CANCELLED, DEADLINE_EXCEEDED, UNAUTHENTICATED)
is dropped and its staged residual discarded; an interrupted one stays in the outbox. ``upload_with_retries``
repeats on UNAVAILABLE with capped exponential backoff and jitter; ``drain`` resends what the outbox holds (at
start, and after a certificate switch) and discards residuals staged for an update that never reached it.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Callable, Iterator, Protocol

import grpc
import structlog

from fedclinic.runtime.audit_log import update_digest
from fedclinic.codecs import ErrorFeedback
from fedclinic.runtime.failpoints import failpoint
from fedclinic.proto import agent_pb2
from fedclinic.transport.wire import CHUNK_BYTES, encode_tensor_chunk_in

from hospital_agent.metrics import AgentMetrics, count_wire_bytes
from hospital_agent.outbox import Outbox, OutboxEntry

log = structlog.get_logger("fedclinic.agent")
_UPDATE_TENSOR_FIELD = agent_pb2.UpdateChunk.DESCRIPTOR.fields_by_name["tensor"].number
_FEEDBACK_SUFFIX = ".error-feedback.safetensors"


class Audit(Protocol):
    def __call__(self, kind: str, task_id: str | None = None, **details: object) -> None: ...


def feedback_path(work_dir: Path, task_id: str) -> Path:
    """Where a task's error-feedback residuals (top-k codecs) are kept at the site."""
    return work_dir / "codec-state" / f"{task_id}{_FEEDBACK_SUFFIX}"


class Uploader:
    """The outbox's way out: one upload at a time, cancelled by :meth:`cancel` when the agent stops."""

    def __init__(self, outbox: Outbox, work_dir: Path, submit_update: Callable[[], object], metrics: AgentMetrics,
                 audit: Audit, stop_event: threading.Event) -> None:
        self.outbox = outbox
        self.work_dir = work_dir
        self._submit_update = submit_update
        self.metrics = metrics
        self.audit = audit
        self.stop_event = stop_event
        #: (task, round) acknowledged (or refused for good) by the aggregator: never trained or sent again
        self.sent: set[tuple[str, int]] = set()
        self._call = None

    def cancel(self) -> None:
        call = self._call
        if call is not None:
            call.cancel()

    def drain(self) -> None:
        for entry in self.outbox.entries():
            structlog.contextvars.bind_contextvars(task_id=entry.header.task_id, round=entry.header.round)
            try:  # the upload's own log lines (acknowledged, refused, interrupted) carry the task and round too
                log.info("resending an update left in the outbox")
                self.upload_with_retries(entry)
            finally:
                structlog.contextvars.unbind_contextvars("task_id", "round")
        waiting = {e.header.task_id for e in self.outbox.entries()}
        folder = self.work_dir / "codec-state"
        for path in sorted(folder.glob("*" + _FEEDBACK_SUFFIX)) if folder.is_dir() else []:
            task_id = path.name[:-len(_FEEDBACK_SUFFIX)]
            if task_id not in waiting:  # staged for an update that never reached the outbox: it was not sent
                self.settle_feedback(task_id, delivered=False)

    def upload_with_retries(self, entry: OutboxEntry) -> None:
        backoff = 1.0
        while not self.stop_event.is_set():
            try:
                self.upload(entry)
                return
            except grpc.RpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
                    return
                self.stop_event.wait(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, 30.0)

    def upload(self, entry: OutboxEntry) -> None:
        h = entry.header
        try:
            self.metrics.upload_started(h.task_id)
            wire_bytes = [0]
            self._call = self._submit_update().future(count_wire_bytes(self.update_stream(entry), wire_bytes))
            receipt = self._call.result()
        except grpc.RpcError as exc:
            code = exc.code()
            # RESOURCE_EXHAUSTED: a limit of the aggregator (concurrent uploads, its disk), not a verdict on the update
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
                        grpc.StatusCode.RESOURCE_EXHAUSTED):
                log.warning("upload interrupted; the update stays in the outbox", error=exc.details())
                self.metrics.upload_interruptions.inc()
                raise
            if code == grpc.StatusCode.UNAUTHENTICATED:  # this site's certificate was refused, not the update
                log.error("the aggregator refused this site's certificate; the update stays in the outbox and is sent "
                          "again once a renewed certificate is installed", error=exc.details())
                self.metrics.refused(code.name)
                raise
            log.error("update refused by the aggregator; dropping it", code=code.name, error=exc.details())
            self.metrics.refused(code.name)
            self.settle_feedback(h.task_id, delivered=False)
            self.sent.add((h.task_id, h.round))
            self.outbox.remove(entry)
            return
        finally:
            self._call = None
        failpoint("agent.after-receipt")
        self.settle_feedback(h.task_id, delivered=True)  # before the outbox entry goes: a crash resends, then commits
        self.metrics.acknowledged(h.task_id, receipt.duplicate, sum(int(t.encoded_nbytes) for t in h.tensors),
                                  wire_bytes[0])
        self.audit("update.sent", h.task_id, round=h.round, update_id=receipt.update_id, duplicate=receipt.duplicate,
                   size=sum(int(t.encoded_nbytes) for t in h.tensors), sha256=update_digest(h.tensors),
                   masked=bool(h.secagg_session_id))
        self.sent.add((h.task_id, h.round))
        self.outbox.remove(entry)
        log.info("update acknowledged", update_id=receipt.update_id, duplicate=receipt.duplicate,
                 nbytes=receipt.stored_nbytes)

    def settle_feedback(self, task_id: str, delivered: bool) -> None:
        """The aggregator acknowledged (``delivered``) or refused the update: commit or drop its staged
        error-feedback residual (no-op for codecs without one)."""
        path = feedback_path(self.work_dir, task_id)
        if not path.exists():
            return
        feedback = ErrorFeedback.load(path)
        if not feedback.pending:
            return
        feedback.commit() if delivered else feedback.discard()
        feedback.save(path)
        log.info("error-feedback residual " + ("committed" if delivered else "discarded"), task_id=task_id,
                 tensors=len(feedback.names))

    @staticmethod
    def update_stream(entry: OutboxEntry) -> Iterator[bytes]:
        """Header, tensor chunks read from the outbox file (one copy each, see wire.py), commit."""
        yield agent_pb2.UpdateChunk(header=entry.header).SerializeToString()
        total = 0
        buf = bytearray(CHUNK_BYTES)
        view = memoryview(buf)
        with open(entry.tensors_path, "rb", buffering=0) as fh:
            for t in entry.header.tensors:
                remaining = t.encoded_nbytes
                offset = 0
                while True:
                    n = fh.readinto(view[:min(CHUNK_BYTES, remaining)]) if remaining else 0
                    failpoint("agent.upload.chunk")
                    yield encode_tensor_chunk_in(_UPDATE_TENSOR_FIELD, t.name, t if offset == 0 else None, offset,
                                                 view[:n])
                    offset += n
                    remaining -= n
                    total += n
                    if remaining <= 0:
                        break
        yield agent_pb2.UpdateChunk(commit=agent_pb2.UpdateCommit(total_encoded_nbytes=total)).SerializeToString()
