"""The files of a submitted model, streamed straight into the blob store: never held in memory, never more
than the manifest declared.

:class:`DeclaredFiles` is built from the manifest's file list before any byte arrives and refuses (IntegrityError,
reported as INVALID_ARGUMENT ``model upload rejected: ...``):

- a manifest with more than ``max_files`` files or more than ``max_total_bytes`` bytes of files in all;
- at its first chunk, a file the manifest does not declare, declared with another size or sha256, or sent twice;
- a chunk out of order or past the file's size, a file whose bytes do not hash to the declared sha256, and at the
  end a declared file that was not sent (every blob a stored manifest references was sent by its submitter).

Each file's chunks go to a :class:`~fedclinic.runtime.blobstore.BlobWriter` as they arrive (hashed there and
checked at commit); on any failure :meth:`abort` drops what was partly written. Memory per submission is one
chunk, whatever the files' sizes.
"""

from __future__ import annotations

from fedclinic.errors import IntegrityError
from fedclinic.proto import tensors_pb2
from fedclinic.runtime.blobstore import BlobStore, BlobWriter
from fedclinic.transport.package import FileEntry


class DeclaredFiles:
    """Receives a submission's files (module docstring)."""

    def __init__(self, blobs: BlobStore, declared: tuple[FileEntry, ...], *, max_files: int,
                 max_total_bytes: int) -> None:
        if len(declared) > max_files:
            raise IntegrityError(f"the manifest lists {len(declared)} files; a model may have at most {max_files} "
                                 "(aggregator limit [limits] model_files)")
        total = sum(max(f.nbytes, 0) for f in declared)
        if total > max_total_bytes:
            raise IntegrityError(f"the manifest's files add up to {total} bytes; a model's files may have at most "
                                 f"{max_total_bytes} in all (aggregator limit [limits] model_file_bytes)")
        self.blobs = blobs
        self.declared = {f.path: f for f in declared}
        self.done: set[str] = set()
        self.nbytes = 0
        self._open: dict[str, BlobWriter] = {}

    def add(self, chunk: tensors_pb2.FileChunk) -> None:
        path = chunk.path
        if chunk.offset == 0 and path not in self._open:
            self._begin(chunk)
        writer = self._open.get(path)
        if writer is None:
            raise IntegrityError(f"chunk of file {path!r} arrived before its first chunk")
        if chunk.offset != writer.nbytes:
            raise IntegrityError(f"file {path!r}: chunk at offset {chunk.offset}, expected {writer.nbytes}")
        writer.write(chunk.data)  # IntegrityError past the declared size
        self.nbytes += len(chunk.data)
        if writer.nbytes == writer.expected_nbytes:
            del self._open[path]
            try:
                writer.commit()  # checks the sha256
            except IntegrityError as exc:
                raise IntegrityError(f"file {path!r}: {exc}; send the file the manifest describes") from None
            self.done.add(path)

    def _begin(self, chunk: tensors_pb2.FileChunk) -> None:
        path = chunk.path
        entry = self.declared.get(path)
        if entry is None:
            raise IntegrityError(f"file {path!r} is not in the manifest; send only the files the manifest lists")
        if path in self.done:
            raise IntegrityError(f"file {path!r} sent twice")
        if chunk.total_nbytes != entry.nbytes or chunk.sha256 != entry.sha256:
            raise IntegrityError(f"file {path!r} is sent as {chunk.total_nbytes} bytes with sha256 "
                                 f"{chunk.sha256[:12]}, but the manifest declares {entry.nbytes} bytes with sha256 "
                                 f"{entry.sha256[:12]}")
        self._open[path] = self.blobs.writer(entry.sha256, entry.nbytes)

    def finish(self) -> None:
        """IntegrityError unless every declared file arrived whole."""
        if self._open:
            raise IntegrityError(f"stream ended inside file(s) {sorted(self._open)}")
        missing = sorted(set(self.declared) - self.done)
        if missing:
            raise IntegrityError(f"file(s) {missing[:5]} of the manifest were not sent; send every file it lists")

    def abort(self) -> None:
        for writer in self._open.values():
            writer.abort()
        self._open.clear()
