"""The agent's work loop.

One thread keeps the ``WatchWork`` stream open (reconnecting with capped exponential backoff and jitter)
and queues what arrives; the main thread handles one assignment at a time, each job in its own module:

1. gates (hospital_agent.gates): the site policy, manual approval (a new task is held until ``hospital-agent
   tasks approve``), the declared tokenizer, private modules; then the data contract and the privacy budget.
   Nothing is downloaded before they pass; a refusal reaches the task owner with its reason;
2. model sync (hospital_agent.model_sync): fetch only the tensors whose hash is not in the local cache;
3. training step (hospital_agent.training_step): run the one site round the simulator runs
   (fedclinic.federation.site_round: seed, SAFL, training, delta, codec);
4. privacy is charged, the update written to the outbox (durable) and uploaded with its idempotency key
   (hospital_agent.uploader); under secure aggregation the delta instead leaves only masked, in the round's
   SecAgg session (hospital_agent.secure_aggregation; phase messages are answered on their own thread);
5. then the round's base model is evaluated on the site's held-out split, while the update uploads, and the values
   sent with ``SubmitResult`` once the update was acknowledged (hospital_agent.result_work), off the round's
   critical path (a secure round, or an aggregator without "results-v1", evaluates before training and sends them
   with the update, as before).

An assignment with ``work`` set trains nothing (hospital_agent.result_work): the final model's evaluation, an
"evaluate" or a "statistics" task.

The model and the encoded dataset of a task stay in memory across its rounds. Every call takes its stub from
hospital_agent.connection.AgentChannel, which switches to a new channel when the site's certificate is renewed on
disk (the work stream then reopens with it; running calls and the outbox are not affected).
"""

from __future__ import annotations

import contextvars
import queue
import random
import shutil
import threading
import time
import uuid

import grpc
import structlog

import fedclinic
from fedclinic.runtime.audit_log import AuditError, AuditLog
from fedclinic.runtime.blobstore import BlobStore
from fedclinic.runtime.disk_errors import is_local_storage_failure
from fedclinic.runtime.failpoints import failpoint
from fedclinic.codecs import available_codecs
from fedclinic.errors import DatasetError, FedclinicError, IntegrityError
from fedclinic.training.private_modules import PrivateStore
from fedclinic.proto import agent_pb2, agent_pb2_grpc, task_pb2
from fedclinic.transport.rpc import explain_rpc_error
from fedclinic.secagg import ClientPolicy
from fedclinic.transport.wire import manifest_from_proto

from hospital_agent.approvals import ApprovalStore
from hospital_agent.config import AgentConfig
from hospital_agent.connection import AgentChannel
from hospital_agent.gates import (DECLINE, HOLD, ApprovalGate, GateChain, PolicyGate, PrivacyBudget, SpecGate,
                                  PrivateModulesGate, SignedTaskGate, TokenizerGate, Verdict, private_names)
from hospital_agent.task_bindings import TaskBindings
from hospital_agent.metrics import AgentMetrics
from hospital_agent.local_models import INDEX_FILE as LOCAL_MODELS_INDEX, LocalModelFolders
from hospital_agent.model_sync import ModelSync
from hospital_agent.outbox import OutboxEntry, Outbox
from hospital_agent.outgoing import declined_for_good, outgoing_reason
from hospital_agent.result_work import FEATURE as RESULTS_FEATURE, ResultWork
from hospital_agent.secure_aggregation import FEATURE as SECAGG_FEATURE, SiteSecAgg
from fedclinic.verification.round_statement import FEATURE as STATEMENT_FEATURE
from hospital_agent.site_model import private_store_folder
from hospital_agent.site_privacy import SitePrivacy
from hospital_agent.task_state import Stopped, TaskState
from hospital_agent.training_step import TrainingStep, update_spill_dir
from hospital_agent.uploader import StatementSeal, Uploader

log = structlog.get_logger("fedclinic.agent")


def _certificate_name(config: AgentConfig) -> str:
    from fedclinic.pki import identity_from_pem  # cryptography: only needed for this one read

    try:
        return identity_from_pem(config.tls.cert.read_bytes()).name
    except (OSError, ValueError, FedclinicError):
        return "?"


class Agent:
    """One site's agent: the work loop over its jobs (gates, model sync, training step, uploader, secure
    aggregation). Implements what :class:`~hospital_agent.secure_aggregation.SiteSecAgg` needs of its host."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        config.work_dir.mkdir(parents=True, exist_ok=True)
        self.outbox = Outbox(config.work_dir / "outbox", seal=StatementSeal(config.tls, lambda: self.site_name()))
        self.privacy = SitePrivacy(config.work_dir / "privacy-ledger.sqlite", config.datasets)
        #: each task's private tensors (FedNER private modules), kept here between rounds and restarts
        self.private_store = PrivateStore(private_store_folder(config.work_dir))
        #: tasks seen and their approval (hospital_agent.approvals; shared with `hospital-agent tasks`)
        self.approvals = ApprovalStore(config.work_dir / "approvals.sqlite")
        #: the site's audit trail (fedclinic.runtime.audit_log); the `hospital-agent tasks` CLI appends to it too
        self.audit_log = AuditLog(config.work_dir / "audit.jsonl", on_torn_tail="quarantine")
        self._cert_name = _certificate_name(config)  # the site's name before Hello has confirmed it
        self.stop_event = threading.Event()
        self.site_id = ""
        self._queue: "queue.Queue[agent_pb2.WorkItem]" = queue.Queue()
        #: task id -> the reason the aggregator gave when it cancelled or ended the task
        self._cancelled: dict[str, str] = {}
        self._tasks: dict[str, TaskState] = {}
        #: the channel to the aggregator, rebuilt when the site's certificate is renewed (hospital_agent.connection)
        self._conn: AgentChannel | None = None
        #: set by SIGHUP (re-read the certificate files now) and by a credentials switch (resend the outbox)
        self.reload_requested = threading.Event()
        self._resend_outbox = threading.Event()
        self._watch_call = None
        self.aggregator_features: frozenset[str] = frozenset()
        self.approval = ApprovalGate(config, self.approvals, self.audit, self.site_name)
        #: (owner, idempotency key) <-> task id of the signed tasks this site accepted (hospital_agent.task_bindings)
        self.task_bindings = TaskBindings(config.work_dir / "task-bindings.sqlite")
        self.admission = GateChain([SignedTaskGate(config, self.task_bindings), SpecGate(), PolicyGate(config),
                                    self.approval])
        self.model_checks = GateChain([TokenizerGate(), PrivateModulesGate()])
        self.budget = PrivacyBudget(self.privacy)
        #: Prometheus metrics (hospital_agent.metrics), served by the CLI when metrics_address is set
        self.metrics = AgentMetrics(self.outbox, self.privacy.ledger, lambda: len(self.approval.held))
        self.uploader = Uploader(self.outbox, config.work_dir, self._submit_update, self.metrics, self.audit,
                                 self.stop_event, query_upload=lambda: self.stub().QueryUpload)
        local = (LocalModelFolders(config.model_folders, config.work_dir / LOCAL_MODELS_INDEX)
                 if config.model_folders else None)
        self.model_sync = ModelSync(BlobStore(config.work_dir / "cache"), self.stub, self.metrics, self.audit,
                                    self.stop_event, local)
        self.training = TrainingStep(config, self.private_store, self.metrics, lambda: self.site_id, self.stop_event,
                                     self._cancelled)
        #: work that trains nothing: the final model's evaluation, "evaluate" and "statistics" tasks, and each
        #: round's evaluation sent after its update (hospital_agent.result_work)
        self.results = ResultWork(config, self.stub, self.training, self.model_sync, self.model_checks, self._passes,
                                  self.decline_round, lambda: self.privacy.ledger, self.audit)
        self.secagg = SiteSecAgg(self)
        self._secagg_queue: "queue.Queue[agent_pb2.SecAggPhase]" = queue.Queue()

    @property
    def cache(self) -> BlobStore:
        return self.model_sync.cache

    def site_name(self) -> str:
        return self.site_id or self._cert_name

    # connection -----------------------------------------------------------------------------------------
    def connect(self) -> None:
        self._conn = AgentChannel(self.config.aggregator, self.config.tls, server_name=self.config.server_name,
                                  on_change=self._credentials_changed)

    def stub(self) -> agent_pb2_grpc.AgentServiceStub:
        """The stub for the next call: on a new channel if the certificate was renewed since the last call."""
        assert self._conn is not None, "connect() first"
        return self._conn.stub()

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
            self.uploader.drain()

    def hello(self) -> agent_pb2.HelloResponse:
        from fedclinic.training.trainer import select_device  # torch: imported once connected (keeps `--help` light)

        devices = self.training.devices() if self.config.devices is not None else [str(select_device(self.config.device))]
        caps = agent_pb2.Capabilities(devices=devices, codecs=["raw", *available_codecs()], secure_aggregation=True,
                                      families=list(self.config.policy.allowed_families), features=[SECAGG_FEATURE, STATEMENT_FEATURE, RESULTS_FEATURE])
        resp = self.stub().Hello(agent_pb2.HelloRequest(protocol_version=fedclinic.PROTOCOL_VERSION,
                                                       agent_version=fedclinic.__version__, capabilities=caps),
                                timeout=30)
        self.site_id = resp.site_id
        #: what the aggregator speaks (HelloResponse.features), e.g. "results-v1": round evaluations follow updates
        self.aggregator_features = frozenset(resp.features)
        return resp

    def stop(self) -> None:
        self.stop_event.set()
        if self._watch_call is not None:
            self._watch_call.cancel()
        self.uploader.cancel()

    # main loop ----------------------------------------------------------------------------------------------
    def run(self) -> None:
        self.connect()
        watcher = threading.Thread(target=self._watch_loop, name="watch-work", daemon=True)
        watcher.start()
        phases = threading.Thread(target=self._secagg_loop, name="secagg", daemon=True)
        phases.start()
        try:
            self.uploader.drain()
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
                self._watch_call = self.stub().WatchWork(
                    agent_pb2.WatchWorkRequest(protocol_version=fedclinic.PROTOCOL_VERSION,
                                               open_tasks=self._open_tasks()))
                for item in self._watch_call:
                    backoff = 1.0
                    kind = item.WhichOneof("item")
                    if kind == "cancel":
                        self._cancelled[item.cancel.task_id] = item.cancel.reason
                        self.secagg.forget(item.cancel.task_id)
                        log.info("task completed at the aggregator" if item.cancel.completed else
                                 "task cancelled by aggregator", task_id=item.cancel.task_id, reason=item.cancel.reason)
                        self._release_privacy(item.cancel.task_id, f"ended at the aggregator: {item.cancel.reason}")
                    elif kind == "assignment":
                        self._queue.put(item)
                    elif kind == "secagg":
                        self._secagg_queue.put(item.secagg)
            except grpc.RpcError as exc:
                if self.stop_event.is_set():
                    return
                lost = self._conn.address if self._conn is not None else self.config.aggregator
                err = explain_rpc_error(exc, lost)
                if exc.code() == grpc.StatusCode.UNAVAILABLE and self._failover(lost):
                    continue  # the next address at once; backoff after every address was tried
                log.warning("work stream lost; reconnecting", error=str(err), retry_in_s=round(backoff, 1))
            except Exception:  # noqa: BLE001 - a message this agent cannot take must not silence the work stream
                log.exception("work stream failed on a message; reconnecting", retry_in_s=round(backoff, 1))
            self.metrics.connected = False
            self.stop_event.wait(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, 30.0)

    def _open_tasks(self) -> list[str]:
        """The tasks this site holds a privacy reservation for, named as the work stream opens: the aggregator answers
        those that ended while the agent was away (or before the news reached it) with a cancellation."""
        try:  # task ids are the aggregator's (64 characters at most): anything else would get the stream refused
            return [t for t in self.privacy.open_tasks() if 0 < len(t) <= 64]
        except Exception:  # noqa: BLE001 - the ledger's trouble must not keep the work stream shut
            log.exception("could not read the privacy ledger's open tasks")
            return []

    def _failover(self, lost: str) -> bool:
        """UNAVAILABLE from ``lost`` (a standby, or nobody listening): move to the next aggregator address. True
        when there is one not yet tried in this cycle (try it at once); False after a full cycle (back off)."""
        if self._conn is None or len(self._conn.ring.addresses) == 1:
            return False
        wrapped = self._conn.failover()
        self.metrics.connected = False
        log.warning("aggregator unavailable; trying the next address", unavailable=lost, next=self._conn.address)
        if wrapped:
            return False
        self.stop_event.wait(0.2 * (0.5 + random.random()))
        return True

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
        """Handle one assignment; nothing it raises ends the agent (an assignment is what the network sent).

        A data or integrity problem is declined with its reason (for good when it is the site's data); a network
        failure waits for the assignment to be offered again; any other exception (a bug reached by what the task
        asked for, e.g. numpy refusing an absurd shape) is logged with its traceback and declined with a reason
        that names its type only (its text may hold a path of this site): for good, since the same assignment
        would fail the same way, unless it is a resource of this site (disk, memory) that may come back."""
        structlog.contextvars.bind_contextvars(task_id=a.task_id, round=a.round, site=self.site_id)
        try:
            self.handle(a)
        except Stopped as exc:
            log.info("assignment interrupted", reason=str(exc))
        except (DatasetError, IntegrityError) as exc:
            log.error("assignment refused", error=str(exc))
            self.metrics.assignment_refused("data")
            self.decline_round(a.task_id, a.round, exc, permanent=declined_for_good(exc), dataset=a.spec.dataset)
        except grpc.RpcError as exc:
            log.warning("assignment failed on the network; it will be offered again", error=str(
                explain_rpc_error(exc, self.config.aggregator)))
        except FedclinicError as exc:
            log.error("assignment failed", error=str(exc))
            self.metrics.assignment_refused("error")
            self.decline_round(a.task_id, a.round, exc, permanent=False, dataset=a.spec.dataset)
        except Exception as exc:  # noqa: BLE001 - the agent outlives whatever an assignment makes it raise
            log.exception("assignment failed unexpectedly; declined, the agent carries on")
            self.metrics.assignment_refused("error")
            self._decline_unexpected(a, exc)
        finally:
            if a.task_id in self._cancelled:
                # the task ended at the aggregator while this site handled its assignment: a reservation admitted
                # after the cancellation came (whose release then found nothing) is given back now, not leaked
                self._release_privacy(a.task_id, f"ended at the aggregator: {self._cancelled[a.task_id]}")
            structlog.contextvars.unbind_contextvars("task_id", "round", "site")

    def _decline_unexpected(self, a: agent_pb2.Assignment, exc: Exception) -> None:
        """Decline an assignment whose handling raised ``exc`` unexpectedly (see :meth:`_handle_safely`); never
        raises."""
        transient = isinstance(exc, MemoryError) or is_local_storage_failure(exc)  # e.g. SQLite: disk is full
        reason = (f"the site's agent failed on this assignment ({type(exc).__name__}); "
                  + ("a resource of the site (disk or memory) ran out; it may take the task again later"
                     if transient else "the task's spec or model cannot be handled here; the task owner should check "
                     "the model's shapes and the spec's numbers and resubmit (the site's log has the details)"))
        try:
            self.decline_round(a.task_id, a.round, reason, permanent=not transient)
        except Exception:  # noqa: BLE001 - e.g. the privacy ledger; logged, the work loop goes on
            log.exception("could not decline the assignment")

    # what secure aggregation needs of its host (hospital_agent.secure_aggregation.SecAggHost) -------------------
    def decline_round(self, task_id: str, rnd: int, reason: str | BaseException, permanent: bool = False,
                      dataset: str | None = None) -> None:
        """Tell the aggregator this site declines the round. What is sent is :func:`outgoing_reason` of ``reason``
        (the rule and at most a row number, never a path or a value of this site's data); the full ``reason`` is
        for this site's log and audit trail only."""
        sent = outgoing_reason(reason, dataset=dataset)
        reason = str(reason)
        try:
            self.stub().Decline(agent_pb2.DeclineRequest(task_id=task_id, round=rnd, reason=sent,
                                                         permanent=permanent), timeout=30)
        except grpc.RpcError as exc:
            log.warning("could not send the refusal", error=str(explain_rpc_error(exc, self.config.aggregator)))
        if permanent:
            self._release_privacy(task_id, f"declined for good by this site: {reason}")

    def upload_with_retries(self, entry: OutboxEntry) -> None:
        self.uploader.upload_with_retries(entry)

    def mark_sent(self, task_id: str, rnd: int) -> None:
        self.uploader.sent.add((task_id, rnd))

    def secagg_policy(self) -> ClientPolicy:
        return self.config.policy.secagg_policy()

    # gates ----------------------------------------------------------------------------------------------------
    def _passes(self, a: agent_pb2.Assignment, verdict: Verdict) -> bool:
        """Apply a gate's verdict: decline (with its metric and audit record) or hold; True to go on."""
        if verdict.action == DECLINE:
            if verdict.refused:
                self.metrics.assignment_refused(verdict.refused)
            self.decline_round(a.task_id, a.round, verdict.reason, permanent=verdict.permanent)
            if verdict.audit:
                self.audit(verdict.audit, a.task_id, round=a.round, reason=verdict.reason)
        elif verdict.action == HOLD and verdict.notify:
            self._hold_round(a.task_id, a.round, verdict.reason)
        return verdict.proceed

    def _hold_round(self, task_id: str, rnd: int, reason: str) -> None:
        """Tell the aggregator why this site holds the round's assignment ("" = it no longer does), so the task
        owner sees it; best effort: the hold itself does not depend on it."""
        try:
            self.stub().Hold(agent_pb2.HoldRequest(task_id=task_id, round=rnd, reason=outgoing_reason(reason)),
                             timeout=30)
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

    def audit(self, kind: str, task_id: str | None = None, **details) -> None:
        """Append to the site's audit trail (after the state change it records). A failed write is logged as an
        error; the work goes on (the log then refuses further writes until the agent restarts)."""
        try:
            self.audit_log.append(kind, actor=f"agent:{self.site_name()}", task_id=task_id, **details)
        except AuditError as exc:
            log.error("audit record not written", kind=kind, error=str(exc))

    def _release_held(self) -> None:
        """Handle held assignments whose task has been decided (approved or rejected) since."""
        for a, approved in self.approval.decided(self._cancelled):
            if approved and a.deadline_unix_ms and a.deadline_unix_ms < time.time() * 1000:
                log.info("task approved after its round's deadline; waiting for the next assignment",
                         task_id=a.task_id, round=a.round)
                continue
            if approved:
                self._hold_round(a.task_id, a.round, "")
            self._handle_safely(a)

    # one assignment -----------------------------------------------------------------------------------------
    def handle(self, a: agent_pb2.Assignment) -> None:
        if not self._passes(a, self.admission.check(a)):
            return  # refused, held for approval, or rejected: nothing is downloaded, read or trained
        if a.work:  # evaluate or statistics: nothing trains (hospital_agent.result_work)
            self.results.handle(a, self._tasks.setdefault(a.task_id, TaskState()))
            if (a.task_id, a.round) in self.results.answered:
                self._tasks.pop(a.task_id, None)  # the task's last work here: its model and data leave memory
            return
        secure = a.spec.secure_aggregation.enabled
        if secure and self.secagg.resume(a):
            return  # trained this round already: joined again with the vector it holds
        if (a.task_id, a.round) in self.uploader.sent:
            return
        pending = self.outbox.get(a.task_id, a.round)
        if pending is not None and pending.header.secagg_session_id:
            self.outbox.remove(pending)  # a masked input of a session this process no longer takes part in
        elif pending is not None:
            self.uploader.upload(pending)
            return
        if not self._passes(a, self.model_checks.check(a)):
            return
        from fedclinic.training.trainer import TrainConfig  # torch-heavy: imported when a round runs

        manifest = manifest_from_proto(a.model)
        private = private_names(a)
        state = self._tasks.setdefault(a.task_id, TaskState())
        self.training.prepare_data(a, state)  # data contract first: nothing is downloaded for a site that cannot train
        cfg = TrainConfig.from_proto(a.spec.training)
        cfg.device = self.config.device
        cfg.mixed_precision = cfg.mixed_precision and self.config.mixed_precision
        if state.private is None and a.spec.privacy.level == "sample":
            # the privacy budget next: nothing is downloaded for a task the site cannot afford
            patients = len(set(state.patient_ids)) if state.patient_ids is not None else None
            verdict, state.private = self.budget.admit(a, len(state.raw_train), cfg.batch_size, cfg.local_epochs,
                                                       num_patients=patients)
            if not self._passes(a, verdict):
                return
        failpoint("agent.fetch")  # kill campaign: assigned, model not yet fetched
        self.model_sync.sync(a, manifest, state)
        if private:
            self.training.restore_private(a.task_id, state, private)
        # a plain round's evaluation follows its update (off the round's critical path) where the aggregator takes
        # it (SubmitResult); a secure round's metrics travel inside the masked vector, so it evaluates first, and so
        # does a round for an older aggregator (in the update's header, as before)
        deferred = not secure and RESULTS_FEATURE in self.aggregator_features
        trained = self.training.run(a, state, cfg, private, evaluate=not deferred)
        failpoint("agent.trained")  # kill campaign: trained, not charged or written
        result = trained.site.train
        dp_report = None
        if state.private is not None:  # charged before the update is written or sent; a refused charge sends nothing
            verdict, dp_report = self.budget.charge(a, state.private)
            failpoint("agent.charged")  # kill campaign: privacy charged, update not yet written
            if not self._passes(a, verdict):
                return
        if secure:  # no sample count, metrics or DP report travel beside a masked vector (count and metrics: inside)
            log.info("trained for a secure round", samples=result.num_samples, loss=round(float(result.loss), 4))
            self.secagg.ready(a, manifest.model_hash, trained.site.delta, trained.site.send,
                              num_samples=result.num_samples, eval_metrics=trained.eval_metrics)
            return
        header = agent_pb2.UpdateHeader(
            task_id=a.task_id, round=a.round, attempt=a.attempt,
            idempotency_key=f"{a.task_id}:{a.round}:{self.site_id}:{uuid.uuid4().hex}",
            base_model_hash=manifest.model_hash, kind=task_pb2.UPDATE_KIND_DELTA, num_samples=result.num_samples,
            metrics=trained.metrics, eval_metrics=trained.eval_metrics)
        if dp_report is not None:
            header.dp.CopyFrom(dp_report)
            header.metrics["dp_epsilon"] = dp_report.epsilon  # per-site spend, visible in the task's rounds
            header.metrics["dp_delta"] = dp_report.delta
        header.tensors.extend(trained.site.update.headers)
        self.training.stage_feedback(a.task_id, trained)  # the staged residual is durable before the update exists
        entry = self.outbox.put(header, trained.site.update.payloads)
        shutil.rmtree(update_spill_dir(self.config.work_dir, a.task_id), ignore_errors=True)  # in the outbox now
        failpoint("agent.outbox-written")  # kill campaign: durable in the outbox, not yet sent
        log.info("update ready", samples=result.num_samples, loss=round(float(result.loss), 4),
                 nbytes=sum(t.encoded_nbytes for t in header.tensors))
        if not deferred:
            self.uploader.upload(entry)
            return
        values = self._upload_while_evaluating(entry, lambda: self._round_evaluation(a, manifest, state, trained))
        if values:
            self.results.send_round_eval(a.task_id, a.round, manifest.model_hash, values)

    def _upload_while_evaluating(self, entry, evaluate) -> dict[str, float]:
        """Upload ``entry`` on a thread of its own while this thread runs ``evaluate()``; returns its values once the
        update was acknowledged (the upload's error is raised, and the values are not sent, when it was not).

        The upload mostly waits (on the network and, for the round's last update, on the aggregator closing the
        round), and the evaluation needs the CPU: one after the other, the last site to finish training spent both
        before it could fetch the next round's model, on every round's critical path."""
        failure: list[BaseException] = []

        def upload() -> None:
            try:
                self.uploader.upload(entry)
            except BaseException as exc:  # noqa: BLE001 - raised again on the worker's thread below
                failure.append(exc)

        # the upload's log lines carry the round's context (structlog's contextvars) as on this thread
        sender = threading.Thread(target=contextvars.copy_context().run, args=(upload,), name="upload", daemon=True)
        sender.start()
        try:
            values = evaluate()
        finally:
            sender.join()
        if failure:
            raise failure[0]
        return values

    def _round_evaluation(self, a: agent_pb2.Assignment, manifest, state: TaskState, trained) -> dict[str, float]:
        """The round's base model evaluated (hospital_agent.result_work's values; empty without a held-out split); a
        failure here is logged and gives no values, the round is not affected."""
        try:
            return self.training.evaluate_base(a, state, trained, lambda: self.model_sync.sync(a, manifest, state))
        except Stopped:
            raise
        except Exception:  # noqa: BLE001 - the update is sent; its evaluation is a report, not the round
            log.exception("round evaluation failed; the update was sent without it")
            return {}
