"""Resuming a cut model stream from the last verified chunk (``FetchModel``'s resume_tensor / resume_offset).

A receiver keeps its :class:`~fedclinic.transport.wire.ChunkAssembler` across the cut: the tensors completed
(verified against their sha256) and the verified prefix of the one being received, whose running hash goes on
with the resumed bytes. :func:`resume_point` says where to ask the sender to continue; :func:`is_cut` which
failures are a cut connection (worth resuming) rather than a refusal. A sender that ignores the resume fields
(an older aggregator) starts its stream over: :func:`honoured` tells, from the first tensor chunk of the resumed
stream, and the receiver then starts over too. :class:`PackageReceiver` assembles a whole package in memory
(a scientist's download, a site's model export) across such resumed streams: :func:`receive_package_resuming`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import grpc

from fedclinic.errors import IntegrityError
from fedclinic.proto import tensors_pb2 as pb
from fedclinic.transport.package import ModelPackage
from fedclinic.transport.wire import CHUNK_BYTES, ChunkAssembler, FileAssembler, MemoryWriter, array_from_bytes

#: how many times one transfer is resumed before its failure is reported to the caller
MAX_RESUMES = 8
#: status codes of a connection that broke (reset, half-open connection found dead by keepalive, proxy gone)
CUT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL})


def is_cut(exc: grpc.RpcError) -> bool:
    """The call failed because the connection broke, not because the peer refused it."""
    return exc.code() in CUT_CODES


def resume_point(assembler: ChunkAssembler, order: Sequence[str]) -> tuple[str, int] | None:
    """(tensor, byte) where a cut stream of the tensors ``order`` (stream order) continues, or None when every
    one of them is complete. A partial tensor whose verified bytes do not end on a chunk boundary (a sender
    with other chunk sizes) is dropped and asked for from its first byte."""
    part = assembler.partial
    if part is not None:
        name, got = part
        if got % CHUNK_BYTES == 0:
            return name, got
        assembler.abort()
        return name, 0
    return next(((name, 0) for name in order if name not in assembler.done), None)


def honoured(chunk: pb.TensorChunk, point: tuple[str, int]) -> bool:
    """Whether the first tensor chunk of a resumed stream starts where it was asked to."""
    return (chunk.name, int(chunk.offset)) == point


class PackageReceiver:
    """Assembles a FetchModel stream (manifest, files, tensors) in memory, one chunk at a time with :meth:`add`;
    :meth:`result` gives the package and its model hash. It can be fed a resumed stream after a cut
    (:func:`receive_package_resuming`): the manifest again (it must be the same
    model: :class:`ModelChanged` otherwise), then the tensors from the resume point on."""

    def __init__(self) -> None:
        self.writers: dict[str, MemoryWriter] = {}
        self.tensors = ChunkAssembler(self._begin)
        self.files = FileAssembler()
        self.manifest: pb.ModelManifest | None = None
        #: the sender's signed statement on the model (Control.FetchModel: right after the manifest), if any
        self.statement = None

    def _begin(self, h: pb.TensorHeader) -> MemoryWriter:
        self.writers[h.name] = MemoryWriter()
        return self.writers[h.name]

    def add(self, chunk: pb.ModelChunk) -> None:
        kind = chunk.WhichOneof("item")
        if kind == "manifest":
            if self.manifest is not None and chunk.manifest.model_hash != self.manifest.model_hash:
                raise ModelChanged("the resumed stream is of another model")
            self.manifest = chunk.manifest
        elif kind == "statement":
            if self.manifest is None:
                raise IntegrityError("the model stream sent a signed statement before its manifest")
            self.statement = chunk.statement
        elif kind == "tensor":
            self.tensors.add(chunk.tensor)
        else:
            self.files.add(chunk.file)

    @property
    def order(self) -> list[str]:
        """The tensors of the stream, in the order they arrive (the manifest's)."""
        return [t.name for t in self.manifest.tensors] if self.manifest is not None else []

    @property
    def files_complete(self) -> bool:
        """The manifest arrived and so did every file it lists (a resumed stream sends no file)."""
        return self.manifest is not None and {f.path for f in self.manifest.files} <= set(self.files.files)

    def result(self) -> tuple[ModelPackage, str]:
        """The package and its model hash; IntegrityError when the stream has no manifest or the assembled
        package does not hash to it (every tensor is also checked against its own sha256 as it completes)."""
        self.tensors.finish()
        self.files.finish()
        if self.manifest is None:
            raise IntegrityError("the aggregator sent no model manifest")
        arrays = {name: array_from_bytes(self.tensors.done[name], w.data) for name, w in self.writers.items()}
        package = ModelPackage(arrays, self.files.files)
        if package.manifest().model_hash != self.manifest.model_hash:
            raise IntegrityError("the downloaded model does not match its manifest hash; download it again")
        return package, self.manifest.model_hash


class ModelChanged(IntegrityError):
    """A resumed model stream is of another model than the cut one (e.g. "the latest" moved on meanwhile)."""


def _received(receiver: PackageReceiver) -> ReceivedModel:
    package, model_hash = receiver.result()
    return ReceivedModel(package, model_hash, receiver.statement)


def receive_package(chunks: Iterable[pb.ModelChunk]) -> tuple[ModelPackage, str]:
    """Assemble a FetchModel stream (manifest, files, tensors) in memory: the package and its model hash
    (:class:`PackageReceiver`). Transport errors propagate as they are."""
    receiver = PackageReceiver()
    for chunk in chunks:
        receiver.add(chunk)
    return receiver.result()


def receive_package_resuming(open_stream: Callable[[tuple[str, int]], Iterable[pb.ModelChunk]], *,
                             wait: Callable[[float], None] = time.sleep) -> tuple[ModelPackage, str]:
    """The package and its model hash, as :func:`receive_resuming` receives them."""
    received = receive_resuming(open_stream, wait=wait)
    return received.package, received.model_hash


@dataclass(frozen=True)
class ReceivedModel:
    """A received model package, its verified model hash, and the sender's signed statement on it (the proto
    ``SignedStatement``; None when the stream carried none)."""

    package: ModelPackage
    model_hash: str
    statement: Any = None


def receive_resuming(open_stream: Callable[[tuple[str, int]], Iterable[pb.ModelChunk]], *,
                     wait: Callable[[float], None] = time.sleep) -> ReceivedModel:
    """A whole model package from ``open_stream(point)`` (a FetchModel call resumed at ``point`` = (tensor,
    byte), ``("", 0)`` for the whole stream), resumed after each cut connection (:func:`is_cut`, at most
    :data:`MAX_RESUMES` times, ``wait`` between tries) from the last verified chunk; started over when the
    sender does not resume (an older aggregator), when the cut came inside the files, or when the model changed
    meanwhile. The package is verified whole at the end (:meth:`PackageReceiver.result`); a refusal and the last
    cut propagate as the RpcError they are."""
    receiver, point, resumes = PackageReceiver(), ("", 0), 0
    while True:
        stream = open_stream(point)
        try:
            first = bool(point[0])
            for chunk in stream:
                if first and chunk.WhichOneof("item") not in ("manifest", "statement"):
                    first = False
                    if chunk.WhichOneof("item") != "tensor" or not honoured(chunk.tensor, point):
                        raise ModelChanged("the sender did not resume where it was asked to")
                receiver.add(chunk)
            return _received(receiver)
        except ModelChanged:
            _cancel(stream)
            receiver, point = PackageReceiver(), ("", 0)
        except grpc.RpcError as exc:
            if not is_cut(exc) or resumes >= MAX_RESUMES:
                raise
            resumes += 1
            if not receiver.files_complete:
                receiver, point = PackageReceiver(), ("", 0)
            else:
                nxt = resume_point(receiver.tensors, receiver.order)
                if nxt is None:
                    return _received(receiver)  # every tensor arrived; the stream broke after the last one
                point = nxt
            wait(min(0.5 * 2 ** resumes, 8.0))


def _cancel(stream: object) -> None:
    cancel = getattr(stream, "cancel", None)
    if cancel is not None:
        cancel()
