"""The agent's work loop.

One thread keeps the ``WatchWork`` stream open (reconnecting with capped exponential backoff and jitter)
and queues what arrives; the main thread handles one assignment at a time:

1. check the site policy and the data contract (nothing is downloaded before this passes; a refusal is
   sent to the aggregator with its reason, which reaches the task owner); under ``approval = "manual"`` a new
   task is then held until ``hospital-agent tasks approve`` (hospital_agent.approvals);
2. fetch only the tensors whose hash is not in the local cache;
3. evaluate the global model on the site's held-out split (when configured), train locally with the
   shared trainer, compute delta = local - global on the tensors the task sends;
4. write the update to the outbox (durable), upload it with its idempotency key, delete it on receipt;
   under secure aggregation the delta instead leaves only masked, in the round's SecAgg session
   (hospital_agent.secure_aggregation; phase messages are answered on their own thread).

The model and the encoded dataset of a task stay in memory across its rounds. Every call takes its stub from
hospital_agent.connection.AgentChannel, which switches to a new channel when the site's certificate is renewed on
disk (the work stream then reopens with it; running calls and the outbox are not affected).
"""

from __future__ import annotations

import hashlib
import queue
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import grpc
import numpy as np
import structlog

import fedclinic
from fedclinic.runtime.audit_trail import AuditError, AuditLog, update_digest
from fedclinic.transport import codec_wire
from fedclinic.runtime.blobstore import BlobStore
from fedclinic.codecs import CodecInputError, ErrorFeedback, available_codecs, parse_codec
from fedclinic.runtime.failpoints import failpoint
from fedclinic.errors import ConfigError, DatasetError, FedclinicError, IntegrityError
from fedclinic.transport.package import Manifest, ModelPackage, raw_bytes, tensor_sha256
from fedclinic.training import private_modules
from fedclinic.training.private_modules import PrivateStore
from fedclinic.proto import agent_pb2, agent_pb2_grpc, task_pb2, tensors_pb2
from fedclinic.transport.rpc import explain_rpc_error
from fedclinic.transport.wire import (CHUNK_BYTES, ChunkAssembler, FileAssembler, MemoryWriter, encode_tensor_chunk_in,
                            header_of, manifest_from_proto)

from hospital_agent.approvals import APPROVED, REJECTED, ApprovalStore
from hospital_agent.config import AgentConfig
from hospital_agent.connection import AgentChannel
from hospital_agent.metrics import AgentMetrics, count_wire_bytes
from hospital_agent.outbox import Outbox, OutboxEntry
from hospital_agent.privacy_ledger import BudgetExceeded
from hospital_agent.secure_aggregation import FEATURE as SECAGG_FEATURE, SiteSecAgg
from hospital_agent.site_model import private_store_folder
from hospital_agent.site_privacy import PrivatePlan, SitePrivacy

if TYPE_CHECKING:
    from fedclinic.training.trainer import TrainConfig

log = structlog.get_logger("fedclinic.agent")
#: what the aggregator (and so the task owner) is told while a task waits for approval here
HOLD_AWAITING_APPROVAL = 'awaiting approval by the site\'s IT (approval = "manual")'
_UPDATE_TENSOR_FIELD = agent_pb2.UpdateChunk.DESCRIPTOR.fields_by_name["tensor"].number


class Stopped(Exception):
    """The agent is shutting down (SIGTERM) or the task was cancelled."""


@dataclass
class _TaskState:
    """What the agent keeps warm for one task across its rounds."""

    loaded: object = None                       # fedclinic.models.LoadedModel
    tensor_sha: dict[str, str] = field(default_factory=dict)
    raw_train: list | None = None               # validated rows: fedclinic.data.text.Example or data_ner.NerExample
    raw_eval: list | None = None
    train_data: object = None                   # fedclinic.training.trainer.EncodedData
    eval_data: object = None
    #: local optimizer moments by tensor name, for tasks with optimizer_state = "keep" (memory only: an agent
    #: restart starts them afresh, as "reset" would)
    optimizer_state: dict | None = None
    #: the task's DP-SGD plan (sample-level privacy), admitted to the ledger once
    private: "PrivatePlan | None" = None
    #: the site's own values of the task's private tensors (private_patterns), as trained in its last round;
    #: None until read from the private store (or taken from the global model on a site's first round)
    private_values: dict[str, np.ndarray] | None = None


@dataclass
class _Trained:
    """One round's local result, as handle() sends it."""

    delta: dict[str, np.ndarray]
    send: list[str]
    result: object                              # fedclinic.training.trainer.TrainResult
    metrics: dict[str, float]
    eval_metrics: dict[str, float]


def _certificate_name(config: AgentConfig) -> str:
    from fedclinic.pki import identity_from_pem

    try:
        return identity_from_pem(config.tls.cert.read_bytes()).name
    except (OSError, ValueError, FedclinicError):
        return "?"


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        config.work_dir.mkdir(parents=True, exist_ok=True)
        self.cache = BlobStore(config.work_dir / "cache")
        self.outbox = Outbox(config.work_dir / "outbox")
        self.privacy = SitePrivacy(config.work_dir / "privacy-ledger.sqlite", config.datasets)
        #: each task's private tensors (FedNER private modules), kept here between rounds and restarts
        self.private_store = PrivateStore(private_store_folder(config.work_dir))
        #: tasks seen and their approval (hospital_agent.approvals; shared with `hospital-agent tasks`)
        self.approvals = ApprovalStore(config.work_dir / "approvals.sqlite")
        #: the site's audit trail (fedclinic.runtime.audit_trail); the `hospital-agent tasks` CLI appends to it too
        self.audit_log = AuditLog(config.work_dir / "audit.jsonl", on_torn_tail="quarantine")
        self._cert_name = _certificate_name(config)  # the site's name before Hello has confirmed it
        #: the latest assignment of each task waiting for approval (re-checked by the main loop)
        self._held: dict[str, agent_pb2.Assignment] = {}
        self.stop_event = threading.Event()
        self.site_id = ""
        self._queue: "queue.Queue[agent_pb2.WorkItem]" = queue.Queue()
        self._cancelled: set[str] = set()
        self._tasks: dict[str, _TaskState] = {}
        self._sent: set[tuple[str, int]] = set()  # (task, round) acknowledged by the aggregator
        #: the channel to the aggregator, rebuilt when the site's certificate is renewed (hospital_agent.connection)
        self._conn: AgentChannel | None = None
        #: set by SIGHUP (re-read the certificate files now) and by a credentials switch (resend the outbox)
        self.reload_requested = threading.Event()
        self._resend_outbox = threading.Event()
        self._watch_call = None
        self._upload_call = None
        self.secagg = SiteSecAgg(self)
        self._secagg_queue: "queue.Queue[agent_pb2.SecAggPhase]" = queue.Queue()
        #: Prometheus metrics (hospital_agent.metrics), served by the CLI when metrics_address is set
        self.metrics = AgentMetrics(self.outbox, self.privacy.ledger, lambda: len(self._held))

    # connection -----------------------------------------------------------------------------------------
    def connect(self) -> None:
        self._conn = AgentChannel(self.config.aggregator, self.config.tls, server_name=self.config.server_name,
                                  on_change=self._credentials_changed)

    @property
    def _stub(self) -> agent_pb2_grpc.AgentServiceStub:
        """The stub for the next call: on a new channel if the certificate was renewed since the last call."""
        assert self._conn is not None, "connect() first"
        return self._conn.stub()

    @property
    def _submit_update(self):
        assert self._conn is not None, "connect() first"
        return self._conn.submit_update()

    def _credentials_changed(self) -> None:
        """A renewed certificate is in use for new calls: move the work stream over, resend the outbox."""
        log.info("renewed certificate in use; reopening the work stream with it")
        self._resend_outbox.set()
        call = self._watch_call
        if call is not None:
            call.cancel()

    def _maintain_connection(self) -> None:
        """Between assignments: pick up renewed credentials (SIGHUP forces a re-read) and resend what the outbox
        holds after a switch (e.g. an update refused while the old certificate was revoked)."""
        assert self._conn is not None
        force = self.reload_requested.is_set()
        self.reload_requested.clear()
        switched = self._conn.refresh(force=force)
        if force:
            ident = self._conn.credentials.current.identity
            log.info("reload requested", certificate="reloaded" if switched else "unchanged",
                     certificate_problem=self._conn.credentials.last_error,
                     serial=ident.serial_hex if ident else None)
        if self._resend_outbox.is_set():
            self._resend_outbox.clear()
            self._drain_outbox()

    def hello(self) -> agent_pb2.HelloResponse:
        from fedclinic.training.trainer import select_device

        device = select_device(self.config.device)
        caps = agent_pb2.Capabilities(devices=[str(device)], codecs=["raw", *available_codecs()], secure_aggregation=True,
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
                    self._maintain_connection()
                    self._release_held()
                    continue
                if item.WhichOneof("item") == "assignment":
                    self._handle_safely(item.assignment)
                self._release_held()
        finally:
            self.stop()
            watcher.join(timeout=5)
            phases.join(timeout=5)
            if self._conn is not None:
                self._conn.close()
            log.info("agent stopped", site=self.site_id)

    def _watch_loop(self) -> None:
        backoff = 1.0
        while not self.stop_event.is_set():
            try:
                resp = self.hello()
                self.metrics.connected = True
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
                        self._release_privacy(item.cancel.task_id, f"ended at the aggregator: {item.cancel.reason}")
                    elif kind == "assignment":
                        self._queue.put(item)
                    elif kind == "secagg":
                        self._secagg_queue.put(item.secagg)
            except grpc.RpcError as exc:
                if self.stop_event.is_set():
                    return
                err = explain_rpc_error(exc, self.config.aggregator)
                log.warning("work stream lost; reconnecting", error=str(err), retry_in_s=round(backoff, 1))
            self.metrics.connected = False
            self.stop_event.wait(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, 30.0)

    def _secagg_loop(self) -> None:
        """Answer secure-aggregation phase messages as they come, also while the main thread trains."""
        while not self.stop_event.is_set():
            try:
                msg = self._secagg_queue.get(timeout=0.5)
            except queue.Empty:
                continue
            structlog.contextvars.bind_contextvars(task_id=msg.task_id, round=msg.round, site=self.site_id)
            try:
                self.secagg.handle(msg)
            except grpc.RpcError as exc:
                log.warning("secure-aggregation phase failed on the network", error=str(
                    explain_rpc_error(exc, self.config.aggregator)))
            except Exception:  # keep answering other sessions; this one will time out at the aggregator
                log.exception("secure-aggregation phase failed")
            finally:
                structlog.contextvars.unbind_contextvars("task_id", "round", "site")

    def _handle_safely(self, a: agent_pb2.Assignment) -> None:
        structlog.contextvars.bind_contextvars(task_id=a.task_id, round=a.round, site=self.site_id)
        try:
            self.handle(a)
        except Stopped as exc:
            log.info("assignment interrupted", reason=str(exc))
        except (DatasetError, IntegrityError) as exc:
            log.error("assignment refused", error=str(exc))
            self.metrics.assignment_refused("data")
            self._decline(a, str(exc), permanent=isinstance(exc, DatasetError))
        except grpc.RpcError as exc:
            log.warning("assignment failed on the network; it will be offered again", error=str(
                explain_rpc_error(exc, self.config.aggregator)))
        except FedclinicError as exc:
            log.error("assignment failed", error=str(exc))
            self.metrics.assignment_refused("error")
            self._decline(a, str(exc), permanent=False)
        finally:
            structlog.contextvars.unbind_contextvars("task_id", "round", "site")

    def _decline(self, a: agent_pb2.Assignment, reason: str, permanent: bool) -> None:
        self._decline_round(a.task_id, a.round, reason, permanent)

    def _decline_round(self, task_id: str, rnd: int, reason: str, permanent: bool = False) -> None:
        try:
            self._stub.Decline(agent_pb2.DeclineRequest(task_id=task_id, round=rnd, reason=reason,
                                                        permanent=permanent), timeout=30)
        except grpc.RpcError as exc:
            log.warning("could not send the refusal", error=str(explain_rpc_error(exc, self.config.aggregator)))
        if permanent:
            self._release_privacy(task_id, f"declined for good by this site: {reason}")

    def _hold_round(self, task_id: str, rnd: int, reason: str) -> None:
        """Tell the aggregator why this site holds the round's assignment ("" = it no longer does), so the task
        owner sees it; best effort: the hold itself does not depend on it."""
        try:
            self._stub.Hold(agent_pb2.HoldRequest(task_id=task_id, round=rnd, reason=reason), timeout=30)
        except grpc.RpcError as exc:
            log.info("could not tell the aggregator about the hold", task_id=task_id, round=rnd,
                     error=str(explain_rpc_error(exc, self.config.aggregator)))

    def _release_privacy(self, task_id: str, why: str) -> None:
        """The task spends nothing more here: give its unspent privacy reservation back (site_privacy)."""
        try:
            datasets = self.privacy.task_ended(task_id)
        except Exception:  # the ledger stays as it was (reserved); the work stream must go on
            log.exception("could not release the task's privacy reservation", task_id=task_id)
            return
        if datasets:
            log.info("privacy reservation released", task_id=task_id, datasets=datasets, reason=why)
            self.audit("privacy.reservation_released", task_id, datasets=datasets, reason=why)

    # audit and approval -------------------------------------------------------------------------------------
    def audit(self, kind: str, task_id: str | None = None, **details) -> None:
        """Append to the site's audit trail (after the state change it records). A failed write is logged as an
        error; the work goes on (the log then refuses further writes until the agent restarts)."""
        try:
            self.audit_log.append(kind, actor=f"agent:{self.site_id or self._cert_name}", task_id=task_id, **details)
        except AuditError as exc:
            log.error("audit record not written", kind=kind, error=str(exc))

    def _approved(self, a: agent_pb2.Assignment) -> bool:
        """May this assignment run now? Records the task in the approval store; under ``approval = "manual"`` a
        task that is not approved yet is held (the aggregator sees a slow site: the round waits for it until its
        deadline) and re-checked by the main loop; a rejected one is declined for good with the reason."""
        auto = self.config.policy.approval == "auto"
        rec, what = self.approvals.observe(a, auto=auto, decided_by="site policy (approval = \"auto\")")
        if what:
            if rec.state == APPROVED:
                self.audit("task.approved", a.task_id, by=rec.decided_by, mode="auto", spec_sha256=rec.spec_sha256,
                           name=a.spec.name)
            else:
                self.audit("task.awaiting_approval", a.task_id, round=a.round, spec_sha256=rec.spec_sha256,
                           name=a.spec.name, **({"note": rec.note} if rec.note else {}))
        if rec.state == APPROVED:
            self._held.pop(a.task_id, None)
            return True
        if rec.state == REJECTED:
            self._held.pop(a.task_id, None)
            site = self.site_id or self._cert_name
            self._decline(a, f"rejected at {site}: {rec.reason}", permanent=True)
            self.metrics.assignment_refused("rejected")
            return False
        previous = self._held.get(a.task_id)
        if previous is None or what:
            log.warning("task awaiting approval at this site; nothing is fetched or trained until then",
                        name=a.spec.name, approve=f"hospital-agent tasks approve {a.task_id} --config ...",
                        show=f"hospital-agent tasks show {a.task_id} --config ...")
        if previous is None or previous.round != a.round:
            self._hold_round(a.task_id, a.round, HOLD_AWAITING_APPROVAL)
        self._held[a.task_id] = a
        return False

    def _release_held(self) -> None:
        """Handle held assignments whose task has been decided (approved or rejected) since."""
        if not self._held:
            return
        for task_id in [t for t in self._held if t in self._cancelled]:
            del self._held[task_id]
        states = self.approvals.states(list(self._held))
        for task_id, a in list(self._held.items()):
            if states.get(task_id) not in (APPROVED, REJECTED):
                continue
            del self._held[task_id]
            if states[task_id] == APPROVED and a.deadline_unix_ms and a.deadline_unix_ms < time.time() * 1000:
                log.info("task approved after its round's deadline; waiting for the next assignment",
                         task_id=task_id, round=a.round)
                continue
            if states[task_id] == APPROVED:
                self._hold_round(task_id, a.round, "")
            self._handle_safely(a)

    # one assignment -----------------------------------------------------------------------------------------
    def handle(self, a: agent_pb2.Assignment) -> None:
        refusal = self.config.policy.refusal(a.spec, self.config.datasets)
        if refusal:
            log.warning("assignment refused by site policy", reason=refusal)
            self.metrics.assignment_refused("policy")
            self._decline(a, refusal, permanent=True)
            self.audit("task.refused_by_policy", a.task_id, round=a.round, reason=refusal)
            return
        if not self._approved(a):
            return  # held for approval, or rejected: nothing is downloaded, read or trained
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
        from fedclinic.training import trainer as training

        manifest = manifest_from_proto(a.model)
        declared = {f.path: f.sha256 for f in manifest.files}.get("tokenizer.json", "")
        if a.spec.tokenizer_sha256 and declared != a.spec.tokenizer_sha256:
            raise IntegrityError("the model's tokenizer.json is not the tokenizer the task declares "
                                 "(tokenizer_sha256); refusing to train with it")
        try:
            private = private_modules.private_names([t.name for t in manifest.tensors], a.spec.update.private_patterns,
                                                    frozen=a.spec.update.frozen_patterns)
        except ConfigError as exc:
            self._decline(a, str(exc), permanent=True)
            return
        asked = private_modules.outgoing_problems(a.send_tensors, private)
        if asked:  # the aggregator's send list must never name a private tensor: refuse the task, send nothing
            reason = (f"the aggregator asked this site to send {len(asked)} private tensor(s): {asked[0]}; this site "
                      "keeps private modules to itself, so it refuses the task")
            log.error("assignment refused: private tensors requested", reason=reason)
            self.metrics.assignment_refused("policy")
            self._decline(a, reason, permanent=True)
            self.audit("task.refused_private_requested", a.task_id, round=a.round, reason=reason)
            return
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
                self.audit("task.refused_by_privacy_budget", a.task_id, round=a.round, reason=str(exc))
                self.metrics.assignment_refused("privacy_budget")
                return
        self._sync_model(a, manifest, state)
        if private:
            self._restore_private(a.task_id, state, private)
        trained = self._train_round(a, state, cfg, private)
        delta, send, result, metrics = trained.delta, trained.send, trained.result, trained.metrics
        eval_metrics = trained.eval_metrics
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
                self.audit("update.withheld_by_privacy_budget", a.task_id, round=a.round, reason=str(exc))
                self.metrics.assignment_refused("privacy_budget")
                return
            header.metrics["dp_epsilon"] = header.dp.epsilon  # per-site spend, visible in the task's rounds
            header.metrics["dp_delta"] = header.dp.delta
            log.info("privacy charged", epsilon=round(header.dp.epsilon, 4), delta=header.dp.delta)
        payloads = self._encode_update(a, header, delta, send)  # after DP: the codec sees only what may leave
        entry = self.outbox.put(header, payloads)
        log.info("update ready", samples=result.num_samples, loss=round(float(result.loss), 4),
                 nbytes=sum(t.encoded_nbytes for t in header.tensors))
        self._upload(entry)

    def _train_round(self, a: agent_pb2.Assignment, state: _TaskState, cfg: "TrainConfig",
                     private: list[str]) -> _Trained:
        """Evaluate the synced model (global shared tensors + this site's private ones) on the site's held-out
        split, train one round (SAFL's layers when the task selects them, and the private tensors), keep the
        private tensors (memory and the private store) and return the delta of the tensors to send. The last
        gate before anything is written: IntegrityError if a private tensor is among them."""
        from fedclinic.training import safl
        from fedclinic.training import trainer as training
        from fedclinic.models import module_tensors

        loaded = state.loaded
        eval_metrics = training.evaluate(loaded, state.eval_data) if state.eval_data is not None else {}
        send = list(a.send_tensors)
        safl_config = safl.SaflConfig.from_spec(a.spec)
        selection = None
        if safl_config is not None:  # attention-selected layers: profile the global model, train the top-k + head
            selection = safl.select_layers(loaded, state.train_data, safl_config, send,
                                           seed=safl.profile_seed(cfg.seed, a.round, self.site_id))
            send = selection.tensors
            log.info("layers selected", layers=selection.layers, tensors=len(send))
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

            result = train_local_private(loaded, state.train_data, cfg, state.private.dp_sgd, trainable=send + private,
                                         progress=progress)
        else:
            result = training.train_local(loaded, state.train_data, cfg, trainable=send + private, progress=progress,
                                          optimizer_state=state.optimizer_state)
        state.optimizer_state = result.optimizer_state
        self.metrics.trained(a.task_id, time.monotonic() - started)
        after = module_tensors(loaded.module, send)
        delta = training.compute_delta(before, after, send)
        # the module now holds local weights; remember that so the next round reloads the global ones
        for name in send:
            state.tensor_sha[name] = ""
        if private:  # kept before the update exists: a restart trains the next round from these values
            state.private_values = module_tensors(loaded.module, private)
            self.private_store.save(a.task_id, a.round, state.private_values)
        leaking = private_modules.outgoing_problems(send, private)
        if leaking:  # unreachable while the checks above hold; the last gate before anything is written or sent
            raise IntegrityError("refusing to send: " + "; ".join(leaking))
        metrics = {**result.reported_metrics(), "train_seconds": time.monotonic() - started,
                   **(selection.metrics() if selection is not None else {})}
        return _Trained(delta, send, result, metrics, eval_metrics)

    # update codecs (fedclinic.transport.codec_wire) -------------------------------------------------------------------
    def _feedback_path(self, task_id: str) -> Path:
        return self.config.work_dir / "codec-state" / f"{task_id}.error-feedback.safetensors"

    def _encode_update(self, a: agent_pb2.Assignment, header: agent_pb2.UpdateHeader, delta: dict[str, np.ndarray],
                       send: list[str]) -> dict[str, np.ndarray | bytes]:
        """Append each sent tensor's header to ``header`` and return what the outbox stores for it: the raw delta,
        or its payload under the task's codec. Top-k keeps an error-feedback residual per task under work_dir:
        the new residual is staged and saved here, committed when the aggregator acknowledges the update."""
        codec = codec_wire.task_codec(a.spec.update.codec)
        if codec is None:
            for name in send:
                arr = delta[name]
                header.tensors.append(tensors_pb2.TensorHeader(
                    name=name, dtype="float32", shape=list(arr.shape), codec="raw",
                    sha256=tensor_sha256(arr), encoded_nbytes=int(arr.nbytes)))
            return dict(delta)
        feedback = None
        if codec_wire.uses_error_feedback(codec):
            path = self._feedback_path(a.task_id)
            path.parent.mkdir(mode=0o700, exist_ok=True)
            feedback = ErrorFeedback.load(path, codec) if path.exists() else ErrorFeedback(codec)
        out: dict[str, np.ndarray | bytes] = {}
        for name in send:
            arr = np.ascontiguousarray(delta[name], dtype=np.float32)
            rng = codec_wire.tensor_rng(a.task_id, a.round, self.site_id, name)
            try:
                if feedback is not None and feedback.residual(name) is not None and \
                        feedback.residual(name).shape != arr.shape:
                    feedback.reset(name)
                enc = feedback.encode(name, arr, rng=rng) if feedback is not None else codec.encode(arr, rng=rng)
            except CodecInputError as exc:
                raise FedclinicError(f"tensor {name!r} cannot be encoded with the task's codec: {exc}") from None
            header.tensors.append(tensors_pb2.TensorHeader(
                name=name, dtype="float32", shape=list(arr.shape), codec=codec.spec,
                sha256=hashlib.sha256(enc.payload).hexdigest(), encoded_nbytes=len(enc.payload),
                codec_params=codec_wire.header_params(enc)))
            out[name] = enc.payload
        if feedback is not None:
            feedback.save(self._feedback_path(a.task_id))  # staged residual durable before the update exists
        return out

    def _settle_feedback(self, task_id: str, delivered: bool) -> None:
        """The aggregator acknowledged (``delivered``) or refused the update: commit or drop its staged
        error-feedback residual (no-op for codecs without one)."""
        path = self._feedback_path(task_id)
        if not path.exists():
            return
        feedback = ErrorFeedback.load(path)
        if not feedback.pending:
            return
        feedback.commit() if delivered else feedback.discard()
        feedback.save(path)
        log.info("error-feedback residual " + ("committed" if delivered else "discarded"), task_id=task_id,
                 tensors=len(feedback.names))

    def _charge_privacy(self, a: agent_pb2.Assignment, state: _TaskState) -> agent_pb2.DpReport | None:
        """Charge this round's DP-SGD steps to the ledger before anything leaves; None (and a decline) when the
        budget refuses."""
        assert state.private is not None
        try:
            report = self.privacy.charge(a.task_id, a.spec, a.round, state.private)
        except BudgetExceeded as exc:
            log.warning("update withheld: privacy budget", reason=str(exc))
            self._decline(a, str(exc), permanent=True)
            self.audit("update.withheld_by_privacy_budget", a.task_id, round=a.round, reason=str(exc))
            self.metrics.assignment_refused("privacy_budget")
            return None
        log.info("privacy charged", epsilon=round(report.epsilon, 4), delta=report.delta)
        return report

    def _prepare_data(self, a: agent_pb2.Assignment, state: _TaskState) -> None:
        from fedclinic.data.text import read_dataset

        entry = self.config.datasets[a.spec.dataset]
        kwargs = dict(format=entry.format, text_field=entry.text_field, label_field=entry.label_field,
                      entities_field=entry.entities_field, question_field=entry.question_field,
                      answer_field=entry.answer_field, context_field=entry.context_field,
                      image_field=entry.image_field, label_set=list(a.spec.labels),
                      multi_label=a.spec.multi_label)
        if state.raw_train is None:
            state.raw_train = read_dataset(a.spec.family, entry.path, **kwargs)
            state.raw_eval = read_dataset(a.spec.family, entry.eval_path, **kwargs) if entry.eval_path else None

    def _restore_private(self, task_id: str, state: _TaskState, private: list[str]) -> None:
        """Put the site's own private tensors into the warm model (after each sync to the global weights): from
        memory, else from the private store (a restarted agent), else the global model's initial values (the
        site's first round). IntegrityError (the assignment is declined for now) when the stored file does not
        fit the model."""
        from fedclinic.models import load_tensors, module_tensors

        if state.private_values is None:
            current = module_tensors(state.loaded.module, private)
            stored = self.private_store.load(task_id, {n: (a.shape, a.dtype) for n, a in current.items()})
            state.private_values = stored[0] if stored is not None else current
            if stored is not None:
                log.info("private modules restored", tensors=len(private), from_round=stored[1])
        load_tensors(state.loaded.module, state.private_values)

    def _sync_model(self, a: agent_pb2.Assignment, manifest: Manifest, state: _TaskState) -> None:
        """Bring the warm model to the assignment's global weights, fetching only unknown tensors."""
        missing = [t for t in manifest.tensors if not self.cache.has(t.sha256)]
        need_files = any(not self.cache.has(f.sha256) for f in manifest.files)
        if missing or need_files:
            self._fetch(a.task_id, manifest, need_files, deltas=self._usable_deltas(a, {t.name for t in missing}))
        from fedclinic.models import build_model, load_tensors
        from fedclinic.training import trainer as training

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

    def _usable_deltas(self, a: agent_pb2.Assignment, missing: set[str]) -> dict[str, tensors_pb2.DownlinkDelta]:
        """The assignment's encoded changes (compressed downlink) for missing tensors whose base this agent holds
        and whose codec is a downlink codec it knows; the other missing tensors are fetched in full."""
        from fedclinic.transport import downlink

        return {d.name: d for d in a.downlink_deltas
                if d.name in missing and self.cache.has(d.base_sha256) and not downlink.spec_problems(d.header.codec)
                and d.header.dtype == "float32"}

    def _fetch(self, task_id: str, manifest: Manifest, include_files: bool,
               deltas: dict[str, tensors_pb2.DownlinkDelta] | None = None) -> None:
        """Download the tensors (and files) of ``manifest`` this agent does not hold; those in ``deltas`` as their
        encoded change, rebuilt on the base tensor (fedclinic.transport.downlink.apply) and checked against the manifest's
        sha256; a change that does not rebuild the tensor exactly is fetched again in full."""
        deltas = deltas or {}
        have = [t.sha256 for t in manifest.tensors if self.cache.has(t.sha256)]
        expect = {t.name: deltas[t.name].header if t.name in deltas else header_of(t)
                  for t in manifest.tensors if t.sha256 not in set(have)}
        changes: dict[str, MemoryWriter] = {}

        def begin(h: tensors_pb2.TensorHeader):
            if h.name in deltas:
                changes[h.name] = MemoryWriter()
                return changes[h.name]
            return self.cache.writer(h.sha256, h.encoded_nbytes, verified_by_caller=True)

        tensors = ChunkAssembler(begin, expect=expect)
        files = FileAssembler()
        stream = self._stub.FetchModel(agent_pb2.FetchModelRequest(
            task_id=task_id, model_hash=manifest.model_hash, have_sha256=have, include_files=include_files,
            delta_names=sorted(deltas)))
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
        log.info("model fetched", tensors=len(expect), bytes=tensors.nbytes, skipped=len(have), as_changes=len(deltas))
        self.metrics.fetched(task_id, tensors.nbytes + sum(len(data) for data in files.files.values()))
        self.audit("model.fetched", task_id, model_hash=manifest.model_hash, bytes=int(tensors.nbytes),
                   tensors=len(expect), skipped=len(have), files=len(files.files), as_changes=len(deltas))
        failed = self._rebuild_from_changes(manifest, deltas, changes)
        if failed:
            log.warning("encoded changes did not rebuild the global tensors; fetching them in full", tensors=failed)
            self._fetch(task_id, manifest, include_files=False)

    def _rebuild_from_changes(self, manifest: Manifest, deltas: dict[str, tensors_pb2.DownlinkDelta],
                              changes: dict[str, MemoryWriter]) -> list[str]:
        """Cache each tensor fetched as an encoded change: base + decode(change), when it hashes to the manifest's
        sha256. Returns the names that did not (left uncached)."""
        from fedclinic.transport import downlink

        failed = []
        for name, writer in changes.items():
            entry, h = manifest.tensor(name), deltas[name].header
            try:
                codec = parse_codec(h.codec)
                params = codec_wire.params_of(name, codec, list(h.shape), dict(h.codec_params))
                base = self.cache.array(deltas[name].base_sha256, "float32", tuple(entry.shape))
                tensor = downlink.apply(base, codec, writer.data, params)
            except (FedclinicError, ValueError) as exc:
                log.warning("encoded change unusable", tensor=name, error=str(exc))
                failed.append(name)
                continue
            data = raw_bytes(tensor)
            if hashlib.sha256(data).hexdigest() != entry.sha256:
                failed.append(name)
                continue
            self.cache.put(data, entry.sha256, verified=True)  # hashed just above
        return failed

    # uploads ------------------------------------------------------------------------------------------------
    def _drain_outbox(self) -> None:
        for entry in self.outbox.entries():
            structlog.contextvars.bind_contextvars(task_id=entry.header.task_id, round=entry.header.round)
            try:  # the upload's own log lines (acknowledged, refused, interrupted) carry the task and round too
                log.info("resending an update left in the outbox")
                self._upload_with_retries(entry)
            finally:
                structlog.contextvars.unbind_contextvars("task_id", "round")
        waiting = {e.header.task_id for e in self.outbox.entries()}
        folder = self.config.work_dir / "codec-state"
        for path in sorted(folder.glob("*.error-feedback.safetensors")) if folder.is_dir() else []:
            task_id = path.name[:-len(".error-feedback.safetensors")]
            if task_id not in waiting:  # staged for an update that never reached the outbox: it was not sent
                self._settle_feedback(task_id, delivered=False)

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
            self.metrics.upload_started(h.task_id)
            wire_bytes = [0]
            self._upload_call = self._submit_update.future(count_wire_bytes(self._update_stream(entry), wire_bytes))
            receipt = self._upload_call.result()
        except grpc.RpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
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
            self._settle_feedback(h.task_id, delivered=False)
            self._sent.add((h.task_id, h.round))
            self.outbox.remove(entry)
            return
        finally:
            self._upload_call = None
        failpoint("agent.after-receipt")
        self._settle_feedback(h.task_id, delivered=True)  # before the outbox entry goes: a crash resends, then commits
        self.metrics.acknowledged(h.task_id, receipt.duplicate, sum(int(t.encoded_nbytes) for t in h.tensors),
                                  wire_bytes[0])
        self.audit("update.sent", h.task_id, round=h.round, update_id=receipt.update_id, duplicate=receipt.duplicate,
                   size=sum(int(t.encoded_nbytes) for t in h.tensors), sha256=update_digest(h.tensors),
                   masked=bool(h.secagg_session_id))
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
