"""The reads of the aggregator's state in SQL that SQLite and PostgreSQL both run, shared by
:class:`~aggregator_service.store.sqlite_store.SqliteStore` and
:class:`~aggregator_service.store.postgres_store.PostgresStore`.

A subclass provides the connection: :meth:`SqlStore._rows` / :meth:`SqlStore._row` (a read, ``?`` placeholders),
:meth:`Store.transaction` (yielding a :class:`~aggregator_service.store.sql_transaction.SqlTransaction`) and the
schema (its own migrations). Statements here use ``?`` placeholders and no dialect-specific syntax.
"""

from __future__ import annotations

import json
import os
from abc import abstractmethod
from typing import Any

import structlog
from google.protobuf import json_format

from fedclinic.transport.package import Manifest
from fedclinic.proto import control_pb2, tensors_pb2

from aggregator_service.store.interface import Store
from aggregator_service.store.records import (AssignmentRecord, EventRecord, ResultPhaseRecord, RoundRecord,
                                              SiteResultRecord, StateGauges, TaskRecord, UpdateRecord)
from aggregator_service.store.sql_rows import (Row, assignment_record, manifest_from_json, phase_record,
                                               result_record, round_record, task_record, update_record)

log = structlog.get_logger("fedclinic.aggregator.store")

S = control_pb2
# a cancelled task's last round keeps state OPEN in the store; only running tasks' rounds are open
OPEN_ROUNDS = ("SELECT r.task_id, r.round FROM rounds r JOIN tasks t USING (task_id) WHERE r.state=%d AND "
               "t.state=%d" % (S.ROUND_STATE_OPEN, S.TASK_STATE_RUNNING))
# the models of a task (Store.task_models): initial model, rounds' base models, closed rounds' models
TASK_MODELS = ("SELECT initial_model AS h FROM tasks WHERE task_id=? UNION SELECT base_model FROM rounds WHERE "
               "task_id=? UNION SELECT model_hash FROM rounds WHERE task_id=? AND model_hash!=''")


class SqlStore(Store):
    """The shared reads (see the module docstring); ``_rows`` / ``_row`` are the subclass's connection."""

    @abstractmethod
    def _rows(self, sql: str, args: tuple = ()) -> list[Any]:
        """Every row of a read (rows indexable by column name and position)."""

    def _row(self, sql: str, args: tuple = ()) -> Any | None:
        rows = self._rows(sql, args)
        return rows[0] if rows else None

    def _count(self, sql: str, args: tuple = ()) -> int:
        row = self._row(sql, args)
        return int(row[0]) if row is not None else 0

    # raw SQL for the stores' own upkeep and for tests; not part of the Store interface ------------------------
    def execute(self, sql: str, args: tuple = ()) -> None:
        """One statement (``?`` placeholders) in its own transaction."""
        with self.transaction() as t:
            t._c.execute(sql, args)  # type: ignore[attr-defined]

    def one(self, sql: str, args: tuple = ()) -> Row | None:
        r = self._row(sql, args)
        return Row(r) if r is not None else None

    def all(self, sql: str, args: tuple = ()) -> list[Row]:
        return [Row(r) for r in self._rows(sql, args)]

    def _relocate_spill_paths(self) -> None:
        """Point the spill paths of ``updates`` into this state folder when the folder was moved or restored
        elsewhere (they are absolute paths under ``<state_dir>/updates``)."""
        row = self.one("SELECT value FROM meta WHERE key='state_dir'")
        here = str(self.state_dir)
        if row is None or row.value == here:
            return
        old, new = os.path.join(row.value, "updates", ""), os.path.join(here, "updates", "")
        with self.transaction() as t:
            n = t._c.execute("UPDATE updates SET spill_path = ? || substr(spill_path, ?) "  # type: ignore[attr-defined]
                             "WHERE substr(spill_path, 1, ?) = ?", (new, len(old) + 1, len(old), old)).rowcount
            t._c.execute("UPDATE meta SET value=? WHERE key='state_dir'", (here,))  # type: ignore[attr-defined]
        log.info("state folder moved: spill paths relocated", old=row.value, new=here, updates=n)

    # tasks --------------------------------------------------------------------------------------------
    def task(self, task_id: str) -> TaskRecord | None:
        r = self._row("SELECT * FROM tasks WHERE task_id=?", (task_id,))
        return task_record(r) if r is not None else None

    def signed_task(self, task_id: str) -> bytes:
        r = self._row("SELECT signed_task FROM tasks WHERE task_id=?", (task_id,))
        return bytes(r[0]) if r is not None and r[0] is not None else b""

    def task_by_key(self, owner: str, idempotency_key: str) -> TaskRecord | None:
        r = self._row("SELECT * FROM tasks WHERE owner=? AND idempotency_key=?", (owner, idempotency_key))
        return task_record(r) if r is not None else None

    def tasks(self, state: int | None = None) -> list[TaskRecord]:
        if state is None:
            return [task_record(r) for r in self._rows("SELECT * FROM tasks ORDER BY created_ms")]
        return [task_record(r) for r in self._rows("SELECT * FROM tasks WHERE state=? ORDER BY created_ms", (state,))]

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
        return frozenset(r["h"] for r in self._rows(TASK_MODELS, (task_id,) * 3) if r["h"])

    def task_blobs(self, task_id: str) -> frozenset[str]:
        out: set[str] = set()
        for r in self._rows(f"SELECT manifest FROM models WHERE model_hash IN ({TASK_MODELS})", (task_id,) * 3):
            m = manifest_from_json(r["manifest"])
            out.update(t.sha256 for t in m.tensors)
            out.update(f.sha256 for f in m.files)
        for r in self._rows(f"SELECT header FROM model_deltas WHERE model_hash IN ({TASK_MODELS})", (task_id,) * 3):
            out.add(json_format.Parse(r["header"], tensors_pb2.TensorHeader()).sha256)
        return frozenset(out)

    # rounds -------------------------------------------------------------------------------------------
    def round(self, task_id: str, rnd: int) -> RoundRecord | None:
        r = self._row("SELECT * FROM rounds WHERE task_id=? AND round=?", (task_id, rnd))
        return round_record(r) if r is not None else None

    def open_round_of(self, task_id: str) -> RoundRecord | None:
        r = self._row("SELECT * FROM rounds WHERE task_id=? AND state=?", (task_id, S.ROUND_STATE_OPEN))
        return round_record(r) if r is not None else None

    def rounds_of(self, task_id: str) -> list[RoundRecord]:
        return [round_record(r) for r in self._rows("SELECT * FROM rounds WHERE task_id=? ORDER BY round", (task_id,))]

    def open_rounds(self, *, running_only: bool = True) -> list[RoundRecord]:
        if not running_only:
            return [round_record(r) for r in self._rows("SELECT * FROM rounds WHERE state=?", (S.ROUND_STATE_OPEN,))]
        return [round_record(r) for r in self._rows(
            "SELECT r.* FROM rounds r JOIN tasks t USING (task_id) WHERE r.state=? AND t.state=?",
            (S.ROUND_STATE_OPEN, S.TASK_STATE_RUNNING))]

    def last_closed_round(self, task_id: str) -> RoundRecord | None:
        r = self._row("SELECT * FROM rounds WHERE task_id=? AND state=? ORDER BY round DESC LIMIT 1",
                      (task_id, S.ROUND_STATE_CLOSED))
        return round_record(r) if r is not None else None

    def newest_round_model(self, task_id: str) -> str:
        r = self._row("SELECT model_hash FROM rounds WHERE task_id=? AND model_hash!='' ORDER BY round DESC LIMIT 1",
                      (task_id,))
        return r["model_hash"] if r is not None else ""

    # sites --------------------------------------------------------------------------------------------
    def assignment(self, task_id: str, rnd: int, site: str) -> AssignmentRecord | None:
        r = self._row("SELECT * FROM assignments WHERE task_id=? AND round=? AND site=?", (task_id, rnd, site))
        return assignment_record(r) if r is not None else None

    def assignments_of(self, task_id: str, rnd: int) -> list[AssignmentRecord]:
        return [assignment_record(r) for r in self._rows("SELECT * FROM assignments WHERE task_id=? AND round=? "
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
        return update_record(r) if r is not None else None

    def has_update(self, task_id: str, rnd: int, site: str) -> bool:
        return self._row("SELECT 1 FROM updates WHERE task_id=? AND round=? AND site=?",
                         (task_id, rnd, site)) is not None

    def updates_of(self, task_id: str, rnd: int) -> list[UpdateRecord]:
        return [update_record(r) for r in self._rows("SELECT * FROM updates WHERE task_id=? AND round=? "
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
        return phase_record(r) if r is not None else None

    def open_result_phases(self) -> list[ResultPhaseRecord]:
        return [phase_record(r) for r in self._rows("SELECT p.* FROM result_phases p JOIN tasks t USING (task_id) "
                                                    "WHERE p.closed_ms=0 AND t.state=?", (S.TASK_STATE_RUNNING,))]

    def results_of(self, task_id: str, rnd: int) -> list[SiteResultRecord]:
        return [result_record(r) for r in self._rows("SELECT * FROM site_results WHERE task_id=? AND round=? "
                                                     "ORDER BY site, model", (task_id, rnd))]

    def reported_sites(self, task_id: str) -> list[str]:
        return [r[0] for r in self._rows("SELECT site FROM updates WHERE task_id=? UNION SELECT site_id FROM "
                                         "site_statements WHERE task_id=? ORDER BY 1", (task_id, task_id))]

    def gauges(self) -> StateGauges:
        by_state = {r["state"]: r["n"] for r in self._rows("SELECT state, COUNT(*) AS n FROM tasks GROUP BY state")}
        return StateGauges(
            by_state, self._count(f"SELECT COUNT(*) FROM ({OPEN_ROUNDS}) o"),
            self._count(f"SELECT COUNT(*) FROM updates u JOIN ({OPEN_ROUNDS}) r USING (task_id, round)"),
            self._count(f"SELECT COUNT(*) FROM assignments a JOIN ({OPEN_ROUNDS}) r USING (task_id, round) "
                        "WHERE a.declined='' AND NOT EXISTS (SELECT 1 FROM updates u WHERE u.task_id=a.task_id "
                        "AND u.round=a.round AND u.site=a.site)"))
