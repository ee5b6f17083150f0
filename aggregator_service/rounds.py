"""The round state machine: task lifecycle, opening, closing and failing rounds, quorum.

State machine of a task: QUEUED -> RUNNING -> COMPLETED | FAILED | CANCELLED. A running task has exactly
one OPEN round. A round closes (CLOSED) when ``sites_target`` updates have arrived, when at least
``min_sites`` have and nobody else can report, or at its deadline if at least ``min_sites`` have; otherwise
the task's quorum policy either reopens it (new attempt, new deadline, up to ``max_round_retries`` times;
updates already received are kept, they were computed on the same global model) or fails the task. A task
that names its sites fails at once when so many declined it for good that quorum is out of reach.

Closing a round finalizes the strategy's accumulator (aggregator_service.folding) into the next global model
(under a downlink codec, as the change the sites rebuild), stores it with the round's figures
(aggregator_service.round_metrics) and the strategy state in one transaction, and opens the next round or
completes the task. Every transition is one store transaction with its events. Callers hold the engine's lock.
"""

from __future__ import annotations

import math
import shutil
import uuid
from pathlib import Path

import grpc
import numpy as np
import structlog

from fedclinic.transport import codec_wire
from fedclinic.transport import downlink
from fedclinic.runtime.blobstore import BlobStore
from fedclinic.runtime.failpoints import failpoint
from fedclinic.errors import ConfigError, IntegrityError, Refused
from fedclinic.transport.package import Manifest, TensorEntry
from fedclinic.proto import control_pb2, task_pb2, tensors_pb2
from fedclinic.spec.validation import check_spec
from fedclinic.strategies.tensorsource import FileTensor, TensorLike

from aggregator_service.folding import Folding, put_tensor
from aggregator_service.results import ResultPhases, round_eval_line, task_kind
from aggregator_service.round_metrics import round_metrics
from aggregator_service.sites import Sites
from aggregator_service.status import TERMINAL, task_of
from aggregator_service.store import RoundRecord, Store, StoreTransaction, TaskRecord, now_ms
from aggregator_service.stored_data import StoredCopyDamaged, verify_model
from aggregator_service.update_admission import sent_tensors

log = structlog.get_logger("fedclinic.aggregator.engine")

S = control_pb2


def validate_spec(spec: task_pb2.TaskSpec, manifest: Manifest) -> None:
    """Reject task specs that cannot run (fedclinic.spec.validation), as Refused(INVALID_ARGUMENT) with a
    message that says what to change."""
    try:
        check_spec(spec, manifest)
    except ConfigError as exc:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None


class RoundMachine:
    """Task and round transitions (module docstring)."""

    def __init__(self, store: Store, blobs: BlobStore, folding: Folding, sites: Sites, spill_root: Path,
                 results: ResultPhases | None = None) -> None:
        self.store = store
        #: result phases (aggregator_service.results): the final evaluation, evaluate and statistics tasks
        self.results = results
        self.blobs = blobs
        self.folding = folding
        self.sites = sites
        self.spill_root = spill_root

    # tasks ----------------------------------------------------------------------------------------------
    def task(self, task_id: str) -> TaskRecord:
        return task_of(self.store, task_id)

    def create_task(self, owner: str, idempotency_key: str, spec: task_pb2.TaskSpec, manifest: Manifest,
                    signed_task: bytes = b"") -> str:
        """Record a task whose model blobs are already durable, with the owner's ``signed_task`` (serialized
        SignedStatement, b"" when unsigned), and open its first round (the same task again for the same owner and
        key)."""
        existing = self.store.task_by_key(owner, idempotency_key)
        if existing is not None:
            return existing.task_id
        task_id = "t-" + uuid.uuid4().hex[:12]
        with self.store.transaction() as tx:
            model_hash = tx.put_model(manifest)
            tx.insert_task(task_id, owner, idempotency_key, spec, S.TASK_STATE_QUEUED, now_ms(), model_hash)
            if signed_task:  # in the same transaction: no assignment of the task ever goes out without it
                tx.set_signed_task(task_id, signed_task)
            tx.add_event(task_id, "submitted", f"task {spec.name!r} submitted by {owner}", actor=owner,
                         name=spec.name, family=spec.family, dataset=spec.dataset, model_hash=model_hash,
                         rounds=spec.rounds.num_rounds)
            if task_kind(spec) and self.results is not None:  # "evaluate" / "statistics": no rounds, one phase
                self.results.open_for_task(tx, task_id, spec, model_hash)
            else:
                self._open_round(tx, task_id, spec, 1, 1, model_hash)
        log.info("task created", task_id=task_id, owner=owner, name=spec.name)
        return task_id

    def cancel(self, task_id: str, by: str, reason: str) -> None:
        task = self.task(task_id)
        if task.state in TERMINAL:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"task {task_id} already ended ({S.TaskState.Name(task.state)}); nothing to cancel")
        with self.store.transaction() as tx:
            tx.end_task(task_id, S.TASK_STATE_CANCELLED, f"cancelled by {by}: {reason}".strip(": "), now_ms())
            tx.add_event(task_id, "cancelled", f"cancelled by {by}" + (f": {reason}" if reason else ""), actor=by,
                         reason=reason)
        self.drop_round_data(task_id)

    def _open_round(self, tx: StoreTransaction, task_id: str, spec: task_pb2.TaskSpec, rnd: int, attempt: int,
                    base_model: str) -> None:
        rc = spec.rounds
        target = max(rc.min_sites, math.ceil(rc.participation_fraction * len(self.sites.eligible_connected(task_id,
                                                                                                            spec))))
        opened = now_ms()
        tx.open_round(task_id, rnd, attempt, target, opened, opened + int(rc.round_timeout_s * 1000), base_model)
        tx.add_event(task_id, "round-opened", f"round {rnd} opened (attempt {attempt}); waiting for {target} site(s), "
                     f"deadline in {rc.round_timeout_s:g} s", round=rnd, attempt=attempt, base_model=base_model,
                     sites_target=target)

    # quorum ---------------------------------------------------------------------------------------------
    def maybe_close(self, task_id: str) -> None:
        """Close the task's open round if it has all the updates it waits for, or quorum and nobody else can
        report."""
        rnd = self.store.open_round_of(task_id)
        if rnd is None:
            return
        task = self.task(task_id)
        if task.state != S.TASK_STATE_RUNNING:
            return
        n = self.store.update_count(task_id, rnd.round)
        if n >= rnd.sites_target:
            self.close_round(task_id)
        elif n >= task.spec.rounds.min_sites and not self._could_still_report(task, rnd):
            self.close_round(task_id)  # quorum reached and nobody else can report: no point waiting

    def _could_still_report(self, task: TaskRecord, rnd: RoundRecord) -> bool:
        """Is some site assigned and not yet reported, or connected, eligible and not yet assigned?"""
        if self.store.outstanding_assignments(task.task_id, rnd.round):
            return True
        assigned = {a.site for a in self.store.assignments_of(task.task_id, rnd.round)}
        return any(s not in assigned for s in self.sites.eligible_connected(task.task_id, task.spec))

    def quorum_unreachable(self, task_id: str, spec: task_pb2.TaskSpec) -> str:
        """Why no round of the task can reach quorum any more ("" while it can): the task names its sites and
        so many of them declined it for good that fewer than ``min_sites`` are left. (A task open to every site
        cannot know this: another site may still connect.)"""
        if not spec.sites:
            return ""
        declined = {s: r for s, r in self.store.site_declines(task_id).items() if s in spec.sites}
        able = [s for s in spec.sites if s not in declined]
        if len(able) >= spec.rounds.min_sites:
            return ""
        return (f"quorum can no longer be reached: {len(declined)} of the task's {len(spec.sites)} site(s) declined it "
                f"for good ({'; '.join(f'{s}: {r}' for s, r in sorted(declined.items()))}), which leaves "
                f"{len(able)} ({', '.join(able) or 'none'}) for min_sites {spec.rounds.min_sites}. Address the sites' "
                "reasons, or submit again with other sites or a lower min_sites")

    def after_decline(self, task_id: str, permanent: bool) -> None:
        """A site declined: the round may close without it, or (declined for good) the task may be out of
        quorum's reach, and then it fails now instead of at its deadlines."""
        if self.store.open_round_of(task_id) is not None:
            self.maybe_close(task_id)
        rnd = self.store.open_round_of(task_id) if permanent else None
        if rnd is None:
            return
        why = self.quorum_unreachable(task_id, self.task(task_id).spec)
        if why:
            self.fail_round(task_id, rnd.round, f"round {rnd.round}: {why}")
            log.warning("task failed: quorum unreachable", task_id=task_id, round=rnd.round)

    def deadline_passed(self, rnd: RoundRecord) -> None:
        """Round ``rnd``'s deadline passed: close it with quorum, else reopen it or fail the task (its quorum
        policy)."""
        task_id = rnd.task_id
        spec = self.task(task_id).spec
        rc = spec.rounds
        n = self.store.update_count(task_id, rnd.round)
        if n >= rc.min_sites:
            self.close_round(task_id)
            return
        missed = (f"round {rnd.round} got {n} of the {rc.min_sites} update(s) it needs by its deadline "
                  f"({rc.round_timeout_s:g} s, attempt {rnd.attempt})")
        unable = sorted(s for s in self.sites.connected_sites() if not self.sites.supports_codec(s, spec.update.codec))
        if unable:
            missed += (f"; connected site(s) {', '.join(unable)} did not announce the update codec "
                       f"{spec.update.codec!r} at Hello (upgrade their agents or choose another codec)")
        retry = rc.on_quorum_miss == task_pb2.QUORUM_POLICY_RETRY and rnd.attempt <= rc.max_round_retries
        if retry:
            with self.store.transaction() as tx:
                tx.add_event(task_id, "round-failed", missed + "; quorum policy is 'retry': reopening",
                             round=rnd.round, attempt=rnd.attempt)
                tx.reopen_round(task_id, rnd.round, now_ms() + int(rc.round_timeout_s * 1000))
        else:
            policy = "retry, and the retries are used up" if rc.on_quorum_miss == task_pb2.QUORUM_POLICY_RETRY else "fail"
            self.fail_round(task_id, rnd.round, f"{missed}; quorum policy is '{policy}'. Check that enough agents "
                                                "are connected and allowed to join (see declined events), or lower "
                                                "min_sites")
        log.warning("round missed quorum", task_id=task_id, round=rnd.round, updates=n, retry=retry)

    # closing and failing ----------------------------------------------------------------------------------
    def close_secure_round(self, task_id: str, rnd: int, mean: dict[str, np.ndarray], metrics: dict[str, float],
                           summary: str) -> bool:
        """Close round ``rnd`` with a secure-aggregation result: ``mean`` is folded into the task's strategy as
        one update of weight 1, then the round closes as usual with ``metrics`` added. False when the round is
        no longer open."""
        current = self.store.open_round_of(task_id)
        if current is None or current.round != rnd:
            return False
        acc = self.folding.accumulator(task_id)
        try:
            acc.strategy.accept(mean, 1.0, site="secure-aggregate")
        except (IntegrityError, ValueError) as exc:
            self.fail_round(task_id, rnd, f"round {rnd}: the securely aggregated update was refused: {exc}")
            return True
        self.close_round(task_id, extra_metrics=metrics, closed_with=summary)
        return True

    def close_round(self, task_id: str, *, extra_metrics: dict[str, float] | None = None,
                    closed_with: str = "") -> None:
        """Finalize the open round into the next global model (module docstring)."""
        rnd = self.store.open_round_of(task_id)
        assert rnd is not None
        spec = self.task(task_id).spec
        base = self.store.model(rnd.base_model)
        assert base is not None
        # finalize reads the base model's tensors the sites send (each strategy reads those it has updates of):
        # they are verified here. The others are re-published by reference, not read: their bytes are verified
        # wherever they are read (a download checks each blob before its last chunk goes out, aggregator_service.
        # transfer), so hashing the whole model at every close (a 1 B model: 4 GB a round) would check nothing more
        try:
            verify_model(self.blobs, base, rnd.base_model, tensors=set(sent_tensors(spec, base)))
            acc = self.folding.accumulator(task_id)
        except StoredCopyDamaged as exc:
            log.error("stored copy damaged", task_id=task_id, round=rnd.round, what=exc.what, path=exc.path)
            self.damaged(task_id, exc)
            return
        try:
            new_arrays = acc.strategy.finalize()
        except (IntegrityError, ValueError) as exc:
            self.fail_round(task_id, rnd.round,
                            f"round {rnd.round}: the {spec.strategy or 'fedavg'} aggregation failed: {exc}")
            log.error("aggregation failed", task_id=task_id, round=rnd.round, error=str(exc))
            return
        entries, deltas = [], []
        codec = downlink.downlink_codec(spec.update.downlink_codec)
        for t in base.tensors:
            arr = new_arrays.get(t.name)
            if arr is None:
                entries.append(t)
                continue
            delta = None
            if codec is not None and t.dtype == "float32" and arr.size:  # the broadcast model is the global one
                arr, delta = self._broadcast_delta(task_id, rnd.round, t, _in_memory(arr), codec)
            sha = put_tensor(self.blobs, arr)  # a spilled result streams from its file
            entries.append(TensorEntry(t.name, t.dtype, t.shape, sha, t.nbytes))
            if delta is not None and sha != t.sha256:
                deltas.append(delta)
        manifest = Manifest(tuple(entries), base.files)
        failpoint("aggregator.round.finalized")  # kill campaign: new model stored, round not closed
        saved_state = self.folding.save_state(acc.strategy)
        reports = self.store.updates_of(task_id, rnd.round)
        metrics = round_metrics(spec, reports, acc.strategy, extra_metrics, self.store.results_of(task_id, rnd.round))
        with self.store.transaction() as tx:
            model_hash = tx.put_model(manifest)
            tx.put_model_deltas(model_hash, deltas)
            tx.close_round(task_id, rnd.round, now_ms(), model_hash, metrics, saved_state)
            evaluated = f"; {round_eval_line(rnd.round, metrics)}" if metrics.get("eval_sites") else ""
            tx.add_event(task_id, "round-closed", f"round {rnd.round} closed with "
                         f"{closed_with or f'{len(reports)} update(s)'}; model {model_hash[:12]}{evaluated}",
                         round=rnd.round, model_hash=model_hash, updates=len(reports))
            last = rnd.round >= spec.rounds.num_rounds
            if last and self.results is not None and self.results.open_after_training(tx, task_id, spec, rnd.round,
                                                                                      model_hash):
                pass  # the task completes when the final model's evaluation closes (aggregator_service.results)
            elif last:
                tx.complete_task(task_id, model_hash, now_ms())
                tx.add_event(task_id, "completed", f"task completed after {rnd.round} round(s)",
                             final_model=model_hash, rounds=rnd.round)
            else:
                self._open_round(tx, task_id, spec, rnd.round + 1, 1, model_hash)
        failpoint("aggregator.round.published")  # kill campaign: round closed, spill not yet dropped
        log.info("round closed", task_id=task_id, round=rnd.round, updates=len(reports), model=model_hash[:12])
        self.folding.drop(task_id)
        shutil.rmtree(self.spill_root / task_id / str(rnd.round), ignore_errors=True)

    def _broadcast_delta(self, task_id: str, rnd: int, base: TensorEntry, new: np.ndarray, codec
                         ) -> tuple[np.ndarray, tensors_pb2.DownlinkDelta]:
        """Round ``rnd``'s global tensor under the task's downlink codec (fedclinic.transport.downlink): the base tensor plus
        the decoded change, and that change as agents fetch it (its payload stored as a blob)."""
        broadcast, enc = downlink.compress(self.blobs.array(base.sha256, base.dtype, base.shape), new, codec,
                                           downlink.tensor_rng(task_id, rnd, base.name))
        payload_sha = self.blobs.put(enc.payload)
        header = tensors_pb2.TensorHeader(name=base.name, dtype="float32", shape=list(base.shape), codec=codec.spec,
                                          sha256=payload_sha, encoded_nbytes=len(enc.payload),
                                          codec_params=codec_wire.header_params(enc))
        return broadcast, tensors_pb2.DownlinkDelta(name=base.name, base_sha256=base.sha256, header=header)

    def fail_round(self, task_id: str, rnd: int, message: str) -> None:
        """Round ``rnd`` failed and takes the task with it (``message`` says why); its spilled updates go."""
        with self.store.transaction() as tx:
            tx.fail_round(task_id, rnd, now_ms())
            tx.end_task(task_id, S.TASK_STATE_FAILED, message, now_ms())
            tx.add_event(task_id, "failed", message)
        self.drop_round_data(task_id)

    def damaged(self, task_id: str, exc: StoredCopyDamaged) -> None:
        """A stored copy the task reads is damaged: a running task's open round fails and takes the task with it,
        with ``exc.message`` ("stored copy damaged: <what>, restore from backup") as the reason; nothing is
        published from it. A task that already ended is left as it is (the reader was refused)."""
        task = self.store.task(task_id)
        rnd = self.store.open_round_of(task_id)
        if task is None or task.state != S.TASK_STATE_RUNNING or rnd is None:
            return
        self.fail_round(task_id, rnd.round, f"round {rnd.round}: {exc.message}")

    def drop_round_data(self, task_id: str) -> None:
        """Forget the task's accumulator and delete its spill files (its task ended)."""
        self.folding.drop(task_id)
        shutil.rmtree(self.spill_root / task_id, ignore_errors=True)


def _in_memory(x: TensorLike) -> np.ndarray:
    """A strategy's result tensor as an array (a spilled one read from its file: one tensor, not the model)."""
    return x.read() if isinstance(x, FileTensor) else x
