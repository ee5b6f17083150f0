"""Uploads: an update leaves the site only from the durable outbox, with its idempotency key.

``upload(entry)`` streams one outbox entry (header, tensor chunks read from its file, commit) through
``SubmitUpdate``; on the receipt the task's staged error-feedback residual is committed, the upload audited and
the entry removed. A refused update (any status but UNAVAILABLE, CANCELLED, DEADLINE_EXCEEDED, UNAUTHENTICATED)
is dropped and its staged residual discarded; an interrupted one stays in the outbox (cancelled by the agent
stopping: :class:`~hospital_agent.task_state.Stopped`, never a reason to decline the task). ``upload_with_retries``
repeats on UNAVAILABLE with capped exponential backoff and jitter; ``drain`` resends what the outbox holds (at
start, and after a certificate switch) and discards residuals staged for an update that never reached it.

Resumption: a plain update travels as a resumable upload (``upload_id`` = its idempotency key). When the
connection breaks mid-stream, ``upload`` asks ``QueryUpload`` how many bytes the aggregator holds verified and
sends only the rest (``resume_offset``), up to fedclinic.transport.resume.MAX_RESUMES times per call; an
aggregator that does not know QueryUpload (UNIMPLEMENTED) gets the whole update again. A resumed stream the
aggregator refuses (its kept bytes did not verify, or it holds none) is sent once more from its first byte
before the refusal counts.

Round statements: every update header is sealed with the site's signed round statement
(:class:`StatementSeal`, fedclinic.verification.round_statement) when it is written to the outbox; an entry left
by an older agent without one is sealed (and rewritten) before it is sent.
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
from fedclinic.pki.signed_statement import Signer
from fedclinic.proto import agent_pb2
from fedclinic.transport import resume
from fedclinic.transport.rpc import TlsFiles
from fedclinic.verification.round_statement import sign_header
from fedclinic.transport.wire import CHUNK_BYTES, encode_tensor_chunk_in

from hospital_agent.metrics import AgentMetrics, count_wire_bytes
from hospital_agent.outbox import Outbox, OutboxEntry
from hospital_agent.task_state import Stopped

log = structlog.get_logger("fedclinic.agent")
_UPDATE_TENSOR_FIELD = agent_pb2.UpdateChunk.DESCRIPTOR.fields_by_name["tensor"].number
_FEEDBACK_SUFFIX = ".error-feedback.safetensors"


class Audit(Protocol):
    def __call__(self, kind: str, task_id: str | None = None, **details: object) -> None: ...


def feedback_path(work_dir: Path, task_id: str) -> Path:
    """Where a task's error-feedback residuals (top-k codecs) are kept at the site."""
    return work_dir / "codec-state" / f"{task_id}{_FEEDBACK_SUFFIX}"


class StatementSeal:
    """Signs the site's round statement into an update header (hospital_agent.outbox.Outbox's ``seal``) with the
    site's own key and certificate (read at each call, so a renewed certificate signs from then on). A header that
    already carries a statement is left as it is (a resend states what the first send stated)."""

    def __init__(self, tls: TlsFiles, site: Callable[[], str]) -> None:
        self._signer = Signer(key_path=tls.key, cert_path=tls.cert)
        self._site = site

    def __call__(self, header: agent_pb2.UpdateHeader) -> None:
        if not header.HasField("statement"):
            sign_header(header, self._site(), self._signer)


class Uploader:
    """The outbox's way out: one upload at a time, cancelled by :meth:`cancel` when the agent stops."""

    def __init__(self, outbox: Outbox, work_dir: Path, submit_update: Callable[[], object], metrics: AgentMetrics,
                 audit: Audit, stop_event: threading.Event,
                 query_upload: Callable[[], Callable[..., agent_pb2.QueryUploadResponse]] | None = None) -> None:
        self.outbox = outbox
        self._query_upload = query_upload
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
        wire_bytes = [0]
        try:
            receipt = self._send_resuming(entry, wire_bytes)
        except grpc.FutureCancelledError:  # cancel(): the agent is stopping, not a refusal of the update
            log.warning("upload interrupted by the agent stopping; the update stays in the outbox")
            self.metrics.upload_interruptions.inc()
            raise Stopped("agent is stopping") from None
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

    def _send_resuming(self, entry: OutboxEntry, wire_bytes: list[int]) -> agent_pb2.UpdateReceipt:
        """Send ``entry`` and return its receipt; a cut stream continues from what the aggregator holds (module
        docstring). Raises the last RpcError when it gives up."""
        if not entry.header.HasField("statement") and self.outbox.seal is not None:  # left by an older agent
            entry = self.outbox.put(entry.header, self._payloads(entry))
        h = agent_pb2.UpdateHeader()
        h.CopyFrom(entry.header)
        if not h.secagg_session_id:
            h.upload_id = h.upload_id or h.idempotency_key
        resumes, restarted = 0, False
        while True:
            self.metrics.upload_started(h.task_id)
            try:
                self._call = self._submit_update().future(count_wire_bytes(self.update_stream(entry, h), wire_bytes))
                return self._call.result()
            except grpc.RpcError as exc:
                code = exc.code()
                if (h.upload_id and resume.is_cut(exc) and resumes < resume.MAX_RESUMES
                        and not self.stop_event.is_set()):
                    resumes += 1
                    self.stop_event.wait(min(0.5 * 2 ** resumes, 8.0) * (0.5 + random.random()))
                    h.resume_offset = self._held(h)
                    log.warning("upload cut; resuming from the bytes the aggregator holds", offset=h.resume_offset,
                                attempt=resumes, error=exc.details())
                    self.metrics.upload_resumed(h.task_id)
                    continue
                if h.resume_offset and not restarted and code in (grpc.StatusCode.INVALID_ARGUMENT,
                                                                  grpc.StatusCode.FAILED_PRECONDITION):
                    log.warning("resumed upload refused; sending the update from its first byte", code=code.name,
                                error=exc.details())
                    h.resume_offset, restarted = 0, True
                    continue
                raise
            finally:
                self._call = None

    @staticmethod
    def _payloads(entry: OutboxEntry) -> dict[str, bytes]:
        """The entry's tensors as written (to rewrite it with a sealed header; an older agent's entries only)."""
        data = entry.tensors_path.read_bytes()
        out, start = {}, 0
        for t in entry.header.tensors:
            out[t.name] = data[start:start + int(t.encoded_nbytes)]
            start += int(t.encoded_nbytes)
        return out

    def _held(self, h: agent_pb2.UpdateHeader) -> int:
        """The verified bytes of upload ``h`` the aggregator holds (QueryUpload); 0 when it holds none, does not
        know the call, or cannot be asked."""
        if self._query_upload is None:
            return 0
        try:
            got = self._query_upload()(agent_pb2.QueryUploadRequest(task_id=h.task_id, upload_id=h.upload_id),
                                       timeout=30)
        except grpc.RpcError as exc:
            log.info("could not ask where the upload continues; sending it from its first byte", code=exc.code().name)
            return 0
        total = sum(int(t.encoded_nbytes) for t in h.tensors)
        return int(got.verified_nbytes) if 0 <= got.verified_nbytes <= total else 0

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
    def update_stream(entry: OutboxEntry, header: agent_pb2.UpdateHeader | None = None) -> Iterator[bytes]:
        """Header (``header``, default the entry's), tensor chunks read from the outbox file (one copy each, see
        wire.py) from byte ``header.resume_offset`` of the update (tensors back to back; a tensor ending at or
        before it is skipped), commit (the whole update's size)."""
        h = header if header is not None else entry.header
        yield agent_pb2.UpdateChunk(header=h).SerializeToString()
        total = sum(int(t.encoded_nbytes) for t in h.tensors)
        buf = bytearray(CHUNK_BYTES)
        view = memoryview(buf)
        start = 0
        with open(entry.tensors_path, "rb", buffering=0) as fh:
            for t in h.tensors:
                size, start = int(t.encoded_nbytes), start + int(t.encoded_nbytes)
                offset = max(0, h.resume_offset - (start - size))
                if offset >= size and (size or start - size < h.resume_offset):
                    continue  # held by the aggregator already
                fh.seek(start - size + offset)
                remaining = size - offset
                while True:
                    n = fh.readinto(view[:min(CHUNK_BYTES, remaining)]) if remaining else 0
                    failpoint("agent.upload.chunk")
                    yield encode_tensor_chunk_in(_UPDATE_TENSOR_FIELD, t.name, t if offset == 0 else None, offset,
                                                 view[:n])
                    offset += n
                    remaining -= n
                    if remaining <= 0:
                        break
        yield agent_pb2.UpdateChunk(commit=agent_pb2.UpdateCommit(total_encoded_nbytes=total)).SerializeToString()
