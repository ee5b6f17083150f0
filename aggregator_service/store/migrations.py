"""The SQLite schema of the aggregator's state, as numbered steps (``meta.schema_version``).

:data:`MIGRATIONS` is the ordered list of steps from version N to N+1; :func:`migrate` applies the steps above a
database's version in one transaction (all or nothing) and logs ``store schema migrated``; a database newer
than this build is refused with :class:`~aggregator_service.store.StoreError`. Append a step, never edit a
released one. (A PostgreSQL store keeps its own schema steps; the versions count the same tables.)
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import structlog

import fedclinic
from fedclinic.errors import FedclinicError

log = structlog.get_logger("fedclinic.aggregator.store")


class StoreError(FedclinicError):
    """The state database cannot be opened or migrated by this build (says what to do)."""


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


def _columns(c: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in c.execute(f"PRAGMA table_info({table})").fetchall()}


def _add_column(c: sqlite3.Connection, table: str, column: str, decl: str) -> None:
    """ALTER TABLE ... ADD COLUMN unless it is there (builds before numbered steps added some columns
    while still calling the schema version 1)."""
    if column not in _columns(c, table):
        c.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")


def _to_v1(c: sqlite3.Connection, state_dir: Path) -> None:
    for statement in SCHEMA_V1:
        c.execute(statement)


def _to_v2(c: sqlite3.Connection, state_dir: Path) -> None:
    _add_column(c, "rounds", "strategy_state", "TEXT NOT NULL DEFAULT '{}'")   # stateful strategies (FedOpt...)
    _add_column(c, "updates", "fp32_bytes", "INTEGER NOT NULL DEFAULT 0")      # byte accounting of update codecs
    _add_column(c, "updates", "wire_bytes", "INTEGER NOT NULL DEFAULT 0")


def _to_v3(c: sqlite3.Connection, state_dir: Path) -> None:
    # where the spill paths in ``updates`` point: SqliteStore relocates them when the folder moved
    c.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('state_dir', ?)", (str(state_dir),))


def _to_v4(c: sqlite3.Connection, state_dir: Path) -> None:
    # compressed downlink (fedclinic.transport.downlink): tensors of a model also kept as an encoded change from a base tensor
    c.execute("CREATE TABLE IF NOT EXISTS model_deltas (model_hash TEXT NOT NULL, name TEXT NOT NULL, "
              "base_sha256 TEXT NOT NULL, header TEXT NOT NULL, PRIMARY KEY (model_hash, name))")


def _to_v5(c: sqlite3.Connection, state_dir: Path) -> None:
    # downlink byte accounting per site and round, payload and on the wire
    _add_column(c, "assignments", "downlink_bytes", "INTEGER NOT NULL DEFAULT 0")
    _add_column(c, "assignments", "downlink_wire_bytes", "INTEGER NOT NULL DEFAULT 0")


def _to_v6(c: sqlite3.Connection, state_dir: Path) -> None:
    # why a site holds its assignment without refusing it (e.g. awaiting approval by its IT); '' = not held
    _add_column(c, "assignments", "held", "TEXT NOT NULL DEFAULT ''")


def _to_v7(c: sqlite3.Connection, state_dir: Path) -> None:
    # the sha256 of an update's spill file when it was acknowledged: recovery checks the file against it
    _add_column(c, "updates", "spill_sha256", "TEXT NOT NULL DEFAULT ''")


def _to_v8(c: sqlite3.Connection, state_dir: Path) -> None:
    # the scientist's signed task (a serialized fedclinic.v1.SignedStatement over the spec and the initial model's
    # manifest), relayed to the sites as it was submitted; empty for a task submitted unsigned
    _add_column(c, "tasks", "signed_task", "BLOB NOT NULL DEFAULT x''")
    # each site's signed statement about a round (the model it trained from, the update it sent), kept with the
    # round so that anyone holding the public records can check it (`fedclinic task verify`)
    c.execute("CREATE TABLE IF NOT EXISTS site_statements ("
              " task_id TEXT NOT NULL, round INTEGER NOT NULL, attempt INTEGER NOT NULL, site_id TEXT NOT NULL,"
              " statement BLOB NOT NULL, PRIMARY KEY (task_id, round, attempt, site_id))")


def _to_v9(c: sqlite3.Connection, state_dir: Path) -> None:
    # a secure round's published result: the unmasked ring sum (a blob), the survivors whose masked inputs are in it
    # and the session's layout, so that `fedclinic task verify` can recompute the round's model from them
    c.execute("CREATE TABLE IF NOT EXISTS secure_sums ("
              " task_id TEXT NOT NULL, round INTEGER NOT NULL, survivors TEXT NOT NULL, sum_sha256 TEXT NOT NULL,"
              " params TEXT NOT NULL, PRIMARY KEY (task_id, round))")


def _to_v10(c: sqlite3.Connection, state_dir: Path) -> None:
    # the result phase of a task (aggregator_service.results): the final model's evaluation after its last round,
    # or an "evaluate" / "statistics" task's only phase; at most one per task
    c.execute("CREATE TABLE IF NOT EXISTS result_phases ("
              " task_id TEXT PRIMARY KEY, round INTEGER NOT NULL, work TEXT NOT NULL, model_hash TEXT NOT NULL,"
              " opened_ms INTEGER NOT NULL, deadline_ms INTEGER NOT NULL, closed_ms INTEGER NOT NULL DEFAULT 0)")
    # the sites' results (SubmitResult): flat values per (task, round, site, model); a training round's
    # evaluation sent after its update is kept here too (work 'round-eval')
    c.execute("CREATE TABLE IF NOT EXISTS site_results ("
              " task_id TEXT NOT NULL, round INTEGER NOT NULL, site TEXT NOT NULL, model TEXT NOT NULL,"
              " work TEXT NOT NULL, model_hash TEXT NOT NULL, vals TEXT NOT NULL, min_cell INTEGER NOT NULL,"
              " received_ms INTEGER NOT NULL, PRIMARY KEY (task_id, round, site, model))")


@dataclass(frozen=True)
class Migration:
    """One step of the store schema, from version ``to - 1`` to ``to``; ``apply`` runs inside the migration's
    transaction and must not commit."""

    to: int
    what: str
    apply: Callable[[sqlite3.Connection, Path], None]


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "tasks, models, rounds, assignments, updates, site declines, events", _to_v1),
    Migration(2, "rounds.strategy_state; updates.fp32_bytes and wire_bytes", _to_v2),
    Migration(3, "meta.state_dir, so a moved or restored state folder relocates its spill paths", _to_v3),
    Migration(4, "model_deltas: global tensors also stored as an encoded change (compressed downlink)", _to_v4),
    Migration(5, "assignments.downlink_bytes and downlink_wire_bytes (per-site downlink accounting)", _to_v5),
    Migration(6, "assignments.held: why a site holds its assignment (e.g. awaiting approval by its IT)", _to_v6),
    Migration(7, "updates.spill_sha256: the spill file's hash at acknowledgement, checked at recovery", _to_v7),
    Migration(8, "tasks.signed_task (the scientist's signature) and site_statements (the sites' signed rounds)",
              _to_v8),
    Migration(9, "secure_sums: a secure round's unmasked sum and survivors, for `fedclinic task verify`", _to_v9),
    Migration(10, "result_phases and site_results: the final-model evaluation, evaluate and statistics tasks",
              _to_v10),
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


def migrate(conn: sqlite3.Connection, db_path: Path, state_dir: Path) -> None:
    """Apply the steps of :data:`MIGRATIONS` above the database's version, in order, in one transaction
    (all or nothing), with a log line; refuse a database newer than this build. ``conn`` is in autocommit
    mode (``isolation_level=None``)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        current = read_schema_version(conn)
        if current > SCHEMA_VERSION:
            raise StoreError(
                f"{db_path} has schema version {current}, newer than this fedclinic-aggregator "
                f"({fedclinic.__version__}, schema version {SCHEMA_VERSION}): it was written by a newer "
                "release. Run that release (or newer), or restore a backup taken with this one")
        steps = [m for m in MIGRATIONS if m.to > current]
        for step in steps:
            try:
                step.apply(conn, state_dir)
            except sqlite3.Error as exc:
                raise StoreError(
                    f"cannot migrate {db_path} from schema version {step.to - 1} to {step.to} "
                    f"({step.what}): {exc}. Nothing was changed; restore the state folder from a "
                    "backup (fedclinic-aggregator restore) or report this with the database") from None
            conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('schema_version', ?)", (str(step.to),))
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    if steps:
        log.info("store schema migrated", path=str(db_path), from_version=current, to_version=SCHEMA_VERSION,
                 steps=[f"{m.to - 1}->{m.to}: {m.what}" for m in steps])
