"""Online backups of the aggregator's state folder, their verification, and restore into a new folder.

A backup is a folder::

    manifest.json        format, format_version, schema_version, created (UTC), source_state_dir,
                         files: [{path, sha256, nbytes}, ...] (every other file in the folder)
    aggregator.sqlite    a consistent snapshot of the database (sqlite3 backup API, taken while the
                         service runs; rollback-journal mode, one self-contained file)
    blobs/ab/cdef...     every blob the snapshot references (model tensors and files, strategy state);
                         the blob store is content-addressed, so each is checked against its name
    updates/T/R/u-*.bin  the spill files of the durable updates of rounds that are open in the snapshot
                         (the engine folds them again when it starts on the restored folder)
    audit.jsonl          the audit trail up to its last complete line
    manifest.sig         (backups taken with --config) the aggregator's signature of manifest.json, made with
    manifest.crt         its TLS key, and its certificate: ``--ca`` checks them (fedclinic.pki.verify_detached)

Consistency: the snapshot fixes what is referenced. Blobs are immutable once published, so copying them
after the snapshot is safe. A spill file can disappear after the snapshot when its round closes; the backup
then starts over from a new snapshot (a few attempts), so it never holds a round without its updates.

The backup is written into a hidden sibling folder and renamed into place once verified: a folder named
DEST with a manifest.json is complete, anything else is not. ``restore`` verifies every file first and writes
only into an empty or new folder.

SQLite-specific: a backup is a file-level snapshot of the SQLite store (aggregator_service.store.sqlite_store),
and the references are read from that snapshot file with SQL here. A store on another database (PostgreSQL) is
backed up with that database's own tools; this module does not apply to it.

Signed backups: the manifest names every file with its sha256, so its signature covers the whole backup. Without
``--ca``, verify and restore check the backup's integrity (against accidents: a truncated copy, a flipped bit);
with ``--ca`` they also require a valid aggregator signature, so someone who can write the backup folder but does
not hold an aggregator key cannot change the state it restores.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import secrets
import shutil
import sqlite3
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import structlog

from fedclinic.runtime.durable_file import fsync_dir, write_atomically
from fedclinic.runtime.blobstore import blob_relpath
from fedclinic.runtime.failpoints import failpoint
from fedclinic.errors import FedclinicError, IntegrityError
from fedclinic.proto import control_pb2

from aggregator_service.store.migrations import SCHEMA_VERSION, read_schema_version
from aggregator_service.store.database_settings import DatabaseSettings
from aggregator_service.store.sqlite_store import SqliteStore, manifest_from_json
from fedclinic.pki import PkiError, identity_from_pem, sign_detached, verify_detached

log = structlog.get_logger("fedclinic.aggregator.backup")

FORMAT = "fedclinic-aggregator-backup"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
SIGNER_CERT = "manifest.crt"
DB_NAME = "aggregator.sqlite"
AUDIT_NAME = "audit.jsonl"
_COPY_CHUNK = 1 << 20


class BackupError(FedclinicError):
    """A backup cannot be taken, is incomplete or corrupt, or cannot be restored (says what to do)."""


#: why backup / restore refuse an aggregator whose state is in PostgreSQL, and what to do instead
POSTGRESQL_ADVICE = (
    "keeps its state in PostgreSQL ([state] database), which fedclinic-aggregator backup/restore do not cover (they "
    "snapshot the embedded SQLite database). Back up the database with pg_dump (or your platform's database "
    "backups / point-in-time recovery) and the state folder's blobs/ and updates/ with your file backups, the "
    "database first; see docs/operator.md, \"State on PostgreSQL\"")


def refuse_postgresql(state: DatabaseSettings, what: str) -> None:
    """Raise BackupError with :data:`POSTGRESQL_ADVICE` when ``state`` names a PostgreSQL database."""
    if state.is_postgresql:
        raise BackupError(f"{what}: this aggregator {POSTGRESQL_ADVICE}")


class _SpillGone(Exception):
    """A spill file referenced by the snapshot was removed (its round closed): take a new snapshot."""


@dataclass(frozen=True)
class BackupFile:
    path: str       # relative, POSIX separators
    sha256: str
    nbytes: int


@dataclass(frozen=True)
class BackupManifest:
    schema_version: int
    created: str
    source_state_dir: str
    files: tuple[BackupFile, ...]

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, "schema_version": self.schema_version,
                           "created": self.created, "source_state_dir": self.source_state_dir,
                           "files": [{"path": f.path, "sha256": f.sha256, "nbytes": f.nbytes} for f in self.files]},
                          indent=1) + "\n"


# ----------------------------------------------------------------------------------------------------------
# helpers


def _copy_hashed(src: Path, dst: Path, *, limit: int | None = None) -> BackupFile:
    """Copy ``src`` (its first ``limit`` bytes when given) to a new file ``dst`` readable by its owner only (the
    state's files hold models, updates and the audit trail), fsync'd; return its sha256 and size."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    digest, nbytes = hashlib.sha256(), 0
    with open(src, "rb") as fin, os.fdopen(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as fout:
        while limit is None or nbytes < limit:
            block = fin.read(_COPY_CHUNK if limit is None else min(_COPY_CHUNK, limit - nbytes))
            if not block:
                break
            digest.update(block)
            fout.write(block)
            nbytes += len(block)
        fout.flush()
        os.fsync(fout.fileno())
    return BackupFile("", digest.hexdigest(), nbytes)


def _hash_file(path: Path) -> tuple[str, int]:
    digest, nbytes = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(_COPY_CHUNK):
            digest.update(block)
            nbytes += len(block)
    return digest.hexdigest(), nbytes


def _fsync_tree(root: Path) -> None:
    for folder, _dirs, _files in os.walk(root):
        fsync_dir(folder)


def _is_empty_or_missing(path: Path) -> bool:
    return not path.exists() or (path.is_dir() and not any(path.iterdir()))


def _staging(dest: Path, what: str) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.{what}-{secrets.token_hex(4)}"
    tmp.mkdir(mode=0o700)
    return tmp


def _publish(tmp: Path, dest: Path) -> None:
    if dest.exists():
        dest.rmdir()  # checked empty before; a file put there since makes this fail rather than overwrite
    os.replace(tmp, dest)
    fsync_dir(dest.parent)


def _blob_rel(sha256: str) -> str:
    try:
        return f"blobs/{blob_relpath(sha256)}"
    except IntegrityError:
        raise BackupError(f"the database references {sha256!r}, which is not a blob id; the state folder is "
                          "damaged") from None


# ----------------------------------------------------------------------------------------------------------
# backup


def _snapshot(db_path: Path, dst: Path) -> None:
    """A consistent copy of the live database (sqlite3 backup API: one read transaction, writers go on)."""
    try:
        src = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=30)
    except sqlite3.Error as exc:
        raise BackupError(f"cannot open {db_path} for the backup ({exc}); run the backup as the aggregator's "
                          "user") from None
    try:
        os.close(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # owner-only before a byte is written
        out = sqlite3.connect(dst)
        try:
            src.backup(out)
            out.execute("PRAGMA journal_mode=DELETE")  # one self-contained file, no -wal beside it
        finally:
            out.close()
    except sqlite3.Error as exc:
        raise BackupError(f"the SQLite backup of {db_path} failed ({exc}); check free space and retry") from None
    finally:
        src.close()


def _references(db_copy: Path) -> tuple[int, str, set[str], list[str]]:
    """From a snapshot: (schema version, the state folder it was written in, referenced blob ids, spill paths of
    the durable updates of open rounds)."""
    db = sqlite3.connect(f"file:{db_copy}?mode=ro", uri=True)
    try:
        version = read_schema_version(db)
        row = db.execute("SELECT value FROM meta WHERE key='state_dir'").fetchone()
        blobs: set[str] = set()
        for (text,) in db.execute("SELECT manifest FROM models"):
            m = manifest_from_json(text)
            blobs.update(t.sha256 for t in m.tensors)
            blobs.update(f.sha256 for f in m.files)
        for (text,) in db.execute("SELECT strategy_state FROM rounds"):
            blobs.update(sha for sha, _dtype, _shape in json.loads(text or "{}").values())
        if version >= 4:  # the encoded changes of the compressed downlink
            blobs.update(json.loads(text)["sha256"] for (text,) in db.execute("SELECT header FROM model_deltas"))
        spills = [p for (p,) in db.execute(
            "SELECT u.spill_path FROM updates u JOIN rounds r ON r.task_id=u.task_id AND r.round=u.round "
            "JOIN tasks t ON t.task_id=u.task_id WHERE r.state=? AND t.state=? ORDER BY u.spill_path",
            (control_pb2.ROUND_STATE_OPEN, control_pb2.TASK_STATE_RUNNING))]
    except (sqlite3.Error, ValueError, KeyError, TypeError) as exc:
        raise BackupError(f"the database snapshot cannot be read ({exc}); the state folder may be damaged or made "
                          f"by another program") from None
    finally:
        db.close()
    return version, (row[0] if row else ""), blobs, spills


def _copy_state(state_dir: Path, tmp: Path) -> BackupManifest:
    created = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    _snapshot(state_dir / DB_NAME, tmp / DB_NAME)
    version, written_in, blobs, spills = _references(tmp / DB_NAME)
    files = [BackupFile(DB_NAME, *_hash_file(tmp / DB_NAME))]
    for sha in sorted(blobs):
        rel = _blob_rel(sha)
        try:
            copied = _copy_hashed(state_dir / rel, tmp / rel)
            failpoint("aggregator.backup.copy")  # kill campaign: a backup half copied
        except FileNotFoundError:
            raise BackupError(f"blob {sha} is referenced by the database but missing from {state_dir / 'blobs'}; "
                              "the state folder is damaged: restore it from an earlier backup") from None
        if copied.sha256 != sha:
            raise BackupError(f"blob {state_dir / rel} does not match its name (sha256 {copied.sha256}); the state "
                              "folder is damaged: restore it from an earlier backup")
        files.append(BackupFile(rel, copied.sha256, copied.nbytes))
    spill_roots = [os.path.join(str(d), "updates", "") for d in dict.fromkeys([written_in or str(state_dir),
                                                                                  str(state_dir)])]
    for path in spills:
        root = next((r for r in spill_roots if path.startswith(r)), None)
        if root is None:
            raise BackupError(f"update file {path} lies outside {state_dir / 'updates'}; the database does not "
                              "belong to this state folder")
        rel = "updates/" + PurePosixPath(*Path(path[len(root):]).parts).as_posix()
        try:
            copied = _copy_hashed(state_dir / rel, tmp / rel)
        except FileNotFoundError:
            raise _SpillGone(path) from None
        files.append(BackupFile(rel, copied.sha256, copied.nbytes))
    audit = state_dir / AUDIT_NAME
    if audit.is_file():
        data_end = _last_complete_line(audit)
        copied = _copy_hashed(audit, tmp / AUDIT_NAME, limit=data_end)
        files.append(BackupFile(AUDIT_NAME, copied.sha256, copied.nbytes))
    return BackupManifest(version, created, str(state_dir), tuple(files))


def _last_complete_line(path: Path) -> int:
    """The length of ``path`` up to and including its last newline (a record being appended is left out)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        pos = size
        while pos > 0:
            step = min(_COPY_CHUNK, pos)
            f.seek(pos - step)
            block = f.read(step)
            i = block.rfind(b"\n")
            if i >= 0:
                return pos - step + i + 1
            pos -= step
    return 0


def create_backup(state_dir: str | os.PathLike[str], dest: str | os.PathLike[str], *,
                  attempts: int = 5, signer: tuple[str | os.PathLike[str], str | os.PathLike[str]] | None = None,
                  ) -> BackupManifest:
    """Back up the aggregator state in ``state_dir`` (the service may be running) into the new or empty
    folder ``dest``; verify the copy; return its manifest. See the module docstring for what is copied.
    ``signer``: ``(certificate, key)`` of the aggregator, which signs the manifest (``manifest.sig``)."""
    state_dir, dest = Path(state_dir), Path(dest)
    if not (state_dir / DB_NAME).is_file():
        raise BackupError(f"{state_dir} holds no aggregator state ({DB_NAME} is missing); give the state_dir of "
                          "the aggregator's configuration (an aggregator whose [state] database is PostgreSQL is "
                          "backed up with pg_dump, not with this command)")
    if not _is_empty_or_missing(dest):
        raise BackupError(f"{dest} exists and is not an empty folder; back up into a new folder (nothing was written)")
    try:
        dest.resolve().relative_to(state_dir.resolve())
    except ValueError:
        pass
    else:
        raise BackupError(f"{dest} is inside the state folder {state_dir}; put backups on another disk or folder")
    for attempt in range(1, attempts + 1):
        tmp = _staging(dest, "partial")
        try:
            manifest = _copy_state(state_dir, tmp)
            write_atomically(tmp / MANIFEST, manifest.to_json().encode(), mode=0o600)
            if signer is not None:
                _sign(tmp, *signer)
            _fsync_tree(tmp)
            verify_backup(tmp)
            _publish(tmp, dest)
        except _SpillGone as gone:
            shutil.rmtree(tmp, ignore_errors=True)
            log.info("a round closed during the backup; taking a new snapshot", spill=str(gone), attempt=attempt)
            continue
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("backup written", dest=str(dest), files=len(manifest.files), bytes=manifest.nbytes,
                 schema_version=manifest.schema_version)
        return manifest
    raise BackupError(f"rounds kept closing while the backup copied their updates ({attempts} attempts); run the "
                      "backup again (nothing was written)")


def _sign(folder: Path, cert_path: str | os.PathLike[str], key_path: str | os.PathLike[str]) -> None:
    try:
        signature, cert_pem = sign_detached((folder / MANIFEST).read_bytes(), key_path=key_path,
                                            cert_path=cert_path)
        identity = identity_from_pem(cert_pem)
    except PkiError as exc:
        raise BackupError(f"cannot sign the backup: {exc}") from None
    if identity.role != "aggregator":
        raise BackupError(f"cannot sign the backup with {cert_path}: it is the {identity.role} {identity.name!r}'s "
                          "certificate; give the aggregator's (the [tls] of aggregator.toml)")
    write_atomically(folder / SIGNATURE, signature, mode=0o600)
    write_atomically(folder / SIGNER_CERT, cert_pem, mode=0o600)


# ----------------------------------------------------------------------------------------------------------
# verify and restore


def _load_manifest(src: Path) -> BackupManifest:
    path = src / MANIFEST
    if not src.is_dir():
        raise BackupError(f"{src} is not a folder; give the folder `fedclinic-aggregator backup` wrote")
    if not path.is_file():
        raise BackupError(f"{src} is an incomplete backup: it has no {MANIFEST} (the backup did not finish, or this "
                          "is not a backup folder); take a new backup")
    try:
        doc: Any = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("format") != FORMAT:
            raise BackupError(f"{path} is not a fedclinic aggregator backup manifest")
        if int(doc.get("format_version", 0)) > FORMAT_VERSION:
            raise BackupError(f"{src} was written in backup format {doc['format_version']}, newer than this "
                              f"fedclinic-aggregator reads ({FORMAT_VERSION}); restore it with a newer release")
        files = tuple(BackupFile(str(f["path"]), str(f["sha256"]), int(f["nbytes"])) for f in doc["files"])
        manifest = BackupManifest(int(doc["schema_version"]), str(doc["created"]), str(doc["source_state_dir"]),
                                  files)
    except BackupError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BackupError(f"{path} is corrupt ({type(exc).__name__}: {exc}); take a new backup") from None
    for f in manifest.files:
        p = PurePosixPath(f.path)
        if p.is_absolute() or ".." in p.parts or not p.parts or f.path == MANIFEST:
            raise BackupError(f"{path} lists the path {f.path!r}, which a backup never holds; the manifest is corrupt")
    if DB_NAME not in {f.path for f in manifest.files}:
        raise BackupError(f"{path} lists no {DB_NAME}; the manifest is corrupt, take a new backup")
    return manifest


def verify_backup(src: str | os.PathLike[str], *, ca: str | os.PathLike[str] | None = None) -> BackupManifest:
    """Check a backup folder: the manifest, every listed file's presence, size and sha256 (blobs also against
    their names), and the database's integrity and schema version; with ``ca`` (the fedclinic CA certificate)
    first the aggregator's signature of the manifest. Returns the manifest; raises :class:`BackupError` naming
    the first problem."""
    src = Path(src)
    manifest = _load_manifest(src)
    if ca is not None:
        signed_by(src, ca)
    for f in manifest.files:
        path = src / f.path
        if not path.is_file():
            raise BackupError(f"{src} is incomplete: {f.path} is listed in {MANIFEST} but missing; take a new backup "
                              "(or copy the backup again if it was moved)")
        sha, nbytes = _hash_file(path)
        if nbytes != f.nbytes or sha != f.sha256:
            raise BackupError(f"{src} is corrupt: {f.path} has {nbytes} bytes with sha256 {sha}, the manifest says "
                              f"{f.nbytes} bytes with sha256 {f.sha256}; use another backup")
        if f.path.startswith("blobs/") and f.path[len("blobs/"):].replace("/", "") != sha:
            raise BackupError(f"{src} is corrupt: blob {f.path} does not match its name; use another backup")
    try:
        db = sqlite3.connect(f"file:{src / DB_NAME}?mode=ro&immutable=1", uri=True)
        try:
            check = db.execute("PRAGMA integrity_check").fetchone()[0]
            version = read_schema_version(db)
        finally:
            db.close()
    except sqlite3.Error as exc:
        raise BackupError(f"{src / DB_NAME} is not a readable SQLite database ({exc}); use another backup") from None
    if check != "ok":
        raise BackupError(f"{src / DB_NAME} fails SQLite's integrity check ({check}); use another backup")
    if version != manifest.schema_version:
        raise BackupError(f"{src / DB_NAME} has schema version {version}, the manifest says {manifest.schema_version}; "
                          "the backup is inconsistent, use another one")
    return manifest


def signed_by(src: str | os.PathLike[str], ca: str | os.PathLike[str]) -> str:
    """The name of the aggregator whose valid signature (certificate issued by ``ca``) the backup's manifest
    carries; BackupError when it carries none or it does not verify."""
    src = Path(src)
    signature, cert = src / SIGNATURE, src / SIGNER_CERT
    if not (signature.is_file() and cert.is_file()):
        raise BackupError(f"{src} is not signed (no {SIGNATURE} and {SIGNER_CERT}): it was taken with --state-dir, "
                          "or by a release before signed backups. Take a new backup with --config, or check its "
                          "integrity only by leaving out --ca")
    try:
        identity = verify_detached((src / MANIFEST).read_bytes(), signature.read_bytes(), cert.read_bytes(),
                                   ca_path=ca, role="aggregator")
    except PkiError as exc:
        raise BackupError(f"{src} fails its signature check: {exc}; do not restore it") from None
    except OSError as exc:
        raise BackupError(f"{src} cannot be read ({exc.strerror}): {exc.filename}") from None
    return identity.name


def restore_backup(src: str | os.PathLike[str], state_dir: str | os.PathLike[str], *,
                   ca: str | os.PathLike[str] | None = None) -> BackupManifest:
    """Verify the backup in ``src`` (with ``ca``: its signature too) and restore it into ``state_dir``, which
    must be new or empty. The copy is made in a hidden sibling folder and renamed into place, then opened once
    as a store (applying schema migrations and pointing spill paths at the new folder). Returns the manifest."""
    src, state_dir = Path(src), Path(state_dir)
    manifest = verify_backup(src, ca=ca)
    if manifest.schema_version > SCHEMA_VERSION:
        raise BackupError(f"{src} holds schema version {manifest.schema_version}, newer than this fedclinic-aggregator "
                          f"knows ({SCHEMA_VERSION}); restore it with the release that took it, or a newer one")
    if not _is_empty_or_missing(state_dir):
        raise BackupError(f"{state_dir} is not empty; restore into a new or empty folder (nothing was changed). "
                          "To replace a state folder, stop the aggregator, move the old folder aside, then restore")
    tmp = _staging(state_dir, "restoring")
    try:
        for f in manifest.files:
            copied = _copy_hashed(src / f.path, tmp / f.path)
            if copied.sha256 != f.sha256:
                raise BackupError(f"{src / f.path} changed while it was restored; nothing was restored, try again")
        _fsync_tree(tmp)
        _publish(tmp, state_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    SqliteStore(state_dir).close()  # migrations and spill-path relocation now, not at the service's first start
    log.info("backup restored", src=str(src), state_dir=str(state_dir), files=len(manifest.files),
             schema_version=manifest.schema_version)
    return manifest
