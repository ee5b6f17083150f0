"""A content-addressed store of immutable blobs on local disk (used by the aggregator and the agent).

A blob's id is the hex sha256 of its bytes; it lives at ``root/ab/cdef...``. Writes go to a temporary
file under ``root/tmp`` (a :class:`~fedclinic.runtime.durable_file.DurableFile`: O_DIRECT where the filesystem allows
it), are hashed while written, fsync'd, checked against the expected hash, and only then renamed into place
(followed by an fsync of the folder), so a crash never leaves a partial blob under a valid name and a blob
that exists is always complete and correct.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path
import numpy as np

from fedclinic.runtime.durable_file import DurableFile, fsync_dir
from fedclinic.errors import IntegrityError

__all__ = ["BlobStore", "BlobWriter", "fsync_dir"]


class BlobWriter:
    """Streams bytes into a new blob; :meth:`commit` verifies and publishes it, :meth:`abort` drops it."""

    def __init__(self, store: "BlobStore", expected_sha256: str | None, expected_nbytes: int | None,
                 verified_by_caller: bool = False) -> None:
        if verified_by_caller and expected_sha256 is None:
            raise ValueError("verified_by_caller needs expected_sha256")
        self._store = store
        self._verified_by_caller = verified_by_caller
        self.expected_sha256 = expected_sha256
        self.expected_nbytes = expected_nbytes
        self._tmp = store.tmp_dir / f"blob-{secrets.token_hex(8)}"
        self._file: DurableFile | None = DurableFile(self._tmp)
        self._hash = hashlib.sha256()
        self.nbytes = 0

    def write(self, data: bytes | memoryview) -> None:
        assert self._file is not None, "writer already closed"
        if self.expected_nbytes is not None and self.nbytes + len(data) > self.expected_nbytes:
            raise IntegrityError(f"blob is longer than the declared {self.expected_nbytes} bytes")
        if not self._verified_by_caller:
            self._hash.update(data)
        self._file.write(data)
        self.nbytes += len(data)

    def commit(self) -> str:
        """Verify size and hash, make the blob durable and visible; returns its sha256."""
        assert self._file is not None, "writer already closed"
        digest = self.expected_sha256 if self._verified_by_caller else self._hash.hexdigest()
        try:
            if self.expected_nbytes is not None and self.nbytes != self.expected_nbytes:
                raise IntegrityError(f"blob has {self.nbytes} bytes, {self.expected_nbytes} were declared")
            if self.expected_sha256 is not None and digest != self.expected_sha256:
                raise IntegrityError(f"blob sha256 {digest[:12]}... does not match declared {self.expected_sha256[:12]}...")
            self._file.close()  # fsync'd on return
            self._file = None
            self._store._publish(self._tmp, digest)
        except BaseException:
            self.abort()
            raise
        return digest

    def abort(self) -> None:
        if self._file is not None:
            self._file.discard()
            self._file = None
        self._tmp.unlink(missing_ok=True)


def blob_relpath(sha256: str) -> str:
    """Where a blob lives under the store's root: ``ab/cdef...`` (IntegrityError for a non-digest)."""
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise IntegrityError(f"{sha256!r} is not a sha256 hex digest")
    return f"{sha256[:2]}/{sha256[2:]}"


class BlobStore:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.tmp_dir = self.root / "tmp"
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.tmp_dir.iterdir():  # partial writes of a process that died
            stale.unlink(missing_ok=True)

    def path(self, sha256: str) -> Path:
        return self.root / blob_relpath(sha256)

    def has(self, sha256: str) -> bool:
        return self.path(sha256).is_file()

    def writer(self, expected_sha256: str | None = None, expected_nbytes: int | None = None, *,
               verified_by_caller: bool = False) -> BlobWriter:
        """A writer for one blob. With ``verified_by_caller`` the caller (a ChunkAssembler) hashes the bytes
        and only commits when they match ``expected_sha256``, so the writer skips its own second hash."""
        return BlobWriter(self, expected_sha256, expected_nbytes, verified_by_caller)

    def put(self, data: bytes | memoryview, expected_sha256: str | None = None, *, verified: bool = False) -> str:
        """Store ``data``; returns its sha256. With ``verified`` the caller has just hashed ``data`` to
        ``expected_sha256``, and the bytes are not hashed a second time."""
        if expected_sha256 is not None and self.has(expected_sha256):
            return expected_sha256
        w = self.writer(expected_sha256, len(data), verified_by_caller=verified)
        w.write(data)
        return w.commit()

    def read(self, sha256: str) -> bytes:
        return self.path(sha256).read_bytes()

    def array(self, sha256: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        """A read-only memory map of a raw tensor blob (no copy; the OS pages it in)."""
        path = self.path(sha256)
        if int(np.prod(shape, dtype=np.int64)) == 0:
            return np.zeros(shape, dtype=dtype)
        return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r", shape=tuple(shape))

    def delete(self, sha256: str) -> None:
        self.path(sha256).unlink(missing_ok=True)

    def _publish(self, tmp: Path, digest: str) -> None:
        dst = self.path(digest)
        dst.parent.mkdir(exist_ok=True)
        os.replace(tmp, dst)
        fsync_dir(dst.parent)
