"""Every codec round-trips within its stated error bound (fedclinic.codecs), and refuses what it cannot encode."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from fedclinic.codecs import (BF16, FP16, FP32, CodecInputError, Int4, Int8, TopK, available_codecs, decode,
                              parse_codec)

F32_MAX = float(np.finfo(np.float32).max)
ROUNDING = st.sampled_from(["stochastic", "nearest"])
BLOCK = st.sampled_from([1, 2, 7, 64, 128])
SHAPES = st.one_of(array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6),
                   st.integers(0, 700).map(lambda n: (n,)))
QUANT = st.one_of(st.builds(Int8, block=BLOCK, scale=st.sampled_from(["fp32", "fp16"]), rounding=ROUNDING),
                  st.builds(Int4, block=BLOCK, scale=st.sampled_from(["fp32", "fp16"]), rounding=ROUNDING))
VALUE = st.one_of(st.just(FP32()), st.just(FP16()), st.just(BF16()), QUANT)
IDX = st.sampled_from(["varint", "delta", "raw"])
TOPK = st.one_of(st.builds(TopK, fraction=st.floats(0.001, 1.0), idx=IDX, values=VALUE),
                 st.builds(TopK, k=st.integers(1, 800), idx=IDX, values=VALUE))
CODECS = st.one_of(VALUE, TOPK)


def max_abs(codec) -> float:
    """Largest |x| the codec accepts: fp16 values, or float16 block scales (absmax <= 65504 * L)."""
    inner = codec.values if isinstance(codec, TopK) else codec
    if isinstance(inner, FP16):
        return 65504.0
    if isinstance(inner, (Int8, Int4)) and inner.scale == "fp16":
        return 65504.0 * inner.levels
    if isinstance(inner, BF16):
        return float(np.float32(3.38e38))
    return F32_MAX


def arrays_for(codec):
    m = max_abs(codec)
    # raw float32 draws (zeros, subnormals, huge) mixed with magnitude-scaled normals
    elements = st.one_of(st.floats(-m, m, width=32),
                         st.builds(lambda a, e: float(np.float32(a * 10.0 ** e)), st.floats(-1, 1, width=32),
                                   st.integers(-44, 4)).filter(lambda v: abs(v) <= m))
    return arrays(np.float32, SHAPES, elements=elements)


def check_round_trip(codec, x, seed):
    enc = codec.encode(x, rng=np.random.default_rng(seed))
    params = json.loads(json.dumps(enc.params, allow_nan=False))  # JSON-able: survives the wire as text
    y = decode(enc.payload, params)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert np.isfinite(y).all()
    err = np.abs(y.astype(np.float64) - x.astype(np.float64))
    bound = codec.error_bound(x)
    assert bound.shape == x.shape
    assert np.all(err <= bound), (codec.spec, float((err - bound).max()))
    return enc, y


@settings(max_examples=250, deadline=None)
@given(data=st.data())
def test_every_codec_round_trips_within_its_bound(data):
    codec = data.draw(CODECS)
    x = data.draw(arrays_for(codec))
    check_round_trip(codec, x, data.draw(st.integers(0, 2 ** 32 - 1)))


EDGE = {
    "zeros": np.zeros(300, np.float32),
    "negative zeros": -np.zeros(129, np.float32),
    "float32 max": np.array([F32_MAX, -F32_MAX, F32_MAX, 1.0, 0.0], np.float32),
    "subnormals": np.array([1e-45, -1e-45, 3e-45, 1e-40, 0.0, -1e-38], np.float32),
    "huge and tiny in one block": np.array([3e38, 1e-30, -2e-45, 7.0, -3e37] * 30, np.float32),
    "scalar": np.array(-0.7, np.float32),
    "empty": np.zeros((4, 0, 3), np.float32),
}


@pytest.mark.parametrize("name", sorted(EDGE))
@pytest.mark.parametrize("spec", ["fp32", "bf16", "int8", "int8:rounding=nearest", "int4:block=2", "int4:block=64",
                                  "int8:block=1", "topk:0.3", "topk:k=2+int8", "topk:0.5,idx=raw+int4",
                                  "topk:1.0,idx=delta+bf16"])
def test_edge_values_round_trip(name, spec):
    x = EDGE[name]
    if "bf16" in spec:
        x = np.clip(x, -3e38, 3e38)  # bf16 refuses |x| >= 3.3962e38 (tested below)
    check_round_trip(parse_codec(spec), x, 7)


def test_bounds_are_not_vacuous():
    """The bounds the tests check against are tight: about half a level (nearest) or one level (stochastic)."""
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    A = np.abs(x).reshape(-1, 128).max(axis=1).repeat(128)
    assert np.all(Int8(rounding="nearest").error_bound(x) <= 0.5001 * A / 127 + 1e-6 * np.abs(x))
    assert np.all(Int8().error_bound(x) <= 1.0001 * A / 127 + 1e-6 * np.abs(x))
    assert np.all(Int4(block=128).error_bound(x) <= 1.0001 * A / 7 + 1e-6 * np.abs(x))
    assert np.all(FP16().error_bound(x) <= 2.0 ** -11 * np.abs(x) + 2.0 ** -24)
    assert np.all(BF16().error_bound(x) <= 2.0 ** -8 * np.abs(x) + 2.0 ** -133)
    assert np.all(FP32().error_bound(x) == 0)
    # and the codecs use them: int8-nearest errors reach a good part of half a level
    y = decode(*_enc(Int8(rounding="nearest"), x))
    assert np.max(np.abs(y - x) / (A / 127)) > 0.45


def _enc(codec, x, seed=0):
    e = codec.encode(x, rng=np.random.default_rng(seed))
    return e.payload, e.params


def test_fp32_is_exact_and_payload_sizes_are_as_documented():
    x = np.random.default_rng(1).standard_normal((7, 45)).astype(np.float32)  # 315 elements
    n = x.size
    assert np.array_equal(decode(*_enc(FP32(), x)), x)
    assert len(_enc(FP32(), x)[0]) == 4 * n
    assert len(_enc(FP16(), x)[0]) == len(_enc(BF16(), x)[0]) == 2 * n
    assert len(_enc(Int8(block=64), x)[0]) == 4 * 5 + n
    assert len(_enc(Int8(block=64, scale="fp16"), x)[0]) == 2 * 5 + n
    assert len(_enc(Int4(block=64), x)[0]) == 4 * 5 + (n + 1) // 2
    topk = TopK(k=10, idx="raw", values=FP32())
    assert len(_enc(topk, x)[0]) == 10 * 4 + 10 * 4


@settings(max_examples=200, deadline=None)
@given(x=arrays(np.float32, st.integers(0, 300), elements=st.floats(-1e6, 1e6, width=32)),
       fraction=st.floats(0.001, 1.0))
def test_topk_keeps_exactly_the_largest(x, fraction):
    codec = TopK(fraction=fraction)
    y = decode(*_enc(codec, x))
    k = codec.k_for(x.size)
    assert k == min(x.size, int(np.ceil(fraction * x.size)))
    sent = np.flatnonzero(y != 0)
    kept = np.flatnonzero(np.asarray(_kept_mask(codec, x)))
    assert kept.size == k
    assert np.array_equal(y[kept], x[kept])  # fp32 values: sent exactly
    dropped = np.setdiff1d(np.arange(x.size), kept)
    if k and dropped.size:
        assert np.abs(x[dropped]).max() <= np.abs(x[kept]).min()
    assert set(sent) <= set(kept)


def _kept_mask(codec, x):
    enc = codec.encode(x)
    ix = np.frombuffer(TopK(k=codec.k_for(x.size) or 1, idx="raw").encode(x).payload[:4 * codec.k_for(x.size)],
                       "<u4")
    mask = np.zeros(x.size, bool)
    mask[ix] = True
    assert enc.params["k"] == codec.k_for(x.size)
    return mask


def test_bf16_matches_torch_round_to_nearest_even():
    torch = pytest.importorskip("torch", reason="torch is the independent bf16 reference; not installed")
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[np.isfinite(x) & (np.abs(x) < 3.38e38)]
    # ties: patterns whose low 16 bits are exactly 0x8000, with even and odd bf16 mantissas
    ties = (np.arange(0x3F80, 0x3F90, dtype=np.uint32) << 16 | 0x8000).view(np.float32)
    x = np.concatenate([x, ties, -ties])
    ours = np.frombuffer(BF16().encode(x).payload, "<u2")
    ref = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, ref)


@pytest.mark.parametrize("spec", [c if c != "topk" else "topk:0.1" for c in available_codecs()]
                         + ["topk:0.5+int8", "int4:rounding=nearest"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_are_refused_with_the_index(spec, bad):
    x = np.linspace(-1, 1, 50, dtype=np.float32)
    x[37] = bad
    with pytest.raises(CodecInputError, match=r"non-finite.*flat index 37"):
        parse_codec(spec).encode(x, rng=np.random.default_rng(0))


def test_non_float32_is_refused():
    with pytest.raises(CodecInputError, match="float32"):
        FP16().encode(np.zeros(3))
    with pytest.raises(CodecInputError, match="float32"):
        Int8().encode(np.zeros(3, np.int32), rng=np.random.default_rng(0))


def test_out_of_range_values_are_refused_with_advice():
    with pytest.raises(CodecInputError, match=r"fp16.*index 2.*bf16 or fp32"):
        FP16().encode(np.array([1, 2, 70000], np.float32))
    assert decode(*_enc(FP16(), np.array([65519.0], np.float32)))[0] == 65504.0  # rounds down, within bound
    with pytest.raises(CodecInputError, match=r"bf16.*index 1.*fp32"):
        BF16().encode(np.array([1, F32_MAX], np.float32))
    with pytest.raises(CodecInputError, match="scale=fp32"):
        Int8(scale="fp16").encode(np.array([1e7], np.float32), rng=np.random.default_rng(0))
    with pytest.raises(CodecInputError, match="needs a seeded numpy Generator"):
        Int8().encode(np.ones(3, np.float32))
    with pytest.raises(CodecInputError, match="needs a seeded numpy Generator"):
        parse_codec("topk:0.5+int4").encode(np.ones(3, np.float32))
    Int8(rounding="nearest").encode(np.ones(3, np.float32))  # nearest needs no generator
