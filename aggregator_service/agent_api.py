"""AgentService: what hospital agents call. The site id is the name in the caller's certificate."""

from __future__ import annotations

import time
from typing import Iterator

import grpc
import numpy as np
import structlog

import fedclinic
from fedclinic.codecs import available_codecs
from fedclinic.errors import IntegrityError, Refused
from fedclinic.proto import agent_pb2, agent_pb2_grpc, tensors_pb2
from fedclinic.transport.wire import ChunkAssembler

from aggregator_service.audit_trail import NoAudit
from aggregator_service.auth import peer_identity
from aggregator_service.engine import Engine
from aggregator_service.model_streams import stream_task_model
from aggregator_service.results import FEATURE as RESULTS_FEATURE
from aggregator_service.secure_rounds import FEATURE as SECAGG_FEATURE
from aggregator_service.status import latest_model_hash
from aggregator_service.task_records import task_records
from aggregator_service.update_admission import GRPC_MESSAGE_PREFIX, read_update_stream

log = structlog.get_logger("fedclinic.aggregator.agents")

ACCEPTED_CODECS = ["raw", *available_codecs()]  # update codecs this aggregator decodes (fedclinic.codecs)


def abort(context: grpc.ServicerContext, exc: Refused) -> None:
    """End the call with the refusal's status code and message."""
    context.abort(exc.code, exc.message)


class AgentApi(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self, engine: Engine, heartbeat_s: float = 15.0, audit=None) -> None:
        self.engine = engine
        self.heartbeat_s = heartbeat_s
        self.audit = audit or NoAudit()  # aggregator_service.audit_trail.AuditTrail

    def Hello(self, request: agent_pb2.HelloRequest, context) -> agent_pb2.HelloResponse:
        site = peer_identity(context).name
        if request.protocol_version != fedclinic.PROTOCOL_VERSION:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"agent speaks protocol v{request.protocol_version}, this aggregator speaks "
                          f"v{fedclinic.PROTOCOL_VERSION}; upgrade the older side")
        caps = request.capabilities
        self.engine.hello(site, caps.features, caps.secure_aggregation, caps.codecs)
        log.info("agent hello", site=site, agent_version=request.agent_version, devices=list(caps.devices),
                 features=list(caps.features), codecs=list(caps.codecs))
        return agent_pb2.HelloResponse(protocol_version=fedclinic.PROTOCOL_VERSION,
                                       aggregator_version=fedclinic.__version__, site_id=site, codecs=ACCEPTED_CODECS,
                                       features=[SECAGG_FEATURE, RESULTS_FEATURE])

    def WatchWork(self, request: agent_pb2.WatchWorkRequest, context) -> Iterator[agent_pb2.WorkItem]:
        site = peer_identity(context).name
        delivered: dict[tuple[str, int, int], bool] = {}
        secagg_cursor = [0]  # the last secure-aggregation phase message this stream delivered
        ended = self.engine.ended_work(site, list(request.open_tasks))  # a site away when its tasks ended
        self.engine.site_connected(site)
        self.audit.record("site.connected", actor=site)
        log.info("work stream opened", site=site)
        last_beat = 0.0
        try:
            yield from ended
            while context.is_active() and not self.engine.stopping:
                items = self.engine.next_work(site, delivered) + self.engine.secagg.pending(site, secagg_cursor)
                yield from items
                now = time.monotonic()
                if now - last_beat >= self.heartbeat_s:
                    yield agent_pb2.WorkItem(heartbeat=agent_pb2.Heartbeat(unix_ms=int(time.time() * 1000)))
                    last_beat = now
                if not items:
                    self.engine.wait_for_change(timeout=min(self.heartbeat_s, 1.0))
        finally:
            self.engine.site_disconnected(site)
            self.audit.record("site.disconnected", actor=site)
            log.info("work stream closed", site=site)

    def FetchModel(self, request: agent_pb2.FetchModelRequest, context) -> Iterator[tensors_pb2.ModelChunk]:
        """Stream a model of the task to a site assigned to it: only the task's own models and blobs
        (aggregator_service.model_streams), each verified as it is read."""
        site = peer_identity(context).name
        store = self.engine.store
        assigned = store.is_assigned(request.task_id, site)
        model_hash = latest_model_hash(store, request.task_id) if request.latest else request.model_hash
        if assigned and request.latest and not model_hash:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"task {request.task_id} has finished no round yet; there is no model to fetch")
        not_found = (f"model {model_hash[:12] or '(latest)'} of task {request.task_id} is not available to {site}; "
                     "models are served only to sites assigned to the task, and only the task's own models")
        if not assigned or model_hash not in store.task_models(request.task_id):
            context.abort(grpc.StatusCode.NOT_FOUND, not_found)
        deltas = store.model_deltas(model_hash) if request.delta_names else {}
        unknown = sorted(set(request.delta_names) - set(deltas))
        if unknown:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"model {model_hash[:12]} has no encoded change for {unknown[:3]}; ask only for the tensors "
                          "the assignment's downlink_deltas list")
        counter, wire = [0], [0]
        complete = False
        try:
            yield from stream_task_model(self.engine, context, request.task_id, model_hash, not_found=not_found,
                                         have=set(request.have_sha256), include_files=request.include_files,
                                         counter=counter, deltas={n: deltas[n] for n in request.delta_names},
                                         wire=wire, resume=(request.resume_tensor, request.resume_offset))
            complete = True
        finally:
            self.engine.add_downlink(request.task_id, counter[0], site=site, wire_bytes=wire[0])
            self.audit.record("model.downloaded", actor=site, task_id=request.task_id, model_hash=model_hash,
                              bytes=counter[0], complete=complete)

    def SubmitUpdate(self, request_iterator, context) -> agent_pb2.UpdateReceipt:
        """Receive one update (or masked input); its outcome and duration go to the metrics."""
        started = time.monotonic()
        outcome = "interrupted"
        try:
            receipt = self._submit_update(request_iterator, context)
            outcome = "duplicate" if receipt.duplicate else "accepted"
            return receipt
        except BaseException:
            code = context.code()  # set by context.abort; None when the stream broke first
            if code is not None:
                outcome = code.name.lower()
            raise
        finally:
            self.engine.metrics.update_answered(outcome, time.monotonic() - started)

    def _submit_update(self, request_iterator, context) -> agent_pb2.UpdateReceipt:
        site = peer_identity(context).name
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("item") != "header":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "an update stream must start with its UpdateHeader")
        h = first.header
        if not h.idempotency_key or len(h.idempotency_key) > 255:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "idempotency_key must be 1-255 characters")
        if h.secagg_session_id:
            return self._masked_input(site, h, request_iterator, context)
        try:
            return self.engine.submit_update(site, h, request_iterator, first.ByteSize() + GRPC_MESSAGE_PREFIX)
        except Refused as exc:
            abort(context, exc)

    def _masked_input(self, site: str, h: agent_pb2.UpdateHeader, request_iterator, context) -> agent_pb2.UpdateReceipt:
        """A secure-aggregation masked input: one tensor in the session's ring (uint16/32/64), assembled in memory (verified chunk by chunk and
        by sha256 like any update), then folded into the round's session. Idempotent per key while the session
        lives; the session (and so the record) is in memory only."""
        try:
            prior = self.engine.secagg.existing_masked(site, h)
            if prior is not None:
                log.info("duplicate masked input acknowledged", site=site, task_id=h.task_id, round=h.round)
                return agent_pb2.UpdateReceipt(update_id=prior, duplicate=True, round=h.round)
            length = self.engine.secagg.check_masked_header(site, h)
            self.engine.admission.check_statement(site, h)
        except Refused as exc:
            abort(context, exc)
        sink = _ArraySink(np.empty(length, dtype=np.dtype(h.tensors[0].dtype)))  # the session's ring, checked above
        assembler = ChunkAssembler(lambda _h: sink, expect={t.name: t for t in h.tensors})
        try:
            read_update_stream(request_iterator, assembler, "the masked-input stream", "nothing was used")
        except IntegrityError as exc:
            log.warning("masked input rejected", site=site, task_id=h.task_id, round=h.round, reason=str(exc))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"masked input rejected: {exc}")
        if h.HasField("statement"):  # kept before the input is used: the round may close soon after
            with self.engine.store.transaction() as tx:
                tx.record_statement(h.task_id, h.round, h.attempt, site, self.engine.admission.statement_bytes(h))
        try:
            update_id = self.engine.secagg.accept_masked(site, h, sink.array, assembler.nbytes)
        except Refused as exc:
            abort(context, exc)
        self.engine.metrics.masked_input_stored(h.task_id, site)
        return agent_pb2.UpdateReceipt(update_id=update_id, duplicate=False, stored_nbytes=assembler.nbytes,
                                       round=h.round)

    def GetTaskRecords(self, request, context):
        """A task's public round records for a site that was assigned to it (aggregator_service.task_records; no
        update is readable by a site)."""
        site = peer_identity(context).name
        if not self.engine.store.is_assigned(request.task_id, site):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"site {site} was never assigned task "
                                                             f"{request.task_id[:64]!r}; a site reads the records of "
                                                             "its own tasks only")
        return task_records(self.engine.store, request.task_id, max(1, request.first_round), updates_readable=False)

    def QueryUpload(self, request: agent_pb2.QueryUploadRequest, context) -> agent_pb2.QueryUploadResponse:
        """Where the caller's resumable upload continues (aggregator_service.upload_partials)."""
        try:
            return self.engine.admission.partials.query(peer_identity(context).name, request)
        except Refused as exc:
            abort(context, exc)

    def SecAggRespond(self, request: agent_pb2.SecAggPhase, context) -> agent_pb2.SecAggAck:
        site = peer_identity(context).name  # the sender is the certificate, never a message field
        try:
            self.engine.secagg.respond(site, request)
        except Refused as exc:
            abort(context, exc)
        return agent_pb2.SecAggAck()

    def Decline(self, request: agent_pb2.DeclineRequest, context) -> agent_pb2.DeclineResponse:
        site = peer_identity(context).name
        try:
            self.engine.decline(site, request.task_id, request.round, request.reason, request.permanent)
        except Refused as exc:
            abort(context, exc)
        return agent_pb2.DeclineResponse()

    def SubmitResult(self, request: agent_pb2.SubmitResultRequest, context) -> agent_pb2.SubmitResultResponse:
        """A site's results of non-training work (aggregator_service.results): only for a task and phase the
        site was assigned; refused with what to do otherwise, nothing written."""
        site = peer_identity(context).name
        try:
            answer = self.engine.submit_result(site, request)
        except Refused as exc:
            log.info("result refused", site=site, task_id=request.task_id[:64], round=request.round,
                     code=exc.code.name, reason=exc.message)
            abort(context, exc)
        return answer  # audited through its task event (aggregator_service.audit_trail.EVENT_KINDS)

    def Hold(self, request: agent_pb2.HoldRequest, context) -> agent_pb2.HoldResponse:
        site = peer_identity(context).name
        try:
            self.engine.hold(site, request.task_id, request.round, request.reason)
        except Refused as exc:
            abort(context, exc)
        return agent_pb2.HoldResponse()


class _ArraySink:
    """ChunkAssembler writer filling a preallocated numpy array (the masked vector: no spill file, one copy)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self._view = memoryview(array).cast("B")
        self._offset = 0

    def write(self, data: bytes) -> None:
        self._view[self._offset:self._offset + len(data)] = data
        self._offset += len(data)

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        self._offset = 0
