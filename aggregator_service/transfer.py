"""Receiving and sending model material: streams of chunks <-> blob store and update spill files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Iterator, Mapping

from fedclinic.runtime.blobstore import BlobStore, fsync_dir
from fedclinic.runtime.durable_file import DurableFile
from fedclinic.errors import IntegrityError
from fedclinic.transport.package import Manifest
from fedclinic.proto import tensors_pb2
from fedclinic.transport.wire import CHUNK_BYTES, ChunkAssembler, PipelinedAssembler, FileAssembler, file_chunks, header_of, manifest_to_proto

from aggregator_service.folding import UpdateLayout


class SpillWriter:
    """Writes an update's tensors back to back into one file; one fsync makes the whole update durable.

    The file is a :class:`~fedclinic.runtime.durable_file.DurableFile` (O_DIRECT where the filesystem allows it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tmp = path.with_suffix(".part")
        self._f = DurableFile(self.tmp)
        self.layout = UpdateLayout([])
        self._offset = 0

    def begin(self, header: tensors_pb2.TensorHeader) -> "SpillWriter":
        self.layout.tensors.append((header.name, header.dtype, tuple(header.shape), self._offset,
                                    int(header.encoded_nbytes)))
        return self

    def write(self, data: bytes) -> None:
        self._f.write(data)
        self._offset += len(data)

    def commit(self) -> None:  # one tensor done; durability comes with finish()
        pass

    def abort(self) -> None:
        self.discard()

    def finish(self) -> int:
        self._f.close()  # fsync'd on return
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
        return self._offset

    def discard(self) -> None:
        self._f.discard()
        self.tmp.unlink(missing_ok=True)


def receive_model(blobs: BlobStore, manifest: Manifest, chunks: Iterable[tensors_pb2.FileChunk | tensors_pb2.TensorChunk]
                  ) -> int:
    """Store the files and tensors of ``manifest`` streamed as chunks; returns bytes received.

    Tensors already in the store are still accepted on the wire (the sender may not know); each is verified
    against the manifest and written atomically, so a failed stream leaves only complete, correct blobs.
    """
    expect = {t.name: header_of(t) for t in manifest.tensors}
    tensors = PipelinedAssembler(ChunkAssembler(
        lambda h: blobs.writer(h.sha256, h.encoded_nbytes, verified_by_caller=True), expect=expect))
    files = FileAssembler()
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
        raise
    declared = {f.path: f for f in manifest.files}
    if set(files.files) != set(declared):
        raise IntegrityError(f"files sent {sorted(files.files)} differ from the manifest's {sorted(declared)}")
    for path, data in files.files.items():
        blobs.put(data, declared[path].sha256)
    return tensors.nbytes + sum(len(d) for d in files.files.values())


def send_model(blobs: BlobStore, manifest: Manifest, *, have: set[str], include_files: bool,
               counter: list[int] | None = None, deltas: Mapping[str, tensors_pb2.DownlinkDelta] | None = None,
               wire: list[int] | None = None) -> Iterator[tensors_pb2.ModelChunk]:
    """Manifest first, then files (optional), then every tensor whose sha256 is not in ``have``: in full, or as
    its encoded change when ``deltas`` holds one for it (compressed downlink, fedclinic.transport.downlink).

    ``counter[0]`` adds up the payload bytes sent, ``wire[0]`` the serialized messages (plus gRPC's 5-byte
    prefix each)."""
    for chunk in _model_chunks(blobs, manifest, have, include_files, counter, deltas):
        if wire is not None:
            wire[0] += chunk.ByteSize() + 5
        yield chunk


def _model_chunks(blobs: BlobStore, manifest: Manifest, have: set[str], include_files: bool,
                  counter: list[int] | None, deltas: Mapping[str, tensors_pb2.DownlinkDelta] | None
                  ) -> Iterator[tensors_pb2.ModelChunk]:
    yield tensors_pb2.ModelChunk(manifest=manifest_to_proto(manifest))
    if include_files:
        for f in manifest.files:
            data = blobs.read(f.sha256)
            for c in file_chunks(f.path, data):
                if counter is not None:
                    counter[0] += min(CHUNK_BYTES, len(data) - c.offset)
                yield tensors_pb2.ModelChunk(file=c)
    for t in manifest.tensors:
        if t.sha256 in have:
            continue
        delta = (deltas or {}).get(t.name)
        path, header = (blobs.path(delta.header.sha256), delta.header) if delta else (blobs.path(t.sha256), header_of(t))
        for c, nbytes in _file_tensor_chunks(path, header):
            if counter is not None:
                counter[0] += nbytes  # not len(c.data): each read of a protobuf bytes field copies it
            yield tensors_pb2.ModelChunk(tensor=c)


def _file_tensor_chunks(path: Path, header: tensors_pb2.TensorHeader
                        ) -> Iterator[tuple[tensors_pb2.TensorChunk, int]]:
    """(chunk, payload bytes) read straight from a blob file (one copy per chunk, never the whole tensor in
    memory)."""
    if header.encoded_nbytes == 0:
        yield tensors_pb2.TensorChunk(name=header.name, header=header, offset=0, data=b""), 0
        return
    with open(path, "rb") as fh:
        offset = 0
        while data := fh.read(CHUNK_BYTES):
            yield tensors_pb2.TensorChunk(name=header.name, header=header if offset == 0 else None, offset=offset,
                                          data=data), len(data)
            offset += len(data)
