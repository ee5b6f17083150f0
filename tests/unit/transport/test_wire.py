import hashlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from fedclinic.errors import IntegrityError
from fedclinic.transport.package import ModelPackage
from fedclinic.proto import tensors_pb2 as pb
from fedclinic.transport.wire import (ChunkAssembler, FileAssembler, MemoryWriter, array_from_bytes, header_of,
                            MAX_RANK, MAX_TENSOR_ELEMENTS, MAX_TENSORS, manifest_from_proto, manifest_to_proto,
                            package_items, tensor_chunks, validate_header)

DTYPES = st.sampled_from([np.float32, np.float16, np.int64, np.int8, np.float64])


def _collect(items, expect=None, finite=False):
    writers = {}

    def begin(h):
        writers[h.name] = MemoryWriter()
        return writers[h.name]

    tensors, files = ChunkAssembler(begin, expect=expect, finite=finite), FileAssembler()
    for it in items:
        (tensors.add if isinstance(it, pb.TensorChunk) else files.add)(it)
    tensors.finish()
    files.finish()
    return {n: array_from_bytes(tensors.done[n], w.data) for n, w in writers.items()}, files.files


@settings(max_examples=60, deadline=None)
@given(arrs=st.lists(arrays(DTYPES, st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple),
                            elements={"allow_nan": False, "allow_infinity": False}), min_size=1, max_size=4),
       chunk_items=st.integers(1, 64),
       files=st.dictionaries(st.text("abc", min_size=1, max_size=5), st.binary(max_size=300), max_size=3))
def test_package_round_trips_through_chunks(arrs, chunk_items, files):
    pkg = ModelPackage({f"t{i}": a for i, a in enumerate(arrs)}, {f"{k}.json": v for k, v in files.items()})
    chunk = chunk_items * 8  # a multiple of every dtype size
    manifest = pkg.manifest()
    got, got_files = _collect(package_items(pkg, manifest, chunk_bytes=chunk),
                              expect={t.name: header_of(t) for t in manifest.tensors}, finite=True)
    for name, a in pkg.tensors.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape
        assert np.array_equal(got[name], a)
    assert got_files == pkg.files
    assert manifest_from_proto(manifest_to_proto(manifest)).model_hash == manifest.model_hash


def _chunks(a, name="w", chunk=16):
    pkg = ModelPackage({name: a})
    t = pkg.manifest().tensors[0]
    return list(tensor_chunks(header_of(t), a.tobytes(), chunk))


def test_corrupt_chunk_is_detected_and_discarded():
    chunks = _chunks(np.arange(32, dtype=np.float32))
    chunks[1].data = b"\x00" * len(chunks[1].data)
    w = {}
    asm = ChunkAssembler(lambda h: w.setdefault(h.name, MemoryWriter()))
    with pytest.raises(IntegrityError, match="sha256.*corrupted"):
        for c in chunks:
            asm.add(c)
    assert w["w"].data is None  # never committed


@pytest.mark.parametrize("mutate, message", [
    (lambda cs: cs.__delitem__(1), "offset"),
    (lambda cs: cs.insert(0, cs[1]), "before its header"),
    (lambda cs: setattr(cs[0].header, "encoded_nbytes", 12), "need"),
    (lambda cs: setattr(cs[0].header, "dtype", "object"), "not allowed"),
    (lambda cs: setattr(cs[0].header, "codec", "zip"), "codec"),
])
def test_protocol_violations_are_named(mutate, message):
    chunks = _chunks(np.arange(32, dtype=np.float32))
    mutate(chunks)
    asm = ChunkAssembler(lambda h: MemoryWriter())
    with pytest.raises(IntegrityError, match=message):
        for c in chunks:
            asm.add(c)
        asm.finish()


def test_nan_is_rejected_when_finite_check_is_on():
    a = np.ones(16, dtype=np.float32)
    a[7] = np.nan
    with pytest.raises(IntegrityError, match="NaN or Inf"):
        asm = ChunkAssembler(lambda h: MemoryWriter(), finite=True)
        for c in _chunks(a):
            asm.add(c)


def test_chunk_splitting_a_value_is_rejected():
    a = np.arange(8, dtype=np.float32)
    chunks = _chunks(a, chunk=6)
    with pytest.raises(IntegrityError, match="splits"):
        asm = ChunkAssembler(lambda h: MemoryWriter())
        for c in chunks:
            asm.add(c)


def test_unannounced_tensor_and_missing_tensor():
    a = np.arange(8, dtype=np.float32)
    with pytest.raises(IntegrityError, match="not announced"):
        asm = ChunkAssembler(lambda h: MemoryWriter(), expect={})
        asm.add(_chunks(a)[0])
    hdr = pb.TensorHeader(name="other", dtype="float32", shape=[1], sha256="0" * 64, encoded_nbytes=4)
    asm = ChunkAssembler(lambda h: MemoryWriter(), expect={"other": hdr})
    with pytest.raises(IntegrityError, match="without tensors"):
        asm.finish()


def test_file_hash_mismatch():
    f = FileAssembler()
    with pytest.raises(IntegrityError, match="sha256"):
        f.add(pb.FileChunk(path="a.json", offset=0, data=b"{}", total_nbytes=2, sha256=hashlib.sha256(b"[]").hexdigest()))


@settings(max_examples=50, deadline=None)
@given(data=st.binary(max_size=5000), offset=st.integers(0, 2**40), name=st.text(max_size=20),
       with_header=st.booleans())
def test_single_copy_chunk_encoding_parses_like_protobuf(data, offset, name, with_header):
    from fedclinic.proto import agent_pb2, control_pb2
    from fedclinic.transport.wire import encode_tensor_chunk_in

    header = pb.TensorHeader(name=name, dtype="uint8", shape=[len(data)], codec="raw",
                             sha256=hashlib.sha256(data).hexdigest(), encoded_nbytes=len(data)) if with_header else None
    for cls, field in ((control_pb2.SubmitTaskChunk, "tensor"), (agent_pb2.UpdateChunk, "tensor")):
        number = cls.DESCRIPTOR.fields_by_name[field].number
        expected = cls(**{field: pb.TensorChunk(name=name, header=header, offset=offset, data=data)})
        assert cls.FromString(encode_tensor_chunk_in(number, name, header, offset, memoryview(data))) == expected


def test_pipelined_assembler_matches_and_propagates_errors():
    from fedclinic.transport.wire import PipelinedAssembler

    a = np.arange(4096, dtype=np.float32)
    writers = {}
    pipe = PipelinedAssembler(ChunkAssembler(lambda h: writers.setdefault(h.name, MemoryWriter())), depth=2)
    for c in _chunks(a, chunk=1024):
        pipe.add(c)
    pipe.finish()
    assert np.array_equal(np.frombuffer(writers["w"].data, np.float32), a)

    bad = _chunks(a, chunk=1024)
    bad[3].data = b"\0" * len(bad[3].data)
    pipe = PipelinedAssembler(ChunkAssembler(lambda h: MemoryWriter()), depth=2)
    with pytest.raises(IntegrityError, match="corrupted"):
        for c in bad:
            pipe.add(c)
        pipe.finish()
    pipe.abort()  # safe after a failure


_SHA = "0" * 64


@pytest.mark.parametrize("shape,dtype,nbytes,codec,message", [
    ([2**32, 2**32], "float32", 0, "raw", "elements"),             # wrapped to 0 in int64 before
    ([2**62, 4], "float32", 0, "raw", "above the"),                     # a dimension alone too large
    ([0, 2**63 - 1], "float32", 0, "raw", "above the"),                 # zero elements, absurd dimension
    ([1 << 20, 1 << 20], "float32", 0, "raw", "elements"),           # 2^40 elements > MAX_TENSOR_ELEMENTS
    ([2] * 9, "float32", 2**9 * 4, "raw", "dimensions"),            # rank above MAX_RANK
    ([4], "float32", 15, "raw", "need 16"),                          # declared bytes differ
    ([4], "float32", -16, "raw", "negative size"),
    ([2**32, 2**32], "float32", 0, "int8", "elements"),              # encoded: the same element bound
    ([-1, 4], "float32", 0, "raw", "negative dimension"),
])
def test_headers_with_overflowing_or_inconsistent_shapes_are_refused(shape, dtype, nbytes, codec, message):
    h = pb.TensorHeader(name="w", dtype=dtype, shape=shape, codec=codec, sha256=_SHA, encoded_nbytes=nbytes)
    with pytest.raises(IntegrityError, match=message):
        validate_header(h)
    manifest = pb.ModelManifest(tensors=[h])
    with pytest.raises(IntegrityError, match=message):
        manifest_from_proto(manifest)


@pytest.mark.parametrize("shape,dtype", [([], "float32"), ([0], "int8"), ([MAX_TENSOR_ELEMENTS], "uint8"),
                                         ([2] * MAX_RANK, "float64")])
def test_headers_at_the_bounds_pass(shape, dtype):
    n = int(np.prod(shape, dtype=object)) if shape else 1
    validate_header(pb.TensorHeader(name="w", dtype=dtype, shape=shape, codec="raw", sha256=_SHA,
                                    encoded_nbytes=n * np.dtype(dtype).itemsize))


def test_a_manifest_with_too_many_tensors_is_refused():
    h = pb.TensorHeader(name="w", dtype="float32", shape=[], codec="raw", sha256=_SHA, encoded_nbytes=4)
    with pytest.raises(IntegrityError, match="at most"):
        manifest_from_proto(pb.ModelManifest(tensors=[h] * (MAX_TENSORS + 1)))


def test_the_element_bound_admits_the_longest_secure_aggregation_vector():
    from fedclinic.secagg.masks import MAX_WORDS

    assert MAX_TENSOR_ELEMENTS >= MAX_WORDS
