"""Hash-chained audit log (fedclinic.runtime.audit_log): a clean log verifies; every kind of tampering is caught at the
right line; concurrent writers (threads and processes) keep one valid chain; a torn tail is never overwritten."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fedclinic.runtime.audit_log import (GENESIS_HASH, AuditError, AuditEvent, AuditLog, TornTailError, canonical_json,
                             record_hash, verify)


def _write_log(path: Path, n: int = 6) -> list[dict]:
    with AuditLog(path) as log:
        return [log.append("update.received", actor=f"site-{i % 3}", task_id="t-1", round=i, size=100 + i,
                           sha256=hashlib.sha256(str(i).encode()).hexdigest()) for i in range(n)]


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def test_clean_log_verifies_and_records_have_the_documented_shape(tmp_path):
    path = tmp_path / "audit.jsonl"
    recs = _write_log(path, 5)
    report = verify(path)
    assert report.ok and report.records == 5 and report.first_bad_line is None
    assert report.head == f"5:{recs[-1]['hash']}"
    lines = _lines(path)
    first = json.loads(lines[0])
    assert set(first) == {"seq", "ts", "kind", "actor", "task_id", "details", "prev_hash", "hash"}
    assert first["seq"] == 1 and first["prev_hash"] == GENESIS_HASH and first["ts"].endswith("Z")
    # hash = sha256 over the canonical JSON of the record without "hash", computed independently here
    body = {k: v for k, v in first.items() if k != "hash"}
    expect = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert first["hash"] == expect == record_hash(first)
    # every line is stored in canonical form and chains to the one before
    for a, b in zip(lines, lines[1:]):
        assert json.loads(b)["prev_hash"] == json.loads(a)["hash"]
    assert all(line == canonical_json(json.loads(line)) + b"\n" for line in lines)
    assert (path.stat().st_mode & 0o777) == 0o600


def test_empty_log_verifies(tmp_path):
    path = tmp_path / "audit.jsonl"
    AuditLog(path).close()
    report = verify(path)
    assert report.ok and report.records == 0 and report.head is None


def test_edit_of_a_field_is_detected_at_its_line(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write_log(path)
    lines = _lines(path)
    rec = json.loads(lines[3])
    rec["details"]["size"] = 999           # the forger keeps the canonical form, but not the hash
    lines[3] = canonical_json(rec) + b"\n"
    path.write_bytes(b"".join(lines))
    report = verify(path)
    assert not report.ok and report.first_bad_line == 4 and "hash does not match" in report.error
    assert report.records == 3


def test_one_byte_edit_anywhere_is_detected(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write_log(path, 4)
    original = path.read_bytes()
    for offset in range(0, len(original), 7):   # every 7th byte, each edit on its own
        data = bytearray(original)
        data[offset] = ord("x") if data[offset] != ord("x") else ord("y")
        path.write_bytes(bytes(data))
        assert not verify(path).ok, f"edit at byte {offset} was not detected"


def test_edit_with_recomputed_hash_breaks_the_next_line(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write_log(path)
    lines = _lines(path)
    rec = json.loads(lines[2])
    rec["actor"] = "mallory"
    rec["hash"] = record_hash(rec)          # a forger who recomputes this record's hash
    lines[2] = canonical_json(rec) + b"\n"
    path.write_bytes(b"".join(lines))
    report = verify(path)
    assert not report.ok and report.first_bad_line == 4 and "prev_hash" in report.error


def test_whitespace_only_edit_is_detected(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write_log(path)
    lines = _lines(path)
    lines[1] = lines[1].replace(b'"kind":', b'"kind": ', 1)
    path.write_bytes(b"".join(lines))
    report = verify(path)
    assert not report.ok and report.first_bad_line == 2 and "canonical" in report.error


def test_deleted_line_is_detected(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write_log(path)
    lines = _lines(path)
    del lines[2]
    path.write_bytes(b"".join(lines))
    report = verify(path)
    assert not report.ok and report.first_bad_line == 3 and "expected 3" in report.error


def test_deleted_first_line_is_detected(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write_log(path)
    path.write_bytes(b"".join(_lines(path)[1:]))
    report = verify(path)
    assert not report.ok and report.first_bad_line == 1


def test_swapped_lines_are_detected(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write_log(path)
    lines = _lines(path)
    lines[1], lines[2] = lines[2], lines[1]
    path.write_bytes(b"".join(lines))
    report = verify(path)
    assert not report.ok and report.first_bad_line == 2


def test_inserted_copy_of_a_line_is_detected(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write_log(path)
    lines = _lines(path)
    lines.insert(3, lines[2])
    path.write_bytes(b"".join(lines))
    report = verify(path)
    assert not report.ok and report.first_bad_line == 4 and "goes back" in report.error


def test_truncated_tail_mid_line_is_detected(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write_log(path)
    data = path.read_bytes()
    path.write_bytes(data[:-20])
    report = verify(path)
    assert not report.ok and report.first_bad_line == 6 and "incomplete" in report.error
    path.write_bytes(data[:-1])             # only the final newline lost
    assert not verify(path).ok


def test_whole_lines_cut_off_the_end_are_caught_against_a_recorded_head(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write_log(path)
    head = verify(path).head
    path.write_bytes(b"".join(_lines(path)[:-2]))
    # the chain alone cannot know (documented); the head kept elsewhere can
    assert verify(path).ok
    report = verify(path, expect_head=head)
    assert not report.ok and "truncated" in report.error
    with pytest.raises(AuditError, match="SEQ:HASH"):
        verify(path, expect_head="6:abc")


def test_rewritten_log_with_a_consistent_forged_chain_is_caught_against_the_head(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write_log(path)
    head = verify(path).head
    lines = [json.loads(line) for line in _lines(path)]
    prev = lines[2]["hash"]
    for rec in lines[3:]:                     # a forger rewrites the chain from record 4 on
        rec["actor"] = "mallory"
        rec["prev_hash"] = prev
        rec["hash"] = prev = record_hash(rec)
    path.write_bytes(b"".join(canonical_json(r) + b"\n" for r in lines))
    assert verify(path).ok                    # self-consistent...
    report = verify(path, expect_head=head)
    assert not report.ok and report.first_bad_line == 6 and "rewritten" in report.error


def test_forged_appended_line_without_the_right_prev_hash_is_detected(tmp_path):
    path = tmp_path / "audit.jsonl"
    recs = _write_log(path)
    forged = {"seq": len(recs) + 1, "ts": "2025-01-01T00:00:00.000000Z", "kind": "task.approved",
              "actor": "mallory", "task_id": "t-1", "details": {}, "prev_hash": "ab" * 32}
    forged["hash"] = record_hash(forged)
    with open(path, "ab") as fh:
        fh.write(canonical_json(forged) + b"\n")
    report = verify(path)
    assert not report.ok and report.first_bad_line == len(recs) + 1 and "prev_hash" in report.error


def test_writer_resumes_the_chain_after_restart(tmp_path):
    path = tmp_path / "audit.jsonl"
    recs = _write_log(path, 3)
    with AuditLog(path) as log:
        assert log.head == f"3:{recs[-1]['hash']}"
        rec = log.append("round.closed", actor="aggregator", task_id="t-1", round=1)
    assert rec["seq"] == 4 and rec["prev_hash"] == recs[-1]["hash"]
    assert verify(path).ok and verify(path).records == 4


def test_torn_last_line_is_reported_and_never_overwritten(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write_log(path, 3)
    with open(path, "ab") as fh:
        fh.write(b'{"actor":"aggregator","details":{"si')     # a crash in the middle of a write
    before = path.read_bytes()
    with pytest.raises(TornTailError, match=r"line 4 \(byte offset") as err:
        AuditLog(path)
    assert err.value.line == 4 and err.value.length == len(b'{"actor":"aggregator","details":{"si')
    assert path.read_bytes() == before                          # untouched
    assert not verify(path).ok


def test_damaged_last_line_with_newline_is_also_refused(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write_log(path, 3)
    lines = _lines(path)
    lines[-1] = lines[-1].replace(b"site-", b"siTe-")
    path.write_bytes(b"".join(lines))
    with pytest.raises(TornTailError):
        AuditLog(path)


def test_quarantine_moves_the_fragment_aside_and_records_it(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write_log(path, 3)
    good = path.read_bytes()
    fragment = b'{"actor":"aggr'
    path.write_bytes(good + fragment)
    with AuditLog(path, on_torn_tail="quarantine") as log:
        log.append("task.submitted", actor="alice", task_id="t-2")
    aside = tmp_path / f"audit.jsonl.torn-{len(good)}"
    assert aside.read_bytes() == fragment
    report = verify(path)
    assert report.ok and report.records == 5
    note = json.loads(_lines(path)[3])
    assert note["kind"] == "audit.torn_tail_quarantined"
    assert note["details"]["sha256"] == hashlib.sha256(fragment).hexdigest()
    assert note["details"]["offset"] == len(good)


def test_concurrent_threads_keep_a_valid_chain(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path)
    n_threads, per_thread = 8, 40
    barrier = threading.Barrier(n_threads)

    def work(i: int) -> None:
        barrier.wait()
        for j in range(per_thread):
            if j % 10 == 9:
                log.append_many([AuditEvent("update.received", f"site-{i}", "t-1", {"j": j, "k": k}) for k in range(3)])
            else:
                log.append("update.received", actor=f"site-{i}", task_id="t-1", j=j)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    report = verify(path)
    expected = n_threads * (per_thread + 4 * 2)   # 4 batches of 3 instead of 4 singles per thread
    assert report.ok, report.error
    assert report.records == expected


def _process_writer(path: str, name: str, n: int) -> None:
    with AuditLog(path) as log:
        for i in range(n):
            log.append("update.received", actor=name, i=i)


def test_concurrent_processes_keep_a_valid_chain(tmp_path):
    path = tmp_path / "audit.jsonl"
    AuditLog(path).close()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_process_writer, args=(str(path), f"p{i}", 30)) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    report = verify(path)
    assert report.ok, report.error
    assert report.records == 90


def test_bad_input_is_refused_with_a_clear_message(tmp_path):
    with AuditLog(tmp_path / "a.jsonl") as log:
        with pytest.raises(AuditError, match="plain JSON"):
            log.append("x", actor="a", value=object())
        with pytest.raises(AuditError, match="plain JSON"):
            log.append("x", actor="a", value=float("nan"))
        with pytest.raises(AuditError, match="non-empty kind"):
            log.append("", actor="a")
        log.append("ok", actor="a")
    report = verify(tmp_path / "a.jsonl")
    assert report.ok and report.records == 1
    with pytest.raises(AuditError, match="cannot read"):
        verify(tmp_path / "missing.jsonl")


def test_cli_verify_exit_codes_and_messages(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write_log(path)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "fedclinic.cli", "audit", "verify", *args],
                              capture_output=True, text=True, timeout=120)

    ok = cli(str(path))
    assert ok.returncode == 0 and "OK, 6 record(s), head 6:" in ok.stdout
    head = ok.stdout.strip().rsplit("head ", 1)[1]
    lines = _lines(path)
    lines[1], lines[2] = lines[2], lines[1]
    path.write_bytes(b"".join(lines))
    bad = cli(str(path), "--json")
    assert bad.returncode == 1
    assert json.loads(bad.stdout)["first_bad_line"] == 2
    path.write_bytes(b"".join(sorted(lines, key=lambda b: json.loads(b)["seq"])[:-1]))
    cut = cli(str(path), "--expect-head", head)
    assert cut.returncode == 1 and "FAILED at line 6" in cut.stderr and "truncated" in cut.stderr
    missing = cli(str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 2 and "cannot read audit log" in missing.stderr
