"""The fuzz part's store checks (campaign.store_invariants) see what they must: a state folder written by the
aggregator's own store, blob store and audit log passes; a blob whose bytes no longer match its name, an
acknowledged update the store does not hold, and an edited audit record each fail it. (So a fuzz run that broke
the store cannot report 0 broken invariants.)"""

from __future__ import annotations

import json

from aggregator_service.store import DatabaseSettings
from fedclinic.runtime.audit_log import AuditLog
from fedclinic.runtime.blobstore import BlobStore
from fedclinic.transport.package import Manifest, TensorEntry

from campaign.store_invariants import StoreInvariants


def _state(tmp_path, open_test_store):
    """A state folder (and database: SQLite or PostgreSQL, one test each) written by the store itself, with one
    blob and a three-record audit chain; returns ``(invariants, state folder, blob store, blob digest)``."""
    state = tmp_path / "aggregator-state"
    store = open_test_store(state)  # the real schema
    database = store.settings if open_test_store.backend == "postgresql" else DatabaseSettings()
    blobs = BlobStore(state / "blobs")
    digest = blobs.put(b"a tensor's bytes")
    with AuditLog(state / "audit.jsonl") as audit:
        for i in range(3):
            audit.append("task.submitted", actor="scientist", task_id=f"t-{i}")
    return StoreInvariants(state, database), state, blobs, digest


def test_a_sound_store_passes(tmp_path, open_test_store):
    inv, state, _blobs, _digest = _state(tmp_path, open_test_store)
    assert inv.check() == [] and inv.check() == []
    assert inv.checks_run == 2 and inv.audit_head is not None


def test_a_corrupted_blob_is_seen(tmp_path, open_test_store):
    inv, state, blobs, digest = _state(tmp_path, open_test_store)
    assert inv.check() == []
    blobs.path(digest).write_bytes(b"a tensor's bytez")  # same size, one byte changed
    problems = inv.check()
    assert len(problems) == 1 and problems[0].startswith(f"blob {digest[:16]}") and "hashing to" in problems[0]


def test_an_acknowledged_update_missing_from_the_store_is_seen(tmp_path, open_test_store):
    inv, state, _blobs, _digest = _state(tmp_path, open_test_store)
    inv.acknowledge("u-1", "t-1", 1, "site-c")
    assert inv.check() == ["acknowledged update u-1 of ('t-1', 1, 'site-c') is stored 0 times"]


def test_an_edited_or_cut_audit_chain_is_seen(tmp_path, open_test_store):
    inv, state, _blobs, _digest = _state(tmp_path, open_test_store)
    assert inv.check() == []
    path = state / "audit.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    rec = json.loads(lines[1])
    rec["actor"] = "someone else"
    path.write_text(lines[0] + json.dumps(rec) + "\n" + lines[2])
    assert any(p.startswith("audit chain broken") for p in inv.check())
    path.write_text(lines[0])  # cut after the head seen at the first check
    again = StoreInvariants(state, inv.database, audit_head=inv.audit_head)
    assert any(p.startswith("audit chain broken") for p in again.check())


def test_a_stored_model_naming_a_missing_blob_is_seen(tmp_path, open_test_store):
    """The models table is read from the aggregator's own database (SQLite or PostgreSQL)."""
    inv, state, _blobs, digest = _state(tmp_path, open_test_store)
    missing = "f" * 64
    with open_test_store(state).transaction() as tx:
        model_hash = tx.put_model(Manifest((TensorEntry("b", "float32", (1,), missing, 4),
                                            TensorEntry("w", "float32", (2,), digest, 8)), ()))
    assert inv.check() == [f"model {model_hash[:16]}... names blob {missing[:16]}..., which is missing"]
