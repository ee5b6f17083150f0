"""The aggregator's store schema: ordered migrations on open, all or nothing, newer schemas refused, moved
state folders relocated."""

from __future__ import annotations

import shutil
import sqlite3

import pytest
from structlog.testing import capture_logs

from aggregator_service.store import MIGRATIONS, SCHEMA_VERSION, StoreError
from aggregator_service.store import SqliteStore as Store

# The tables exactly as the first release (schema version 1) created them, written out here rather than
# imported, so this stays a database "made by an older build" whatever the code does later.
V1_DDL = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE tasks (
  task_id TEXT PRIMARY KEY, owner TEXT NOT NULL, idempotency_key TEXT NOT NULL, spec BLOB NOT NULL,
  state INTEGER NOT NULL, current_round INTEGER NOT NULL DEFAULT 0, error TEXT NOT NULL DEFAULT '',
  created_ms INTEGER NOT NULL, updated_ms INTEGER NOT NULL, initial_model TEXT NOT NULL,
  final_model TEXT NOT NULL DEFAULT '', UNIQUE (owner, idempotency_key));
CREATE TABLE models (model_hash TEXT PRIMARY KEY, manifest TEXT NOT NULL);
CREATE TABLE rounds (
  task_id TEXT NOT NULL, round INTEGER NOT NULL, attempt INTEGER NOT NULL, state INTEGER NOT NULL,
  sites_target INTEGER NOT NULL, opened_ms INTEGER NOT NULL, deadline_ms INTEGER NOT NULL,
  closed_ms INTEGER NOT NULL DEFAULT 0, base_model TEXT NOT NULL, model_hash TEXT NOT NULL DEFAULT '',
  uplink_bytes INTEGER NOT NULL DEFAULT 0, downlink_bytes INTEGER NOT NULL DEFAULT 0,
  metrics TEXT NOT NULL DEFAULT '{}', PRIMARY KEY (task_id, round));
CREATE TABLE assignments (
  task_id TEXT NOT NULL, round INTEGER NOT NULL, site TEXT NOT NULL, attempt INTEGER NOT NULL,
  assigned_ms INTEGER NOT NULL, declined TEXT NOT NULL DEFAULT '', PRIMARY KEY (task_id, round, site));
CREATE TABLE updates (
  update_id TEXT PRIMARY KEY, task_id TEXT NOT NULL, round INTEGER NOT NULL, site TEXT NOT NULL,
  idempotency_key TEXT NOT NULL, num_samples INTEGER NOT NULL, nbytes INTEGER NOT NULL,
  spill_path TEXT NOT NULL, layout TEXT NOT NULL, metrics TEXT NOT NULL, eval_metrics TEXT NOT NULL,
  received_ms INTEGER NOT NULL, UNIQUE (task_id, round, site), UNIQUE (task_id, idempotency_key));
CREATE TABLE site_declines (
  task_id TEXT NOT NULL, site TEXT NOT NULL, reason TEXT NOT NULL, PRIMARY KEY (task_id, site));
CREATE TABLE events (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, task_id TEXT NOT NULL, kind TEXT NOT NULL, message TEXT NOT NULL,
  unix_ms INTEGER NOT NULL);
CREATE INDEX events_by_task ON events (task_id, seq);
INSERT INTO meta VALUES ('schema_version', '1');
"""


def _v1_database(state_dir, *, drop: str | None = None):
    state_dir.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(state_dir / "aggregator.sqlite")
    db.executescript(V1_DDL)
    db.execute("INSERT INTO tasks VALUES ('t-1', 'alice', 'k', x'00', 1, 1, '', 1, 1, 'm0', '')")
    db.execute("INSERT INTO rounds(task_id, round, attempt, state, sites_target, opened_ms, deadline_ms, base_model)"
               " VALUES ('t-1', 1, 1, 1, 2, 1, 2, 'm0')")
    db.execute("INSERT INTO updates VALUES ('u-1', 't-1', 1, 'site-a', 'key-a', 10, 16, ?, '{}', '{}', '{}', 5)",
               (str(state_dir / "updates" / "t-1" / "1" / "u-1.bin"),))
    if drop:
        db.execute(f"DROP TABLE {drop}")
    db.commit()
    db.close()


def _columns(store: Store, table: str) -> set[str]:
    return {r.name for r in store.all(f"PRAGMA table_info({table})")}


def test_migrations_are_numbered_steps_in_order():
    assert [m.to for m in MIGRATIONS] == list(range(1, SCHEMA_VERSION + 1))


def test_a_version_1_database_is_migrated_on_open_with_its_rows_kept(tmp_path):
    _v1_database(tmp_path)
    with capture_logs() as logs:
        store = Store(tmp_path)
    assert store.schema_version == SCHEMA_VERSION
    assert {"strategy_state"} <= _columns(store, "rounds")
    assert {"fp32_bytes", "wire_bytes"} <= _columns(store, "updates")
    assert store.one("SELECT strategy_state FROM rounds WHERE task_id='t-1'").strategy_state == "{}"
    u = store.one("SELECT * FROM updates WHERE update_id='u-1'")
    assert (u.site, u.num_samples, u.fp32_bytes, u.wire_bytes) == ("site-a", 10, 0, 0)
    assert store.one("SELECT value FROM meta WHERE key='state_dir'").value == str(tmp_path)
    (line,) = [e for e in logs if e["event"] == "store schema migrated"]
    assert (line["from_version"], line["to_version"]) == (1, SCHEMA_VERSION)
    assert len(line["steps"]) == SCHEMA_VERSION - 1 and line["steps"][0].startswith("1->2")
    store.close()
    with capture_logs() as logs:  # already current: nothing to do, nothing logged
        Store(tmp_path).close()
    assert not [e for e in logs if e["event"] == "store schema migrated"]


def test_a_new_database_gets_every_step(tmp_path):
    store = Store(tmp_path)
    assert store.schema_version == SCHEMA_VERSION
    assert {"fp32_bytes", "wire_bytes"} <= _columns(store, "updates")


def test_a_newer_schema_is_refused_and_left_alone(tmp_path):
    Store(tmp_path).close()
    db = sqlite3.connect(tmp_path / "aggregator.sqlite")
    db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION + 1),))
    db.commit()
    db.close()
    with pytest.raises(StoreError, match=f"schema version {SCHEMA_VERSION + 1}, newer than this"):
        Store(tmp_path)
    db = sqlite3.connect(tmp_path / "aggregator.sqlite")
    assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION + 1)


def test_a_failing_step_changes_nothing(tmp_path):
    _v1_database(tmp_path, drop="updates")  # damaged: step 2 alters rounds, then fails on updates
    with pytest.raises(StoreError, match="cannot migrate .* from schema version 1 to 2.*Nothing was changed"):
        Store(tmp_path)
    db = sqlite3.connect(tmp_path / "aggregator.sqlite")
    assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == "1"
    assert "strategy_state" not in {r[1] for r in db.execute("PRAGMA table_info(rounds)")}


def test_a_moved_state_folder_relocates_its_spill_paths(tmp_path):
    _v1_database(tmp_path / "old")
    Store(tmp_path / "old").close()
    shutil.move(tmp_path / "old", tmp_path / "new")
    store = Store(tmp_path / "new")
    expected = tmp_path / "new" / "updates" / "t-1" / "1" / "u-1.bin"
    assert store.one("SELECT spill_path FROM updates").spill_path == str(expected)
    assert store.one("SELECT value FROM meta WHERE key='state_dir'").value == str(tmp_path / "new")


def test_version_10_adds_the_result_tables_and_keeps_a_version_9_database(tmp_path):
    from aggregator_service.store import ResultPhaseRecord, SiteResultRecord

    _v1_database(tmp_path)
    db = sqlite3.connect(tmp_path / "aggregator.sqlite")
    db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    db.commit()
    db.close()
    store = Store(tmp_path)  # 1 -> current, through step 10
    assert {"task_id", "round", "work", "model_hash", "deadline_ms", "closed_ms"} <= _columns(store, "result_phases")
    assert {"site", "model", "vals", "min_cell"} <= _columns(store, "site_results")
    assert store.one("SELECT site FROM updates WHERE update_id='u-1'").site == "site-a"
    with store.transaction() as tx:
        tx.open_result_phase(ResultPhaseRecord("t-1", 2, "evaluate", "m1", 5, 6, 0))
        assert tx.record_result(SiteResultRecord("t-1", 2, "site-a", "final", "evaluate", "m1",
                                                 {"eval_rows": 12.0, "accuracy": 0.5}, 10, 7))
        assert not tx.record_result(SiteResultRecord("t-1", 2, "site-a", "final", "evaluate", "m1",
                                                     {"eval_rows": 1.0}, 10, 8))  # a second copy writes nothing
    store.close()
    store = Store(tmp_path)
    assert store.result_phase("t-1").work == "evaluate" and store.open_result_phases()[0].round == 2
    (r,) = store.results_of("t-1", 2)
    assert (r.site, r.model, r.values["eval_rows"], r.min_cell) == ("site-a", "final", 12.0, 10)
    assert store.reported_sites("t-1") == ["site-a"]
