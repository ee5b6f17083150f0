"""Which signed task each task id is, as this site first saw it: the binding the owner's signature cannot make.

The owner signs a task before the aggregator gives it a task id (fedclinic.spec.signed_task), so the signature
covers the submission's idempotency key instead; the aggregator makes exactly one task of each (owner, key). This
store remembers, durably, for every signed task the site accepted: (owner, idempotency key) -> task id, and the
signed statement that task id came with. An aggregator that replays a signed task under a new task id, or presents
another signed statement under a task id the site already knows, is found out here (:meth:`TaskBindings.bind`).

``WORK_DIR/task-bindings.sqlite``: SQLite, ``synchronous=FULL``, each binding one transaction, durable on return.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

from fedclinic.errors import FedclinicError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS bindings (
    owner TEXT NOT NULL, idempotency_key TEXT NOT NULL, task_id TEXT NOT NULL UNIQUE, statement_id TEXT NOT NULL,
    first_seen_ms INTEGER NOT NULL, PRIMARY KEY (owner, idempotency_key));
"""


class TaskBindings:
    """The durable map (owner, idempotency key) <-> task id of the signed tasks this site has accepted."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(self.path, isolation_level=None, timeout=30, check_same_thread=False)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise FedclinicError(f"cannot open the signed-task bindings {self.path}: {exc}") from None

    def bind(self, *, owner: str, idempotency_key: str, task_id: str, statement_id: str) -> str | None:
        """Record that ``task_id`` is the signed task (``owner``, ``idempotency_key``, statement ``statement_id``),
        or say why it cannot be: that signed task already ran here under another task id (a replay), or this task
        id came with another signed statement before. None when the binding holds (new or as recorded)."""
        with self._lock:
            by_key = self._conn.execute("SELECT task_id FROM bindings WHERE owner=? AND idempotency_key=?",
                                        (owner, idempotency_key)).fetchone()
            by_id = self._conn.execute("SELECT owner, statement_id FROM bindings WHERE task_id=?",
                                       (task_id,)).fetchone()
            if by_key is not None and by_key[0] != task_id:
                return (f"the task {owner!r} signed (idempotency key {idempotency_key[:16]}) already ran at this site "
                        f"as task {by_key[0]}; the aggregator replays it under the new task id {task_id}")
            if by_id is not None and by_id[1] != statement_id:
                return (f"task {task_id} came to this site before with another signed task (owner {by_id[0]!r}); "
                        "the aggregator now presents a different one under the same task id")
            if by_key is None:
                self._conn.execute("INSERT INTO bindings(owner, idempotency_key, task_id, statement_id, first_seen_ms)"
                                   " VALUES (?, ?, ?, ?, ?)", (owner, idempotency_key, task_id, statement_id,
                                                               int(time.time() * 1000)))
            return None

    def known(self, *, owner: str, idempotency_key: str) -> bool:
        """Whether this site has accepted the signed task (``owner``, ``idempotency_key``) before."""
        with self._lock:
            return self._conn.execute("SELECT 1 FROM bindings WHERE owner=? AND idempotency_key=?",
                                      (owner, idempotency_key)).fetchone() is not None

    def close(self) -> None:
        with self._lock:
            self._conn.close()


__all__ = ["TaskBindings"]
