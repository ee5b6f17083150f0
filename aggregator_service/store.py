"""Durable aggregator state: SQLite in WAL mode (synchronous=FULL) beside a content-addressed blob store.

Everything the service acknowledges is in here first: a task after its model blobs are durable, an update
after its spill file is fsync'd and its row committed. The round engine rebuilds its in-memory
accumulators from these rows after a restart, so an acknowledged update is never lost or counted twice
(``updates`` is unique per (task, round, site) and per (task, idempotency key)).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from fedclinic.package import FileEntry, Manifest, TensorEntry

SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tasks (
  task_id TEXT PRIMARY KEY, owner TEXT NOT NULL, idempotency_key TEXT NOT NULL, spec BLOB NOT NULL,
  state INTEGER NOT NULL, current_round INTEGER NOT NULL DEFAULT 0, error TEXT NOT NULL DEFAULT '',
  created_ms INTEGER NOT NULL, updated_ms INTEGER NOT NULL, initial_model TEXT NOT NULL,
  final_model TEXT NOT NULL DEFAULT '', UNIQUE (owner, idempotency_key));
CREATE TABLE IF NOT EXISTS models (model_hash TEXT PRIMARY KEY, manifest TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS rounds (
  task_id TEXT NOT NULL, round INTEGER NOT NULL, attempt INTEGER NOT NULL, state INTEGER NOT NULL,
  sites_target INTEGER NOT NULL, opened_ms INTEGER NOT NULL, deadline_ms INTEGER NOT NULL,
  closed_ms INTEGER NOT NULL DEFAULT 0, base_model TEXT NOT NULL, model_hash TEXT NOT NULL DEFAULT '',
  uplink_bytes INTEGER NOT NULL DEFAULT 0, downlink_bytes INTEGER NOT NULL DEFAULT 0,
  metrics TEXT NOT NULL DEFAULT '{}', strategy_state TEXT NOT NULL DEFAULT '{}', PRIMARY KEY (task_id, round));
CREATE TABLE IF NOT EXISTS assignments (
  task_id TEXT NOT NULL, round INTEGER NOT NULL, site TEXT NOT NULL, attempt INTEGER NOT NULL,
  assigned_ms INTEGER NOT NULL, declined TEXT NOT NULL DEFAULT '', PRIMARY KEY (task_id, round, site));
CREATE TABLE IF NOT EXISTS updates (
  update_id TEXT PRIMARY KEY, task_id TEXT NOT NULL, round INTEGER NOT NULL, site TEXT NOT NULL,
  idempotency_key TEXT NOT NULL, num_samples INTEGER NOT NULL, nbytes INTEGER NOT NULL,
  spill_path TEXT NOT NULL, layout TEXT NOT NULL, metrics TEXT NOT NULL, eval_metrics TEXT NOT NULL,
  received_ms INTEGER NOT NULL, UNIQUE (task_id, round, site), UNIQUE (task_id, idempotency_key));
CREATE TABLE IF NOT EXISTS site_declines (
  task_id TEXT NOT NULL, site TEXT NOT NULL, reason TEXT NOT NULL, PRIMARY KEY (task_id, site));
CREATE TABLE IF NOT EXISTS events (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, task_id TEXT NOT NULL, kind TEXT NOT NULL, message TEXT NOT NULL,
  unix_ms INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS events_by_task ON events (task_id, seq);
"""


def now_ms() -> int:
    return int(time.time() * 1000)


def manifest_to_json(m: Manifest) -> str:
    return json.dumps({"tensors": [[t.name, t.dtype, list(t.shape), t.sha256, t.nbytes] for t in m.tensors],
                       "files": [[f.path, f.sha256, f.nbytes] for f in m.files]}, separators=(",", ":"))


def manifest_from_json(text: str) -> Manifest:
    doc = json.loads(text)
    return Manifest(tuple(TensorEntry(n, d, tuple(s), h, b) for n, d, s, h, b in doc["tensors"]),
                    tuple(FileEntry(p, h, b) for p, h, b in doc["files"]))


@dataclass
class Row:
    """A result row as attributes (sqlite3.Row with a friendlier face)."""

    _r: sqlite3.Row

    def __getattr__(self, name: str) -> Any:
        return self._r[name]


class Store:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.db_path = self.state_dir / "aggregator.sqlite"
        self._conn = sqlite3.connect(self.db_path, check_same_thread=False, isolation_level=None, timeout=30)
        self._conn.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        #: called after each commit with that transaction's events (see add_event): the audit trail
        self.on_commit: Callable[[list[dict[str, Any]]], None] | None = None
        self._tx_events: list[dict[str, Any]] = []
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        self._conn.executescript(SCHEMA)
        self._migrate()
        version = self.one("SELECT value FROM meta WHERE key='schema_version'")
        if version is None:
            self.execute("INSERT INTO meta(key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        elif int(version.value) > SCHEMA_VERSION:
            raise RuntimeError(f"{self.db_path} has schema version {version.value}, newer than this aggregator "
                               f"({SCHEMA_VERSION}); upgrade fedclinic-aggregator")

    def _migrate(self) -> None:
        """Bring a database made by an earlier build of this schema version up to date (additive only)."""
        columns = {r["name"] for r in self._conn.execute("PRAGMA table_info(rounds)").fetchall()}
        if "strategy_state" not in columns:
            self._conn.execute("ALTER TABLE rounds ADD COLUMN strategy_state TEXT NOT NULL DEFAULT '{}'")
        columns = {r["name"] for r in self._conn.execute("PRAGMA table_info(updates)").fetchall()}
        for column in ("fp32_bytes", "wire_bytes"):  # byte accounting of update codecs (issue #6)
            if column not in columns:
                self._conn.execute(f"ALTER TABLE updates ADD COLUMN {column} INTEGER NOT NULL DEFAULT 0")

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """One atomic, durable transaction (BEGIN IMMEDIATE ... COMMIT). The events it added go to
        ``on_commit`` after the commit (and nowhere after a rollback)."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            self._tx_events = []
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                self._tx_events = []
                raise
            self._conn.execute("COMMIT")
            events, self._tx_events = self._tx_events, []
            if events and self.on_commit is not None:
                self.on_commit(events)

    def execute(self, sql: str, args: tuple = ()) -> None:
        with self.tx() as c:
            c.execute(sql, args)

    def one(self, sql: str, args: tuple = ()) -> Row | None:
        with self._lock:
            r = self._conn.execute(sql, args).fetchone()
        return Row(r) if r is not None else None

    def all(self, sql: str, args: tuple = ()) -> list[Row]:
        with self._lock:
            return [Row(r) for r in self._conn.execute(sql, args).fetchall()]

    # models -------------------------------------------------------------------------------------------
    def put_model(self, c: sqlite3.Connection, manifest: Manifest) -> str:
        h = manifest.model_hash
        c.execute("INSERT OR IGNORE INTO models(model_hash, manifest) VALUES (?, ?)", (h, manifest_to_json(manifest)))
        return h

    def model(self, model_hash: str) -> Manifest | None:
        r = self.one("SELECT manifest FROM models WHERE model_hash=?", (model_hash,))
        return manifest_from_json(r.manifest) if r else None

    def add_event(self, c: sqlite3.Connection, task_id: str, kind: str, message: str, *, actor: str = "",
                  **details: Any) -> None:
        """Journal a task event (``WatchTask``); ``actor`` (who caused it) and ``details`` (plain JSON values)
        go only to the audit trail, with the message."""
        c.execute("INSERT INTO events(task_id, kind, message, unix_ms) VALUES (?, ?, ?, ?)",
                  (task_id, kind, message, now_ms()))
        self._tx_events.append({"task_id": task_id, "kind": kind, "message": message, "actor": actor,
                                "details": details})

    def close(self) -> None:
        with self._lock:
            self._conn.close()
