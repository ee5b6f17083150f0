"""Receiving and sending model material: streams of chunks <-> blob store and update spill files."""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from pathlib import Path
from typing import Iterable, Iterator, Mapping

from fedclinic.runtime.blobstore import BlobStore, fsync_dir
from fedclinic.runtime.durable_file import DurableFile
from fedclinic.errors import IntegrityError
from fedclinic.transport.package import Manifest
from fedclinic.proto import tensors_pb2
from fedclinic.transport.wire import CHUNK_BYTES, ChunkAssembler, PipelinedAssembler, file_chunks, header_of, manifest_to_proto

from aggregator_service.declared_files import DeclaredFiles
from aggregator_service.folding import UpdateLayout
from aggregator_service.stored_data import BlobNotAuthorised, StoredCopyDamaged


class SpillWriter:
    """Writes an update's tensors back to back into one file; one fsync makes the whole update durable.

    The file is a :class:`~fedclinic.runtime.durable_file.DurableFile` (O_DIRECT where the filesystem allows it).
    :attr:`sha256` is the hash of the whole file as written (recorded with the update, checked at recovery)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tmp = path.with_suffix(".part")
        self._f = DurableFile(self.tmp)
        self.layout = UpdateLayout([])
        self._offset = 0
        self._hash = hashlib.sha256()

    def begin(self, header: tensors_pb2.TensorHeader) -> "SpillWriter":
        self.layout.tensors.append((header.name, header.dtype, tuple(header.shape), self._offset,
                                    int(header.encoded_nbytes)))
        return self

    def write(self, data: bytes) -> None:
        self._f.write(data)
        self._hash.update(data)
        self._offset += len(data)

    @property
    def sha256(self) -> str:
        """The sha256 of the bytes written so far (the whole file once :meth:`finish` returned)."""
        return self._hash.hexdigest()

    def commit(self) -> None:  # one tensor done; durability comes with finish()
        pass

    def abort(self) -> None:
        self.discard()

    def finish(self) -> int:
        self._f.close()  # fsync'd on return
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
        return self._offset

    def keep_prefix(self) -> Path:
        """Close the file written so far (fsync'd) without naming it final: the verified prefix of an
        interrupted resumable upload (aggregator_service.upload_partials). Returns its path."""
        self._f.close()
        return self.tmp

    def discard(self) -> None:
        self._f.discard()
        self.tmp.unlink(missing_ok=True)


def receive_model(blobs: BlobStore, manifest: Manifest, chunks: Iterable[tensors_pb2.FileChunk | tensors_pb2.TensorChunk],
                  *, max_files: int = 1000, max_file_bytes: int = 1 << 30) -> int:
    """Store the files and tensors of ``manifest`` streamed as chunks; returns bytes received.

    Tensors already in the store are still accepted on the wire (the sender may not know); each is verified
    against the manifest and written atomically, so a failed stream leaves only complete, correct blobs.
    IntegrityError for a manifest that names a tensor or a file twice (one entry could point at a blob the
    sender never sent: a hash is not a capability), and for a file whose bytes do not hash to the manifest's
    sha256: every blob a stored manifest references was sent, whole, by its submitter. Files are streamed to
    the blob store as they arrive (aggregator_service.declared_files): at most ``max_files`` of at most
    ``max_file_bytes`` in all, only those the manifest declares.
    """
    check_unique_names(manifest)
    expect = {t.name: header_of(t) for t in manifest.tensors}
    tensors = PipelinedAssembler(ChunkAssembler(
        lambda h: blobs.writer(h.sha256, h.encoded_nbytes, verified_by_caller=True), expect=expect))
    files = DeclaredFiles(blobs, manifest.files, max_files=max_files, max_total_bytes=max_file_bytes)
    try:
        for item in chunks:
            if isinstance(item, tensors_pb2.TensorChunk):
                tensors.add(item)
            else:
                files.add(item)
        tensors.finish()
        files.finish()
    except BaseException:
        tensors.abort()
        files.abort()
        raise
    return tensors.nbytes + files.nbytes


def check_unique_names(manifest: Manifest) -> None:
    """IntegrityError when the manifest names a tensor or a file more than once."""
    for kind, names in (("tensor", [t.name for t in manifest.tensors]), ("file", [f.path for f in manifest.files])):
        twice = sorted(n for n, c in Counter(names).items() if c > 1)
        if twice:
            raise IntegrityError(f"the manifest names {kind}(s) {twice[:3]} more than once; each {kind} must appear "
                                 "once")


class BadResume(ValueError):
    """A resume point (tensor, offset) the stream cannot start at; the message says what to ask for instead."""


def check_resume(manifest: Manifest, have: set[str], deltas: Mapping[str, tensors_pb2.DownlinkDelta],
                 tensor: str, offset: int) -> None:
    """BadResume unless ``tensor`` is one the stream sends (in the manifest, not in ``have``) and ``offset`` is
    a multiple of :data:`CHUNK_BYTES` below its size (of its encoded change when sent as one); ``("", 0)`` (no
    resume) always passes."""
    if not tensor:
        if offset:
            raise BadResume(f"resume_offset {offset} was given without resume_tensor; name the tensor to resume")
        return
    entry = next((t for t in manifest.tensors if t.name == tensor), None)
    if entry is None or entry.sha256 in have:
        raise BadResume(f"resume_tensor {tensor!r} is not a tensor this stream sends; fetch again without resume")
    size = int(deltas[tensor].header.encoded_nbytes) if tensor in deltas else entry.nbytes
    if offset < 0 or offset % CHUNK_BYTES or (offset and offset >= size):
        raise BadResume(f"resume_offset {offset} of tensor {tensor!r} is not a chunk boundary (a multiple of "
                        f"{CHUNK_BYTES} bytes) below its {size} bytes; resume from the offset of the last chunk "
                        "you verified, or fetch it from 0")


def send_model(blobs: BlobStore, manifest: Manifest, *, allowed: frozenset[str], have: set[str],
               include_files: bool, counter: list[int] | None = None,
               deltas: Mapping[str, tensors_pb2.DownlinkDelta] | None = None,
               wire: list[int] | None = None, resume: tuple[str, int] = ("", 0)
               ) -> Iterator[tensors_pb2.ModelChunk]:
    """Manifest first, then files (optional), then every tensor whose sha256 is not in ``have``: in full, or as
    its encoded change when ``deltas`` holds one for it (compressed downlink, fedclinic.transport.downlink).

    Authorisation: every blob to be streamed must be in ``allowed`` (the blobs of the task it is read through,
    :meth:`~aggregator_service.store.Store.task_blobs`), and the manifest must name each tensor and file once;
    otherwise BlobNotAuthorised is raised before anything is sent. Verification: every blob is hashed as it is
    read, and the last chunk of a tensor is held back until its hash matched, so a damaged stored copy raises
    StoredCopyDamaged instead of reaching the receiver (who would blame transit).

    ``resume`` = (tensor, offset), checked by :func:`check_resume` (BadResume): after the manifest the stream
    starts at that byte of that tensor (no files, no tensor before it in manifest order); the skipped prefix
    of the tensor is still read and hashed, so the blob is verified whole.

    ``counter[0]`` adds up the payload bytes sent, ``wire[0]`` the serialized messages (plus gRPC's 5-byte
    prefix each)."""
    check_resume(manifest, have, deltas or {}, *resume)
    if resume[0]:
        names = [t.name for t in manifest.tensors]
        have = have | {t.sha256 for t in manifest.tensors[:names.index(resume[0])]}
        include_files = False
    _authorise(manifest, allowed, have, include_files, deltas or {})
    for chunk in _model_chunks(blobs, manifest, have, include_files, counter, deltas, resume):
        if wire is not None:
            wire[0] += chunk.ByteSize() + 5
        yield chunk


def _authorise(manifest: Manifest, allowed: frozenset[str], have: set[str], include_files: bool,
               deltas: Mapping[str, tensors_pb2.DownlinkDelta]) -> None:
    try:
        check_unique_names(manifest)
    except IntegrityError:
        raise BlobNotAuthorised("the manifest names a tensor or file twice") from None
    wanted = [f.sha256 for f in manifest.files] if include_files else []
    for t in manifest.tensors:
        if t.sha256 not in have:
            wanted.append(deltas[t.name].header.sha256 if t.name in deltas else t.sha256)
    if any(sha not in allowed for sha in wanted):
        raise BlobNotAuthorised("a blob of the stream is not referenced by the task")


def _model_chunks(blobs: BlobStore, manifest: Manifest, have: set[str], include_files: bool,
                  counter: list[int] | None, deltas: Mapping[str, tensors_pb2.DownlinkDelta] | None,
                  resume: tuple[str, int] = ("", 0)) -> Iterator[tensors_pb2.ModelChunk]:
    yield tensors_pb2.ModelChunk(manifest=manifest_to_proto(manifest))
    if include_files:
        for f in manifest.files:
            try:
                data = blobs.read(f.sha256)
            except FileNotFoundError:
                raise StoredCopyDamaged(f"file {f.path!r} of model {manifest.model_hash[:12]} is missing",
                                        blobs.path(f.sha256)) from None
            if hashlib.sha256(data).hexdigest() != f.sha256:
                raise StoredCopyDamaged(f"file {f.path!r} of model {manifest.model_hash[:12]} does not match its "
                                        "recorded sha256", blobs.path(f.sha256))
            for c in file_chunks(f.path, data):
                if counter is not None:
                    counter[0] += min(CHUNK_BYTES, len(data) - c.offset)
                yield tensors_pb2.ModelChunk(file=c)
    for t in manifest.tensors:
        if t.sha256 in have:
            continue
        delta = (deltas or {}).get(t.name)
        path, header = (blobs.path(delta.header.sha256), delta.header) if delta else (blobs.path(t.sha256), header_of(t))
        what = f"{'the encoded change of ' if delta else ''}tensor {t.name!r} of model {manifest.model_hash[:12]}"
        start = resume[1] if t.name == resume[0] else 0
        for c, nbytes in _file_tensor_chunks(path, header, what, start):
            if counter is not None:
                counter[0] += nbytes  # not len(c.tensor.data): each read of a protobuf bytes field copies it
            yield c


def _file_tensor_chunks(path: Path, header: tensors_pb2.TensorHeader, what: str, start: int = 0
                        ) -> Iterator[tuple[tensors_pb2.ModelChunk, int]]:
    """(ModelChunk holding a tensor chunk, payload bytes) read straight from a blob file (one copy per chunk, never
    the whole tensor in memory), from byte ``start`` (a multiple of CHUNK_BYTES; the bytes before it are read and
    hashed, not sent). The bytes are hashed as they are read and the last chunk is yielded only once they matched
    ``header.sha256`` and ``header.encoded_nbytes``: StoredCopyDamaged (``what`` names the tensor) otherwise.

    Each chunk is built in place inside its ModelChunk: ``ModelChunk(tensor=TensorChunk(...))`` would copy the
    payload twice more (2 MB: 3.6 ms against 0.2 ms with upb), on every model download."""
    if header.encoded_nbytes == 0:
        yield _model_chunk(header, header, 0, b""), 0
        return
    digest = hashlib.sha256()
    held: tuple[tensors_pb2.ModelChunk, int] | None = None
    offset = 0
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        raise StoredCopyDamaged(f"{what} is missing", path) from None
    with fh:
        while data := fh.read(CHUNK_BYTES):
            digest.update(data)
            if offset < start:
                offset += len(data)
                continue
            if held is not None:
                yield held
            held = (_model_chunk(header, header if offset == 0 else None, offset, data), len(data))
            offset += len(data)
    if offset != header.encoded_nbytes or digest.hexdigest() != header.sha256:
        raise StoredCopyDamaged(f"{what} does not match its recorded sha256", path)
    assert held is not None
    yield held


def _model_chunk(of: tensors_pb2.TensorHeader, header: tensors_pb2.TensorHeader | None, offset: int,
                 data: bytes) -> tensors_pb2.ModelChunk:
    """``ModelChunk(tensor=TensorChunk(name=of.name, header=header, offset=offset, data=data))``, built in place."""
    chunk = tensors_pb2.ModelChunk()
    tensor = chunk.tensor
    tensor.name = of.name
    if header is not None:
        tensor.header.CopyFrom(header)
    tensor.offset = offset
    tensor.data = data
    return chunk
