"""Control: what data scientists (role ``scientist``) and administrators (role ``admin``) call.

A scientist sees and manages only the tasks it submitted; an admin sees and manages all of them. The public
records of a task's rounds (``GetTaskRecords``: the sites' signed statements, each round's base and result model,
a secure round's sum and survivors) and the blobs they name (``FetchTaskBlob``: a secure round's sum; the
committed updates only when the task publishes them) are what ``fedclinic task verify`` checks.
"""

from __future__ import annotations

import hashlib

from pathlib import Path
from typing import Iterator

import grpc
import structlog

from fedclinic.errors import IntegrityError, Refused
from fedclinic.pki.common import PkiError
from fedclinic.pki.model_signatures import aggregator_statement
from fedclinic.pki.signed_statement import SignedStatement, Signer
from fedclinic.proto import control_pb2, control_pb2_grpc, tensors_pb2
from fedclinic.spec.signed_task import verify_signed_task
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
    def __init__(self, engine: Engine, audit=None, limits: Limits | None = None,
                 signer: Signer | None = None, ca_path: Path | None = None) -> None:
        self.engine = engine
        #: the aggregator's own key and certificate: signs each model a scientist downloads (FetchModel)
        self.signer = signer
        #: the fedclinic CA the owners' signed tasks are checked against (None: not checked, e.g. unit tests)
        self.ca_path = ca_path
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
            named = h.spec.evaluation.model_task
            manifest = self._model_of_task(owner, named, h) if named else manifest_from_proto(h.model)
            validate_spec(h.spec, manifest)
            signed = self._signed_task(context, h, manifest.model_hash)
            items = _payload(request_iterator)
            if named:  # the named task's blobs are stored already and no chunk may come with the submission
                nbytes = sum(1 for _ in items)
                if nbytes:
                    raise IntegrityError("a task that names [evaluation] model_task sends no model chunks")
            else:
                nbytes = receive_model(self.engine.blobs, manifest, items, max_files=self.limits.model_files,
                                       max_file_bytes=self.limits.model_file_bytes)
            task_id = self.engine.create_task(owner, h.idempotency_key, h.spec, manifest, signed)
        except IntegrityError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"model upload rejected: {exc}")
        except Refused as exc:
            context.abort(exc.code, exc.message)
        if not signed:
            log.warning("task submitted unsigned: sites that require signed tasks (the default) will decline it",
                        task_id=task_id, owner=owner)
        log.info("task submitted", task_id=task_id, owner=owner, model_bytes=nbytes, signed=bool(signed))
        return status_of(self.engine.store, task_id)

    def _model_of_task(self, owner: str, task_id: str, h: control_pb2.SubmitTaskHeader):
        """The final model of ``task_id`` for an "evaluate" task that names it (``[evaluation] model_task``): only
        a completed task of the same owner (a task id is not a capability: another owner's task is refused like a
        missing one, PERMISSION_DENIED, so its existence is not revealed). The submission itself carries no model."""
        if h.model.tensors or h.model.files:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          "the task names [evaluation] model_task and also sends a model; send one or the other")
        row = self.engine.store.task(task_id)
        if row is None or row.owner != owner:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                          f"model_task {task_id[:64]!r} is not a task of yours; an evaluation may name only a "
                          "finished task its submitter owns")
        manifest = self.engine.store.model(row.final_model) if row.final_model else None
        if row.state != control_pb2.TASK_STATE_COMPLETED or manifest is None:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"model_task {task_id} has no final model (it is {control_pb2.TaskState.Name(row.state)}); "
                          "name a task that completed")
        return manifest

    def _signed_task(self, context, h: control_pb2.SubmitTaskHeader, model_hash: str) -> bytes:
        """The header's signed task, serialized, after checking that the submitting identity signed exactly this
        spec, initial model and idempotency key (fedclinic.spec.signed_task); b"" when the submission is unsigned
        (allowed: the sites decide whether they run unsigned tasks). Refused INVALID_ARGUMENT otherwise."""
        if not h.HasField("signed_task"):
            return b""
        ident = peer_identity(context)
        if self.ca_path is not None:
            try:
                signed = verify_signed_task(SignedStatement.from_proto(h.signed_task), ca_path=self.ca_path,
                                            spec=h.spec, model_hash=model_hash)
            except PkiError as exc:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"the task's signature does not hold: {exc}; submit it with the fedclinic SDK "
                              "(Client.submit signs it with your certificate)") from None
            if (signed.signer.role, signed.signer.name) != (ident.role, ident.name):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"the task is signed by the {signed.signer.role} {signed.signer.name!r}, not by the "
                              f"submitting {ident.role} {ident.name!r}; sign it with the certificate you submit with")
            if signed.idempotency_key != h.idempotency_key:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              "the task's signature covers another idempotency key than the submission's; sign the "
                              "submission you send")
        return h.signed_task.SerializeToString()

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
            for chunk in stream_task_model(self.engine, context, request.task_id, model_hash, counter=counter,
                                           not_found=f"task {request.task_id} has no such model; list its rounds "
                                                     "with `fedclinic task status`",
                                           have=set(request.have_sha256), include_files=True,
                                           resume=(request.resume_tensor, request.resume_offset)):
                yield chunk
                if chunk.WhichOneof("item") == "manifest" and self.signer is not None:
                    yield tensors_pb2.ModelChunk(statement=self._model_statement(task, model_hash).to_proto())
            complete = True
        finally:
            self.engine.metrics.control_download.inc(counter[0])
            self.audit.record("model.downloaded", actor=who, task_id=request.task_id, model_hash=model_hash,
                              bytes=counter[0], complete=complete)

    def _model_statement(self, task, model_hash: str) -> SignedStatement:
        """The aggregator's signature over a model it streams to a scientist (fedclinic.pki.model_signatures):
        the task, the round that made it (0: the submitted initial model), whether it is the final model."""
        rounds = [r.round for r in self.engine.store.rounds_of(task.task_id) if r.model_hash == model_hash]
        return aggregator_statement(self.signer, task_id=task.task_id, round=max(rounds, default=0),
                                    model_hash=model_hash, final=model_hash == task.final_model)

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
        # read back from disk: hashed as it streams, the last chunk held until the whole blob matches its name
        digest, held = hashlib.sha256(), None
        with open(self.engine.blobs.path(request.sha256), "rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
                if held is not None:
                    yield control_pb2.BlobChunk(data=held)
                held = chunk
        if digest.hexdigest() != request.sha256:
            log.error("stored copy damaged", blob=request.sha256, path=str(self.engine.blobs.path(request.sha256)))
            context.abort(grpc.StatusCode.DATA_LOSS, f"stored copy damaged: blob {request.sha256[:16]}... of task "
                          f"{request.task_id} no longer matches its hash; the aggregator's operator must restore it "
                          "from backup")
        if held is not None:
            yield control_pb2.BlobChunk(data=held)


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
