"""The writes of one store transaction in SQL that SQLite (3.24+) and PostgreSQL both run: ``?`` placeholders
(the PostgreSQL store's connection wrapper turns them into ``%s``), ``INSERT ... ON CONFLICT DO NOTHING`` for
"keep the first", and DELETE + INSERT for "replace the row" (what SQLite's ``INSERT OR REPLACE`` did: columns the
statement does not name go back to their defaults).

The transaction itself (BEGIN, COMMIT, locks) belongs to each store; this class only issues statements on the
connection it is given, which must expose ``execute(sql, args)`` returning a cursor with ``rowcount``."""

from __future__ import annotations

import json
from typing import Any, Iterable, Protocol, Sequence

from google.protobuf import json_format

from fedclinic.transport.package import Manifest
from fedclinic.proto import control_pb2, task_pb2, tensors_pb2

from aggregator_service.store.interface import StoreTransaction
from aggregator_service.store.records import ResultPhaseRecord, SiteResultRecord, UpdateRecord, now_ms
from aggregator_service.store.sql_rows import manifest_to_json

S = control_pb2


class SqlConnection(Protocol):
    """What the shared SQL needs of a connection (sqlite3.Connection, or the PostgreSQL store's wrapper)."""

    def execute(self, sql: str, args: Sequence[Any] = ...) -> Any: ...


class SqlTransaction(StoreTransaction):
    """The writes of one transaction on ``conn`` (see the module docstring); ``events`` go to ``on_commit``."""

    def __init__(self, conn: SqlConnection) -> None:
        self._c = conn
        self.events: list[dict[str, Any]] = []

    def _replace(self, table: str, key: Sequence[str], row: dict[str, Any]) -> None:
        """Replace the row of ``table`` with the same ``key`` columns by ``row`` (unnamed columns: defaults)."""
        self._c.execute(f"DELETE FROM {table} WHERE " + " AND ".join(f"{k}=?" for k in key),
                        tuple(row[k] for k in key))
        self._c.execute(f"INSERT INTO {table}({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                        tuple(row.values()))

    def add_event(self, task_id: str, kind: str, message: str, *, actor: str = "", **details: Any) -> None:
        self._c.execute("INSERT INTO events(task_id, kind, message, unix_ms) VALUES (?, ?, ?, ?)",
                        (task_id, kind, message, now_ms()))
        self.events.append({"task_id": task_id, "kind": kind, "message": message, "actor": actor,
                            "details": details})

    def put_model(self, manifest: Manifest) -> str:
        h = manifest.model_hash
        self._c.execute("INSERT INTO models(model_hash, manifest) VALUES (?, ?) ON CONFLICT DO NOTHING",
                        (h, manifest_to_json(manifest)))
        return h

    def put_model_deltas(self, model_hash: str, deltas: Iterable[tensors_pb2.DownlinkDelta]) -> None:
        for d in deltas:
            self._replace("model_deltas", ("model_hash", "name"), {
                "model_hash": model_hash, "name": d.name, "base_sha256": d.base_sha256,
                "header": json_format.MessageToJson(d.header, indent=None)})

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
        self._replace("rounds", ("task_id", "round"), {
            "task_id": task_id, "round": rnd, "attempt": attempt, "state": S.ROUND_STATE_OPEN,
            "sites_target": sites_target, "opened_ms": opened_ms, "deadline_ms": deadline_ms,
            "base_model": base_model})
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
        self._replace("assignments", ("task_id", "round", "site"), {
            "task_id": task_id, "round": rnd, "site": site, "attempt": attempt, "assigned_ms": assigned_ms})

    def hold(self, task_id: str, rnd: int, site: str, reason: str) -> None:
        self._c.execute("UPDATE assignments SET held=? WHERE task_id=? AND round=? AND site=?",
                        (reason, task_id, rnd, site))

    def decline(self, task_id: str, rnd: int, site: str, reason: str, permanent: bool) -> None:
        self._c.execute("UPDATE assignments SET declined=? WHERE task_id=? AND round=? AND site=?",
                        (reason, task_id, rnd, site))
        if permanent:
            self._replace("site_declines", ("task_id", "site"), {"task_id": task_id, "site": site, "reason": reason})

    def record_update(self, u: UpdateRecord) -> None:
        self._c.execute("INSERT INTO updates(update_id, task_id, round, site, idempotency_key, num_samples, nbytes, "
                        "spill_path, layout, metrics, eval_metrics, received_ms, fp32_bytes, wire_bytes, spill_sha256) "
                        "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                        (u.update_id, u.task_id, u.round, u.site, u.idempotency_key, u.num_samples, u.nbytes,
                         u.spill_path, u.layout, json.dumps(u.metrics), json.dumps(u.eval_metrics), u.received_ms,
                         u.fp32_bytes, u.wire_bytes, u.spill_sha256))
        self.add_uplink(u.task_id, u.round, u.nbytes)

    def record_statement(self, task_id: str, rnd: int, attempt: int, site: str, statement: bytes) -> None:
        self._replace("site_statements", ("task_id", "round", "attempt", "site_id"), {
            "task_id": task_id, "round": rnd, "attempt": attempt, "site_id": site, "statement": statement})

    def record_secure_sum(self, task_id: str, rnd: int, survivors: list[str], sum_sha256: str, params: str) -> None:
        self._replace("secure_sums", ("task_id", "round"), {
            "task_id": task_id, "round": rnd, "survivors": json.dumps(survivors), "sum_sha256": sum_sha256,
            "params": params})

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
            "INSERT INTO site_results(task_id, round, site, model, work, model_hash, vals, min_cell, received_ms) "
            "VALUES (?,?,?,?,?,?,?,?,?) ON CONFLICT DO NOTHING",
            (r.task_id, r.round, r.site, r.model, r.work, r.model_hash, json.dumps(r.values), r.min_cell,
             r.received_ms)).rowcount > 0

    def set_round_metrics(self, task_id: str, rnd: int, metrics: dict[str, float]) -> None:
        self._c.execute("UPDATE rounds SET metrics=? WHERE task_id=? AND round=?", (json.dumps(metrics), task_id, rnd))
