"""Task approval at the site: with ``approval = "manual"`` in ``[policy]``, a task the policy allows still waits
for a person at the hospital (``hospital-agent tasks approve ID`` / ``reject ID --reason ...``).

The approval state lives in ``WORK_DIR/approvals.sqlite``, shared by the running agent and the CLI: SQLite in
WAL mode with ``synchronous=FULL``, each change one ``BEGIN IMMEDIATE`` transaction (atomic between the two
processes, durable on return). Per task it keeps what the site was asked to run: the declarative spec, the
tensors an update would carry (name, dtype, shape) and the model it starts from, so ``tasks show`` can print
exactly what would leave the site before anyone approves.

States: ``pending`` -> ``approved`` | ``rejected``; ``approved`` -> ``rejected`` (approval withdrawn: the
next assignment is declined for good). A rejection is final. Approval is bound to the task's spec and the
tensors it sends (``spec_sha256``): if a later assignment of the same task id asks for anything else, the task
is pending again and must be reviewed again.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from fedclinic.errors import FedclinicError
from fedclinic.proto import agent_pb2, task_pb2

PENDING, APPROVED, REJECTED = "pending", "approved", "rejected"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    task_id TEXT PRIMARY KEY, state TEXT NOT NULL, spec BLOB NOT NULL, spec_sha256 TEXT NOT NULL,
    send_tensors TEXT NOT NULL, model_hash TEXT NOT NULL, round INTEGER NOT NULL, first_seen_ms INTEGER NOT NULL,
    decided_ms INTEGER NOT NULL DEFAULT 0, decided_by TEXT NOT NULL DEFAULT '', reason TEXT NOT NULL DEFAULT '',
    note TEXT NOT NULL DEFAULT '');
"""


class ApprovalError(FedclinicError):
    """An approval decision that cannot be made as asked."""


def spec_digest(a: agent_pb2.Assignment) -> str:
    """What an approval covers: the task's spec and the names of the tensors its updates carry."""
    h = hashlib.sha256(a.spec.SerializeToString(deterministic=True))
    h.update(json.dumps(sorted(a.send_tensors)).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class TaskApproval:
    task_id: str
    state: str
    spec: task_pb2.TaskSpec
    spec_sha256: str
    send_tensors: list[list]      # [name, dtype, shape, nbytes] of each tensor an update carries
    model_hash: str
    round: int                    # the round of the assignment last seen
    first_seen_ms: int
    decided_ms: int
    decided_by: str
    reason: str
    note: str


def _row(r: sqlite3.Row) -> TaskApproval:
    return TaskApproval(r["task_id"], r["state"], task_pb2.TaskSpec.FromString(r["spec"]), r["spec_sha256"],
                        json.loads(r["send_tensors"]), r["model_hash"], r["round"], r["first_seen_ms"],
                        r["decided_ms"], r["decided_by"], r["reason"], r["note"])


class ApprovalStore:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(self.path, isolation_level=None, timeout=30, check_same_thread=False)
            self._conn.row_factory = sqlite3.Row
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.executescript(_SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise ApprovalError(f"cannot open the approval store {self.path}: {exc}; run this as the agent's user "
                                "(e.g. sudo -u hospital-agent) with the agent's --config") from exc

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self._conn
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def observe(self, a: agent_pb2.Assignment, *, auto: bool, decided_by: str = "") -> tuple[TaskApproval, str]:
        """Record an assignment of a task: a new task is ``pending`` (``approved`` at once when ``auto``); a known
        one keeps its decision unless its spec or sent tensors changed since (then pending again). Returns the
        record and what happened: "new", "changed" or "" (nothing new)."""
        digest = spec_digest(a)
        by_name = {t.name: t for t in a.model.tensors}
        send = [[n, by_name[n].dtype, list(by_name[n].shape), int(by_name[n].encoded_nbytes)] if n in by_name
                else [n, "?", [], 0] for n in a.send_tensors]
        now = int(time.time() * 1000)
        with self._tx() as c:
            r = c.execute("SELECT * FROM tasks WHERE task_id=?", (a.task_id,)).fetchone()
            what = ""
            if r is None:
                state, what = (APPROVED, "new") if auto else (PENDING, "new")
                c.execute("INSERT INTO tasks(task_id, state, spec, spec_sha256, send_tensors, model_hash, round, "
                          "first_seen_ms, decided_ms, decided_by) VALUES (?,?,?,?,?,?,?,?,?,?)",
                          (a.task_id, state, a.spec.SerializeToString(), digest, json.dumps(send), a.model.model_hash,
                           a.round, now, now if auto else 0, decided_by if auto else ""))
            elif r["spec_sha256"] != digest and r["state"] != REJECTED:
                what = "changed"
                state = APPROVED if auto else PENDING
                c.execute("UPDATE tasks SET state=?, spec=?, spec_sha256=?, send_tensors=?, model_hash=?, round=?, "
                          "decided_ms=?, decided_by=?, note=? WHERE task_id=?",
                          (state, a.spec.SerializeToString(), digest, json.dumps(send), a.model.model_hash, a.round,
                           now if auto else 0, decided_by if auto else "",
                           f"the task's spec or sent tensors changed in round {a.round}; review it again", a.task_id))
            else:
                c.execute("UPDATE tasks SET round=?, model_hash=? WHERE task_id=?",
                          (a.round, a.model.model_hash, a.task_id))
            r = c.execute("SELECT * FROM tasks WHERE task_id=?", (a.task_id,)).fetchone()
        return _row(r), what

    def get(self, task_id: str) -> TaskApproval | None:
        r = self._conn.execute("SELECT * FROM tasks WHERE task_id=?", (task_id,)).fetchone()
        return _row(r) if r is not None else None

    def states(self, task_ids: list[str]) -> dict[str, str]:
        if not task_ids:
            return {}
        marks = ",".join("?" * len(task_ids))
        return {r["task_id"]: r["state"] for r in
                self._conn.execute(f"SELECT task_id, state FROM tasks WHERE task_id IN ({marks})", task_ids)}

    def all(self) -> list[TaskApproval]:
        return [_row(r) for r in self._conn.execute("SELECT * FROM tasks ORDER BY first_seen_ms")]

    def decide(self, task_id: str, *, approve: bool, by: str, reason: str = "") -> TaskApproval:
        """Approve or reject ``task_id`` (see the module docstring for the allowed transitions)."""
        if not approve and not reason.strip():
            raise ApprovalError("a rejection needs a reason (--reason \"...\"); it is sent to the task's owner")
        with self._tx() as c:
            r = c.execute("SELECT state FROM tasks WHERE task_id=?", (task_id,)).fetchone()
            if r is None:
                raise ApprovalError(f"this site has not been asked to run task {task_id!r}; "
                                    "`hospital-agent tasks list` shows the tasks it has seen")
            if r["state"] == REJECTED:
                raise ApprovalError(f"task {task_id} was rejected; a rejection is final (the site declined the task "
                                    "for good at the aggregator). Ask the owner to submit it again")
            if approve and r["state"] == APPROVED:
                raise ApprovalError(f"task {task_id} is already approved")
            c.execute("UPDATE tasks SET state=?, decided_ms=?, decided_by=?, reason=?, note='' WHERE task_id=?",
                      (APPROVED if approve else REJECTED, int(time.time() * 1000), by, reason.strip(), task_id))
            row = c.execute("SELECT * FROM tasks WHERE task_id=?", (task_id,)).fetchone()
        return _row(row)

    def close(self) -> None:
        self._conn.close()
