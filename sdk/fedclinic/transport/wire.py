"""Tensors and files on the wire: splitting into 1-4 MiB chunks and verified reassembly.

Sending: :func:`encoded_tensor_chunks` (the upload paths: serialized chunks, payload copied once),
:func:`tensor_chunks` (chunk messages) and :func:`file_chunks` cut raw bytes into 1-4 MiB pieces; the first
chunk of each item carries its header (dtype, shape, codec, sha256, size).

Receiving: :class:`ChunkAssembler` checks every protocol rule as the chunks arrive (header first, offsets
contiguous, no chunk larger than the limit, chunk sizes a multiple of the dtype size, size and sha256 as
declared, dtype/shape consistent with the size) and hands the verified bytes to a sink. It never trusts a
length or hash it has not recomputed itself.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import numpy as np

from fedclinic.transport.codec_wire import check_header as check_encoded_header, is_raw
from fedclinic.errors import IntegrityError
from fedclinic.transport.package import Manifest, ModelPackage, TensorEntry, FileEntry, raw_bytes
from fedclinic.proto import tensors_pb2 as pb

CHUNK_BYTES = 2 << 20
MAX_CHUNK_BYTES = 4 << 20
ALLOWED_DTYPES = frozenset(
    {"float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
     "uint16", "uint32", "uint64"}  # secure-aggregation masked inputs (elements of Z_2^16, Z_2^32, Z_2^64)
)
#: the most dimensions a tensor may have (the model families use at most 4)
MAX_RANK = 8
#: the most elements one tensor may have, and so the largest dimension: 2^34, the longest secure-aggregation
#: masked vector (fedclinic.secagg.masks.MAX_WORDS; 64 GiB of float32). Shapes are multiplied in Python ints,
#: never in int64, so a header cannot wrap its element count to a small number, and a shape within these bounds
#: never overflows numpy's sizes.
MAX_TENSOR_ELEMENTS = 1 << 34
#: the most tensors one model manifest or update may list
MAX_TENSORS = 100_000


def dtype_of(name: str) -> np.dtype:
    if name not in ALLOWED_DTYPES:
        raise IntegrityError(f"dtype {name!r} is not allowed; expected one of {sorted(ALLOWED_DTYPES)}")
    if name == "bfloat16":  # numpy has no bfloat16: carried as 2-byte words
        return np.dtype("<u2")
    return np.dtype(name).newbyteorder("<") if np.dtype(name).itemsize > 1 else np.dtype(name)


def header_of(entry: TensorEntry, codec: str = "raw") -> pb.TensorHeader:
    return pb.TensorHeader(name=entry.name, dtype=entry.dtype, shape=list(entry.shape), codec=codec,
                           sha256=entry.sha256, encoded_nbytes=entry.nbytes)


def manifest_to_proto(manifest: Manifest) -> pb.ModelManifest:
    return pb.ModelManifest(
        model_hash=manifest.model_hash,
        tensors=[header_of(t) for t in manifest.tensors],
        files=[pb.FileInfo(path=f.path, nbytes=f.nbytes, sha256=f.sha256) for f in manifest.files],
    )


def manifest_from_proto(msg: pb.ModelManifest) -> Manifest:
    """The manifest a ModelManifest message describes, every tensor header checked by :func:`validate_header`
    (IntegrityError says what is wrong: too many tensors, a bad header, a model hash that does not match)."""
    if len(msg.tensors) > MAX_TENSORS:
        raise IntegrityError(f"the model manifest lists {len(msg.tensors)} tensors; at most {MAX_TENSORS} are allowed")
    tensors = []
    for h in msg.tensors:
        validate_header(h)
        tensors.append(TensorEntry(h.name, h.dtype, tuple(int(s) for s in h.shape), h.sha256, int(h.encoded_nbytes)))
    files = tuple(FileEntry(f.path, f.sha256, int(f.nbytes)) for f in msg.files)
    manifest = Manifest(tuple(sorted(tensors, key=lambda t: t.name)), tuple(sorted(files, key=lambda f: f.path)))
    if msg.model_hash and manifest.model_hash != msg.model_hash:
        raise IntegrityError(f"manifest hash {msg.model_hash[:12]}... does not match its content")
    return manifest


def tensor_elements(name: str, shape: Iterable[int]) -> int:
    """The element count of a tensor of ``shape``, computed in Python ints (no wrap-around), after checking the
    rank (at most :data:`MAX_RANK`), each dimension (0 to :data:`MAX_TENSOR_ELEMENTS`) and the product (at most
    :data:`MAX_TENSOR_ELEMENTS`). IntegrityError names the tensor and the bound it breaks."""
    dims = [int(s) for s in shape]
    if len(dims) > MAX_RANK:
        raise IntegrityError(f"tensor {name!r}: shape has {len(dims)} dimensions; at most {MAX_RANK} are allowed")
    if any(d < 0 for d in dims):
        raise IntegrityError(f"tensor {name!r}: negative dimension in shape {dims}")
    if any(d > MAX_TENSOR_ELEMENTS for d in dims):
        raise IntegrityError(f"tensor {name!r}: a dimension of shape {dims} is above the {MAX_TENSOR_ELEMENTS} "
                             "elements one tensor may have")
    n = math.prod(dims)
    if n > MAX_TENSOR_ELEMENTS:
        raise IntegrityError(f"tensor {name!r}: shape {dims} has {n} elements; one tensor may have at most "
                             f"{MAX_TENSOR_ELEMENTS} (split it, or shrink the model)")
    return n


def validate_header(h: pb.TensorHeader) -> None:
    """Check that a tensor header is self-consistent, before any byte is read; IntegrityError says what is wrong.

    Every header: a name, a 64-character sha256, a shape within the bounds of :func:`tensor_elements` (rank,
    dimensions, element count, all in Python ints) and a non-negative size. Codec "raw": an allowed dtype and
    size = elements * itemsize exactly; an update codec (:mod:`fedclinic.transport.codec_wire`): a known codec
    spec, float32, a size within reach of the element count. A header that passes can be allocated, reshaped
    and memory-mapped by numpy without overflow."""
    if not h.name:
        raise IntegrityError("tensor header has an empty name")
    if len(h.sha256) != 64:
        raise IntegrityError(f"tensor {h.name!r}: sha256 must be 64 hex characters")
    n = tensor_elements(h.name, h.shape)
    if h.encoded_nbytes < 0:
        raise IntegrityError(f"tensor {h.name!r}: negative size {h.encoded_nbytes} declared")
    if not is_raw(h.codec):
        check_encoded_header(h.name, h.codec, h.dtype, list(h.shape), int(h.encoded_nbytes))
        return
    if h.codec_params:
        raise IntegrityError(f"tensor {h.name!r}: codec 'raw' takes no codec_params")
    expected = n * dtype_of(h.dtype).itemsize
    if h.encoded_nbytes != expected:
        raise IntegrityError(
            f"tensor {h.name!r}: {h.encoded_nbytes} bytes declared but dtype {h.dtype} and shape "
            f"{list(h.shape)} need {expected}"
        )


def _pieces(header: pb.TensorHeader, data: bytes | memoryview, chunk_bytes: int
            ) -> Iterator[tuple[pb.TensorHeader | None, int, memoryview]]:
    """(header on the first piece only, offset, bytes) for each chunk of one tensor; one empty piece if empty."""
    view = memoryview(data).cast("B")
    if len(view) == 0:
        yield header, 0, view
        return
    for off in range(0, len(view), chunk_bytes):
        yield (header if off == 0 else None), off, view[off:off + chunk_bytes]


def tensor_chunks(header: pb.TensorHeader, data: bytes | memoryview, chunk_bytes: int = CHUNK_BYTES
                  ) -> Iterator[pb.TensorChunk]:
    """Cut one tensor's encoded bytes into chunk messages; the first carries the header."""
    for h, off, piece in _pieces(header, data, chunk_bytes):
        yield pb.TensorChunk(name=header.name, header=h, offset=off, data=bytes(piece))


def file_chunks(path: str, data: bytes, chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.FileChunk]:
    sha = hashlib.sha256(data).hexdigest()
    for off in range(0, max(len(data), 1), chunk_bytes):
        first = off == 0
        yield pb.FileChunk(path=path, offset=off, data=data[off:off + chunk_bytes],
                           total_nbytes=len(data) if first else 0, sha256=sha if first else "")


def package_items(package: ModelPackage, manifest: Manifest | None = None, *, skip_sha256: Iterable[str] = (),
                  include_files: bool = True, chunk_bytes: int = CHUNK_BYTES
                  ) -> Iterator[pb.FileChunk | pb.TensorChunk]:
    """All file then tensor chunks of a package, skipping tensors whose sha256 is in ``skip_sha256``."""
    manifest = manifest or package.manifest()
    skip = set(skip_sha256)
    if include_files:
        for f in manifest.files:
            yield from file_chunks(f.path, package.files[f.path], chunk_bytes)
    for t in manifest.tensors:
        if t.sha256 not in skip:
            yield from tensor_chunks(header_of(t), raw_bytes(package.tensors[t.name]), chunk_bytes)


@dataclass
class _Open:
    header: pb.TensorHeader
    writer: object
    itemsize: int
    hasher: "hashlib._Hash" = field(default_factory=hashlib.sha256)
    received: int = 0
    check_finite: bool = False


class ChunkAssembler:
    """Reassembles a stream of TensorChunks, one tensor at a time, verifying everything.

    ``begin_tensor(header) -> writer`` is called on the first chunk of each tensor (after header
    validation); ``expect`` (optional) maps name -> required header fields, and ``finite`` asks for a
    NaN/Inf check of floating point data chunk by chunk. :meth:`finish` raises if a tensor is incomplete.
    """

    def __init__(self, begin_tensor: Callable[[pb.TensorHeader], object], *,
                 expect: dict[str, pb.TensorHeader] | None = None, finite: bool = False) -> None:
        self._begin = begin_tensor
        self._expect = expect
        self._finite = finite
        self._open: _Open | None = None
        self.done: dict[str, pb.TensorHeader] = {}
        self.nbytes = 0

    def add(self, chunk: pb.TensorChunk) -> None:
        data = chunk.data  # read once: each read of a protobuf bytes field is a fresh copy
        if len(data) > MAX_CHUNK_BYTES:
            raise IntegrityError(f"chunk of {chunk.name!r} has {len(data)} bytes; the limit is {MAX_CHUNK_BYTES}")
        if chunk.offset == 0 and chunk.HasField("header"):
            self._start(chunk)
            if self._open is None:  # an empty tensor is complete with its header
                if data:
                    raise IntegrityError(f"tensor {chunk.name!r}: data sent for an empty tensor")
                return
        cur = self._open
        if cur is None or cur.header.name != chunk.name:
            raise IntegrityError(f"chunk of tensor {chunk.name!r} at offset {chunk.offset} arrived before its header")
        if chunk.offset != cur.received:
            raise IntegrityError(f"tensor {chunk.name!r}: chunk offset {chunk.offset}, expected {cur.received}")
        if cur.received + len(data) > cur.header.encoded_nbytes:
            raise IntegrityError(f"tensor {chunk.name!r}: more bytes than the {cur.header.encoded_nbytes} declared")
        if len(data) % cur.itemsize:
            raise IntegrityError(f"tensor {chunk.name!r}: chunk of {len(data)} bytes splits a {cur.header.dtype} value")
        if cur.check_finite and data:
            values = np.frombuffer(data, dtype=dtype_of(cur.header.dtype))
            if not np.isfinite(values).all():
                raise IntegrityError(f"tensor {chunk.name!r} contains NaN or Inf values")
        cur.hasher.update(data)
        cur.writer.write(data)  # type: ignore[attr-defined]
        cur.received += len(data)
        self.nbytes += len(data)
        if cur.received == cur.header.encoded_nbytes:
            self._close()

    def _start(self, chunk: pb.TensorChunk) -> None:
        if self._open is not None:
            raise IntegrityError(f"tensor {self._open.header.name!r} ended after {self._open.received} of "
                                 f"{self._open.header.encoded_nbytes} bytes")
        h = chunk.header
        if h.name != chunk.name:
            raise IntegrityError(f"chunk name {chunk.name!r} differs from its header name {h.name!r}")
        validate_header(h)
        if h.name in self.done:
            raise IntegrityError(f"tensor {h.name!r} sent twice")
        if self._expect is not None:
            want = self._expect.get(h.name)
            if want is None:
                raise IntegrityError(f"tensor {h.name!r} was not announced")
            if ((want.dtype, list(want.shape), want.sha256, want.codec or "raw", want.encoded_nbytes,
                 dict(want.codec_params)) != (h.dtype, list(h.shape), h.sha256, h.codec or "raw", h.encoded_nbytes,
                                              dict(h.codec_params))):
                raise IntegrityError(f"tensor {h.name!r}: header differs from the one announced")
        writer = self._begin(h)
        raw = is_raw(h.codec)  # an encoded payload is bytes; its codec checks values (fedclinic.transport.codec_wire)
        self._open = _Open(h, writer, dtype_of(h.dtype).itemsize if raw else 1,
                           check_finite=raw and self._finite and h.dtype in ("float16", "float32", "float64"))
        if h.encoded_nbytes == 0:
            self._close()

    def _close(self) -> None:
        cur = self._open
        assert cur is not None
        digest = cur.hasher.hexdigest()
        if digest != cur.header.sha256:
            cur.writer.abort()  # type: ignore[attr-defined]
            self._open = None
            raise IntegrityError(f"tensor {cur.header.name!r}: sha256 of the received bytes does not match its header "
                                 "(corrupted in transit); the upload was discarded, send it again")
        cur.writer.commit()  # type: ignore[attr-defined]
        self.done[cur.header.name] = cur.header
        self._open = None

    def abort(self) -> None:
        if self._open is not None:
            self._open.writer.abort()  # type: ignore[attr-defined]
            self._open = None

    @property
    def partial(self) -> tuple[str, int] | None:
        """(name, verified bytes) of the tensor being received, or None between tensors: where a cut stream
        resumes. The bytes so far are written and hashed; the rest continues the same running hash, so the
        whole tensor is still checked against its header's sha256 when it completes."""
        return (self._open.header.name, self._open.received) if self._open is not None else None

    def finish(self) -> None:
        if self._open is not None:
            h = self._open.header
            self.abort()
            raise IntegrityError(f"stream ended inside tensor {h.name!r}")
        if self._expect is not None:
            missing = sorted(set(self._expect) - set(self.done))
            if missing:
                raise IntegrityError(f"stream ended without tensors {missing[:5]}{'...' if len(missing) > 5 else ''}")


class FileAssembler:
    """Reassembles FileChunks into path -> bytes (package files are small: JSON, vocab)."""

    MAX_FILE_BYTES = 256 << 20

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self._parts: dict[str, list[bytes]] = {}
        self._meta: dict[str, tuple[int, str, int]] = {}

    def add(self, chunk: pb.FileChunk) -> None:
        p = chunk.path
        if chunk.offset == 0:
            if p in self._meta or p in self.files:
                raise IntegrityError(f"file {p!r} sent twice")
            if chunk.total_nbytes > self.MAX_FILE_BYTES:
                raise IntegrityError(f"file {p!r} is {chunk.total_nbytes} bytes; package files are limited to "
                                     f"{self.MAX_FILE_BYTES}")
            self._meta[p] = (chunk.total_nbytes, chunk.sha256, 0)
            self._parts[p] = []
        if p not in self._meta:
            raise IntegrityError(f"chunk of file {p!r} arrived before its first chunk")
        total, sha, got = self._meta[p]
        data = chunk.data  # read once (each read copies)
        if chunk.offset != got or got + len(data) > total:
            raise IntegrityError(f"file {p!r}: bad chunk offset {chunk.offset} or size")
        self._parts[p].append(data)
        got += len(data)
        self._meta[p] = (total, sha, got)
        if got == total:
            data = b"".join(self._parts.pop(p))
            del self._meta[p]
            if hashlib.sha256(data).hexdigest() != sha:
                raise IntegrityError(f"file {p!r}: sha256 does not match (corrupted in transit)")
            self.files[p] = data

    def finish(self) -> None:
        if self._meta:
            raise IntegrityError(f"stream ended inside file(s) {sorted(self._meta)}")


class MemoryWriter:
    """A writer that keeps bytes in memory (small tensors in tests and SDK downloads)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.data: bytes | None = None

    def write(self, data: bytes) -> None:
        self.buf += data

    def commit(self) -> None:
        self.data = bytes(self.buf)

    def abort(self) -> None:
        self.buf = bytearray()


def array_from_bytes(header: pb.TensorHeader, data: bytes | memoryview) -> np.ndarray:
    arr = np.frombuffer(data, dtype=dtype_of(header.dtype)).reshape(tuple(header.shape))
    if header.dtype == "bfloat16":
        return arr  # kept as raw 2-byte words; torch side reinterprets
    return arr.astype(np.dtype(header.dtype), copy=False)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


_DATA_FIELD = pb.TensorChunk.DESCRIPTOR.fields_by_name["data"].number


def encode_tensor_chunk_in(field_number: int, name: str, header: pb.TensorHeader | None, offset: int,
                           data: bytes | memoryview) -> bytes:
    """Serialized bytes of a wrapper message whose field ``field_number`` is this TensorChunk.

    Equivalent to ``Wrapper(tensor=TensorChunk(name=..., header=..., offset=..., data=...)).SerializeToString()``
    (protobuf allows fields in any order), but the payload is copied once, straight from ``data`` into the
    output, instead of three times (bytes(), CopyFrom, serialize). The upload path is copy-bound.
    """
    small = pb.TensorChunk(name=name, header=header, offset=offset).SerializeToString()
    data_len = len(data)
    data_key = _varint((_DATA_FIELD << 3) | 2) + _varint(data_len)
    inner_len = len(small) + len(data_key) + data_len
    outer = _varint((field_number << 3) | 2) + _varint(inner_len)
    return b"".join((outer, small, data_key, data))


def encoded_tensor_chunks(field_number: int, header: pb.TensorHeader, data: bytes | memoryview,
                          chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """:func:`tensor_chunks`, each already serialized inside a wrapper message at ``field_number``."""
    for h, off, piece in _pieces(header, data, chunk_bytes):
        yield encode_tensor_chunk_in(field_number, header.name, h, off, piece)


class PipelinedAssembler:
    """Runs a ChunkAssembler's verify/hash/write on a worker thread, so they overlap with receiving and
    parsing the next chunks (sha256 and file writes release the GIL). At most ``depth`` chunks wait in
    between, which bounds memory to depth x chunk size. Errors surface on the next ``add`` or on ``finish``.
    """

    _DONE = object()

    def __init__(self, inner: ChunkAssembler, depth: int = 4) -> None:
        import queue
        import threading

        self.inner = inner
        self._queue: "queue.Queue[object]" = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="chunk-assembler", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is self._DONE:
                return
            if self._error is None:
                try:
                    self.inner.add(item)  # type: ignore[arg-type]
                except BaseException as exc:  # handed to the receiving thread
                    self._error = exc

    def add(self, chunk: pb.TensorChunk) -> None:
        if self._error is not None:
            self._stop()
            raise self._error
        self._queue.put(chunk)

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(self._DONE)
            self._thread.join()

    def finish(self) -> None:
        self._stop()
        if self._error is not None:
            raise self._error
        self.inner.finish()

    def abort(self) -> None:
        self._stop()
        self.inner.abort()

    def settle(self) -> BaseException | None:
        """Stop the worker once the chunks already handed to it are processed, leaving the tensor being received
        open (its accepted bytes written): what keeping an interrupted stream's prefix needs. Returns the error
        one of those chunks raised, if any."""
        self._stop()
        return self._error

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    @property
    def done(self) -> dict[str, pb.TensorHeader]:
        return self.inner.done
