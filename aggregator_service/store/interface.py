"""The aggregator's durable state as an interface: :class:`Store` (reads) and :class:`StoreTransaction`
(writes, one atomic unit of work). The SQLite implementation is :mod:`aggregator_service.store.sqlite_store`;
another database (PostgreSQL) plugs in by implementing these two classes, nothing else of the service knows
which one runs.

Contract of every implementation:

- **Durability.** A transaction's writes are durable when ``with store.transaction()`` exits without an
  exception (the service acknowledges an update, a submission or a decision only after that); on an exception
  none of them happened.
- **Atomicity and isolation.** Transactions are serialized: one state transition (e.g. closing a round: the new
  model, the round's figures, its events, the next round) is seen whole or not at all by readers.
- **Events.** ``StoreTransaction.add_event`` journals a task event (``WatchTask``); after the commit, the
  transaction's events, each ``{"task_id", "kind", "message", "actor", "details"}``, are passed to
  ``Store.on_commit`` (the audit trail and the metrics), and never after a rollback.
- **Uniqueness.** A task is unique per (owner, idempotency key); an update per (task, round, site) and per
  (task, idempotency key): recording a second one raises instead of storing it twice.
- **Reads** return typed, immutable records (:mod:`aggregator_service.store.records`) or None when there is
  no such row; lists come in the order each method states.
- Methods are safe to call from several threads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Callable, Iterable

from fedclinic.transport.package import Manifest
from fedclinic.proto import task_pb2, tensors_pb2

from aggregator_service.store.records import (AssignmentRecord, EventRecord, ResultPhaseRecord, RoundRecord,
                                              SiteResultRecord, StateGauges, TaskRecord, UpdateRecord)

CommitHook = Callable[[list[dict[str, Any]]], None]


class StoreTransaction(ABC):
    """The writes of one atomic unit of work (see the module docstring). Obtained from
    :meth:`Store.transaction`; valid only inside its ``with`` block."""

    @abstractmethod
    def add_event(self, task_id: str, kind: str, message: str, *, actor: str = "", **details: Any) -> None:
        """Journal a task event; ``actor`` (who caused it) and ``details`` (plain JSON values) go only to
        ``on_commit`` (the audit trail), with the message."""

    # models -------------------------------------------------------------------------------------------
    @abstractmethod
    def put_model(self, manifest: Manifest) -> str:
        """Record a model (its blobs already durable) and return its hash; recording it again is a no-op."""

    @abstractmethod
    def put_model_deltas(self, model_hash: str, deltas: Iterable[tensors_pb2.DownlinkDelta]) -> None:
        """Record tensors of ``model_hash`` that are also stored as an encoded change (payload blob =
        ``header.sha256``)."""

    # tasks and rounds ---------------------------------------------------------------------------------
    @abstractmethod
    def insert_task(self, task_id: str, owner: str, idempotency_key: str, spec: task_pb2.TaskSpec, state: int,
                    created_ms: int, initial_model: str) -> None:
        """Record a new task (unique per owner and idempotency key)."""

    @abstractmethod
    def set_signed_task(self, task_id: str, statement: bytes) -> None:
        """Keep the owner's signed task (a serialized fedclinic.v1.SignedStatement) with the task, to relay it to
        the sites in every assignment as it was submitted."""

    @abstractmethod
    def open_round(self, task_id: str, rnd: int, attempt: int, sites_target: int, opened_ms: int, deadline_ms: int,
                   base_model: str) -> None:
        """Open round ``rnd`` (replacing a row of the same number) and make it the running task's current one."""

    @abstractmethod
    def reopen_round(self, task_id: str, rnd: int, deadline_ms: int) -> None:
        """Give the open round a new attempt (attempt + 1) with a new deadline; its updates are kept."""

    @abstractmethod
    def close_round(self, task_id: str, rnd: int, closed_ms: int, model_hash: str, metrics: dict[str, float],
                    strategy_state: dict[str, Any]) -> None:
        """Close the round with its new global model, its figures and the strategy state it leaves."""

    @abstractmethod
    def fail_round(self, task_id: str, rnd: int, closed_ms: int) -> None:
        """Mark the round failed."""

    @abstractmethod
    def complete_task(self, task_id: str, final_model: str, updated_ms: int) -> None:
        """The task completed with ``final_model``."""

    @abstractmethod
    def end_task(self, task_id: str, state: int, error: str, updated_ms: int) -> None:
        """The task ended in ``state`` (failed or cancelled), ``error`` saying why."""

    # sites --------------------------------------------------------------------------------------------
    @abstractmethod
    def assign(self, task_id: str, rnd: int, site: str, attempt: int, assigned_ms: int) -> None:
        """Assign ``site`` to the round's attempt (replacing an assignment to an earlier attempt)."""

    @abstractmethod
    def hold(self, task_id: str, rnd: int, site: str, reason: str) -> None:
        """The site holds its assignment (``reason``; "" = no longer)."""

    @abstractmethod
    def decline(self, task_id: str, rnd: int, site: str, reason: str, permanent: bool) -> None:
        """The site declined the round; ``permanent``: every later round of the task too."""

    # updates and bytes --------------------------------------------------------------------------------
    @abstractmethod
    def record_update(self, update: UpdateRecord) -> None:
        """Record a durable update and add its payload bytes to its round's uplink (raises on a second update
        of the same site and round, or with the same idempotency key)."""

    @abstractmethod
    def record_statement(self, task_id: str, rnd: int, attempt: int, site: str, statement: bytes) -> None:
        """Keep ``site``'s signed round statement (a serialized fedclinic.v1.SignedStatement) with the round; a
        later one of the same site, round and attempt (a re-keyed secure session) replaces it."""

    @abstractmethod
    def record_secure_sum(self, task_id: str, rnd: int, survivors: list[str], sum_sha256: str, params: str) -> None:
        """Keep a secure round's unmasked ring sum (blob ``sum_sha256``), its survivors and its layout (JSON)."""

    @abstractmethod
    def add_uplink(self, task_id: str, rnd: int, nbytes: int) -> None:
        """Add bytes received outside plain updates to the round's uplink."""

    @abstractmethod
    def add_downlink(self, task_id: str, nbytes: int, *, site: str = "", wire_bytes: int = 0) -> None:
        """Charge bytes sent to the task's open round; with ``site`` also to its assignment there."""

    # result phases (aggregator_service.results) ----------------------------------------------------------
    @abstractmethod
    def open_result_phase(self, phase: ResultPhaseRecord) -> None:
        """Open the task's result phase (one per task) and mark the task running with ``phase.round`` current."""

    @abstractmethod
    def close_result_phase(self, task_id: str, closed_ms: int) -> None: ...

    @abstractmethod
    def record_result(self, result: SiteResultRecord) -> bool:
        """Keep a site's values for one model; False (nothing written) when that cell is already there."""

    @abstractmethod
    def set_round_metrics(self, task_id: str, rnd: int, metrics: dict[str, float]) -> None:
        """Replace a closed round's figures (a site's evaluation of it arrived after it closed)."""


class Store(ABC):
    """Reads of the aggregator's durable state, and :meth:`transaction` for writes (module docstring)."""

    #: called after each commit with that transaction's events (see the module docstring)
    on_commit: CommitHook | None = None

    @property
    @abstractmethod
    def state_dir(self) -> Path:
        """The service's local state folder (spill files live under ``state_dir / "updates"``)."""

    @property
    @abstractmethod
    def schema_version(self) -> int:
        """The schema version of the stored state."""

    @abstractmethod
    def transaction(self) -> AbstractContextManager[StoreTransaction]:
        """One atomic, durable unit of work (module docstring)."""

    @abstractmethod
    def close(self) -> None:
        """Release the connection; the store is unusable afterwards."""

    # tasks --------------------------------------------------------------------------------------------
    @abstractmethod
    def task(self, task_id: str) -> TaskRecord | None: ...

    @abstractmethod
    def signed_task(self, task_id: str) -> bytes:
        """The task's signed task (serialized SignedStatement) as submitted; b"" for a task submitted unsigned."""

    @abstractmethod
    def task_by_key(self, owner: str, idempotency_key: str) -> TaskRecord | None:
        """The task ``owner`` submitted with ``idempotency_key``."""

    @abstractmethod
    def tasks(self, state: int | None = None) -> list[TaskRecord]:
        """Every task (only those in ``state`` when given), oldest first."""

    # models -------------------------------------------------------------------------------------------
    @abstractmethod
    def model(self, model_hash: str) -> Manifest | None: ...

    @abstractmethod
    def model_deltas(self, model_hash: str) -> dict[str, tensors_pb2.DownlinkDelta]:
        """name -> the encoded change recorded for that tensor of ``model_hash`` (empty when none)."""

    @abstractmethod
    def task_models(self, task_id: str) -> frozenset[str]:
        """The hashes of every model of the task: its initial model, each round's base model and each closed
        round's model (empty for an unknown task). A model outside this set is never read through the task."""

    @abstractmethod
    def task_blobs(self, task_id: str) -> frozenset[str]:
        """The sha256 of every blob the task references and may stream: the tensors and files of each of
        :meth:`task_models` and the payloads of their encoded changes (:meth:`model_deltas`); empty for an
        unknown task. The aggregator streams a blob through a task only if it is in this set (a hash is not a
        capability: another task's blob is refused even when it exists in the blob store)."""

    # rounds -------------------------------------------------------------------------------------------
    @abstractmethod
    def round(self, task_id: str, rnd: int) -> RoundRecord | None: ...

    @abstractmethod
    def open_round_of(self, task_id: str) -> RoundRecord | None:
        """The task's OPEN round (a cancelled task's last round stays OPEN in the store: check the task)."""

    @abstractmethod
    def rounds_of(self, task_id: str) -> list[RoundRecord]:
        """The task's rounds, by number."""

    @abstractmethod
    def open_rounds(self, *, running_only: bool = True) -> list[RoundRecord]:
        """OPEN rounds, of running tasks only unless ``running_only`` is False."""

    @abstractmethod
    def last_closed_round(self, task_id: str) -> RoundRecord | None:
        """The task's highest CLOSED round."""

    @abstractmethod
    def newest_round_model(self, task_id: str) -> str:
        """The model of the task's highest round that has one ("" when none)."""

    # sites --------------------------------------------------------------------------------------------
    @abstractmethod
    def assignment(self, task_id: str, rnd: int, site: str) -> AssignmentRecord | None: ...

    @abstractmethod
    def assignments_of(self, task_id: str, rnd: int) -> list[AssignmentRecord]:
        """The round's assignments, by site name."""

    @abstractmethod
    def is_assigned(self, task_id: str, site: str) -> bool:
        """Was ``site`` ever assigned to a round of the task?"""

    @abstractmethod
    def active_assignments(self, task_id: str, rnd: int, attempt: int) -> int:
        """Assignments of the round not declined that belong to ``attempt`` or whose site has reported."""

    @abstractmethod
    def outstanding_assignments(self, task_id: str, rnd: int) -> int:
        """Assignments of the round neither declined nor reported."""

    @abstractmethod
    def site_declines(self, task_id: str) -> dict[str, str]:
        """site -> reason, for every site that declined the task for good."""

    @abstractmethod
    def declined_for_good(self, task_id: str, site: str) -> bool: ...

    # updates and events ---------------------------------------------------------------------------------
    @abstractmethod
    def update_by_key(self, task_id: str, idempotency_key: str) -> UpdateRecord | None: ...

    @abstractmethod
    def has_update(self, task_id: str, rnd: int, site: str) -> bool: ...

    @abstractmethod
    def updates_of(self, task_id: str, rnd: int) -> list[UpdateRecord]:
        """The round's updates, in the order they were received."""

    @abstractmethod
    def update_count(self, task_id: str, rnd: int) -> int: ...

    @abstractmethod
    def statements_of(self, task_id: str, rnd: int) -> list[bytes]:
        """The round's signed site statements (serialized SignedStatement), by site and attempt."""

    @abstractmethod
    def secure_sum(self, task_id: str, rnd: int) -> tuple[list[str], str, str] | None:
        """A secure round's (survivors, sum blob sha256, layout JSON), or None."""

    @abstractmethod
    def spill_paths(self) -> set[str]:
        """The spill files every stored update references."""

    @abstractmethod
    def events_of(self, task_id: str, after_seq: int = 0) -> list[EventRecord]:
        """The task's events with ``seq > after_seq``, in order."""

    @abstractmethod
    def result_phase(self, task_id: str) -> ResultPhaseRecord | None: ...

    @abstractmethod
    def open_result_phases(self) -> list[ResultPhaseRecord]:
        """Result phases not closed, of running tasks."""

    @abstractmethod
    def results_of(self, task_id: str, rnd: int) -> list[SiteResultRecord]:
        """The site results kept for the task's round or phase ``rnd``, by site then model."""

    @abstractmethod
    def reported_sites(self, task_id: str) -> list[str]:
        """The sites that sent an update or a signed round statement in any round of the task (those that
        trained), sorted."""

    @abstractmethod
    def gauges(self) -> StateGauges:
        """The counts the metrics endpoint reads at each scrape."""
