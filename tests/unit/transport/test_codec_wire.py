"""Update codecs on the wire (fedclinic.transport.codec_wire): task codecs, TensorHeader codec fields and their checks."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from fedclinic.transport import codec_wire
from fedclinic.codecs import decode, parse_codec
from fedclinic.errors import ConfigError, IntegrityError
from fedclinic.proto import tensors_pb2
from fedclinic.strategies.fedavg import FedAvg
from fedclinic.strategies.tensorsource import EncodedTensor, blocks
from fedclinic.spec.task import Task
from fedclinic.transport.wire import ChunkAssembler, MemoryWriter, tensor_chunks, validate_header


def _encoded_header(spec: str, x: np.ndarray, name: str = "w"):
    codec = parse_codec(spec)
    enc = codec.encode(x, rng=np.random.default_rng(0))
    h = tensors_pb2.TensorHeader(name=name, dtype="float32", shape=list(x.shape), codec=codec.spec,
                                 sha256=hashlib.sha256(enc.payload).hexdigest(), encoded_nbytes=len(enc.payload),
                                 codec_params=codec_wire.header_params(enc))
    return codec, enc, h


def test_task_codec_canonical_and_needed():
    assert codec_wire.canonical("") == codec_wire.canonical("raw") == "raw"
    assert codec_wire.task_codec("raw") is None
    assert codec_wire.canonical("topk:0.01+int8") == "topk:fraction=0.01,idx=varint+int8:block=128,scale=fp32," \
                                                     "rounding=stochastic"
    assert codec_wire.needed_codecs("topk:0.01+int8") == ("topk", "int8") and codec_wire.needed_codecs("raw") == ()
    assert codec_wire.uses_error_feedback(parse_codec("topk:0.1")) and not codec_wire.uses_error_feedback(
        parse_codec("int8"))


def test_spec_problems_name_the_codec_and_refuse_secure_aggregation():
    assert codec_wire.spec_problems("int8", secure_aggregation=False) == []
    assert "unknown codec 'int9'" in codec_wire.spec_problems("int9", secure_aggregation=False)[0]
    assert codec_wire.spec_problems("topk:0.01", secure_aggregation=True) == []  # a shared random index set
    (msg,) = codec_wire.spec_problems("topk:0.05+int8", secure_aggregation=True)
    assert "secure aggregation" in msg and "secure_aggregation.bits" in msg and "'topk:0.05'" in msg
    assert "give a fraction" in codec_wire.spec_problems("topk:k=10", secure_aggregation=True)[0]
    assert "quantizer" in codec_wire.spec_problems("int8", secure_aggregation=True)[0]
    assert codec_wire.spec_problems("raw", secure_aggregation=True) == []


def test_task_carries_the_canonical_codec_and_refuses_bad_ones(tmp_path):
    t = Task(name="t", dataset="d", labels=["a", "b"], codec="topk:0.05+int8")
    assert t.to_spec().update.codec == parse_codec("topk:0.05+int8").spec
    assert Task(name="t", dataset="d", labels=["a", "b"]).to_spec().update.codec == "raw"
    with pytest.raises(ConfigError, match="int9"):
        Task(name="t", dataset="d", labels=["a", "b"], codec="int9").validate()
    with pytest.raises(ConfigError, match="secure aggregation"):
        Task(name="t", dataset="d", labels=["a", "b"], codec="topk:0.1+int8", min_sites=3,
             secure_aggregation={"enabled": True}).validate()
    toml = tmp_path / "task.toml"
    toml.write_text('name = "t"\ndataset = "d"\nlabels = ["a", "b"]\n[update]\ncodec = "fp16"\n')
    assert Task.from_toml(toml).to_spec().update.codec == "fp16"


@pytest.mark.parametrize("spec", ["fp16", "bf16", "int8", "int4:block=32", "topk:0.1", "topk:k=3,idx=raw+int8"])
def test_header_round_trip_rebuilds_the_params(spec):
    x = np.random.default_rng(1).standard_normal((7, 9)).astype(np.float32)
    codec, enc, h = _encoded_header(spec, x)
    validate_header(h)
    params = codec_wire.params_of(h.name, codec, list(h.shape), dict(h.codec_params))
    assert params == enc.params
    np.testing.assert_array_equal(decode(enc.payload, params), decode(enc.payload, enc.params))
    writer = MemoryWriter()
    asm = ChunkAssembler(lambda _h: writer, expect={h.name: h}, finite=True)
    for c in tensor_chunks(h, enc.payload, chunk_bytes=5):  # odd chunk sizes: encoded bytes have no item size
        asm.add(c)
    asm.finish()
    assert writer.data == enc.payload


@pytest.mark.parametrize("change, message", [
    ({"block": "64"}, "block is 64"),
    ({"scale": '"fp16"'}, "scale is 'fp16'"),
    ({"block": "12x"}, "not JSON"),
    ({"codec": '"int8"'}, "must not repeat"),
])
def test_params_that_disagree_with_the_task_codec_are_refused(change, message):
    x = np.ones((4, 40), np.float32)
    codec, _, h = _encoded_header("int8", x)
    with pytest.raises(IntegrityError, match=message):
        codec_wire.params_of("w", codec, list(h.shape), {**dict(h.codec_params), **change})


def test_topk_params_are_checked_down_to_the_value_codec():
    x = np.arange(100, dtype=np.float32).reshape(10, 10)
    codec, _, h = _encoded_header("topk:0.05+int8", x)
    params = dict(h.codec_params)
    with pytest.raises(IntegrityError, match="k is 6"):
        codec_wire.params_of("w", codec, [10, 10], {**params, "k": "6"})
    with pytest.raises(IntegrityError, match="idx is 'raw'"):
        codec_wire.params_of("w", codec, [10, 10], {**params, "idx": '"raw"'})
    inner = json.loads(params["values"])
    with pytest.raises(IntegrityError, match="block is 64"):
        codec_wire.params_of("w", codec, [10, 10], {**params, "values": json.dumps({**inner, "block": 64})})
    with pytest.raises(IntegrityError, match="codec is 'fp16'"):
        codec_wire.params_of("w", codec, [10, 10], {**params, "values": json.dumps({"codec": "fp16", "shape": [5]})})


def test_encoded_headers_are_checked_before_any_byte():
    x = np.ones(10, np.float32)
    _, _, h = _encoded_header("int8", x)
    for field, value, message in (("codec", "int9", "unknown codec"), ("dtype", "float16", "decode to float32"),
                                  ("encoded_nbytes", 10 ** 9, "encoded bytes declared")):
        bad = tensors_pb2.TensorHeader()
        bad.CopyFrom(h)
        setattr(bad, field, value)
        with pytest.raises(IntegrityError, match=message):
            validate_header(bad)
    raw = tensors_pb2.TensorHeader(name="w", dtype="float32", shape=[10], codec="raw", sha256="0" * 64,
                                   encoded_nbytes=40, codec_params={"block": "1"})
    with pytest.raises(IntegrityError, match="takes no codec_params"):
        validate_header(raw)
    announced = tensors_pb2.TensorHeader()
    announced.CopyFrom(h)
    announced.codec_params["block"] = "64"
    asm = ChunkAssembler(lambda _h: MemoryWriter(), expect={"w": announced})
    with pytest.raises(IntegrityError, match="differs from the one announced"):
        asm.add(next(tensor_chunks(h, b"x" * h.encoded_nbytes)))


def test_tensor_rng_depends_on_every_coordinate():
    draws = {codec_wire.tensor_rng(*key).integers(1 << 62) for key in
             [("t", 1, "a", "w"), ("t", 2, "a", "w"), ("t", 1, "b", "w"), ("t", 1, "a", "v"), ("u", 1, "a", "w")]}
    assert len(draws) == 5
    assert codec_wire.tensor_rng("t", 1, "a", "w").integers(1 << 62) == codec_wire.tensor_rng(
        "t", 1, "a", "w").integers(1 << 62)


@pytest.mark.parametrize("spec", ["int8", "topk:0.1+int8", "fp16"])
def test_encoded_tensors_fold_like_their_decoded_values(tmp_path, spec):
    """FedAvg decodes an EncodedTensor straight into its accumulator; blocks() gives the dense values."""
    rng = np.random.default_rng(2)
    base = {"w": rng.standard_normal((300, 7)).astype(np.float32)}
    deltas = [rng.standard_normal((300, 7)).astype(np.float32) for _ in range(3)]
    codec = parse_codec(spec)
    encoded, dense = [], []
    for i, d in enumerate(deltas):
        enc = codec.encode(d, rng=np.random.default_rng(i))
        path = tmp_path / f"u{i}.bin"
        path.write_bytes(b"pad" + enc.payload)
        t = EncodedTensor(path, 3, len(enc.payload), json.dumps(enc.params), (300, 7))
        encoded.append(t)
        dense.append(decode(enc.payload, enc.params))
        scratch = np.empty(256, np.float32)
        flat = np.concatenate([b.copy() for _, b in blocks(t, scratch)])
        np.testing.assert_array_equal(flat, dense[-1].reshape(-1))
    a, b = FedAvg(), FedAvg()
    a.begin(base)
    b.begin(base)
    for i, (t, d) in enumerate(zip(encoded, dense)):
        a.accept({"w": t}, 10.0 + i, site=str(i))
        b.accept({"w": d}, 10.0 + i, site=str(i))
    np.testing.assert_array_equal(a.finalize()["w"], b.finalize()["w"])


def test_watch_and_model_card_show_uplink_bytes_against_fp32():
    import io

    from fedclinic.client import ProgressDisplay
    from fedclinic.spec.model_card import uplink_text
    from fedclinic.proto import control_pb2

    metrics = {"eval_accuracy": 0.75, "uplink_payload_bytes": 48.0, "uplink_fp32_bytes": 744.0,
               "uplink_wire_bytes": 4278.0, "uplink_reduction": 15.5}
    assert uplink_text(48, metrics) == "48 (fp32 744, 15.5x smaller; 4278 on the wire)"
    assert uplink_text(200, {"eval_accuracy": 0.5}) == "200"
    rnd = control_pb2.RoundSummary(round=1, state=control_pb2.ROUND_STATE_CLOSED, metrics=metrics, uplink_bytes=48)
    status = control_pb2.TaskStatus(task_id="t-1", rounds=[rnd])
    out = io.StringIO()
    ProgressDisplay(out, tty=False).update(control_pb2.TaskEvent(kind="round-closed", message="round 1 closed",
                                                                 status=status))
    assert "up 48 B (fp32 744 B, 15.5x)" in out.getvalue()
