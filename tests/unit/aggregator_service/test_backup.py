"""Aggregator backups: an online snapshot plus referenced blobs and open-round updates, verified by manifest;
restore only into an empty folder; corrupt or incomplete backups are refused with what to do."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import numpy as np
import pytest

from aggregator_service.backup import MANIFEST, BackupError, create_backup, restore_backup, verify_backup
from aggregator_service.store import SCHEMA_VERSION
from fedclinic.transport.package import ModelPackage

from tests.helpers.engine import assign_sites, make_engine, send_update, submit_task


def _mid_round_two(root):
    """A FedAdam task (strategy state in blobs) with round 1 closed and one of two round-2 updates durable."""
    store, engine = make_engine(root)
    task_id = submit_task(engine, ModelPackage({"w": np.zeros(3, np.float32)}), min_sites=2, num_rounds=2,
                      strategy="fedadam", strategy_params={"server_lr": 0.1})
    a = assign_sites(engine, ["s1", "s2"])
    send_update(engine, "s1", a["s1"], {"w": np.ones(3, np.float32)})
    send_update(engine, "s2", a["s2"], {"w": np.ones(3, np.float32)})
    b = assign_sites(engine, ["s1", "s2"])
    send_update(engine, "s1", b["s1"], {"w": np.ones(3, np.float32)}, key="r2-s1")
    (root / "audit.jsonl").write_text('{"seq": 1}\n{"seq": 2, "torn')  # a record being appended right now
    return store, engine, task_id, b


def _finish(root, b) -> np.ndarray:
    store, engine = make_engine(root)
    engine.recover()
    engine.site_connected("s2")
    send_update(engine, "s2", b["s2"], {"w": np.ones(3, np.float32)}, key="r2-s2")
    final = store.model(store.task(b["s2"].task_id).final_model)
    out = np.array(engine.blobs.array(final.tensor("w").sha256, "float32", (3,)))
    store.close()
    return out


def test_backup_of_a_running_store_restores_and_the_round_completes_the_same(tmp_path):
    store, _engine_, task_id, b = _mid_round_two(tmp_path / "live")
    manifest = create_backup(tmp_path / "live", tmp_path / "backup")  # the store is open: an online backup
    paths = {f.path for f in manifest.files}
    assert "aggregator.sqlite" in paths and "audit.jsonl" in paths
    assert len([p for p in paths if p.startswith("updates/")]) == 1  # the durable round-2 update, not round 1's
    assert len([p for p in paths if p.startswith("blobs/")]) >= 4    # models of rounds 0, 1 and FedAdam's m, v
    assert manifest.schema_version == SCHEMA_VERSION
    assert (tmp_path / "backup" / "audit.jsonl").read_text() == '{"seq": 1}\n'
    doc = json.loads((tmp_path / "backup" / MANIFEST).read_text())
    assert doc["format"] == "fedclinic-aggregator-backup" and doc["created"].endswith("Z")
    assert all(len(f["sha256"]) == 64 for f in doc["files"])
    assert verify_backup(tmp_path / "backup") == manifest

    restore_backup(tmp_path / "backup", tmp_path / "restored")
    for folder in ("backup", "restored"):  # owner-only, like the live state (the audit log is 0600 there)
        assert all(p.stat().st_mode & 0o077 == 0 for p in (tmp_path / folder).rglob("*") if p.is_file()), folder
    store.close()
    expected = _finish(tmp_path / "live", b)
    got = _finish(tmp_path / "restored", b)
    np.testing.assert_array_equal(got, expected)
    restored = sqlite3.connect(tmp_path / "restored" / "aggregator.sqlite")
    (spill,) = [p for (p,) in restored.execute("SELECT spill_path FROM updates WHERE idempotency_key='r2-s1'")]
    assert spill.startswith(str(tmp_path / "restored" / "updates"))


@pytest.fixture
def backup(tmp_path):
    store, *_ = _mid_round_two(tmp_path / "live")
    create_backup(tmp_path / "live", tmp_path / "backup")
    store.close()
    return tmp_path / "backup"


def _rewrite_manifest(folder, change) -> None:
    doc = json.loads((folder / MANIFEST).read_text())
    change(doc)
    (folder / MANIFEST).write_text(json.dumps(doc))


def test_restore_refuses_a_folder_that_is_not_empty(backup, tmp_path):
    target = tmp_path / "busy"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(BackupError, match="is not empty; restore into a new or empty folder"):
        restore_backup(backup, target)
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    restore_backup(backup, tmp_path / "empty-ok")  # a new folder is fine
    (tmp_path / "empty").mkdir()
    restore_backup(backup, tmp_path / "empty")     # and so is an empty one


def test_backup_refuses_a_destination_that_is_not_empty(tmp_path, backup):
    with pytest.raises(BackupError, match="exists and is not an empty folder"):
        create_backup(tmp_path / "live", backup)
    with pytest.raises(BackupError, match="holds no aggregator state"):
        create_backup(tmp_path / "nothing", tmp_path / "b2")


def test_a_flipped_byte_in_a_blob_is_found_and_nothing_is_restored(backup, tmp_path):
    blob = next(p for p in (backup / "blobs").rglob("*") if p.is_file())
    data = bytearray(blob.read_bytes())
    data[0] ^= 1
    blob.write_bytes(bytes(data))
    rel = blob.relative_to(backup).as_posix()
    with pytest.raises(BackupError, match=f"is corrupt: {rel} has .* sha256 .* the manifest says"):
        verify_backup(backup)
    with pytest.raises(BackupError, match="is corrupt"):
        restore_backup(backup, tmp_path / "restored")
    assert not (tmp_path / "restored").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".restored")]


def test_a_missing_file_or_manifest_is_an_incomplete_backup(backup):
    spill = next((backup / "updates").rglob("*.bin"))
    spill.unlink()
    with pytest.raises(BackupError, match=r"is incomplete: updates/.*\.bin is listed in manifest.json but missing"):
        verify_backup(backup)
    (backup / MANIFEST).unlink()
    with pytest.raises(BackupError, match="incomplete backup: it has no manifest.json"):
        verify_backup(backup)


def test_a_damaged_manifest_is_refused(backup):
    (backup / MANIFEST).write_text('{"format": "fedclinic-aggregator-backup", "files": [')
    with pytest.raises(BackupError, match="manifest.json is corrupt"):
        verify_backup(backup)
    escaping = json.dumps({"format": "fedclinic-aggregator-backup", "format_version": 1,
                           "schema_version": SCHEMA_VERSION, "created": "x", "source_state_dir": "/",
                           "files": [{"path": "../etc/passwd", "sha256": "0" * 64, "nbytes": 1}]})
    (backup / MANIFEST).write_text(escaping)
    with pytest.raises(BackupError, match="lists the path '../etc/passwd'"):
        verify_backup(backup)


def test_a_backup_from_a_newer_schema_is_not_restored(backup, tmp_path):
    db = sqlite3.connect(backup / "aggregator.sqlite")
    db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION + 1),))
    db.commit()
    db.close()
    from aggregator_service.backup import _hash_file

    sha, nbytes = _hash_file(backup / "aggregator.sqlite")

    def newer(doc):
        doc["schema_version"] = SCHEMA_VERSION + 1
        for f in doc["files"]:
            if f["path"] == "aggregator.sqlite":
                f.update(sha256=sha, nbytes=nbytes)

    _rewrite_manifest(backup, newer)
    assert verify_backup(backup).schema_version == SCHEMA_VERSION + 1  # intact, just newer
    with pytest.raises(BackupError, match="newer than this fedclinic-aggregator knows"):
        restore_backup(backup, tmp_path / "restored")
    assert not (tmp_path / "restored").exists()


def test_cli_backup_verify_restore_and_a_corrupt_backup(tmp_path):
    store, *_ = _mid_round_two(tmp_path / "live")

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "aggregator_service.cli", *map(str, args)], capture_output=True,
                              text=True, timeout=120)

    run = cli("backup", "--state-dir", tmp_path / "live", tmp_path / "b")
    assert run.returncode == 0, run.stderr
    assert "backup written to" in run.stdout and "verified" in run.stdout
    run = cli("verify-backup", tmp_path / "b")
    assert run.returncode == 0 and "complete and intact" in run.stdout
    run = cli("restore", tmp_path / "b", tmp_path / "r")
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "r" / "aggregator.sqlite").is_file()
    run = cli("restore", tmp_path / "b", tmp_path / "r")
    assert run.returncode == 2 and "is not empty" in run.stderr
    (tmp_path / "b" / "aggregator.sqlite").write_bytes(b"not a database")
    run = cli("verify-backup", tmp_path / "b")
    assert run.returncode == 2 and "is corrupt: aggregator.sqlite" in run.stderr
    store.close()


# ---------------------------------------------------------------------------------------------- signatures


@pytest.fixture
def pki_dir(tmp_path):
    """A real CA with an aggregator and an agent certificate, and a second, foreign CA with an aggregator."""
    from fedclinic import pki

    pki.init_ca(tmp_path / "ca")
    pki.issue(tmp_path / "ca", role="aggregator", name="aggregator", out_dir=tmp_path / "agg")
    pki.issue(tmp_path / "ca", role="agent", name="st-mary", out_dir=tmp_path / "mary")
    pki.init_ca(tmp_path / "other-ca")
    pki.issue(tmp_path / "other-ca", role="aggregator", name="aggregator", out_dir=tmp_path / "other-agg")
    return tmp_path


def _pair(folder, name):
    return folder / f"{name}.crt", folder / f"{name}.key"


def test_a_signed_backup_verifies_with_the_ca_and_a_changed_manifest_does_not(tmp_path, pki_dir):
    from aggregator_service.backup import SIGNATURE, signed_by

    store, *_ = _mid_round_two(tmp_path / "live")
    create_backup(tmp_path / "live", tmp_path / "b", signer=_pair(pki_dir / "agg", "aggregator"))
    ca = pki_dir / "ca" / "ca.crt"
    assert signed_by(tmp_path / "b", ca) == "aggregator"
    verify_backup(tmp_path / "b", ca=ca)
    restore_backup(tmp_path / "b", tmp_path / "r1", ca=ca)
    assert not (tmp_path / "r1" / SIGNATURE).exists()  # the signature belongs to the backup, not to the state
    with pytest.raises(BackupError, match="was not issued by the CA"):
        verify_backup(tmp_path / "b", ca=pki_dir / "other-ca" / "ca.crt")
    # someone who can write the backup changes a file and, consistently, the manifest: integrity still holds,
    # the signature does not
    doc = json.loads((tmp_path / "b" / MANIFEST).read_text())
    doc["source_state_dir"] = "/somewhere/else"
    (tmp_path / "b" / MANIFEST).write_text(json.dumps(doc))
    verify_backup(tmp_path / "b")
    with pytest.raises(BackupError, match="fails its signature check: the signature does not match the data: it "
                                          "was changed after the aggregator 'aggregator' signed it; do not restore"):
        restore_backup(tmp_path / "b", tmp_path / "r2", ca=ca)
    assert not (tmp_path / "r2").exists()
    store.close()


def test_unsigned_and_wrongly_signed_backups_are_refused_under_ca(tmp_path, pki_dir):
    store, *_ = _mid_round_two(tmp_path / "live")
    ca = pki_dir / "ca" / "ca.crt"
    create_backup(tmp_path / "live", tmp_path / "unsigned")
    with pytest.raises(BackupError, match="is not signed .*Take a new backup with --config, or check its integrity "
                                          "only by leaving out --ca"):
        verify_backup(tmp_path / "unsigned", ca=ca)
    with pytest.raises(BackupError, match="it is the agent 'st-mary''s certificate; give the aggregator's"):
        create_backup(tmp_path / "live", tmp_path / "by-agent", signer=_pair(pki_dir / "mary", "st-mary"))
    assert not (tmp_path / "by-agent").exists()
    crt, _ = _pair(pki_dir / "agg", "aggregator")
    _, other_key = _pair(pki_dir / "other-agg", "aggregator")
    with pytest.raises(BackupError, match="does not belong to the certificate"):
        create_backup(tmp_path / "live", tmp_path / "mismatch", signer=(crt, other_key))
    store.close()


def test_cli_signs_with_the_configured_aggregator_and_checks_with_ca(tmp_path, pki_dir):
    store, *_ = _mid_round_two(tmp_path / "live")
    crt, key = _pair(pki_dir / "agg", "aggregator")
    ca = pki_dir / "ca" / "ca.crt"
    config = tmp_path / "aggregator.toml"
    config.write_text(f'listen = "127.0.0.1:0"\nstate_dir = "{tmp_path / "live"}"\n\n[tls]\ncert = "{crt}"\n'
                      f'key = "{key}"\nca = "{ca}"\n')

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "aggregator_service.cli", *map(str, args)], capture_output=True,
                              text=True, timeout=120)

    run = cli("backup", "--config", config, tmp_path / "b")
    assert run.returncode == 0, run.stderr
    assert "signed by the aggregator" in run.stdout
    run = cli("verify-backup", tmp_path / "b", "--ca", ca)
    assert run.returncode == 0, run.stderr
    assert "signed by the aggregator 'aggregator'" in run.stdout
    run = cli("verify-backup", tmp_path / "b")
    assert run.returncode == 0 and "signature not checked (give --ca" in run.stdout
    run = cli("backup", "--state-dir", tmp_path / "live", tmp_path / "u")
    assert run.returncode == 0 and "not signed" in run.stdout
    run = cli("restore", tmp_path / "u", tmp_path / "r", "--ca", ca)
    assert run.returncode == 2 and "is not signed" in run.stderr and not (tmp_path / "r").exists()
    store.close()
