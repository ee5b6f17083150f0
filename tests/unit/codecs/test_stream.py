"""Streaming decode-accumulate (fedclinic.codecs.decode_into): exact, chunked, and safe on malformed payloads."""

from __future__ import annotations

import json
import re
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from fedclinic.codecs import (BF16, FP16, FP32, CodecInputError, Int4, Int8, IntegrityError, TopK, decode, decode_into,
                              parse_codec)

ROUNDING = st.sampled_from(["stochastic", "nearest"])
VALUE = st.one_of(st.just(FP32()), st.just(FP16()), st.just(BF16()),
                  st.builds(Int8, block=st.sampled_from([1, 3, 16, 64]), scale=st.sampled_from(["fp32", "fp16"]),
                            rounding=ROUNDING),
                  st.builds(Int4, block=st.sampled_from([1, 3, 16, 64]), scale=st.sampled_from(["fp32", "fp16"]),
                            rounding=ROUNDING))
CODECS = st.one_of(VALUE, st.builds(TopK, fraction=st.floats(0.01, 1.0), idx=st.sampled_from(["varint", "delta", "raw"]),
                                    values=VALUE))


@settings(max_examples=200, deadline=None)
@given(codec=CODECS, x=arrays(np.float32, st.integers(0, 500), elements=st.floats(-1e4, 1e4, width=32)),
       weight=st.floats(-10, 10), dtype=st.sampled_from([np.float32, np.float64]), chunk=st.integers(1, 200),
       seed=st.integers(0, 2 ** 32 - 1))
def test_decode_into_equals_weight_times_decode_exactly(codec, x, weight, dtype, chunk, seed):
    """acc + w * decode(payload) bit for bit, for every chunk size (small chunks cross block boundaries)."""
    enc = codec.encode(x, rng=np.random.default_rng(seed))
    acc0 = np.random.default_rng(seed + 1).standard_normal(x.size).astype(dtype)
    expected = acc0 + dtype(weight) * decode(enc.payload, enc.params).reshape(-1).astype(dtype)
    acc = acc0.copy()
    decode_into(acc, enc.payload, json.loads(json.dumps(enc.params)), weight, chunk=chunk)
    assert acc.dtype == dtype
    assert np.array_equal(acc, expected)
    codec.decode_into(acc, enc.payload, enc.params, -weight, chunk=chunk)  # the method form, undoing it roughly
    assert np.allclose(acc, acc0, atol=1e-3 * (1 + np.abs(expected).max(initial=0)))


def test_several_sites_fold_into_one_accumulator():
    rng = np.random.default_rng(5)
    sites = [rng.standard_normal(10_000).astype(np.float32) for _ in range(3)]
    weights = [0.5, 0.3, 0.2]
    codec = parse_codec("topk:0.1+int8:block=64")
    encs = [codec.encode(x, rng=rng) for x in sites]
    acc = np.zeros(10_000, np.float32)
    for w, e in zip(weights, encs):
        decode_into(acc, e.payload, e.params, w)
    expected = np.zeros(10_000, np.float32)
    for w, e in zip(weights, encs):
        expected = expected + np.float32(w) * decode(e.payload, e.params)
    assert np.array_equal(acc, expected)


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("spec", ["int8:rounding=nearest", "fp16", "topk:0.01+int8:rounding=nearest",
                                  "topk:0.25,idx=varint"])
def test_decode_into_makes_no_dense_temporary(spec):
    """Peak traced allocation of decode_into stays at a few chunks, far below one dense float32 copy
    (32 MiB here); decode(), which does build the dense tensor, is the control that shows the meter works."""
    n = 1 << 23
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    enc = parse_codec(spec).encode(x)
    acc = np.zeros(n, np.float32)
    peak = _peak(lambda: decode_into(acc, enc.payload, enc.params, 0.5))
    assert peak < 6 << 20, peak
    assert _peak(lambda: decode(enc.payload, enc.params)) >= 4 * n


# ----------------------------------------------------------------------------------------- malformed payloads

X = np.random.default_rng(9).standard_normal(300).astype(np.float32)


def _enc(spec: str):
    e = parse_codec(spec).encode(X, rng=np.random.default_rng(0))
    return bytearray(e.payload), json.loads(json.dumps(e.params))


def _set(params, path, value):
    d = params
    for key in path[:-1]:
        d = d[key]
    if value is _DELETE:
        del d[path[-1]]
    else:
        d[path[-1]] = value
    return params


_DELETE = object()


def _corrupt_bytes(spec, at, value):
    payload, params = _enc(spec)
    payload[at] = value
    return payload, params


def _handmade_topk(index_bytes: bytes, k: int):
    values = np.ones(k, np.float32).tobytes()
    return index_bytes + values, {"codec": "topk", "shape": [300], "k": k, "idx": "varint",
                                  "idx_bytes": len(index_bytes), "values": {"codec": "fp32", "shape": [k]}}


def _varint_overlong():
    return _handmade_topk(b"\x83\x80\x80\x80\x80\x00" + b"\x00", 2)  # 3 in 6 bytes, then 0


def _varint_too_big():
    return _handmade_topk(b"\xff\xff\xff\xff\x7f" + b"\x00", 2)  # 2^35 - 1


def _raw_swapped():
    payload, params = _enc("topk:0.1,idx=raw")
    payload[0:8] = payload[4:8] + payload[0:4]
    return payload, params


def _raw_out_of_range():
    payload, params = _enc("topk:0.1,idx=raw")
    payload[4 * 29:4 * 30] = np.array([300], "<u4").tobytes()
    return payload, params


def _delta_out_of_range():
    payload, params = _enc("topk:0.1,idx=delta")
    payload[0:4] = np.array([299], "<u4").tobytes()  # first index 299: the next one falls outside
    return payload, params


def _scale(spec, value, dtype="<f4"):
    payload, params = _enc(spec)
    payload[0:np.dtype(dtype).itemsize] = np.array([value], dtype).tobytes()
    return payload, params


MALFORMED = {
    "truncated": (lambda: (_enc("int8")[0][:-1], _enc("int8")[1]), "bytes, expected"),
    "extra byte": (lambda: (_enc("fp16")[0] + b"\0", _enc("fp16")[1]), "bytes, expected"),
    "truncated topk": (lambda: (_enc("topk:0.1+int4")[0][:-3], _enc("topk:0.1+int4")[1]), "bytes, expected"),
    "params not a dict": (lambda: (_enc("fp32")[0], ["fp32"]), "JSON object"),
    "unknown codec": (lambda: (_enc("int8")[0], _set(_enc("int8")[1], ["codec"], "int7")), "unknown to this version"),
    "missing shape": (lambda: (_enc("int8")[0], _set(_enc("int8")[1], ["shape"], _DELETE)), "params['shape']"),
    "negative dim": (lambda: (_enc("fp32")[0], _set(_enc("fp32")[1], ["shape"], [-300])), "non-negative"),
    "bool dim": (lambda: (_enc("fp32")[0], _set(_enc("fp32")[1], ["shape"], [True])), "non-negative"),
    "wrong shape": (lambda: (_enc("fp32")[0], _set(_enc("fp32")[1], ["shape"], [301])), "bytes, expected"),
    "unknown key": (lambda: (_enc("int8")[0], _set(_enc("int8")[1], ["rounding"], "nearest")), "unexpected keys"),
    "missing key": (lambda: (_enc("int8")[0], _set(_enc("int8")[1], ["block"], _DELETE)), "missing keys"),
    "block zero": (lambda: (_enc("int8")[0], _set(_enc("int8")[1], ["block"], 0)), "params['block']"),
    "block as text": (lambda: (_enc("int8")[0], _set(_enc("int8")[1], ["block"], "128")), "params['block']"),
    "block mismatch": (lambda: (_enc("int8")[0], _set(_enc("int8")[1], ["block"], 64)), "bytes, expected"),
    "scale fp8": (lambda: (_enc("int4")[0], _set(_enc("int4")[1], ["scale"], "fp8")), "params['scale']"),
    "nan scale": (lambda: _scale("int8", np.nan), "scale of block 0"),
    "negative scale": (lambda: _scale("int4", -1.0), "scale of block 0"),
    "inf fp16 scale": (lambda: _scale("int8:scale=fp16", np.inf, "<f2"), "scale of block 0"),
    "fp32 nan": (lambda: _scale("fp32", np.nan), "NaN/Inf at flat index 0"),
    "fp16 inf": (lambda: _corrupt_bytes("fp16", 2 * 7 + 1, 0x7C), "NaN/Inf at flat index 7"),
    "bf16 nan": (lambda: _bf16_nan(), "NaN/Inf at flat index 9"),
    "topk k > n": (lambda: (_enc("topk:0.1")[0], _set(_enc("topk:0.1")[1], ["k"], 301)), "params['k']"),
    "topk idx kind": (lambda: (_enc("topk:0.1")[0], _set(_enc("topk:0.1")[1], ["idx"], "zip")), "params['idx']"),
    "topk idx_bytes": (lambda: (_enc("topk:0.1,idx=raw")[0], _set(_enc("topk:0.1,idx=raw")[1], ["idx_bytes"], 116)),
                       "bytes, expected"),
    "topk values missing": (lambda: (_enc("topk:0.1")[0], _set(_enc("topk:0.1")[1], ["values"], None)),
                            "value codec's params"),
    "topk values shape": (lambda: (_enc("topk:0.1")[0], _set(_enc("topk:0.1")[1], ["values", "shape"], [29])),
                          "does not match k"),
    "topk nested topk": (lambda: (_enc("topk:0.1")[0], _set(_enc("topk:0.1")[1], ["values", "codec"], "topk")),
                         "value codec's params"),
    "varint overlong": (_varint_overlong, "longer than 5 bytes"),
    "varint too big": (_varint_too_big, "exceeds 2^32 - 1"),
    "varint truncated": (lambda: _handmade_topk(b"\x05\x85", 2), "ends after 1 of the expected"),
    "raw not increasing": (_raw_swapped, "strictly increasing"),
    "raw out of range": (_raw_out_of_range, "out of range"),
    "delta out of range": (_delta_out_of_range, "out of range"),
    "payload not bytes": (lambda: ([1, 2, 3], _enc("fp32")[1]), "payload must be bytes"),
}


def _bf16_nan():
    payload, params = _enc("bf16")
    payload[2 * 9:2 * 9 + 2] = np.array([0x7FC1], "<u2").tobytes()
    return payload, params


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_payload_raises_integrity_error_and_leaves_accumulator_untouched(case):
    make, message = MALFORMED[case]
    payload, params = make()
    with pytest.raises(IntegrityError, match=re.escape(message)):
        decode(payload, params)
    acc = np.arange(300, dtype=np.float32)
    with pytest.raises(IntegrityError, match=re.escape(message)):
        decode_into(acc, payload, params, 0.5, chunk=8)  # small chunks: the bad part is not in the first one
    assert np.array_equal(acc, np.arange(300, dtype=np.float32))


def test_handmade_varint_payload_decodes_as_documented():
    """Gaps 5 and 133 (LEB128 0x05, 0x85 0x01) are indices 5 and 5 + 133 + 1 = 139: the format in the docs,
    and the control for the malformed handmade payloads above."""
    y = decode(*_handmade_topk(b"\x05\x85\x01", 2))
    assert np.array_equal(np.flatnonzero(y), [5, 139])


def test_varint_stream_must_be_consumed_exactly():
    payload, params = _enc("topk:0.1")
    params["idx_bytes"] += 1  # one value byte now counted as index byte
    with pytest.raises(IntegrityError):
        decode(bytes(payload), params)


def test_bad_accumulator_is_refused():
    payload, params = _enc("fp16")
    payload = bytes(payload)
    with pytest.raises(CodecInputError, match="has 299 elements"):
        decode_into(np.zeros(299, np.float32), payload, params)
    with pytest.raises(CodecInputError, match="1-D float32 or float64"):
        decode_into(np.zeros((3, 100), np.float32), payload, params)
    with pytest.raises(CodecInputError, match="1-D float32 or float64"):
        decode_into(np.zeros(300, np.float16), payload, params)
    ro = np.zeros(300, np.float32)
    ro.flags.writeable = False
    with pytest.raises(CodecInputError, match="read-only"):
        decode_into(ro, payload, params)
    with pytest.raises(CodecInputError, match="weight must be finite"):
        decode_into(np.zeros(300, np.float32), payload, params, float("nan"))
    with pytest.raises(IntegrityError, match="expected 'int8'"):
        Int8().decode(payload, params)
