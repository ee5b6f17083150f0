"""Control: what data scientists (role ``scientist``) and administrators (role ``admin``) call.

A scientist sees and manages only the tasks it submitted; an admin sees and manages all of them. The public
records of a task's rounds (``GetTaskRecords``: the sites' signed statements, each round's base and result model,
a secure round's sum and survivors) and the blobs they name (``FetchTaskBlob``: a secure round's sum; the
committed updates only when the task publishes them) are what ``fedclinic task verify`` checks.
"""

from __future__ import annotations

from typing import Iterator

import grpc
import structlog

from fedclinic.errors import IntegrityError, Refused
from fedclinic.proto import control_pb2, control_pb2_grpc, tensors_pb2
from fedclinic.transport.wire import manifest_from_proto

from aggregator_service.audit_trail import NoAudit
from aggregator_service.auth import peer_identity
from aggregator_service.engine import Engine
from aggregator_service.limits import Limits
from aggregator_service.rounds import validate_spec
from aggregator_service.status import TERMINAL, latest_model_hash, status_of
from aggregator_service.model_streams import stream_task_model
from aggregator_service.task_records import readable_blobs, task_records
from aggregator_service.transfer import receive_model

log = structlog.get_logger("fedclinic.aggregator.control")


class ControlApi(control_pb2_grpc.ControlServicer):
    def __init__(self, engine: Engine, audit=None, limits: Limits | None = None) -> None:
        self.engine = engine
        self.limits = limits or Limits()  # a submitted model's files: count and total bytes
        self.audit = audit or NoAudit()  # aggregator_service.audit_trail.AuditTrail

    def _visible(self, context, task_id: str) -> None:
        ident = peer_identity(context)
        row = self.engine.store.task(task_id)
        if row is None:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"no task {task_id!r} on this aggregator; list tasks with `fedclinic task list`")
        if ident.role != "admin" and row.owner != ident.name:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"task {task_id} belongs to {row.owner}; only its owner or an admin may use it")

    def SubmitTask(self, request_iterator, context) -> control_pb2.TaskStatus:
        owner = peer_identity(context).name
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("item") != "header":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a task submission must start with SubmitTaskHeader")
        h = first.header
        if not h.idempotency_key or len(h.idempotency_key) > 255:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "idempotency_key must be 1-255 characters")
        existing = self.engine.store.task_by_key(owner, h.idempotency_key)
        if existing is not None:
            return status_of(self.engine.store, existing.task_id)
        try:
            manifest = manifest_from_proto(h.model)
            validate_spec(h.spec, manifest)
            items = _payload(request_iterator)
            nbytes = receive_model(self.engine.blobs, manifest, items, max_files=self.limits.model_files,
                                   max_file_bytes=self.limits.model_file_bytes)
            task_id = self.engine.create_task(owner, h.idempotency_key, h.spec, manifest)
        except IntegrityError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"model upload rejected: {exc}")
        except Refused as exc:
            context.abort(exc.code, exc.message)
        log.info("task submitted", task_id=task_id, owner=owner, model_bytes=nbytes)
        return status_of(self.engine.store, task_id)

    def GetTask(self, request, context) -> control_pb2.TaskStatus:
        self._visible(context, request.task_id)
        return status_of(self.engine.store, request.task_id)

    def ListTasks(self, request, context) -> control_pb2.ListTasksResponse:
        ident = peer_identity(context)
        out = control_pb2.ListTasksResponse()
        for row in self.engine.store.tasks():
            if ident.role != "admin" and row.owner != ident.name:
                continue
            if not request.include_finished and row.state in TERMINAL:
                continue
            out.tasks.append(status_of(self.engine.store, row.task_id))
        return out

    def WatchTask(self, request, context) -> Iterator[control_pb2.TaskEvent]:
        self._visible(context, request.task_id)
        after = request.after_seq
        while context.is_active() and not self.engine.stopping:
            events = self.engine.store.events_of(request.task_id, after)
            if events:
                status = status_of(self.engine.store, request.task_id)
                for e in events:
                    yield control_pb2.TaskEvent(seq=e.seq, kind=e.kind, message=e.message, status=status,
                                                unix_ms=e.unix_ms)
                    after = e.seq
                if status.state in TERMINAL:
                    return
                continue
            self.engine.wait_for_change(timeout=1.0)

    def CancelTask(self, request, context) -> control_pb2.TaskStatus:
        self._visible(context, request.task_id)
        try:
            self.engine.cancel(request.task_id, peer_identity(context).name, request.reason)
        except Refused as exc:
            context.abort(exc.code, exc.message)
        return status_of(self.engine.store, request.task_id)

    def FetchModel(self, request, context) -> Iterator[tensors_pb2.ModelChunk]:
        self._visible(context, request.task_id)
        task = self.engine.store.task(request.task_id)
        if request.round > 0:
            row = self.engine.store.round(request.task_id, request.round)
            if row is None or not row.model_hash:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"round {request.round} of task {request.task_id} has no model yet")
            model_hash = row.model_hash
        elif request.round < 0:
            model_hash = task.initial_model
        else:
            model_hash = latest_model_hash(self.engine.store, request.task_id)
            if not model_hash:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"task {request.task_id} has finished no round yet; nothing to download")
        who, counter, complete = peer_identity(context).name, [0], False
        try:  # only the task's own models and blobs, verified as read (aggregator_service.model_streams)
            yield from stream_task_model(self.engine, context, request.task_id, model_hash, counter=counter,
                                         not_found=f"task {request.task_id} has no such model; list its rounds "
                                                   "with `fedclinic task status`",
                                         have=set(request.have_sha256), include_files=True,
                                         resume=(request.resume_tensor, request.resume_offset))
            complete = True
        finally:
            self.engine.metrics.control_download.inc(counter[0])
            self.audit.record("model.downloaded", actor=who, task_id=request.task_id, model_hash=model_hash,
                              bytes=counter[0], complete=complete)

    def GetTaskRecords(self, request, context) -> control_pb2.TaskRecords:
        self._visible(context, request.task_id)
        return task_records(self.engine.store, request.task_id, max(1, request.first_round))

    def FetchTaskBlob(self, request, context) -> Iterator[control_pb2.BlobChunk]:
        self._visible(context, request.task_id)
        if request.sha256 not in readable_blobs(self.engine.store, request.task_id) or not \
                self.engine.blobs.has(request.sha256):
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"task {request.task_id} publishes no blob {request.sha256[:64]!r}: only a secure round's sum "
                          "and, when the task sets [verification] publish_updates, the updates its sites committed")
        with open(self.engine.blobs.path(request.sha256), "rb") as fh:
            while chunk := fh.read(1 << 20):
                yield control_pb2.BlobChunk(data=chunk)


def _payload(request_iterator) -> Iterator[tensors_pb2.FileChunk | tensors_pb2.TensorChunk]:
    for msg in request_iterator:
        kind = msg.WhichOneof("item")
        if kind == "file":
            yield msg.file
        elif kind == "tensor":
            yield msg.tensor
        elif kind == "commit":
            return
        else:
            raise IntegrityError(f"unexpected {kind!r} message inside a task submission")
    raise IntegrityError("the submission stream ended before its commit message; nothing was stored")
