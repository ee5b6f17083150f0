"""The round engine: one coordinator over the parts that run federated rounds.

- :mod:`aggregator_service.rounds` — the round state machine (task lifecycle, open/close/fail rounds, quorum)
- :mod:`aggregator_service.update_admission` — a site's update from header to durable, folded update
- :mod:`aggregator_service.folding` — the streaming accumulators of open rounds
- :mod:`aggregator_service.sites` — connected sites, what they announced, the work each is given
- :mod:`aggregator_service.deadlines` — the ticker applying round and secure-aggregation deadlines
- :mod:`aggregator_service.secure_rounds` — secure-aggregation sessions (it sees the engine as its
  :class:`~aggregator_service.secure_rounds.SecureRoundHost`)
- :mod:`aggregator_service.status` — read-outs for the APIs

Contract: every state change happens under :attr:`Engine.lock` and wakes waiters (work streams, task watchers,
the ticker) through :attr:`Engine.changed`; every durable change goes through the store
(:class:`~aggregator_service.store.Store`) in one transaction per transition. Refusals are
:class:`~fedclinic.errors.Refused` with their gRPC code. :meth:`Engine.start` first recovers: spill files no
update references are deleted, and the accumulators of open rounds are rebuilt from their durable updates.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import structlog

from fedclinic.runtime.blobstore import BlobStore
from fedclinic.transport.package import Manifest
from fedclinic.proto import agent_pb2, control_pb2, task_pb2

from aggregator_service.deadlines import RoundTicker
from aggregator_service.folding import Folding, UpdateLayout
from aggregator_service.metrics import AggregatorMetrics
from aggregator_service.results import ResultPhases
from aggregator_service.rounds import RoundMachine, validate_spec
from aggregator_service.secure_rounds import SecureRounds
from aggregator_service.sites import Sites
from aggregator_service.stakes import require_assignment
from aggregator_service.store import Store
from aggregator_service.stored_data import StoredCopyDamaged, verify_spill
from aggregator_service.update_admission import UpdateAdmission

log = structlog.get_logger("fedclinic.aggregator.engine")

S = control_pb2


class Engine:
    """The aggregator's round engine (module docstring)."""

    def __init__(self, store: Store, blobs: BlobStore, *, clock: Callable[[], float] = time.time,
                 metrics: AggregatorMetrics | None = None) -> None:
        self._store = store
        self.blobs = blobs
        self.spill_root = store.state_dir / "updates"
        self.spill_root.mkdir(exist_ok=True)
        self.clock = clock
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self._stopping = False
        #: Prometheus metrics (aggregator_service.metrics); a private registry when none is given
        self.metrics = metrics if metrics is not None else AggregatorMetrics()
        #: rounds of tasks with secure aggregation: one SecAgg(+) session each (aggregator_service.secure_rounds)
        self.secagg = SecureRounds(self)
        self.sites = Sites(store, self.secagg.capable)
        #: result phases: the final model's evaluation, "evaluate" and "statistics" tasks (aggregator_service.results)
        self.results = ResultPhases(store, self.sites.eligible, self.sites.connected_sites)
        self.folding = Folding(store, blobs, self.spill_root)
        self.rounds = RoundMachine(store, blobs, self.folding, self.sites, self.spill_root, self.results)
        self.admission = UpdateAdmission(store, self.folding, self.spill_root, self.lock, self.changed, self.metrics,
                                         on_accepted=self.rounds.maybe_close, on_damaged=self.stored_copy_damaged)
        self.ticker = RoundTicker(store, self.rounds, lambda: min(self.secagg.tick(), self.results.tick()),
                                  self.changed)
        self.metrics.attach(self)

    @property
    def store(self) -> Store:
        return self._store

    # lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> None:
        with self.lock:
            self.recover()
        self.ticker.start()

    def stop(self) -> None:
        with self.lock:
            self._stopping = True
            self.changed.notify_all()
        self.ticker.stop()

    @property
    def stopping(self) -> bool:
        return self._stopping

    def recover(self) -> None:
        """Rebuild accumulators of open rounds from durable updates; drop spill files nobody references.

        Each update's spill file is checked first against the sha256 recorded when it was acknowledged and for
        finite values (aggregator_service.stored_data.verify_spill); a damaged one is never folded: the task
        fails with "stored copy damaged: ..., restore from backup" and the operator's log names the file."""
        with self.lock:
            referenced = self.store.spill_paths()
            for path in self.spill_root.rglob("*"):
                if path.is_file() and str(path) not in referenced:
                    path.unlink()
            for task in self.store.tasks(S.TASK_STATE_RUNNING):
                rnd = self.store.open_round_of(task.task_id)
                if rnd is None:
                    continue
                updates = self.store.updates_of(task.task_id, rnd.round)
                try:
                    for u in updates:
                        verify_spill(Path(u.spill_path), u.spill_sha256,
                                     UpdateLayout.from_json(u.layout).tensors_in(Path(u.spill_path)),
                                     f"the round {rnd.round} update of site {u.site} ({u.update_id})")
                    acc = self.folding.accumulator(task.task_id)
                except StoredCopyDamaged as exc:
                    log.error("round not recovered: stored copy damaged", task_id=task.task_id, round=rnd.round,
                              what=exc.what, path=exc.path)
                    self.rounds.damaged(task.task_id, exc)
                    continue
                unhashed = sum(1 for u in updates if not u.spill_sha256)
                if unhashed:
                    log.warning("updates without a recorded spill hash (stored by an older release): checked for "
                                "finite values only", task_id=task.task_id, round=rnd.round, updates=unhashed)
                for u in updates:
                    acc.fold_record(u)
                log.info("round recovered", task_id=task.task_id, round=rnd.round, updates=len(updates))
                self.rounds.maybe_close(task.task_id)

    def stored_copy_damaged(self, task_id: str, exc: StoredCopyDamaged) -> None:
        """A stored blob or spill file of the task was found damaged while it was read: the operator's log
        names the file; a running task fails with ``exc.message`` ("stored copy damaged: ..., restore from
        backup"), and nothing more is published from it."""
        log.error("stored copy damaged", task_id=task_id, what=exc.what, path=exc.path)
        with self.lock:
            self.rounds.damaged(task_id, exc)
            self.changed.notify_all()

    def wait_for_change(self, timeout: float) -> None:
        with self.changed:
            if not self._stopping:
                self.changed.wait(timeout)

    def tick(self) -> float:
        """Apply deadlines now (aggregator_service.deadlines); seconds until the next one."""
        return self.ticker.tick()

    # tasks ----------------------------------------------------------------------------------------------
    def create_task(self, owner: str, idempotency_key: str, spec: task_pb2.TaskSpec, manifest: Manifest,
                    signed_task: bytes = b"") -> str:
        """Record a task whose model blobs are already durable (with the owner's ``signed_task``, relayed to the
        sites), and open its first round (Refused INVALID_ARGUMENT for a spec that cannot run)."""
        validate_spec(spec, manifest)
        with self.lock:
            task_id = self.rounds.create_task(owner, idempotency_key, spec, manifest, signed_task)
            self.changed.notify_all()
            return task_id

    def cancel(self, task_id: str, by: str, reason: str) -> None:
        with self.lock:
            self.rounds.cancel(task_id, by, reason)
            self.changed.notify_all()

    # agents -------------------------------------------------------------------------------------------
    def hello(self, site: str, features: Iterable[str], secure_aggregation: bool, codecs: Iterable[str]) -> None:
        """Remember what ``site`` announced at Hello: features and secure-aggregation capability
        (aggregator_service.secure_rounds) and update codecs."""
        with self.lock:
            self.secagg.hello(site, list(features), secure_aggregation)
            self.results.hello(site, features)
            self.admission.hello(site, features)
            self.sites.hello_codecs(site, codecs)
            self.changed.notify_all()

    def site_connected(self, site: str) -> None:
        with self.lock:
            self.sites.connected(site)
            self.changed.notify_all()

    def site_disconnected(self, site: str) -> None:
        with self.lock:
            self.sites.disconnected(site)
            for phase in self.store.open_result_phases():  # a phase open to any site may wait for nobody now
                self.results.maybe_close(phase.task_id)
            self.changed.notify_all()

    def connected_count(self) -> int:
        """How many distinct sites have a work stream open now."""
        return len(self.sites.connected_sites())

    def connected_sites(self) -> list[str]:
        return self.sites.connected_sites()

    def eligible(self, task_id: str, spec: task_pb2.TaskSpec, site: str) -> bool:
        return self.sites.eligible(task_id, spec, site)

    def ended_work(self, site: str, task_ids: list[str]) -> list[agent_pb2.WorkItem]:
        """Cancellations of the tasks ``site`` holds open that ended while it was away (Sites.ended_work)."""
        with self.lock:
            return self.sites.ended_work(site, task_ids)

    def next_work(self, site: str, delivered: dict[tuple[str, int, int], bool]) -> list[agent_pb2.WorkItem]:
        """Work for ``site`` not yet delivered on this stream: new assignments and cancellations."""
        with self.lock:
            return self.sites.next_work(site, delivered) + self.results.next_work(site, delivered)

    def hold(self, site: str, task_id: str, rnd: int, reason: str) -> None:
        """``site`` holds its assignment to round ``rnd`` without refusing it (``reason``, e.g. awaiting approval by
        its IT), or no longer does (``reason`` empty). Shown to the task owner while the site has not reported;
        the round still waits for the site until its deadline. Refused when the site has no open assignment
        there."""
        with self.lock:
            require_assignment(self.store, site, task_id, rnd, "hold")  # PERMISSION_DENIED if never assigned
            self.rounds.task(task_id)
            if self.sites.hold(site, task_id, rnd, reason):
                self.changed.notify_all()

    def decline(self, site: str, task_id: str, rnd: int, reason: str, permanent: bool) -> None:
        """``site`` declined round ``rnd`` (``permanent``: the whole task): the round may close without it, or
        the task fail when quorum is out of reach (aggregator_service.rounds). Refused (PERMISSION_DENIED, nothing
        written) when ``site`` was never assigned to the task, FAILED_PRECONDITION when not to that round."""
        with self.lock:
            require_assignment(self.store, site, task_id, rnd, "decline")
            self.rounds.task(task_id)
            self.sites.decline(site, task_id, rnd, reason, permanent)
            self.secagg.declined(site, task_id, rnd)
            self.rounds.after_decline(task_id, permanent)
            self.results.maybe_close(task_id)
            self.changed.notify_all()

    def submit_result(self, site: str, request: agent_pb2.SubmitResultRequest) -> agent_pb2.SubmitResultResponse:
        """Keep a site's results (aggregator_service.results.ResultPhases.submit)."""
        with self.lock:
            answer = self.results.submit(site, request)
            self.changed.notify_all()
            return answer

    # bytes ----------------------------------------------------------------------------------------------
    def add_downlink(self, task_id: str, nbytes: int, *, site: str = "", wire_bytes: int = 0) -> None:
        """Charge bytes sent to sites to the task's open round; with ``site`` also to that site's assignment
        (payload ``nbytes`` and ``wire_bytes`` as serialized)."""
        self.metrics.downlink_sent(task_id, nbytes)
        with self.lock, self.store.transaction() as tx:
            tx.add_downlink(task_id, nbytes, site=site, wire_bytes=wire_bytes)

    def add_uplink(self, task_id: str, rnd: int, nbytes: int) -> None:
        self.metrics.uplink(task_id, nbytes)
        with self.lock, self.store.transaction() as tx:
            tx.add_uplink(task_id, rnd, nbytes)

    # updates --------------------------------------------------------------------------------------------
    def submit_update(self, site: str, header: agent_pb2.UpdateHeader, messages: Iterator,
                      header_wire_bytes: int = 0) -> agent_pb2.UpdateReceipt:
        """Admit one plain update (aggregator_service.update_admission.UpdateAdmission.admit)."""
        return self.admission.admit(site, header, messages, header_wire_bytes)

    def close_secure_round(self, task_id: str, rnd: int, mean: dict[str, np.ndarray], metrics: dict[str, float],
                           summary: str) -> None:
        """Close round ``rnd`` with a secure-aggregation result: ``mean`` (the survivors' sample-weighted mean, per
        tensor some survivor sent, decoded from the unmasked sum) is folded into the task's strategy as one update
        of weight 1, then the round
        closes as usual with ``metrics`` added to its metrics."""
        with self.lock:
            if self.rounds.close_secure_round(task_id, rnd, mean, metrics, summary):
                self.changed.notify_all()
