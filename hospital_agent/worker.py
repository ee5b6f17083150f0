"""The agent's work loop.

One thread keeps the ``WatchWork`` stream open (reconnecting with capped exponential backoff and jitter)
and queues what arrives; the main thread handles one assignment at a time:

1. check the site policy and the data contract (nothing is downloaded before this passes; a refusal is
   sent to the aggregator with its reason, which reaches the task owner);
2. fetch only the tensors whose hash is not in the local cache;
3. evaluate the global model on the site's held-out split (when configured), train locally with the
   shared trainer, compute delta = local - global on the tensors the task sends;
4. write the update to the outbox (durable), upload it with its idempotency key, delete it on receipt;
   under secure aggregation the delta instead leaves only masked, in the round's SecAgg session
   (hospital_agent.secure_aggregation; phase messages are answered on their own thread).

The model and the encoded dataset of a task stay in memory across its rounds.
"""

from __future__ import annotations

import queue
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Iterator

import grpc
import numpy as np
import structlog

import fedclinic
from fedclinic.blobstore import BlobStore
from fedclinic.failpoints import failpoint
from fedclinic.errors import ConfigError, DatasetError, FedclinicError, IntegrityError
from fedclinic.package import Manifest, ModelPackage, tensor_sha256
from fedclinic.proto import agent_pb2, agent_pb2_grpc, task_pb2, tensors_pb2
from fedclinic.rpc import explain_rpc_error, secure_channel
from fedclinic.wire import (CHUNK_BYTES, ChunkAssembler, FileAssembler, encode_tensor_chunk_in, header_of,
                            manifest_from_proto)

from hospital_agent.config import AgentConfig
from hospital_agent.outbox import Outbox, OutboxEntry
from hospital_agent.privacy_ledger import BudgetExceeded
from hospital_agent.secure_aggregation import FEATURE as SECAGG_FEATURE, SiteSecAgg
from hospital_agent.site_privacy import PrivatePlan, SitePrivacy

log = structlog.get_logger("fedclinic.agent")
_UPDATE_TENSOR_FIELD = agent_pb2.UpdateChunk.DESCRIPTOR.fields_by_name["tensor"].number


class Stopped(Exception):
    """The agent is shutting down (SIGTERM) or the task was cancelled."""


@dataclass
class _TaskState:
    """What the agent keeps warm for one task across its rounds."""

    loaded: object = None                       # fedclinic.models.LoadedModel
    tensor_sha: dict[str, str] = field(default_factory=dict)
    raw_train: list | None = None               # validated rows: fedclinic.data.Example or data_ner.NerExample
    raw_eval: list | None = None
    train_data: object = None                   # fedclinic.training.EncodedData
    eval_data: object = None
    #: local optimizer moments by tensor name, for tasks with optimizer_state = "keep" (memory only: an agent
    #: restart starts them afresh, as "reset" would)
    optimizer_state: dict | None = None
    #: the task's DP-SGD plan (sample-level privacy), admitted to the ledger once
    private: "PrivatePlan | None" = None


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        config.work_dir.mkdir(parents=True, exist_ok=True)
        self.cache = BlobStore(config.work_dir / "cache")
        self.outbox = Outbox(config.work_dir / "outbox")
        self.privacy = SitePrivacy(config.work_dir / "privacy-ledger.sqlite", config.datasets)
        self.stop_event = threading.Event()
        self.site_id = ""
        self._queue: "queue.Queue[agent_pb2.WorkItem]" = queue.Queue()
        self._cancelled: set[str] = set()
        self._tasks: dict[str, _TaskState] = {}
        self._sent: set[tuple[str, int]] = set()  # (task, round) acknowledged by the aggregator
        self._channel: grpc.Channel | None = None
        self._stub: agent_pb2_grpc.AgentServiceStub | None = None
        self._watch_call = None
        self._upload_call = None
        self.secagg = SiteSecAgg(self)
        self._secagg_queue: "queue.Queue[agent_pb2.SecAggPhase]" = queue.Queue()

    # connection -----------------------------------------------------------------------------------------
    def connect(self) -> None:
        self._channel = secure_channel(self.config.aggregator, self.config.tls, server_name=self.config.server_name)
        self._stub = agent_pb2_grpc.AgentServiceStub(self._channel)
        self._submit_update = self._channel.stream_unary(  # takes pre-serialized UpdateChunk bytes
            "/fedclinic.v1.AgentService/SubmitUpdate", request_serializer=None,
            response_deserializer=agent_pb2.UpdateReceipt.FromString)

    def hello(self) -> agent_pb2.HelloResponse:
        from fedclinic.training import select_device

        device = select_device(self.config.device)
        caps = agent_pb2.Capabilities(devices=[str(device)], codecs=["raw"], secure_aggregation=True,
                                      families=list(self.config.policy.allowed_families), features=[SECAGG_FEATURE])
        resp = self._stub.Hello(agent_pb2.HelloRequest(protocol_version=fedclinic.PROTOCOL_VERSION,
                                                       agent_version=fedclinic.__version__, capabilities=caps),
                                timeout=30)
        self.site_id = resp.site_id
        return resp

    def stop(self) -> None:
        self.stop_event.set()
        for call in (self._watch_call, self._upload_call):
            if call is not None:
                call.cancel()

    # main loop ----------------------------------------------------------------------------------------------
    def run(self) -> None:
        self.connect()
        watcher = threading.Thread(target=self._watch_loop, name="watch-work", daemon=True)
        watcher.start()
        phases = threading.Thread(target=self._secagg_loop, name="secagg", daemon=True)
        phases.start()
        try:
            self._drain_outbox()
            while not self.stop_event.is_set():
                try:
                    item = self._queue.get(timeout=0.5)
                except queue.Empty:
                    continue
                if item.WhichOneof("item") == "assignment":
                    self._handle_safely(item.assignment)
        finally:
            self.stop()
            watcher.join(timeout=5)
            phases.join(timeout=5)
            if self._channel is not None:
                self._channel.close()
            log.info("agent stopped", site=self.site_id)

    def _watch_loop(self) -> None:
        backoff = 1.0
        while not self.stop_event.is_set():
            try:
                resp = self.hello()
                log.info("connected", aggregator=self.config.aggregator, site=resp.site_id,
                         aggregator_version=resp.aggregator_version)
                self._watch_call = self._stub.WatchWork(
                    agent_pb2.WatchWorkRequest(protocol_version=fedclinic.PROTOCOL_VERSION))
                for item in self._watch_call:
                    backoff = 1.0
                    kind = item.WhichOneof("item")
                    if kind == "cancel":
                        self._cancelled.add(item.cancel.task_id)
                        self.secagg.forget(item.cancel.task_id)
                        log.info("task cancelled by aggregator", task_id=item.cancel.task_id, reason=item.cancel.reason)
                    elif kind == "assignment":
                        self._queue.put(item)
                    elif kind == "secagg":
                        self._secagg_queue.put(item.secagg)
            except grpc.RpcError as exc:
                if self.stop_event.is_set():
                    return
                err = explain_rpc_error(exc, self.config.aggregator)
                log.warning("work stream lost; reconnecting", error=str(err), retry_in_s=round(backoff, 1))
            self.stop_event.wait(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, 30.0)

    def _secagg_loop(self) -> None:
        """Answer secure-aggregation phase messages as they come, also while the main thread trains."""
        while not self.stop_event.is_set():
            try:
                msg = self._secagg_queue.get(timeout=0.5)
            except queue.Empty:
                continue
            structlog.contextvars.bind_contextvars(task_id=msg.task_id, round=msg.round)
            try:
                self.secagg.handle(msg)
            except grpc.RpcError as exc:
                log.warning("secure-aggregation phase failed on the network", error=str(
                    explain_rpc_error(exc, self.config.aggregator)))
            except Exception:  # keep answering other sessions; this one will time out at the aggregator
                log.exception("secure-aggregation phase failed")
            finally:
                structlog.contextvars.unbind_contextvars("task_id", "round")

    def _handle_safely(self, a: agent_pb2.Assignment) -> None:
        structlog.contextvars.bind_contextvars(task_id=a.task_id, round=a.round)
        try:
            self.handle(a)
        except Stopped as exc:
            log.info("assignment interrupted", reason=str(exc))
        except (DatasetError, IntegrityError) as exc:
            log.error("assignment refused", error=str(exc))
            self._decline(a, str(exc), permanent=isinstance(exc, DatasetError))
        except grpc.RpcError as exc:
            log.warning("assignment failed on the network; it will be offered again", error=str(
                explain_rpc_error(exc, self.config.aggregator)))
        except FedclinicError as exc:
            log.error("assignment failed", error=str(exc))
            self._decline(a, str(exc), permanent=False)
        finally:
            structlog.contextvars.unbind_contextvars("task_id", "round")

    def _decline(self, a: agent_pb2.Assignment, reason: str, permanent: bool) -> None:
        self._decline_round(a.task_id, a.round, reason, permanent)

    def _decline_round(self, task_id: str, rnd: int, reason: str, permanent: bool = False) -> None:
        try:
            self._stub.Decline(agent_pb2.DeclineRequest(task_id=task_id, round=rnd, reason=reason,
                                                        permanent=permanent), timeout=30)
        except grpc.RpcError as exc:
            log.warning("could not send the refusal", error=str(explain_rpc_error(exc, self.config.aggregator)))

    # one assignment -----------------------------------------------------------------------------------------
    def handle(self, a: agent_pb2.Assignment) -> None:
        refusal = self.config.policy.refusal(a.spec, self.config.datasets)
        if refusal:
            log.warning("assignment refused by site policy", reason=refusal)
            self._decline(a, refusal, permanent=True)
            return
        secure = a.spec.secure_aggregation.enabled
        if secure and self.secagg.resume(a):
            return  # trained this round already: joined again with the vector it holds
        if (a.task_id, a.round) in self._sent:
            return
        pending = self.outbox.get(a.task_id, a.round)
        if pending is not None and pending.header.secagg_session_id:
            self.outbox.remove(pending)  # a masked input of a session this process no longer takes part in
        elif pending is not None:
            self._upload(pending)
            return
        from fedclinic import training

        manifest = manifest_from_proto(a.model)
        declared = {f.path: f.sha256 for f in manifest.files}.get("tokenizer.json", "")
        if a.spec.tokenizer_sha256 and declared != a.spec.tokenizer_sha256:
            raise IntegrityError("the model's tokenizer.json is not the tokenizer the task declares "
                                 "(tokenizer_sha256); refusing to train with it")
        state = self._tasks.setdefault(a.task_id, _TaskState())
        self._prepare_data(a, state)  # data contract first: nothing is downloaded for a site that cannot train
        cfg = training.TrainConfig.from_proto(a.spec.training)
        cfg.device = self.config.device
        cfg.mixed_precision = cfg.mixed_precision and self.config.mixed_precision
        if state.private is None and a.spec.privacy.level == "sample":
            try:  # the privacy budget next: nothing is downloaded for a task the site cannot afford
                state.private = self.privacy.admit(a.task_id, a.spec, len(state.raw_train), batch_size=cfg.batch_size,
                                                   local_epochs=cfg.local_epochs)
            except (BudgetExceeded, ConfigError) as exc:
                log.warning("private task refused", reason=str(exc))
                self._decline(a, str(exc), permanent=True)
                return
        self._sync_model(a, manifest, state)
        loaded = state.loaded
        eval_metrics = training.evaluate(loaded, state.eval_data) if state.eval_data is not None else {}
        send = list(a.send_tensors)
        from fedclinic.models import module_tensors

        before = module_tensors(loaded.module, send)
        started = time.monotonic()

        def progress(step: int, total: int, loss: float) -> None:
            if self.stop_event.is_set():
                raise Stopped("agent is stopping")
            if a.task_id in self._cancelled:
                raise Stopped("task cancelled")
            if step == total or step % 10 == 0:
                log.info("training", step=step, steps=total, loss=round(loss, 4))

        if state.private is not None:
            from fedclinic.privacy.dp_sgd import train_local_private

            result = train_local_private(loaded, state.train_data, cfg, state.private.dp_sgd, trainable=send,
                                         progress=progress)
        else:
            result = training.train_local(loaded, state.train_data, cfg, trainable=send, progress=progress,
                                          optimizer_state=state.optimizer_state)
        state.optimizer_state = result.optimizer_state
        after = module_tensors(loaded.module, send)
        delta = training.compute_delta(before, after, send)
        # the module now holds local weights; remember that so the next round reloads the global ones
        for name in send:
            state.tensor_sha[name] = ""
        metrics = {**result.reported_metrics(), "train_seconds": time.monotonic() - started}
        if secure:
            # no sample count, metrics or DP report travel beside a masked vector; privacy is charged first
            if state.private is not None and self._charge_privacy(a, state) is None:
                return
            log.info("trained for a secure round", samples=result.num_samples, loss=round(float(result.loss), 4))
            self.secagg.ready(a, manifest.model_hash, delta, send)
            return
        header = agent_pb2.UpdateHeader(
            task_id=a.task_id, round=a.round, attempt=a.attempt,
            idempotency_key=f"{a.task_id}:{a.round}:{self.site_id}:{uuid.uuid4().hex}",
            base_model_hash=manifest.model_hash, kind=task_pb2.UPDATE_KIND_DELTA, num_samples=result.num_samples,
            metrics=metrics, eval_metrics={k: float(v) for k, v in eval_metrics.items()})
        if state.private is not None:
            try:  # charged before the update is written or sent; a refused charge sends nothing
                header.dp.CopyFrom(self.privacy.charge(a.task_id, a.spec, a.round, state.private))
            except BudgetExceeded as exc:
                log.warning("update withheld: privacy budget", reason=str(exc))
                self._decline(a, str(exc), permanent=True)
                return
            header.metrics["dp_epsilon"] = header.dp.epsilon  # per-site spend, visible in the task's rounds
            header.metrics["dp_delta"] = header.dp.delta
            log.info("privacy charged", epsilon=round(header.dp.epsilon, 4), delta=header.dp.delta)
        for name in send:
            arr = delta[name]
            header.tensors.append(tensors_pb2.TensorHeader(
                name=name, dtype="float32", shape=list(arr.shape), codec="raw",
                sha256=tensor_sha256(arr), encoded_nbytes=int(arr.nbytes)))
        entry = self.outbox.put(header, delta)
        log.info("update ready", samples=result.num_samples, loss=round(float(result.loss), 4),
                 nbytes=sum(t.encoded_nbytes for t in header.tensors))
        self._upload(entry)

    def _charge_privacy(self, a: agent_pb2.Assignment, state: _TaskState) -> agent_pb2.DpReport | None:
        """Charge this round's DP-SGD steps to the ledger before anything leaves; None (and a decline) when the
        budget refuses."""
        assert state.private is not None
        try:
            report = self.privacy.charge(a.task_id, a.spec, a.round, state.private)
        except BudgetExceeded as exc:
            log.warning("update withheld: privacy budget", reason=str(exc))
            self._decline(a, str(exc), permanent=True)
            return None
        log.info("privacy charged", epsilon=round(report.epsilon, 4), delta=report.delta)
        return report

    def _prepare_data(self, a: agent_pb2.Assignment, state: _TaskState) -> None:
        from fedclinic.data import read_dataset

        entry = self.config.datasets[a.spec.dataset]
        kwargs = dict(format=entry.format, text_field=entry.text_field, label_field=entry.label_field,
                      entities_field=entry.entities_field, question_field=entry.question_field,
                      answer_field=entry.answer_field, context_field=entry.context_field,
                      image_field=entry.image_field, label_set=list(a.spec.labels),
                      multi_label=a.spec.multi_label)
        if state.raw_train is None:
            state.raw_train = read_dataset(a.spec.family, entry.path, **kwargs)
            state.raw_eval = read_dataset(a.spec.family, entry.eval_path, **kwargs) if entry.eval_path else None

    def _sync_model(self, a: agent_pb2.Assignment, manifest: Manifest, state: _TaskState) -> None:
        """Bring the warm model to the assignment's global weights, fetching only unknown tensors."""
        missing = [t for t in manifest.tensors if not self.cache.has(t.sha256)]
        need_files = any(not self.cache.has(f.sha256) for f in manifest.files)
        if missing or need_files:
            self._fetch(a.task_id, manifest, need_files)
        from fedclinic.models import build_model, load_tensors
        from fedclinic import training

        if state.loaded is None:
            package = ModelPackage(
                tensors={t.name: np.array(self.cache.array(t.sha256, t.dtype, t.shape)) for t in manifest.tensors},
                files={f.path: self.cache.read(f.sha256) for f in manifest.files})
            state.loaded = build_model(package)
            state.tensor_sha = {t.name: t.sha256 for t in manifest.tensors}
            cfg = training.TrainConfig.from_proto(a.spec.training)
            state.train_data = training.encode(state.raw_train, state.loaded, max_length=cfg.max_length)
            if state.raw_eval is not None:
                state.eval_data = training.encode(state.raw_eval, state.loaded, max_length=cfg.max_length)
            return
        changed = {t.name: np.array(self.cache.array(t.sha256, t.dtype, t.shape))
                   for t in manifest.tensors if state.tensor_sha.get(t.name) != t.sha256}
        if changed:
            load_tensors(state.loaded.module, changed)
            state.tensor_sha.update({t.name: t.sha256 for t in manifest.tensors})

    def _fetch(self, task_id: str, manifest: Manifest, include_files: bool) -> None:
        have = [t.sha256 for t in manifest.tensors if self.cache.has(t.sha256)]
        expect = {t.name: header_of(t) for t in manifest.tensors if t.sha256 not in set(have)}
        tensors = ChunkAssembler(lambda h: self.cache.writer(h.sha256, h.encoded_nbytes, verified_by_caller=True), expect=expect)
        files = FileAssembler()
        stream = self._stub.FetchModel(agent_pb2.FetchModelRequest(
            task_id=task_id, model_hash=manifest.model_hash, have_sha256=have, include_files=include_files))
        try:
            for chunk in stream:
                if self.stop_event.is_set():
                    stream.cancel()
                    raise Stopped("agent is stopping")
                kind = chunk.WhichOneof("item")
                if kind == "manifest":
                    if chunk.manifest.model_hash != manifest.model_hash:
                        raise IntegrityError("the aggregator sent a different model than the one assigned")
                elif kind == "tensor":
                    tensors.add(chunk.tensor)
                elif kind == "file":
                    files.add(chunk.file)
            tensors.finish()
            files.finish()
        except BaseException:
            tensors.abort()
            raise
        declared = {f.path: f.sha256 for f in manifest.files}
        for path, data in files.files.items():
            if path not in declared:
                raise IntegrityError(f"the aggregator sent file {path!r}, which is not in the model manifest")
            self.cache.put(data, declared[path])
        log.info("model fetched", tensors=len(expect), bytes=tensors.nbytes, skipped=len(have))

    # uploads ------------------------------------------------------------------------------------------------
    def _drain_outbox(self) -> None:
        for entry in self.outbox.entries():
            log.info("resending an update left in the outbox", task_id=entry.header.task_id, round=entry.header.round)
            self._upload_with_retries(entry)

    def _upload_with_retries(self, entry: OutboxEntry) -> None:
        backoff = 1.0
        while not self.stop_event.is_set():
            try:
                self._upload(entry)
                return
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    return
                self.stop_event.wait(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, 30.0)

    def _upload(self, entry: OutboxEntry) -> None:
        h = entry.header
        try:
            self._upload_call = self._submit_update.future(self._update_stream(entry))
            receipt = self._upload_call.result()
        except grpc.RpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
                log.warning("upload interrupted; the update stays in the outbox", error=exc.details())
                raise
            log.error("update refused by the aggregator; dropping it", code=code.name, error=exc.details())
            self._sent.add((h.task_id, h.round))
            self.outbox.remove(entry)
            return
        finally:
            self._upload_call = None
        failpoint("agent.after-receipt")
        self._sent.add((h.task_id, h.round))
        self.outbox.remove(entry)
        log.info("update acknowledged", update_id=receipt.update_id, duplicate=receipt.duplicate,
                 nbytes=receipt.stored_nbytes)

    @staticmethod
    def _update_stream(entry: OutboxEntry) -> Iterator[bytes]:
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
