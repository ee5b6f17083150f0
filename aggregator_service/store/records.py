"""The rows of the aggregator's state as typed, immutable records (what :class:`~aggregator_service.store.Store`
methods return). Times are Unix milliseconds; states are the ``control_pb2`` enums; ``metrics`` are the JSON
objects stored with rounds and updates, already parsed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fedclinic.proto import task_pb2


@dataclass(frozen=True)
class TaskRecord:
    """A submitted task. ``state`` is a ``control_pb2.TaskState``; ``error`` says why it failed or who
    cancelled it; ``final_model`` is "" until it completes."""

    task_id: str
    owner: str
    idempotency_key: str
    spec: task_pb2.TaskSpec
    state: int
    current_round: int
    error: str
    created_ms: int
    updated_ms: int
    initial_model: str
    final_model: str


@dataclass(frozen=True)
class RoundRecord:
    """One round of a task (its latest attempt). ``state`` is a ``control_pb2.RoundState``; ``model_hash`` is
    "" until the round closed; ``strategy_state`` maps a state key to ``[blob sha256, dtype, shape]``."""

    task_id: str
    round: int
    attempt: int
    state: int
    sites_target: int
    opened_ms: int
    deadline_ms: int
    closed_ms: int
    base_model: str
    model_hash: str
    uplink_bytes: int
    downlink_bytes: int
    metrics: dict[str, float] = field(default_factory=dict)
    strategy_state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AssignmentRecord:
    """A site's assignment to a round: ``declined`` / ``held`` are the site's reasons ("" = not)."""

    task_id: str
    round: int
    site: str
    attempt: int
    assigned_ms: int
    declined: str
    held: str
    downlink_bytes: int
    downlink_wire_bytes: int


@dataclass(frozen=True)
class UpdateRecord:
    """A durable update: its spill file, the layout of its tensors in that file (JSON, see
    aggregator_service.folding.UpdateLayout), the byte counts (payload as sent, fp32-equivalent, wire) and
    ``spill_sha256``, the hash of the whole spill file when the update was acknowledged ("" for updates stored
    by a release that did not record it); recovery checks the file against it before folding it again."""

    update_id: str
    task_id: str
    round: int
    site: str
    idempotency_key: str
    num_samples: int
    nbytes: int
    spill_path: str
    layout: str
    metrics: dict[str, float]
    eval_metrics: dict[str, float]
    received_ms: int
    fp32_bytes: int
    wire_bytes: int
    spill_sha256: str = ""


@dataclass(frozen=True)
class ResultPhaseRecord:
    """A task's result phase (aggregator_service.results): ``work`` "evaluate" | "statistics", its number
    ``round`` in the task's assignments, the model evaluated ("" for statistics); ``closed_ms`` 0 while open."""

    task_id: str
    round: int
    work: str
    model_hash: str
    opened_ms: int
    deadline_ms: int
    closed_ms: int


@dataclass(frozen=True)
class SiteResultRecord:
    """One site's values for one model (or its dataset) in a result phase or a training round, as received
    (suppression is applied when they are read out, with the site's ``min_cell``)."""

    task_id: str
    round: int
    site: str
    model: str
    work: str
    model_hash: str
    values: dict[str, float]
    min_cell: int
    received_ms: int


@dataclass(frozen=True)
class EventRecord:
    """A journalled task event, as ``WatchTask`` streams it (``seq`` grows over all tasks)."""

    seq: int
    task_id: str
    kind: str
    message: str
    unix_ms: int


@dataclass(frozen=True)
class StateGauges:
    """Counts read at each metrics scrape: tasks by state, open rounds of running tasks, updates waiting in
    them, and assignments to them that have neither reported nor declined."""

    tasks_by_state: dict[int, int]
    open_rounds: int
    pending_updates: int
    outstanding_assignments: int


def now_ms() -> int:
    """The current time in Unix milliseconds (the unit of every time in the store)."""
    return int(time.time() * 1000)
