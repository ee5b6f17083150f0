"""The site's privacy ledger: how much of each dataset's privacy budget every task has spent.

Every DP task that trains on a dataset spends part of that dataset's budget, and spends add up across tasks
(sequential composition: epsilons and deltas of separate tasks on the same records sum). The ledger keeps,
per dataset and task, the epsilon planned when the task was admitted and the epsilon actually spent so far
(the task accountant's cumulative epsilon after its last charged round).

Rules, enforced in one SQLite transaction each (``BEGIN IMMEDIATE`` serialises concurrent tasks and processes;
WAL with ``synchronous=FULL`` makes a committed charge survive a power cut):

admit(dataset, task, planned_epsilon, delta)
    Refused with :class:`BudgetExceeded` when ``committed + planned > budget`` (or the deltas likewise), where
    ``committed`` = spent by finished tasks + max(planned, spent) of running ones. Admission happens before
    anything is downloaded or trained; the refusal message reaches the task owner.
charge(dataset, task, round, epsilon_after)
    Called **before** an update leaves the site (before it is even written to the outbox, whose resends do not
    charge again). Refused when the task was not admitted, when it would spend more than it planned, or when
    the dataset's committed spend with this charge would exceed the budget (e.g. the budget was lowered since
    admission). Idempotent per round: charging a round again keeps the larger epsilon.
finish(dataset, task) / finish_task(task)
    The task ended for this site: its reservation shrinks to what it spent (the unspent rest of its plan goes
    back to the dataset's budget) and it is charged no more. Called when the agent learns that the task will
    spend nothing more here (see below); idempotent, and a no-op for a task the ledger does not hold.

When a task ends for the site (:class:`hospital_agent.site_privacy.SitePrivacy` calls ``finish``):

- its last round (``rounds.num_rounds``) is charged: the plan covers no further round;
- the aggregator cancels it or it fails (``CancelWork`` on the work stream);
- the site declines it for good (``permanent`` decline: the aggregator never assigns it here again);
- the agent reconnects after the task ended (cancelled, failed or completed) while it was away or before the news
  reached it: its work stream names the tasks it holds open (:meth:`PrivacyLedger.open_tasks`) and the aggregator
  answers each that ended with ``CancelWork`` (``completed`` for a completed task);
- the site's admin says so (``hospital-agent privacy finish TASK``): for a task that completed without this
  site in its last round while the agent stayed connected (nobody tells a connected site of a completion).

So a crash between charge and send leaves the spend recorded (the update may never arrive: the ledger
over-counts, never under-counts), and no sequence of concurrent admissions and charges lets the committed
spend exceed a budget.
"""

from __future__ import annotations

import json
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from fedclinic.errors import ConfigError, FedclinicError

_SLACK = 1e-9  # float noise of accountant outputs


class BudgetExceeded(FedclinicError):
    """A task's spend would exceed a dataset's privacy budget."""


@dataclass(frozen=True)
class Budget:
    epsilon: float
    delta: float


@dataclass(frozen=True)
class TaskSpend:
    task_id: str
    planned_epsilon: float
    spent_epsilon: float
    delta: float
    rounds_charged: int
    finished: bool
    #: what the task's epsilon protects: "example" (one row) or "patient" (all of a patient's rows; its sampling
    #: rate is over patients). Kept in the task's accountant state; epsilons of tasks with different units on one
    #: dataset are added as they are (see docs/hospital-it.md)
    unit: str = "example"


@dataclass(frozen=True)
class DatasetSpend:
    dataset: str
    budget: Budget | None
    spent_epsilon: float       # what has left the site
    committed_epsilon: float   # spent + what running tasks may still spend
    committed_delta: float
    tasks: tuple[TaskSpend, ...]

    @property
    def remaining_epsilon(self) -> float | None:
        return None if self.budget is None else max(0.0, self.budget.epsilon - self.committed_epsilon)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS budgets (dataset TEXT PRIMARY KEY, epsilon REAL NOT NULL, delta REAL NOT NULL);
CREATE TABLE IF NOT EXISTS tasks (
    dataset TEXT NOT NULL, task_id TEXT NOT NULL, planned_epsilon REAL NOT NULL, spent_epsilon REAL NOT NULL,
    delta REAL NOT NULL, finished INTEGER NOT NULL DEFAULT 0, accountant TEXT NOT NULL DEFAULT '',
    admitted_ms INTEGER NOT NULL, PRIMARY KEY (dataset, task_id));
CREATE TABLE IF NOT EXISTS charges (
    dataset TEXT NOT NULL, task_id TEXT NOT NULL, round INTEGER NOT NULL, epsilon_after REAL NOT NULL,
    charged_ms INTEGER NOT NULL, PRIMARY KEY (dataset, task_id, round));
"""


class PrivacyLedger:
    """A ledger file (SQLite) shared by every task and process of one agent; safe to open many times."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, isolation_level=None, timeout=60)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(_SCHEMA)  # idempotent; runs in its own transaction
        finally:
            db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, isolation_level=None, timeout=60)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        finally:
            db.close()

    def set_budget(self, dataset: str, epsilon: float, delta: float) -> None:
        """Record the budget from the site configuration (the configuration is the source of truth)."""
        if not (epsilon > 0) or not (0 < delta < 1):
            raise ConfigError(f"dataset {dataset!r}: a privacy budget needs epsilon > 0 and 0 < delta < 1, got "
                              f"epsilon={epsilon}, delta={delta}")
        with self._tx() as db:
            db.execute("INSERT INTO budgets VALUES (?, ?, ?) ON CONFLICT(dataset) DO UPDATE SET epsilon=excluded.epsilon,"
                       " delta=excluded.delta", (dataset, float(epsilon), float(delta)))

    def admit(self, dataset: str, task_id: str, planned_epsilon: float, delta: float, accountant: str = "") -> None:
        """Reserve ``planned_epsilon`` (and ``delta``) of the dataset's budget for a task, or refuse."""
        with self._tx() as db:
            if db.execute("SELECT 1 FROM tasks WHERE dataset=? AND task_id=?", (dataset, task_id)).fetchone():
                return  # admitted before (agent restart): the reservation stands
            budget = _budget(db, dataset)
            eps, dlt = _committed(db, dataset)
            if eps + planned_epsilon > budget.epsilon + _SLACK or dlt + delta > budget.delta + _SLACK:
                raise BudgetExceeded(
                    f"dataset {dataset!r}: the task would spend epsilon {planned_epsilon:.3g} (delta {delta:.1e}) but "
                    f"only epsilon {max(0.0, budget.epsilon - eps):.3g} (delta {max(0.0, budget.delta - dlt):.1e}) "
                    f"of the site's budget of {budget.epsilon:.3g} ({budget.delta:.1e}) is left "
                    f"(committed {eps:.3g}); lower the task's target epsilon or rounds, or ask the site's privacy "
                    "officer to raise the dataset's budget")
            db.execute("INSERT INTO tasks VALUES (?, ?, ?, 0.0, ?, 0, ?, ?)",
                       (dataset, task_id, float(planned_epsilon), float(delta), accountant, _now_ms()))

    def charge(self, dataset: str, task_id: str, round_number: int, epsilon_after: float,
               accountant: str = "") -> None:
        """Record that the task has spent ``epsilon_after`` in total once this round's update leaves."""
        with self._tx() as db:
            row = db.execute("SELECT planned_epsilon, spent_epsilon, finished FROM tasks WHERE dataset=? AND task_id=?",
                             (dataset, task_id)).fetchone()
            if row is None:
                raise BudgetExceeded(f"task {task_id} was never admitted on dataset {dataset!r}; nothing is sent")
            planned, spent, finished = row
            if finished:
                raise BudgetExceeded(f"task {task_id} is finished on dataset {dataset!r}; nothing more is sent")
            if epsilon_after > planned + _SLACK:
                raise BudgetExceeded(f"task {task_id} would spend epsilon {epsilon_after:.4g} on {dataset!r}, more "
                                     f"than the {planned:.4g} it was admitted with; the update is not sent")
            new_spent = max(spent, float(epsilon_after))
            budget = _budget(db, dataset)
            eps, _ = _committed(db, dataset, exclude=task_id)
            if eps + new_spent > budget.epsilon + _SLACK:
                raise BudgetExceeded(f"dataset {dataset!r}: spending epsilon {new_spent:.4g} on task {task_id} would "
                                     f"exceed the budget {budget.epsilon:.4g} (others committed {eps:.4g}); "
                                     "the update is not sent")
            db.execute("UPDATE tasks SET spent_epsilon=?, accountant=CASE WHEN ?='' THEN accountant ELSE ? END "
                       "WHERE dataset=? AND task_id=?", (new_spent, accountant, accountant, dataset, task_id))
            db.execute("INSERT INTO charges VALUES (?, ?, ?, ?, ?) ON CONFLICT(dataset, task_id, round) DO UPDATE "
                       "SET epsilon_after=max(epsilon_after, excluded.epsilon_after)",
                       (dataset, task_id, int(round_number), float(epsilon_after), _now_ms()))

    def finish(self, dataset: str, task_id: str) -> bool:
        """The task ended on ``dataset``: release its unspent reservation, refuse further charges. True when the
        task was running (False: unknown, or finished already)."""
        with self._tx() as db:
            return db.execute("UPDATE tasks SET finished=1 WHERE dataset=? AND task_id=? AND finished=0",
                              (dataset, task_id)).rowcount > 0

    def finish_task(self, task_id: str) -> list[str]:
        """:meth:`finish` on every dataset the task was admitted on (a cancellation names the task only); the
        datasets whose reservation was released."""
        with self._tx() as db:
            names = [r[0] for r in db.execute("SELECT dataset FROM tasks WHERE task_id=? AND finished=0 "
                                              "ORDER BY dataset", (task_id,))]
            db.execute("UPDATE tasks SET finished=1 WHERE task_id=? AND finished=0", (task_id,))
        return names

    def open_tasks(self, limit: int = 1000) -> list[str]:
        """The tasks holding a reservation here (admitted, not finished), the most recently admitted first."""
        with self._tx() as db:
            return [r[0] for r in db.execute("SELECT task_id FROM tasks WHERE finished=0 GROUP BY task_id "
                                             "ORDER BY max(admitted_ms) DESC LIMIT ?", (limit,))]

    def accountant_state(self, dataset: str, task_id: str) -> str:
        """The JSON accountant state last charged for the task ('' when none), to resume after a restart."""
        with self._tx() as db:
            row = db.execute("SELECT accountant FROM tasks WHERE dataset=? AND task_id=?", (dataset, task_id)).fetchone()
        return row[0] if row else ""

    def status(self) -> list[DatasetSpend]:
        with self._tx() as db:
            names = sorted({r[0] for r in db.execute("SELECT dataset FROM budgets UNION SELECT dataset FROM tasks")})
            out = []
            for name in names:
                b = db.execute("SELECT epsilon, delta FROM budgets WHERE dataset=?", (name,)).fetchone()
                tasks = tuple(TaskSpend(t, p, s, d, n, bool(f), _unit(a)) for t, p, s, d, f, n, a in db.execute(
                    "SELECT t.task_id, t.planned_epsilon, t.spent_epsilon, t.delta, t.finished, "
                    "(SELECT count(*) FROM charges c WHERE c.dataset=t.dataset AND c.task_id=t.task_id), "
                    "t.accountant FROM tasks t WHERE t.dataset=? ORDER BY t.admitted_ms", (name,)))
                eps, dlt = _committed(db, name)
                out.append(DatasetSpend(name, Budget(*b) if b else None, sum(t.spent_epsilon for t in tasks), eps, dlt,
                                        tasks))
        return out


def _budget(db: sqlite3.Connection, dataset: str) -> Budget:
    row = db.execute("SELECT epsilon, delta FROM budgets WHERE dataset=?", (dataset,)).fetchone()
    if row is None:
        raise BudgetExceeded(f"dataset {dataset!r} has no privacy budget in the site configuration, so private "
                             "tasks on it are refused; the site admin sets privacy_epsilon and privacy_delta under "
                             f"[datasets.{dataset}] in agent.toml")
    return Budget(*row)


def _committed(db: sqlite3.Connection, dataset: str, exclude: str | None = None) -> tuple[float, float]:
    """(epsilon, delta) committed on the dataset: spent by finished tasks, max(planned, spent) by running ones."""
    eps, dlt = db.execute(
        "SELECT coalesce(sum(CASE WHEN finished THEN spent_epsilon ELSE max(planned_epsilon, spent_epsilon) END), 0),"
        " coalesce(sum(CASE WHEN finished AND spent_epsilon = 0 THEN 0 ELSE delta END), 0) "
        "FROM tasks WHERE dataset=? AND task_id IS NOT ?", (dataset, exclude)).fetchone()
    return float(eps), float(dlt)


def _unit(accountant: str) -> str:
    """The privacy unit recorded in a task's accountant state (JSON; "" or no unit: "example")."""
    try:
        doc = json.loads(accountant) if accountant else {}
    except ValueError:
        return "example"
    unit = doc.get("unit") if isinstance(doc, dict) else None
    return unit if isinstance(unit, str) and unit else "example"


def _now_ms() -> int:
    return int(time.time() * 1000)
