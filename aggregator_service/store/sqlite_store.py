"""The aggregator's state in SQLite (WAL mode, synchronous=FULL): the default, embedded
:class:`~aggregator_service.store.Store`.

Everything the service acknowledges is in here first: a task after its model blobs are durable, an update
after its spill file is fsync'd and its row committed. The round engine rebuilds its in-memory accumulators
from these rows after a restart, so an acknowledged update is never lost or counted twice (``updates`` is
unique per (task, round, site) and per (task, idempotency key)).

Opening a store applies the schema steps of :mod:`aggregator_service.store.migrations`, then points the spill
paths of ``updates`` into this state folder when it was moved or restored elsewhere. The statements are shared
with the PostgreSQL store (:mod:`.sql_store` reads, :mod:`.sql_transaction` writes); this module is the SQLite
connection: one connection, one writer at a time (``BEGIN IMMEDIATE`` under a lock), reads under the same lock.
(backup.py also reads its own snapshot file with SQLite.)
"""

from __future__ import annotations

import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from aggregator_service.store.migrations import migrate, read_schema_version
from aggregator_service.store.sql_rows import Row, manifest_from_json, manifest_to_json
from aggregator_service.store.sql_store import SqlStore
from aggregator_service.store.sql_transaction import SqlTransaction

DB_NAME = "aggregator.sqlite"

__all__ = ["DB_NAME", "Row", "SqliteStore", "SqliteTransaction", "manifest_from_json", "manifest_to_json"]


class SqliteTransaction(SqlTransaction):
    """The writes of one SQLite transaction (BEGIN IMMEDIATE ... COMMIT), see :meth:`SqliteStore.transaction`."""


class SqliteStore(SqlStore):
    """The SQLite store of a state folder (``state_dir / "aggregator.sqlite"``), created when missing."""

    def __init__(self, state_dir: Path) -> None:
        self._state_dir = Path(state_dir)
        self._state_dir.mkdir(parents=True, exist_ok=True)
        self.db_path = self._state_dir / DB_NAME
        self._conn = sqlite3.connect(self.db_path, check_same_thread=False, isolation_level=None, timeout=30)
        self._conn.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        self.on_commit = None
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        with self._lock:
            migrate(self._conn, self.db_path, self._state_dir)
        self._relocate_spill_paths()

    @property
    def state_dir(self) -> Path:
        return self._state_dir

    @property
    def schema_version(self) -> int:
        """The schema version recorded in the database (0 for a new, empty one)."""
        return read_schema_version(self._conn)

    @contextmanager
    def transaction(self) -> Iterator[SqliteTransaction]:
        """BEGIN IMMEDIATE ... COMMIT; the events it added go to ``on_commit`` after the commit."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            tx = SqliteTransaction(self._conn)
            try:
                yield tx
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
            if tx.events and self.on_commit is not None:
                self.on_commit(tx.events)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """A raw transaction on the SQLite connection (no events; for tests)."""
        with self.transaction() as t:
            yield t._c  # type: ignore[misc]

    def _rows(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._conn.execute(sql, args).fetchall()

    def _row(self, sql: str, args: tuple = ()) -> sqlite3.Row | None:
        with self._lock:
            return self._conn.execute(sql, args).fetchone()
