"""Fixed-point quantization into Z_2^32 (fedclinic.secagg.quantize): range, overflow, error bound."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from fedclinic.secagg.errors import SecAggConfigError, SecAggInputError
from fedclinic.secagg.quantize import RING_MAX, Quantizer

ROUNDING = st.sampled_from(["stochastic", "nearest"])


@settings(max_examples=80, deadline=None)
@given(clip=st.floats(1e-3, 1e3), bits=st.integers(1, 24), rounding=ROUNDING, m=st.integers(1, 12),
       length=st.integers(1, 300), scale=st.floats(0.0, 2.0), seed=st.integers(0, 2 ** 32 - 1))
def test_aggregate_error_bound_holds(clip, bits, rounding, m, length, scale, seed):
    """|dequantize(sum_mod_2^32 q(x_i)) - sum clip(x_i)| <= error_bound(m, |sum clip(x_i)|), per coordinate,
    for inputs inside and (scale > 1) outside the clip range."""
    q = Quantizer(clip=clip, bits=bits, rounding=rounding)
    if m > q.max_clients:
        m = q.max_clients
    rng = np.random.default_rng(seed)
    xs = [(rng.uniform(-1, 1, length) * scale * clip).astype(np.float32) for _ in range(m)]
    total = np.zeros(length, np.uint32)
    for i, x in enumerate(xs):
        qi = q.quantize(x, seed=rng.bytes(32))
        assert qi.dtype == np.uint32 and qi.max(initial=0) <= q.levels
        total += qi  # wraps mod 2^32, exactly like the masked sum
    exact = np.sum([np.clip(x.astype(np.float64), -clip, clip) for x in xs], axis=0)
    got = q.dequantize(total, m)
    assert got.dtype == np.float32
    assert np.all(np.abs(got.astype(np.float64) - exact) <= q.error_bound(m, exact))
    assert np.all(q.error_bound(m, exact) <= q.error_bound(m))  # the scalar bound covers every coordinate


@settings(max_examples=40, deadline=None)
@given(x=arrays(np.float32, st.integers(1, 200), elements=st.floats(-1, 1, width=32)), rounding=ROUNDING,
       bits=st.integers(1, 24))
def test_single_input_rounding_error(x, rounding, bits):
    q = Quantizer(clip=1.0, bits=bits, rounding=rounding)
    v = (x.astype(np.float64) + 1.0) * q.scale
    err = np.abs(q.quantize(x).astype(np.float64) - v)
    assert np.all(err <= (0.5 if rounding == "nearest" else 1.0) + 1e-9)


def test_stochastic_rounding_is_unbiased_and_nearest_is_deterministic():
    q = Quantizer(clip=1.0, bits=8, rounding="stochastic")
    # a value 0.3 of a level above a grid point, repeated 2^18 times: E[q - v] = 0, sd = sqrt(0.21/n)
    v0 = 100.3
    x = np.full(1 << 18, v0 / q.scale - 1.0, dtype=np.float64)
    qs = q.quantize(x, seed=bytes(range(32))).astype(np.float64)
    assert set(np.unique(qs)) == {100.0, 101.0}
    assert abs(qs.mean() - v0) < 6 * np.sqrt(0.21 / x.size)
    qn = Quantizer(clip=1.0, bits=8, rounding="nearest")
    assert np.all(qn.quantize(x) == 100) and np.array_equal(qn.quantize(x), qn.quantize(x))
    assert np.array_equal(q.quantize(x, seed=bytes(32)), q.quantize(x, seed=bytes(32)))


def test_dequantize_into_a_slice_equals_the_whole_vector():
    q = Quantizer(clip=0.5, bits=20)
    total = np.random.default_rng(3).integers(0, 10 * q.levels, 200_001, dtype=np.uint32)
    whole = q.dequantize(total, 10)
    assert np.array_equal(whole, (total * q.step - 10 * 0.5).astype(np.float32))  # float64, rounded once
    out = np.full(total.size + 5, np.nan, np.float32)
    assert np.shares_memory(q.dequantize(total[5:], 10, out=out[10:]), out)  # written in place, returned
    assert np.array_equal(out[10:], whole[5:]) and np.isnan(out[:10]).all()
    with pytest.raises(TypeError, match="float32 vector of 3"):
        q.dequantize(total[:3], 10, out=np.zeros(3, np.float64))
    with pytest.raises(TypeError, match="float32 vector of 3"):
        q.dequantize(total[:3], 10, out=np.zeros(4, np.float32))


def test_clipping_and_range_ends():
    q = Quantizer(clip=2.0, bits=4, rounding="nearest")
    out = q.quantize(np.array([-100.0, -2.0, 0.0, 2.0, 100.0], np.float32))
    assert out.tolist() == [0, 0, 8, 15, 15]  # 0 maps to (2/4)*15 = 7.5 -> 8 (round half up)


def test_values_at_the_clip_never_exceed_the_top_level():
    """x = +-c (and beyond) must map to exactly L and 0 under stochastic rounding too; a value a hair above
    L would round up to L + 1 now and then and break the overflow guarantee."""
    for clip in (0.1, 0.3, 1.7):
        q = Quantizer(clip=clip, bits=24)
        x = np.repeat(np.array([clip, -clip, 10 * clip, -10 * clip], np.float32), 1 << 16)
        out = q.quantize(x)
        assert out.max() == q.levels and out.min() == 0
        assert np.all(out[x > 0] == q.levels) and np.all(out[x < 0] == 0)


def test_overflow_check_is_exact():
    """n * L <= 2^32 - 1 is accepted, one more client is refused, and that client really could wrap."""
    q = Quantizer(clip=1.0, bits=20)
    n = q.max_clients
    assert n == 4096
    q.check_cohort(n)
    with pytest.raises(SecAggConfigError, match="4097 clients .* wrap"):
        q.check_cohort(n + 1)
    assert n * q.levels <= RING_MAX < (n + 1) * q.levels
    with pytest.raises(SecAggConfigError, match="at most 19 bits"):
        Quantizer(bits=20).check_cohort(8192)


def test_non_finite_and_malformed_inputs_are_refused():
    q = Quantizer()
    with pytest.raises(SecAggInputError, match="index 2"):
        q.quantize(np.array([0.0, 1.0, np.nan], np.float32))
    with pytest.raises(SecAggInputError, match="1-D float"):
        q.quantize(np.zeros((2, 2), np.float32))
    with pytest.raises(SecAggInputError, match="1-D float"):
        q.quantize(np.zeros(3, np.int32))
    with pytest.raises(SecAggInputError, match="32 bytes"):
        q.quantize(np.zeros(3, np.float32), seed=b"x")


@pytest.mark.parametrize("kwargs,match", [({"clip": 0.0}, "clip"), ({"clip": float("inf")}, "clip"),
                                          ({"bits": 0}, "bits"), ({"bits": 25}, "bits"),
                                          ({"rounding": "up"}, "rounding")])
def test_bad_quantizer_configs(kwargs, match):
    with pytest.raises(SecAggConfigError, match=match):
        Quantizer(**kwargs)


@pytest.mark.parametrize("bits,clip", [(24, 1.0), (24, 0.1), (20, 3.7), (12, 0.5)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_quantization_arithmetic_is_float64_exact_enough(bits, clip, dtype):
    """Nearest rounding must equal floor((x + c) s + 1/2) computed in float64 for 200k random inputs (a
    float32 computation of x * s would be off by up to half a level at 24 bits)."""
    x = np.random.default_rng(bits).uniform(-clip, clip, 200_000).astype(dtype)
    q = Quantizer(clip=clip, bits=bits, rounding="nearest")
    v = (x.astype(np.float64) + clip) * q.scale
    ref = np.floor(v + 0.5)
    got = q.quantize(x).astype(np.float64)
    near_tie = np.abs(v - np.floor(v) - 0.5) < 1e-6
    assert np.array_equal(got[~near_tie], ref[~near_tie])
    assert np.all(np.abs(got - v) <= 0.5 + 1e-6)
