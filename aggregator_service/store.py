"""Durable aggregator state: SQLite in WAL mode (synchronous=FULL) beside a content-addressed blob store.

Everything the service acknowledges is in here first: a task after its model blobs are durable, an update
after its spill file is fsync'd and its row committed. The round engine rebuilds its in-memory
accumulators from these rows after a restart, so an acknowledged update is never lost or counted twice
(``updates`` is unique per (task, round, site) and per (task, idempotency key)).

The schema is versioned (``meta.schema_version``). :data:`MIGRATIONS` is the ordered list of steps from
version N to N+1; opening a store applies the missing steps in one transaction (all or nothing) and logs
``store schema migrated``; a database newer than this build is refused with :class:`StoreError`.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import structlog
from google.protobuf import json_format

import fedclinic
from fedclinic.errors import FedclinicError
from fedclinic.transport.package import FileEntry, Manifest, TensorEntry
from fedclinic.proto import tensors_pb2

log = structlog.get_logger("fedclinic.aggregator.store")

SCHEMA_V1 = (
    "CREATE TABLE IF NOT EXISTS tasks ("
    " task_id TEXT PRIMARY KEY, owner TEXT NOT NULL, idempotency_key TEXT NOT NULL, spec BLOB NOT NULL,"
    " state INTEGER NOT NULL, current_round INTEGER NOT NULL DEFAULT 0, error TEXT NOT NULL DEFAULT '',"
    " created_ms INTEGER NOT NULL, updated_ms INTEGER NOT NULL, initial_model TEXT NOT NULL,"
    " final_model TEXT NOT NULL DEFAULT '', UNIQUE (owner, idempotency_key))",
    "CREATE TABLE IF NOT EXISTS models (model_hash TEXT PRIMARY KEY, manifest TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS rounds ("
    " task_id TEXT NOT NULL, round INTEGER NOT NULL, attempt INTEGER NOT NULL, state INTEGER NOT NULL,"
    " sites_target INTEGER NOT NULL, opened_ms INTEGER NOT NULL, deadline_ms INTEGER NOT NULL,"
    " closed_ms INTEGER NOT NULL DEFAULT 0, base_model TEXT NOT NULL, model_hash TEXT NOT NULL DEFAULT '',"
    " uplink_bytes INTEGER NOT NULL DEFAULT 0, downlink_bytes INTEGER NOT NULL DEFAULT 0,"
    " metrics TEXT NOT NULL DEFAULT '{}', PRIMARY KEY (task_id, round))",
    "CREATE TABLE IF NOT EXISTS assignments ("
    " task_id TEXT NOT NULL, round INTEGER NOT NULL, site TEXT NOT NULL, attempt INTEGER NOT NULL,"
    " assigned_ms INTEGER NOT NULL, declined TEXT NOT NULL DEFAULT '', PRIMARY KEY (task_id, round, site))",
    "CREATE TABLE IF NOT EXISTS updates ("
    " update_id TEXT PRIMARY KEY, task_id TEXT NOT NULL, round INTEGER NOT NULL, site TEXT NOT NULL,"
    " idempotency_key TEXT NOT NULL, num_samples INTEGER NOT NULL, nbytes INTEGER NOT NULL,"
    " spill_path TEXT NOT NULL, layout TEXT NOT NULL, metrics TEXT NOT NULL, eval_metrics TEXT NOT NULL,"
    " received_ms INTEGER NOT NULL, UNIQUE (task_id, round, site), UNIQUE (task_id, idempotency_key))",
    "CREATE TABLE IF NOT EXISTS site_declines ("
    " task_id TEXT NOT NULL, site TEXT NOT NULL, reason TEXT NOT NULL, PRIMARY KEY (task_id, site))",
    "CREATE TABLE IF NOT EXISTS events ("
    " seq INTEGER PRIMARY KEY AUTOINCREMENT, task_id TEXT NOT NULL, kind TEXT NOT NULL, message TEXT NOT NULL,"
    " unix_ms INTEGER NOT NULL)",
    "CREATE INDEX IF NOT EXISTS events_by_task ON events (task_id, seq)",
)
"""The tables as the first release made them (schema version 1)."""


class StoreError(FedclinicError):
    """The state database cannot be opened or migrated by this build (says what to do)."""


def _columns(c: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in c.execute(f"PRAGMA table_info({table})").fetchall()}


def _add_column(c: sqlite3.Connection, table: str, column: str, decl: str) -> None:
    """ALTER TABLE ... ADD COLUMN unless it is there (builds before numbered steps added some columns
    while still calling the schema version 1)."""
    if column not in _columns(c, table):
        c.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")


def _to_v1(c: sqlite3.Connection, store: "Store") -> None:
    for statement in SCHEMA_V1:
        c.execute(statement)


def _to_v2(c: sqlite3.Connection, store: "Store") -> None:
    _add_column(c, "rounds", "strategy_state", "TEXT NOT NULL DEFAULT '{}'")   # stateful strategies (FedOpt...)
    _add_column(c, "updates", "fp32_bytes", "INTEGER NOT NULL DEFAULT 0")      # byte accounting of update codecs
    _add_column(c, "updates", "wire_bytes", "INTEGER NOT NULL DEFAULT 0")


def _to_v3(c: sqlite3.Connection, store: "Store") -> None:
    # where the spill paths in ``updates`` point: Store.__init__ relocates them when the folder moved
    c.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('state_dir', ?)", (str(store.state_dir),))


def _to_v4(c: sqlite3.Connection, store: "Store") -> None:
    # compressed downlink (fedclinic.transport.downlink): tensors of a model also kept as an encoded change from a base tensor
    c.execute("CREATE TABLE IF NOT EXISTS model_deltas (model_hash TEXT NOT NULL, name TEXT NOT NULL, "
              "base_sha256 TEXT NOT NULL, header TEXT NOT NULL, PRIMARY KEY (model_hash, name))")


def _to_v5(c: sqlite3.Connection, store: "Store") -> None:
    # downlink byte accounting per site and round, payload and on the wire
    _add_column(c, "assignments", "downlink_bytes", "INTEGER NOT NULL DEFAULT 0")
    _add_column(c, "assignments", "downlink_wire_bytes", "INTEGER NOT NULL DEFAULT 0")


def _to_v6(c: sqlite3.Connection, store: "Store") -> None:
    # why a site holds its assignment without refusing it (e.g. awaiting approval by its IT); '' = not held
    _add_column(c, "assignments", "held", "TEXT NOT NULL DEFAULT ''")


@dataclass(frozen=True)
class Migration:
    """One step of the store schema, from version ``to - 1`` to ``to``; ``apply`` runs inside the migration's
    transaction and must not commit."""

    to: int
    what: str
    apply: Callable[[sqlite3.Connection, "Store"], None]


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "tasks, models, rounds, assignments, updates, site declines, events", _to_v1),
    Migration(2, "rounds.strategy_state; updates.fp32_bytes and wire_bytes", _to_v2),
    Migration(3, "meta.state_dir, so a moved or restored state folder relocates its spill paths", _to_v3),
    Migration(4, "model_deltas: global tensors also stored as an encoded change (compressed downlink)", _to_v4),
    Migration(5, "assignments.downlink_bytes and downlink_wire_bytes (per-site downlink accounting)", _to_v5),
    Migration(6, "assignments.held: why a site holds its assignment (e.g. awaiting approval by its IT)", _to_v6),
)
"""Every schema step in order; append a step (never edit a released one) and its number is the new version."""

SCHEMA_VERSION = MIGRATIONS[-1].to


def read_schema_version(conn: sqlite3.Connection) -> int:
    """The ``schema_version`` in the ``meta`` table of an open database (0 when there is none)."""
    try:
        row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    except sqlite3.OperationalError:  # no meta table: a new database
        return 0
    return int(row[0]) if row is not None else 0


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
        self._migrate()
        self._relocate_spill_paths()

    @property
    def schema_version(self) -> int:
        """The schema version recorded in the database (0 for a new, empty one)."""
        return read_schema_version(self._conn)

    def _migrate(self) -> None:
        """Apply the steps of :data:`MIGRATIONS` above the database's version, in order, in one transaction
        (all or nothing), with a log line; refuse a database newer than this build."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
                current = read_schema_version(self._conn)
                if current > SCHEMA_VERSION:
                    raise StoreError(
                        f"{self.db_path} has schema version {current}, newer than this fedclinic-aggregator "
                        f"({fedclinic.__version__}, schema version {SCHEMA_VERSION}): it was written by a newer "
                        "release. Run that release (or newer), or restore a backup taken with this one")
                steps = [m for m in MIGRATIONS if m.to > current]
                for step in steps:
                    try:
                        step.apply(self._conn, self)
                    except sqlite3.Error as exc:
                        raise StoreError(
                            f"cannot migrate {self.db_path} from schema version {step.to - 1} to {step.to} "
                            f"({step.what}): {exc}. Nothing was changed; restore the state folder from a "
                            "backup (fedclinic-aggregator restore) or report this with the database") from None
                    self._conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('schema_version', ?)",
                                       (str(step.to),))
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
        if steps:
            log.info("store schema migrated", path=str(self.db_path), from_version=current, to_version=SCHEMA_VERSION,
                     steps=[f"{m.to - 1}->{m.to}: {m.what}" for m in steps])

    def _relocate_spill_paths(self) -> None:
        """Point the spill paths of ``updates`` into this state folder when the folder was moved or restored
        elsewhere (they are absolute paths under ``<state_dir>/updates``)."""
        row = self.one("SELECT value FROM meta WHERE key='state_dir'")
        here = str(self.state_dir)
        if row is None or row.value == here:
            return
        old, new = os.path.join(row.value, "updates", ""), os.path.join(here, "updates", "")
        with self.tx() as c:
            n = c.execute("UPDATE updates SET spill_path = ? || substr(spill_path, ?) "
                          "WHERE substr(spill_path, 1, ?) = ?", (new, len(old) + 1, len(old), old)).rowcount
            c.execute("UPDATE meta SET value=? WHERE key='state_dir'", (here,))
        log.info("state folder moved: spill paths relocated", old=row.value, new=here, updates=n)

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

    def put_model_deltas(self, c: sqlite3.Connection, model_hash: str,
                         deltas: Iterable[tensors_pb2.DownlinkDelta]) -> None:
        """Record tensors of ``model_hash`` that are also stored as an encoded change (their payload blobs are
        ``header.sha256``)."""
        c.executemany("INSERT OR REPLACE INTO model_deltas(model_hash, name, base_sha256, header) VALUES (?,?,?,?)",
                      [(model_hash, d.name, d.base_sha256, json_format.MessageToJson(d.header, indent=None))
                       for d in deltas])

    def model_deltas(self, model_hash: str) -> dict[str, tensors_pb2.DownlinkDelta]:
        """name -> the encoded change recorded for that tensor of ``model_hash`` (empty when none)."""
        out = {}
        for r in self.all("SELECT name, base_sha256, header FROM model_deltas WHERE model_hash=?", (model_hash,)):
            header = json_format.Parse(r.header, tensors_pb2.TensorHeader())
            out[r.name] = tensors_pb2.DownlinkDelta(name=r.name, base_sha256=r.base_sha256, header=header)
        return out

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
