"""The distributed-DP encoding of one site's update: the whole-update L2 clip, conditional rounding's norm bound,
two's complement in every ring and back, the ring's worst-case bound, and the layout that carries it (digest, count
slot, refusals)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedclinic.privacy.secure_random import SecureRandom
from fedclinic.secagg import Quantizer, SecAggConfigError, SecAggInputError
from fedclinic.secagg.skellam_encoding import WRAP_PROBABILITY, SkellamEncoding, ring_for, signed, to_ring
from fedclinic.secagg.vector_layout import VectorLayout

BETA = math.exp(-0.5)


def _rng(tag: bytes) -> SecureRandom:
    return SecureRandom(key=tag.ljust(32, b"."))


def _enc(**kw) -> SkellamEncoding:
    args = dict(clip_norm=1.0, scale=64.0, site_variance=1e4, values=500, ring_bits=32, beta=BETA)
    args.update(kw)
    return SkellamEncoding(**args)


def test_an_update_above_the_clip_norm_is_scaled_down_to_it():
    enc = _enc(scale=2.0 ** 20)  # fine grid: the rounded norm is the clipped norm within sqrt(d) steps
    x = np.full(500, 0.3, dtype=np.float32)  # norm 6.7 > C = 1
    r = enc.round_update(x, _rng(b"clip"))
    assert abs(np.linalg.norm(r) / enc.scale - 1.0) < math.sqrt(500) / enc.scale
    small = np.full(500, 0.01, dtype=np.float32)  # norm 0.22 < C: kept as it is
    np.testing.assert_allclose(enc.round_update(small, _rng(b"keep")) / enc.scale, small, atol=1 / enc.scale)


def test_conditional_rounding_never_exceeds_the_norm_bound_and_is_unbiased():
    enc = _enc(scale=4.0, values=2000)  # coarse grid: stochastic rounding alone would often exceed the bound
    x = np.random.default_rng(0).normal(size=2000).astype(np.float32)
    x *= 1.0 / np.linalg.norm(x)
    rng = _rng(b"round")
    runs = np.stack([enc.round_update(x, rng) for _ in range(300)])
    assert (np.sqrt((runs.astype(np.float64) ** 2).sum(axis=1)) <= enc.l2_bound + 1e-9).all()
    # the conditioning biases little (beta = exp(-1/2) redraws rarely): the mean stays within 5.3 s.e. of gamma x
    err = runs.mean(axis=0) / enc.scale - x
    assert np.abs(err).max() < 5.3 * 0.5 / math.sqrt(300) / enc.scale + 0.02


@pytest.mark.parametrize("bits", [16, 32, 64])
def test_twos_complement_round_trip_in_every_ring(bits):
    v = np.array([0, 1, -1, 12345, -12345, (1 << (bits - 1)) - 1, -(1 << (bits - 1))], dtype=np.int64)
    ring = to_ring(v, bits)
    assert ring.dtype == np.dtype(f"uint{bits}")
    np.testing.assert_array_equal(signed(ring, bits), v)
    total = (ring[:3].astype(np.uint64).sum() % (1 << bits)) if bits < 64 else ring[:3].sum(dtype=np.uint64)
    assert signed(np.array([total], dtype=ring.dtype), bits)[0] == 0  # 0 + 1 - 1, summed with wrap-around


def test_the_ring_holds_the_worst_case_sum_and_the_narrowest_is_chosen():
    assert ring_for(1.0, 64.0, 1e4, 500, BETA, 5) == 16
    assert ring_for(1.0, 4096.0, 1e8, 500, BETA, 5) == 32
    assert ring_for(1.0, 2.0 ** 20, 1e16, 500, BETA, 50) == 64
    enc = _enc()
    L = math.log(2 * 500 / WRAP_PROBABILITY)
    assert enc.wrap_bound(4) == pytest.approx(4 * enc.l2_bound + L / 3 + math.sqrt(L * L / 9 + 2 * 4e4 * L))
    with pytest.raises(SecAggConfigError, match="wrap the 16-bit ring"):
        _enc(ring_bits=16, scale=8192.0).check_cohort(5)
    with pytest.raises(SecAggConfigError):
        ring_for(1.0, 2.0 ** 40, 1e30, 500, BETA, 50)


def test_bad_inputs_are_refused():
    enc = _enc()
    with pytest.raises(SecAggInputError, match="non-finite"):
        enc.round_update(np.full(500, np.nan, np.float32), _rng(b"x"))
    with pytest.raises(SecAggInputError, match="500 values"):
        enc.round_update(np.zeros(499, np.float32), _rng(b"x"))
    with pytest.raises(SecAggInputError, match="int64 noise"):
        enc.encode(np.zeros(500, np.float32), np.zeros(500, np.int32), _rng(b"x"))
    with pytest.raises(SecAggConfigError, match="site_variance"):
        _enc(site_variance=0.0)
    with pytest.raises(SecAggConfigError, match="mechanism"):
        _enc(mechanism="gaussian")


def _layout(enc: SkellamEncoding) -> VectorLayout:
    return VectorLayout((("w", 400), ("b", 100)), Quantizer(ring_bits=enc.ring_bits, weight_cap=1, bits=16), dp=enc)


def test_the_layout_carries_noise_and_a_count_of_one_and_its_digest_names_the_plan():
    enc = _enc()
    layout = _layout(enc)
    rng = _rng(b"layout")
    delta = {"w": np.zeros(400, np.float32), "b": np.zeros(100, np.float32)}
    noise = np.arange(500, dtype=np.int64) - 250
    vec = layout.encode(delta, weight=1, dp_noise=noise, dp_random=rng)
    assert vec.shape == (501,) and vec[-1] == 1
    np.testing.assert_array_equal(signed(vec[:500], 32), noise)  # a zero update: exactly the noise
    decoded = layout.decode(vec)
    np.testing.assert_allclose(decoded.tensors["b"], noise[400:] / enc.scale)
    assert layout.digest() != _layout(_enc(site_variance=2e4)).digest()
    assert layout.digest() != _layout(_enc(scale=128.0)).digest()
    with pytest.raises(SecAggInputError, match="noise share"):
        layout.encode(delta, weight=1)
    with pytest.raises(SecAggInputError, match="weight 1"):
        layout.encode(delta, weight=2, dp_noise=noise, dp_random=rng)
    with pytest.raises(SecAggConfigError, match="distributed-DP layout"):
        VectorLayout((("w", 500),), Quantizer(ring_bits=32, weight_cap=4), dp=enc)
    with pytest.raises(SecAggConfigError, match="distributed-DP layout"):
        VectorLayout((("w", 500),), Quantizer(ring_bits=32, weight_cap=1), metric_names=("acc",), dp=enc)
