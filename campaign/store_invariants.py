"""The aggregator's store checked from outside, read-only, while it runs: what must hold whatever a peer sent.

:class:`StoreInvariants` checks a state directory (``aggregator-state/`` of
:class:`fedclinic.federation.local_federation.LocalFederation`):

- every blob file's sha256 equals its name (``blobs/ab/cdef...``, :mod:`fedclinic.runtime.blobstore`);
- every acknowledged update (an ``UpdateReceipt`` a caller got, not marked duplicate) is in the ``updates``
  table exactly once, under the round and site it was acknowledged for, and no (task, round, site) or
  (task, idempotency key) is stored twice;
- every model manifest the store names points at blobs that exist;
- the audit chain (``audit.jsonl``) verifies (:func:`fedclinic.runtime.audit_log.verify`) and still contains the
  head seen at the previous check (nothing cut off or rewritten since).

Each check returns a list of problems (empty: all holds). The aggregator writes while we read: the database (its
SQLite file, or its PostgreSQL database: :class:`~campaign.state_reader.StateReader`) is read read-only, and an
audit line being appended (no final newline yet) is re-read once.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

from fedclinic.runtime.audit_log import AuditError, verify

from aggregator_service.store.database_settings import DatabaseSettings
from aggregator_service.store.sqlite_store import manifest_from_json

from campaign.state_reader import StateReader


@dataclass
class StoreInvariants:
    """Read-only checks of one aggregator state directory (module docstring)."""

    state_dir: Path
    #: the ``[state]`` database when it is PostgreSQL; by default the SQLite file of ``state_dir``
    database: DatabaseSettings = field(default_factory=DatabaseSettings)
    #: update_id -> (task_id, round, site) of every non-duplicate receipt a caller got
    acknowledged: dict[str, tuple[str, int, str]] = field(default_factory=dict)
    audit_head: str | None = None
    #: blobs already verified, with the (size, mtime) they had: a blob is rehashed only when either changed
    _verified: dict[Path, tuple[int, int]] = field(default_factory=dict)
    checks_run: int = 0

    def acknowledge(self, update_id: str, task_id: str, rnd: int, site: str) -> None:
        """Remember an acknowledged update (its receipt was not a duplicate)."""
        self.acknowledged[update_id] = (task_id, rnd, site)

    def check(self) -> list[str]:
        """All checks once; the problems found (module docstring)."""
        self.checks_run += 1
        return self.blobs() + self.updates() + self.manifests() + self.audit()

    def blobs(self) -> list[str]:
        problems = []
        root = self.state_dir / "blobs"
        for path in sorted(root.glob("??/*")):
            name = path.parent.name + path.name
            try:
                st = path.stat()
            except FileNotFoundError:  # deleted by the store's cleanup meanwhile
                continue
            seen = (st.st_size, st.st_mtime_ns)
            if self._verified.get(path) == seen:
                continue
            h = hashlib.sha256()
            with open(path, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
            if h.hexdigest() != name:
                problems.append(f"blob {name[:16]}... holds content hashing to {h.hexdigest()[:16]}...")
            else:
                self._verified[path] = seen
        return problems

    def _rows(self, sql: str) -> list[tuple]:
        return StateReader(self.state_dir, self.database).rows(sql)

    def updates(self) -> list[str]:
        problems = []
        rows = self._rows("SELECT update_id, task_id, round, site, idempotency_key FROM updates")
        by_id: dict[str, list[tuple]] = {}
        per_site: dict[tuple, int] = {}
        per_key: dict[tuple, int] = {}
        for uid, task, rnd, site, key in rows:
            by_id.setdefault(uid, []).append((task, rnd, site))
            per_site[(task, rnd, site)] = per_site.get((task, rnd, site), 0) + 1
            per_key[(task, key)] = per_key.get((task, key), 0) + 1
        for uid, where in self.acknowledged.items():
            got = by_id.get(uid, [])
            if len(got) != 1:
                problems.append(f"acknowledged update {uid} of {where} is stored {len(got)} times")
            elif got[0] != where:
                problems.append(f"acknowledged update {uid} for {where} is stored as {got[0]}")
        problems += [f"{k} has {n} updates" for k, n in per_site.items() if n > 1]
        problems += [f"idempotency key {k} has {n} updates" for k, n in per_key.items() if n > 1]
        return problems

    def manifests(self) -> list[str]:
        problems = []
        rows = self._rows("SELECT model_hash, manifest FROM models")
        blobs = self.state_dir / "blobs"
        for model_hash, manifest in rows:
            m = manifest_from_json(manifest)
            for sha, nbytes in [(t.sha256, t.nbytes) for t in m.tensors] + [(f.sha256, f.nbytes) for f in m.files]:
                if nbytes and not (blobs / sha[:2] / sha[2:]).is_file():
                    problems.append(f"model {model_hash[:16]}... names blob {sha[:16]}..., which is missing")
        return problems

    def audit(self) -> list[str]:
        path = self.state_dir / "audit.jsonl"
        if not path.exists():
            return []
        for attempt in range(3):
            try:
                report = verify(path, expect_head=self.audit_head)
            except AuditError as exc:
                return [f"audit chain unreadable: {exc}"]
            if report.ok:
                self.audit_head = report.head
                return []
            if "incomplete" not in (report.error or "") or attempt == 2:
                return [f"audit chain broken: {report.error}"]
            time.sleep(0.2)  # a line being appended right now: read it again once it is whole
        return []
