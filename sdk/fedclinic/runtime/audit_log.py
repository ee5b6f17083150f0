"""Append-only, hash-chained audit trail (JSON lines) and its verifier.

Every line of an audit file is one record, written as canonical JSON (keys sorted, no whitespace, UTF-8)
followed by ``\\n``::

    {"actor":"aggregator","details":{"sha256":"9f..","size":1234},"hash":"..","kind":"update.received",
     "prev_hash":"..","seq":7,"task_id":"t-1c9e..","ts":"2025-05-01T09:12:03.123456Z"}

- ``seq`` counts records from 1, without gaps;
- ``prev_hash`` is the ``hash`` of the record before (64 zeros for the first record);
- ``hash`` is the sha256 (hex) of the canonical JSON of the record *without* its ``hash`` field.

:func:`verify` recomputes the chain and reports the first bad line: any edited byte (the line is no longer
canonical, or its hash no longer matches), a deleted, inserted or reordered line (``seq`` or ``prev_hash``
breaks), and a torn or truncated last line (no final newline, or not JSON).

What a hash chain cannot show on its own: that whole records were cut off the *end* of the file, or that
someone with write access rewrote the file and recomputed every hash after their edit. Both are caught by
comparing with a head recorded elsewhere: :func:`verify` returns ``head`` (``"SEQ:HASH"`` of the last
record); keep it outside the machine (a ticket, the compliance system, a daily e-mail) and check later logs
with ``verify(path, expect_head=...)`` or ``fedclinic audit verify FILE --expect-head SEQ:HASH``.

Durability: :meth:`AuditLog.append` returns after the record is written **and fsync'd** (one fsync per
record). :meth:`AuditLog.append_many` writes several records with a single write and a single fsync (one
fsync per batch). An :class:`AuditLog` is safe to share between threads (a lock), and between processes on
the same host (``flock`` on the file; a writer that finds the file grown by someone else re-reads the tail
and continues the chain from there).

After a restart, :class:`AuditLog` resumes the chain from the last line. If the last line is torn (a crash
in the middle of a write: no final newline, or bytes that are not a valid record) it refuses to open
(:class:`TornTailError`, naming the line and byte offset) rather than write over it. Opening with
``on_torn_tail="quarantine"`` moves the torn bytes to ``FILE.torn-OFFSET`` (kept, fsync'd), cuts the file back
to the last complete record and appends an ``audit.torn_tail_quarantined`` record that names the fragment's
size and sha256, so the repair itself is part of the trail.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import fcntl
import hashlib
import json
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from fedclinic.errors import FedclinicError

GENESIS_HASH = "0" * 64
FIELDS = frozenset({"seq", "ts", "kind", "actor", "task_id", "details", "prev_hash", "hash"})
_TAIL_BLOCK = 64 * 1024


class AuditError(FedclinicError):
    """The audit log cannot be written or read as asked."""


class TornTailError(AuditError):
    """The audit file ends with an incomplete record (a crash during a write, or a truncation)."""

    def __init__(self, message: str, *, line: int, offset: int, length: int) -> None:
        super().__init__(message)
        self.line = line
        self.offset = offset
        self.length = length


def canonical_json(obj: Any) -> bytes:
    """The canonical serialization hashed and stored: sorted keys, no whitespace, UTF-8, no NaN/Infinity."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def record_hash(record: dict[str, Any]) -> str:
    """sha256 (hex) of the canonical JSON of ``record`` without its ``hash`` field."""
    return hashlib.sha256(canonical_json({k: v for k, v in record.items() if k != "hash"})).hexdigest()


def update_digest(tensors: Iterable[Any]) -> str:
    """The sha256 an audit record names for one update: over the canonical JSON of ``[[name, codec, sha256,
    encoded_nbytes], ...]`` of its tensor headers, in order. Each header's sha256 covers that tensor's encoded
    bytes (checked by the receiver), so the digest commits to every byte sent; the agent's ``update.sent`` and
    the aggregator's ``update.received`` records of the same update carry the same value."""
    return hashlib.sha256(canonical_json([[t.name, t.codec or "raw", t.sha256, int(t.encoded_nbytes)]
                                          for t in tensors])).hexdigest()


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class AuditEvent:
    """One event for :meth:`AuditLog.append_many`."""

    kind: str
    actor: str
    task_id: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


# reading ---------------------------------------------------------------------------------------------------
def _check_line(raw: bytes, lineno: int) -> tuple[dict[str, Any] | None, str | None]:
    """Parse and self-check one line (without its ``\\n``): (record, None) or (None, what is wrong)."""
    try:
        rec = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"line {lineno} is not a JSON record ({exc})"
    if not isinstance(rec, dict):
        return None, f"line {lineno} is not a JSON object"
    if set(rec) != FIELDS:
        missing, extra = sorted(FIELDS - set(rec)), sorted(set(rec) - FIELDS)
        return None, f"line {lineno} has the wrong fields (missing {missing}, unexpected {extra})"
    if not isinstance(rec["seq"], int) or isinstance(rec["seq"], bool) or not isinstance(rec["hash"], str) \
            or not isinstance(rec["prev_hash"], str) or not isinstance(rec["details"], dict):
        return None, f"line {lineno}: seq must be an integer, hash and prev_hash strings, details an object"
    try:
        canonical = canonical_json(rec)
    except ValueError as exc:
        return None, f"line {lineno} holds a value JSON cannot carry canonically ({exc})"
    if canonical != raw:
        return None, (f"line {lineno} (seq {rec['seq']}) is not in canonical form: its bytes were edited "
                      "(the writer only produces sorted keys without whitespace)")
    if record_hash(rec) != rec["hash"]:
        return None, f"line {lineno} (seq {rec['seq']}): the hash does not match the record's content (edited)"
    return rec, None


@dataclass(frozen=True)
class VerifyReport:
    ok: bool
    records: int                        # records checked and found good (before the first bad line)
    head: str | None                    # "SEQ:HASH" of the last good record; None for an empty log
    first_bad_line: int | None = None   # 1-based line number of the first problem
    error: str | None = None

    def summary(self, path: str | Path = "") -> str:
        where = f"{path}: " if path else ""
        if self.ok:
            return f"{where}OK, {self.records} record(s), head {self.head or '(empty log)'}"
        return f"{where}FAILED at line {self.first_bad_line}: {self.error} ({self.records} good record(s) before it)"


def verify(path: str | Path, *, expect_head: str | None = None) -> VerifyReport:
    """Check the whole chain in ``path``. ``expect_head`` ("SEQ:HASH", from an earlier :func:`verify` kept
    elsewhere) must then be one of the file's records: this catches records cut off the end, and a file
    rewritten from an earlier point on."""
    path = Path(path)
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise AuditError(f"cannot read audit log {path}: {exc.strerror}") from exc
    want_seq, want_hash = _parse_head(expect_head) if expect_head else (None, None)
    seen_expected = False
    prev_hash, prev_seq, count, lineno = GENESIS_HASH, 0, 0, 0
    head = None

    def bad(msg: str) -> VerifyReport:
        return VerifyReport(False, count, head, lineno, msg)

    with fh:
        for raw in fh:
            lineno += 1
            if not raw.endswith(b"\n"):
                return bad(f"line {lineno} is incomplete (no final newline, {len(raw)} bytes): a torn write "
                           "or a truncated file")
            rec, err = _check_line(raw[:-1], lineno)
            if err:
                return bad(err)
            if rec["seq"] != prev_seq + 1:
                hint = ("records are missing before it (deleted?)" if rec["seq"] > prev_seq + 1
                        else "it repeats or goes back (inserted or reordered?)")
                return bad(f"line {lineno} has seq {rec['seq']}, expected {prev_seq + 1}: {hint}")
            if rec["prev_hash"] != prev_hash:
                return bad(f"line {lineno} (seq {rec['seq']}): prev_hash does not match the hash of the record "
                           "before it (a record was replaced, inserted, deleted or reordered)")
            if want_seq is not None and rec["seq"] == want_seq:
                if rec["hash"] != want_hash:
                    return bad(f"line {lineno} (seq {want_seq}) has hash {rec['hash'][:16]}..., but the recorded "
                               f"head says {want_hash[:16]}...: the log was rewritten from this point on or before")
                seen_expected = True
            prev_hash, prev_seq = rec["hash"], rec["seq"]
            count += 1
            head = f"{prev_seq}:{prev_hash}"
    if want_seq is not None and not seen_expected:
        lineno += 1
        return bad(f"the log ends at seq {prev_seq} but the recorded head is seq {want_seq}: records were "
                   "removed from the end (truncated) or the file was replaced by an older copy")
    return VerifyReport(True, count, head)


def _parse_head(text: str) -> tuple[int, str]:
    seq, sep, digest = text.strip().partition(":")
    if not sep or not seq.isdigit() or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise AuditError(f"head {text!r} is not SEQ:HASH (e.g. 42:<64 hex digits>), as `fedclinic audit verify` "
                         "prints it")
    return int(seq), digest


def _read_tail(fd: int, size: int) -> tuple[int, int]:
    """(offset, length) of the last line of an open file of ``size`` bytes, including its newline if any."""
    end = size
    if end == 0:
        return 0, 0
    # the last line ends at ``size``; find the newline before it
    search_end = end - 1 if _pread(fd, 1, end - 1) == b"\n" else end
    pos = search_end
    while pos > 0:
        start = max(0, pos - _TAIL_BLOCK)
        block = _pread(fd, pos - start, start)
        nl = block.rfind(b"\n")
        if nl >= 0:
            return start + nl + 1, end - (start + nl + 1)
        pos = start
    return 0, end


def _pread(fd: int, n: int, offset: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = os.pread(fd, n - len(out), offset + len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


# writing ---------------------------------------------------------------------------------------------------
class AuditLog:
    """Appends hash-chained records to ``path`` (created 0600 if absent). See the module docstring."""

    def __init__(self, path: str | Path, *, on_torn_tail: str = "raise") -> None:
        if on_torn_tail not in ("raise", "quarantine"):
            raise AuditError("on_torn_tail must be 'raise' or 'quarantine'")
        self.path = Path(path)
        self._lock = threading.Lock()
        self._broken: str | None = None
        created = not self.path.exists()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise AuditError(f"cannot open audit log {self.path}: {exc.strerror}") from exc
        if created:
            _fsync_dir(self.path.parent)
        try:
            with self._file_lock():
                self._load_tail(on_torn_tail)
        except BaseException:
            os.close(self._fd)
            raise

    # state of the chain ------------------------------------------------------------------------------------
    @property
    def head(self) -> str | None:
        """"SEQ:HASH" of the last record written or found (None while the log is empty)."""
        return f"{self._seq}:{self._hash}" if self._seq else None

    def _load_tail(self, on_torn_tail: str = "raise") -> None:
        size = os.fstat(self._fd).st_size
        offset, length = _read_tail(self._fd, size)
        self._seq, self._hash, self._size = 0, GENESIS_HASH, size
        if length == 0:
            return
        raw = _pread(self._fd, length, offset)
        lineno = _pread_count_newlines(self._fd, offset) + 1
        problem = None
        if not raw.endswith(b"\n"):
            problem = f"has no final newline ({length} bytes)"
        else:
            rec, err = _check_line(raw[:-1], lineno)
            if err:
                problem = err
            else:
                self._seq, self._hash = rec["seq"], rec["hash"]
                return
        if on_torn_tail == "raise":
            raise TornTailError(
                f"audit log {self.path} ends with an incomplete or damaged record at line {lineno} (byte offset "
                f"{offset}): it {problem}. This is what a crash during a write leaves. It was not overwritten. "
                "Check the file with `fedclinic audit verify`, then open the log with "
                "on_torn_tail='quarantine' to move the fragment aside and record that in the trail.",
                line=lineno, offset=offset, length=length)
        self._quarantine(offset, raw, lineno, problem)

    def _quarantine(self, offset: int, fragment: bytes, lineno: int, problem: str) -> None:
        aside = self.path.with_name(f"{self.path.name}.torn-{offset}")
        fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, fragment)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.ftruncate(self._fd, offset)
        os.fsync(self._fd)
        _fsync_dir(self.path.parent)
        self._load_tail("raise")  # the line before must now be a complete record
        self._write([AuditEvent("audit.torn_tail_quarantined", "audit", None, {
            "line": lineno, "offset": offset, "length": len(fragment),
            "sha256": hashlib.sha256(fragment).hexdigest(), "moved_to": aside.name, "problem": problem})])

    # appending ---------------------------------------------------------------------------------------------
    def append(self, kind: str, *, actor: str, task_id: str | None = None, **details: Any) -> dict[str, Any]:
        """Write one record and fsync it; returns the record (with ``seq`` and ``hash``)."""
        return self.append_many([AuditEvent(kind, actor, task_id, details)])[0]

    def append_many(self, events: Iterable[AuditEvent]) -> list[dict[str, Any]]:
        """Write several records with one write and one fsync (all or, after a crash, a torn tail)."""
        events = list(events)
        if not events:
            return []
        with self._lock:
            if self._broken:
                raise AuditError(f"audit log {self.path} is unusable after an earlier write error ({self._broken}); "
                                 "restart the service, which checks the file's tail")
            with self._file_lock():
                if os.fstat(self._fd).st_size != self._size:
                    self._load_tail("raise")   # another process appended: continue its chain
                return self._write(events)

    def _write(self, events: list[AuditEvent]) -> list[dict[str, Any]]:
        records, lines = [], []
        seq, prev = self._seq, self._hash
        for ev in events:
            if not isinstance(ev.kind, str) or not ev.kind:
                raise AuditError("an audit record needs a non-empty kind, e.g. 'task.submitted'")
            if not isinstance(ev.actor, str):
                raise AuditError(f"audit record {ev.kind!r}: actor must be a string")
            if ev.task_id is not None and not isinstance(ev.task_id, str):
                raise AuditError(f"audit record {ev.kind!r}: task_id must be a string or None")
            seq += 1
            rec = {"seq": seq, "ts": _now(), "kind": ev.kind, "actor": ev.actor, "task_id": ev.task_id,
                   "details": dict(ev.details), "prev_hash": prev}
            try:
                rec["hash"] = record_hash(rec)
                line = canonical_json(rec) + b"\n"
            except (TypeError, ValueError) as exc:
                raise AuditError(f"audit record {ev.kind!r}: details must be plain JSON values "
                                 f"(str, int, float, bool, None, lists, objects; no NaN): {exc}") from exc
            prev = rec["hash"]
            records.append(rec)
            lines.append(line)
        data = b"".join(lines)
        try:
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            os.fsync(self._fd)
        except OSError as exc:
            self._broken = exc.strerror or str(exc)
            raise AuditError(f"cannot write audit log {self.path}: {exc.strerror}") from exc
        self._seq, self._hash = seq, prev
        self._size = os.fstat(self._fd).st_size
        return records

    def _file_lock(self):
        fd = self._fd

        class _Flock:
            def __enter__(self_inner):
                fcntl.flock(fd, fcntl.LOCK_EX)

            def __exit__(self_inner, *exc):
                fcntl.flock(fd, fcntl.LOCK_UN)

        return _Flock()

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> "AuditLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _pread_count_newlines(fd: int, end: int) -> int:
    count, pos = 0, 0
    while pos < end:
        block = _pread(fd, min(1 << 20, end - pos), pos)
        if not block:
            break
        count += block.count(b"\n")
        pos += len(block)
    return count


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# command line ----------------------------------------------------------------------------------------------
def _verify_command(args: argparse.Namespace) -> int:
    report = verify(args.file, expect_head=args.expect_head)
    if args.json:
        print(json.dumps({"file": str(args.file), "ok": report.ok, "records": report.records, "head": report.head,
                          "first_bad_line": report.first_bad_line, "error": report.error}))
    else:
        print(report.summary(args.file), file=sys.stdout if report.ok else sys.stderr)
    return 0 if report.ok else 1


def add_audit_commands(sub: argparse._SubParsersAction) -> None:
    audit = sub.add_parser("audit", help="check hash-chained audit logs")
    asub = audit.add_subparsers(dest="audit_cmd", required=True)
    p = asub.add_parser("verify", help="verify an audit log's hash chain; exit 1 at the first bad line")
    p.add_argument("file", help="the audit log (JSON lines)")
    p.add_argument("--expect-head", metavar="SEQ:HASH",
                   help="a head printed by an earlier verify and kept elsewhere: catches records cut off the end")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_verify_command)
