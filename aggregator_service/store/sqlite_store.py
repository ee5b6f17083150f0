"""The aggregator's state in SQLite (WAL mode, synchronous=FULL): the default :class:`~aggregator_service.store.Store`.

Everything the service acknowledges is in here first: a task after its model blobs are durable, an update
after its spill file is fsync'd and its row committed. The round engine rebuilds its in-memory accumulators
from these rows after a restart, so an acknowledged update is never lost or counted twice (``updates`` is
unique per (task, round, site) and per (task, idempotency key)).

Opening a store applies the schema steps of :mod:`aggregator_service.store.migrations`, then points the spill
paths of ``updates`` into this state folder when it was moved or restored elsewhere. Every SQL statement of the
service lives here or in the migrations (backup.py also reads its own snapshot file with SQLite).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

import structlog
from google.protobuf import json_format

from fedclinic.transport.package import FileEntry, Manifest, TensorEntry
from fedclinic.proto import control_pb2, task_pb2, tensors_pb2

from aggregator_service.store.interface import Store, StoreTransaction
from aggregator_service.store.migrations import migrate, read_schema_version
from aggregator_service.store.records import (AssignmentRecord, EventRecord, ResultPhaseRecord, RoundRecord,
                                              SiteResultRecord, StateGauges, TaskRecord, UpdateRecord, now_ms)

log = structlog.get_logger("fedclinic.aggregator.store")

S = control_pb2
DB_NAME = "aggregator.sqlite"
# a cancelled task's last round keeps state OPEN in the store; only running tasks' rounds are open
_OPEN_ROUNDS = ("SELECT r.task_id, r.round FROM rounds r JOIN tasks t USING (task_id) WHERE r.state=%d AND "
                "t.state=%d" % (S.ROUND_STATE_OPEN, S.TASK_STATE_RUNNING))
# the models of a task (Store.task_models): initial model, rounds' base models, closed rounds' models
_TASK_MODELS = ("SELECT initial_model AS h FROM tasks WHERE task_id=? UNION SELECT base_model FROM rounds WHERE "
                "task_id=? UNION SELECT model_hash FROM rounds WHERE task_id=? AND model_hash!=''")


def manifest_to_json(m: Manifest) -> str:
    return json.dumps({"tensors": [[t.name, t.dtype, list(t.shape), t.sha256, t.nbytes] for t in m.tensors],
                       "files": [[f.path, f.sha256, f.nbytes] for f in m.files]}, separators=(",", ":"))


def manifest_from_json(text: str) -> Manifest:
    doc = json.loads(text)
    return Manifest(tuple(TensorEntry(n, d, tuple(s), h, b) for n, d, s, h, b in doc["tensors"]),
                    tuple(FileEntry(p, h, b) for p, h, b in doc["files"]))


class Row:
    """A raw result row as attributes (for :meth:`SqliteStore.one` / :meth:`SqliteStore.all`)."""

    __slots__ = ("_r",)

    def __init__(self, r: sqlite3.Row) -> None:
        self._r = r

    def __getattr__(self, name: str) -> Any:
        try:
            return self._r[name]
        except IndexError:
            raise AttributeError(name) from None


def _task(r: sqlite3.Row) -> TaskRecord:
    return TaskRecord(r["task_id"], r["owner"], r["idempotency_key"], task_pb2.TaskSpec.FromString(r["spec"]),
                      r["state"], r["current_round"], r["error"], r["created_ms"], r["updated_ms"],
                      r["initial_model"], r["final_model"])


def _round(r: sqlite3.Row) -> RoundRecord:
    return RoundRecord(r["task_id"], r["round"], r["attempt"], r["state"], r["sites_target"], r["opened_ms"],
                       r["deadline_ms"], r["closed_ms"], r["base_model"], r["model_hash"], r["uplink_bytes"],
                       r["downlink_bytes"], json.loads(r["metrics"]), json.loads(r["strategy_state"] or "{}"))


def _assignment(r: sqlite3.Row) -> AssignmentRecord:
    return AssignmentRecord(r["task_id"], r["round"], r["site"], r["attempt"], r["assigned_ms"], r["declined"],
                            r["held"], r["downlink_bytes"], r["downlink_wire_bytes"])


def _update(r: sqlite3.Row) -> UpdateRecord:
    return UpdateRecord(r["update_id"], r["task_id"], r["round"], r["site"], r["idempotency_key"], r["num_samples"],
                        r["nbytes"], r["spill_path"], r["layout"], json.loads(r["metrics"]),
                        json.loads(r["eval_metrics"]), r["received_ms"], r["fp32_bytes"], r["wire_bytes"],
                        r["spill_sha256"])


def _phase(r: sqlite3.Row) -> ResultPhaseRecord:
    return ResultPhaseRecord(r["task_id"], r["round"], r["work"], r["model_hash"], r["opened_ms"], r["deadline_ms"],
                             r["closed_ms"])


def _result(r: sqlite3.Row) -> SiteResultRecord:
    return SiteResultRecord(r["task_id"], r["round"], r["site"], r["model"], r["work"], r["model_hash"],
                            json.loads(r["vals"]), r["min_cell"], r["received_ms"])


class SqliteTransaction(StoreTransaction):
    """The writes of one SQLite transaction (BEGIN IMMEDIATE ... COMMIT), see :meth:`SqliteStore.transaction`."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._c = conn
        self.events: list[dict[str, Any]] = []

    def add_event(self, task_id: str, kind: str, message: str, *, actor: str = "", **details: Any) -> None:
        self._c.execute("INSERT INTO events(task_id, kind, message, unix_ms) VALUES (?, ?, ?, ?)",
                        (task_id, kind, message, now_ms()))
        self.events.append({"task_id": task_id, "kind": kind, "message": message, "actor": actor,
                            "details": details})

    def put_model(self, manifest: Manifest) -> str:
        h = manifest.model_hash
        self._c.execute("INSERT OR IGNORE INTO models(model_hash, manifest) VALUES (?, ?)",
                        (h, manifest_to_json(manifest)))
        return h

    def put_model_deltas(self, model_hash: str, deltas: Iterable[tensors_pb2.DownlinkDelta]) -> None:
        self._c.executemany(
            "INSERT OR REPLACE INTO model_deltas(model_hash, name, base_sha256, header) VALUES (?,?,?,?)",
            [(model_hash, d.name, d.base_sha256, json_format.MessageToJson(d.header, indent=None)) for d in deltas])

    def insert_task(self, task_id: str, owner: str, idempotency_key: str, spec: task_pb2.TaskSpec, state: int,
                    created_ms: int, initial_model: str) -> None:
        self._c.execute("INSERT INTO tasks(task_id, owner, idempotency_key, spec, state, created_ms, updated_ms,"
                        " initial_model) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        (task_id, owner, idempotency_key, spec.SerializeToString(), state, created_ms, created_ms,
                         initial_model))

    def set_signed_task(self, task_id: str, statement: bytes) -> None:
        self._c.execute("UPDATE tasks SET signed_task=? WHERE task_id=?", (statement, task_id))

    def open_round(self, task_id: str, rnd: int, attempt: int, sites_target: int, opened_ms: int, deadline_ms: int,
                   base_model: str) -> None:
        self._c.execute("INSERT OR REPLACE INTO rounds(task_id, round, attempt, state, sites_target, opened_ms, "
                        "deadline_ms, base_model) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        (task_id, rnd, attempt, S.ROUND_STATE_OPEN, sites_target, opened_ms, deadline_ms, base_model))
        self._c.execute("UPDATE tasks SET state=?, current_round=?, updated_ms=? WHERE task_id=?",
                        (S.TASK_STATE_RUNNING, rnd, opened_ms, task_id))

    def reopen_round(self, task_id: str, rnd: int, deadline_ms: int) -> None:
        self._c.execute("UPDATE rounds SET attempt=attempt+1, deadline_ms=? WHERE task_id=? AND round=?",
                        (deadline_ms, task_id, rnd))

    def close_round(self, task_id: str, rnd: int, closed_ms: int, model_hash: str, metrics: dict[str, float],
                    strategy_state: dict[str, Any]) -> None:
        self._c.execute("UPDATE rounds SET state=?, closed_ms=?, model_hash=?, metrics=?, strategy_state=? "
                        "WHERE task_id=? AND round=?", (S.ROUND_STATE_CLOSED, closed_ms, model_hash,
                                                        json.dumps(metrics), json.dumps(strategy_state), task_id,
                                                        rnd))

    def fail_round(self, task_id: str, rnd: int, closed_ms: int) -> None:
        self._c.execute("UPDATE rounds SET state=?, closed_ms=? WHERE task_id=? AND round=?",
                        (S.ROUND_STATE_FAILED, closed_ms, task_id, rnd))

    def complete_task(self, task_id: str, final_model: str, updated_ms: int) -> None:
        self._c.execute("UPDATE tasks SET state=?, final_model=?, updated_ms=? WHERE task_id=?",
                        (S.TASK_STATE_COMPLETED, final_model, updated_ms, task_id))

    def end_task(self, task_id: str, state: int, error: str, updated_ms: int) -> None:
        self._c.execute("UPDATE tasks SET state=?, error=?, updated_ms=? WHERE task_id=?",
                        (state, error, updated_ms, task_id))

    def assign(self, task_id: str, rnd: int, site: str, attempt: int, assigned_ms: int) -> None:
        self._c.execute("INSERT OR REPLACE INTO assignments(task_id, round, site, attempt, assigned_ms) "
                        "VALUES (?, ?, ?, ?, ?)", (task_id, rnd, site, attempt, assigned_ms))

    def hold(self, task_id: str, rnd: int, site: str, reason: str) -> None:
        self._c.execute("UPDATE assignments SET held=? WHERE task_id=? AND round=? AND site=?",
                        (reason, task_id, rnd, site))

    def decline(self, task_id: str, rnd: int, site: str, reason: str, permanent: bool) -> None:
        self._c.execute("UPDATE assignments SET declined=? WHERE task_id=? AND round=? AND site=?",
                        (reason, task_id, rnd, site))
        if permanent:
            self._c.execute("INSERT OR REPLACE INTO site_declines(task_id, site, reason) VALUES (?, ?, ?)",
                            (task_id, site, reason))

    def record_update(self, u: UpdateRecord) -> None:
        self._c.execute("INSERT INTO updates(update_id, task_id, round, site, idempotency_key, num_samples, nbytes, "
                        "spill_path, layout, metrics, eval_metrics, received_ms, fp32_bytes, wire_bytes, spill_sha256) "
                        "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                        (u.update_id, u.task_id, u.round, u.site, u.idempotency_key, u.num_samples, u.nbytes,
                         u.spill_path, u.layout, json.dumps(u.metrics), json.dumps(u.eval_metrics), u.received_ms,
                         u.fp32_bytes, u.wire_bytes, u.spill_sha256))
        self.add_uplink(u.task_id, u.round, u.nbytes)

    def record_statement(self, task_id: str, rnd: int, attempt: int, site: str, statement: bytes) -> None:
        self._c.execute("INSERT OR REPLACE INTO site_statements(task_id, round, attempt, site_id, statement) "
                        "VALUES (?, ?, ?, ?, ?)", (task_id, rnd, attempt, site, statement))

    def record_secure_sum(self, task_id: str, rnd: int, survivors: list[str], sum_sha256: str, params: str) -> None:
        self._c.execute("INSERT OR REPLACE INTO secure_sums(task_id, round, survivors, sum_sha256, params) "
                        "VALUES (?, ?, ?, ?, ?)", (task_id, rnd, json.dumps(survivors), sum_sha256, params))

    def add_uplink(self, task_id: str, rnd: int, nbytes: int) -> None:
        self._c.execute("UPDATE rounds SET uplink_bytes = uplink_bytes + ? WHERE task_id=? AND round=?",
                        (nbytes, task_id, rnd))

    def add_downlink(self, task_id: str, nbytes: int, *, site: str = "", wire_bytes: int = 0) -> None:
        self._c.execute("UPDATE rounds SET downlink_bytes = downlink_bytes + ? WHERE task_id=? AND state=?",
                        (nbytes, task_id, S.ROUND_STATE_OPEN))
        if site:
            self._c.execute("UPDATE assignments SET downlink_bytes = downlink_bytes + ?, "
                            "downlink_wire_bytes = downlink_wire_bytes + ? WHERE task_id=? AND site=? AND round = "
                            "(SELECT round FROM rounds WHERE task_id=? AND state=?)",
                            (nbytes, wire_bytes, task_id, site, task_id, S.ROUND_STATE_OPEN))

    def open_result_phase(self, p: ResultPhaseRecord) -> None:
        self._c.execute("INSERT INTO result_phases(task_id, round, work, model_hash, opened_ms, deadline_ms) "
                        "VALUES (?, ?, ?, ?, ?, ?)", (p.task_id, p.round, p.work, p.model_hash, p.opened_ms,
                                                      p.deadline_ms))
        self._c.execute("UPDATE tasks SET state=?, current_round=?, updated_ms=? WHERE task_id=?",
                        (S.TASK_STATE_RUNNING, p.round, p.opened_ms, p.task_id))

    def close_result_phase(self, task_id: str, closed_ms: int) -> None:
        self._c.execute("UPDATE result_phases SET closed_ms=? WHERE task_id=?", (closed_ms, task_id))

    def record_result(self, r: SiteResultRecord) -> bool:
        return self._c.execute(
            "INSERT OR IGNORE INTO site_results(task_id, round, site, model, work, model_hash, vals, min_cell, "
            "received_ms) VALUES (?,?,?,?,?,?,?,?,?)", (r.task_id, r.round, r.site, r.model, r.work, r.model_hash,
                                                        json.dumps(r.values), r.min_cell, r.received_ms)).rowcount > 0

    def set_round_metrics(self, task_id: str, rnd: int, metrics: dict[str, float]) -> None:
        self._c.execute("UPDATE rounds SET metrics=? WHERE task_id=? AND round=?", (json.dumps(metrics), task_id, rnd))


class SqliteStore(Store):
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

    def _relocate_spill_paths(self) -> None:
        """Point the spill paths of ``updates`` into this state folder when the folder was moved or restored
        elsewhere (they are absolute paths under ``<state_dir>/updates``)."""
        row = self.one("SELECT value FROM meta WHERE key='state_dir'")
        here = str(self._state_dir)
        if row is None or row.value == here:
            return
        old, new = os.path.join(row.value, "updates", ""), os.path.join(here, "updates", "")
        with self.tx() as c:
            n = c.execute("UPDATE updates SET spill_path = ? || substr(spill_path, ?) "
                          "WHERE substr(spill_path, 1, ?) = ?", (new, len(old) + 1, len(old), old)).rowcount
            c.execute("UPDATE meta SET value=? WHERE key='state_dir'", (here,))
        log.info("state folder moved: spill paths relocated", old=row.value, new=here, updates=n)

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

    # raw SQL: SQLite-specific, for migrations and tests; not part of the Store interface ---------------------
    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """A raw transaction on the connection (no events)."""
        with self.transaction() as t:
            yield t._c

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

    def _rows(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._conn.execute(sql, args).fetchall()

    def _row(self, sql: str, args: tuple = ()) -> sqlite3.Row | None:
        with self._lock:
            return self._conn.execute(sql, args).fetchone()

    def _count(self, sql: str, args: tuple = ()) -> int:
        row = self._row(sql, args)
        return int(row[0]) if row is not None else 0

    # tasks --------------------------------------------------------------------------------------------
    def task(self, task_id: str) -> TaskRecord | None:
        r = self._row("SELECT * FROM tasks WHERE task_id=?", (task_id,))
        return _task(r) if r is not None else None

    def signed_task(self, task_id: str) -> bytes:
        r = self._row("SELECT signed_task FROM tasks WHERE task_id=?", (task_id,))
        return bytes(r[0]) if r is not None and r[0] is not None else b""

    def task_by_key(self, owner: str, idempotency_key: str) -> TaskRecord | None:
        r = self._row("SELECT * FROM tasks WHERE owner=? AND idempotency_key=?", (owner, idempotency_key))
        return _task(r) if r is not None else None

    def tasks(self, state: int | None = None) -> list[TaskRecord]:
        if state is None:
            return [_task(r) for r in self._rows("SELECT * FROM tasks ORDER BY created_ms")]
        return [_task(r) for r in self._rows("SELECT * FROM tasks WHERE state=? ORDER BY created_ms", (state,))]

    # models -------------------------------------------------------------------------------------------
    def model(self, model_hash: str) -> Manifest | None:
        r = self._row("SELECT manifest FROM models WHERE model_hash=?", (model_hash,))
        return manifest_from_json(r["manifest"]) if r else None

    def model_deltas(self, model_hash: str) -> dict[str, tensors_pb2.DownlinkDelta]:
        out = {}
        for r in self._rows("SELECT name, base_sha256, header FROM model_deltas WHERE model_hash=?", (model_hash,)):
            header = json_format.Parse(r["header"], tensors_pb2.TensorHeader())
            out[r["name"]] = tensors_pb2.DownlinkDelta(name=r["name"], base_sha256=r["base_sha256"], header=header)
        return out

    def task_models(self, task_id: str) -> frozenset[str]:
        return frozenset(r["h"] for r in self._rows(_TASK_MODELS, (task_id,) * 3) if r["h"])

    def task_blobs(self, task_id: str) -> frozenset[str]:
        out: set[str] = set()
        for r in self._rows(f"SELECT manifest FROM models WHERE model_hash IN ({_TASK_MODELS})", (task_id,) * 3):
            m = manifest_from_json(r["manifest"])
            out.update(t.sha256 for t in m.tensors)
            out.update(f.sha256 for f in m.files)
        for r in self._rows(f"SELECT header FROM model_deltas WHERE model_hash IN ({_TASK_MODELS})", (task_id,) * 3):
            out.add(json_format.Parse(r["header"], tensors_pb2.TensorHeader()).sha256)
        return frozenset(out)

    # rounds -------------------------------------------------------------------------------------------
    def round(self, task_id: str, rnd: int) -> RoundRecord | None:
        r = self._row("SELECT * FROM rounds WHERE task_id=? AND round=?", (task_id, rnd))
        return _round(r) if r is not None else None

    def open_round_of(self, task_id: str) -> RoundRecord | None:
        r = self._row("SELECT * FROM rounds WHERE task_id=? AND state=?", (task_id, S.ROUND_STATE_OPEN))
        return _round(r) if r is not None else None

    def rounds_of(self, task_id: str) -> list[RoundRecord]:
        return [_round(r) for r in self._rows("SELECT * FROM rounds WHERE task_id=? ORDER BY round", (task_id,))]

    def open_rounds(self, *, running_only: bool = True) -> list[RoundRecord]:
        if not running_only:
            return [_round(r) for r in self._rows("SELECT * FROM rounds WHERE state=?", (S.ROUND_STATE_OPEN,))]
        return [_round(r) for r in self._rows(
            "SELECT r.* FROM rounds r JOIN tasks t USING (task_id) WHERE r.state=? AND t.state=?",
            (S.ROUND_STATE_OPEN, S.TASK_STATE_RUNNING))]

    def last_closed_round(self, task_id: str) -> RoundRecord | None:
        r = self._row("SELECT * FROM rounds WHERE task_id=? AND state=? ORDER BY round DESC LIMIT 1",
                      (task_id, S.ROUND_STATE_CLOSED))
        return _round(r) if r is not None else None

    def newest_round_model(self, task_id: str) -> str:
        r = self._row("SELECT model_hash FROM rounds WHERE task_id=? AND model_hash!='' ORDER BY round DESC LIMIT 1",
                      (task_id,))
        return r["model_hash"] if r is not None else ""

    # sites --------------------------------------------------------------------------------------------
    def assignment(self, task_id: str, rnd: int, site: str) -> AssignmentRecord | None:
        r = self._row("SELECT * FROM assignments WHERE task_id=? AND round=? AND site=?", (task_id, rnd, site))
        return _assignment(r) if r is not None else None

    def assignments_of(self, task_id: str, rnd: int) -> list[AssignmentRecord]:
        return [_assignment(r) for r in self._rows("SELECT * FROM assignments WHERE task_id=? AND round=? "
                                                   "ORDER BY site", (task_id, rnd))]

    def is_assigned(self, task_id: str, site: str) -> bool:
        return self._row("SELECT 1 FROM assignments WHERE task_id=? AND site=?", (task_id, site)) is not None

    def active_assignments(self, task_id: str, rnd: int, attempt: int) -> int:
        return self._count("SELECT COUNT(*) FROM assignments WHERE task_id=? AND round=? AND declined='' "
                           "AND (attempt=? OR site IN (SELECT site FROM updates WHERE task_id=? AND round=?))",
                           (task_id, rnd, attempt, task_id, rnd))

    def outstanding_assignments(self, task_id: str, rnd: int) -> int:
        return self._count("SELECT COUNT(*) FROM assignments a WHERE task_id=? AND round=? AND declined='' AND NOT "
                           "EXISTS (SELECT 1 FROM updates u WHERE u.task_id=a.task_id AND u.round=a.round AND "
                           "u.site=a.site)", (task_id, rnd))

    def site_declines(self, task_id: str) -> dict[str, str]:
        return {r["site"]: r["reason"] for r in self._rows("SELECT site, reason FROM site_declines WHERE task_id=?",
                                                           (task_id,))}

    def declined_for_good(self, task_id: str, site: str) -> bool:
        return self._row("SELECT 1 FROM site_declines WHERE task_id=? AND site=?", (task_id, site)) is not None

    # updates and events ---------------------------------------------------------------------------------
    def update_by_key(self, task_id: str, idempotency_key: str) -> UpdateRecord | None:
        r = self._row("SELECT * FROM updates WHERE task_id=? AND idempotency_key=?", (task_id, idempotency_key))
        return _update(r) if r is not None else None

    def has_update(self, task_id: str, rnd: int, site: str) -> bool:
        return self._row("SELECT 1 FROM updates WHERE task_id=? AND round=? AND site=?",
                         (task_id, rnd, site)) is not None

    def updates_of(self, task_id: str, rnd: int) -> list[UpdateRecord]:
        return [_update(r) for r in self._rows("SELECT * FROM updates WHERE task_id=? AND round=? "
                                               "ORDER BY received_ms", (task_id, rnd))]

    def update_count(self, task_id: str, rnd: int) -> int:
        return self._count("SELECT COUNT(*) FROM updates WHERE task_id=? AND round=?", (task_id, rnd))

    def statements_of(self, task_id: str, rnd: int) -> list[bytes]:
        return [bytes(r["statement"]) for r in self._rows("SELECT statement FROM site_statements WHERE task_id=? AND "
                                                          "round=? ORDER BY site_id, attempt", (task_id, rnd))]

    def secure_sum(self, task_id: str, rnd: int) -> tuple[list[str], str, str] | None:
        r = self._row("SELECT * FROM secure_sums WHERE task_id=? AND round=?", (task_id, rnd))
        return (json.loads(r["survivors"]), r["sum_sha256"], r["params"]) if r is not None else None

    def spill_paths(self) -> set[str]:
        return {r["spill_path"] for r in self._rows("SELECT spill_path FROM updates")}

    def events_of(self, task_id: str, after_seq: int = 0) -> list[EventRecord]:
        return [EventRecord(r["seq"], r["task_id"], r["kind"], r["message"], r["unix_ms"]) for r in self._rows(
            "SELECT * FROM events WHERE task_id=? AND seq>? ORDER BY seq", (task_id, after_seq))]

    def result_phase(self, task_id: str) -> ResultPhaseRecord | None:
        r = self._row("SELECT * FROM result_phases WHERE task_id=?", (task_id,))
        return _phase(r) if r is not None else None

    def open_result_phases(self) -> list[ResultPhaseRecord]:
        return [_phase(r) for r in self._rows("SELECT p.* FROM result_phases p JOIN tasks t USING (task_id) WHERE "
                                              "p.closed_ms=0 AND t.state=?", (S.TASK_STATE_RUNNING,))]

    def results_of(self, task_id: str, rnd: int) -> list[SiteResultRecord]:
        return [_result(r) for r in self._rows("SELECT * FROM site_results WHERE task_id=? AND round=? "
                                               "ORDER BY site, model", (task_id, rnd))]

    def reported_sites(self, task_id: str) -> list[str]:
        return [r[0] for r in self._rows("SELECT site FROM updates WHERE task_id=? UNION SELECT site_id FROM "
                                         "site_statements WHERE task_id=? ORDER BY 1", (task_id, task_id))]

    def gauges(self) -> StateGauges:
        by_state = {r["state"]: r["n"] for r in self._rows("SELECT state, COUNT(*) AS n FROM tasks GROUP BY state")}
        return StateGauges(
            by_state, self._count(f"SELECT COUNT(*) FROM ({_OPEN_ROUNDS})"),
            self._count(f"SELECT COUNT(*) FROM updates u JOIN ({_OPEN_ROUNDS}) r USING (task_id, round)"),
            self._count(f"SELECT COUNT(*) FROM assignments a JOIN ({_OPEN_ROUNDS}) r USING (task_id, round) "
                        "WHERE a.declined='' AND NOT EXISTS (SELECT 1 FROM updates u WHERE u.task_id=a.task_id "
                        "AND u.round=a.round AND u.site=a.site)"))
