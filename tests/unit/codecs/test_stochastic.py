"""Stochastic rounding of the block quantizers is unbiased: E[decode(encode(x))] = x (fedclinic.codecs)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from fedclinic.codecs import Int4, Int8, TopK, decode

N_SEEDS = 2000


def _levels(codec, x):
    """Per-element quantization step s_b = A_b / L (the standard deviation of one rounding is <= s_b / 2)."""
    B, L = codec.block, codec.levels
    pad = np.zeros(-(-x.size // B) * B)
    pad[:x.size] = np.abs(x)
    return np.repeat(pad.reshape(-1, B).max(axis=1), B)[:x.size] / L


def _max_z(codec, x, decoded_mean):
    """Largest |mean - x| in standard errors of a mean of N_SEEDS roundings. One stochastic rounding has
    sd <= S_b / 2, with S_b the bound on the stored scale (stochastic error_bound >= S_b; float16 scales of
    tiny blocks are their smallest subnormal, far above A_b / L)."""
    se = replace(codec, rounding="stochastic").error_bound(x) / 2 / np.sqrt(N_SEEDS)
    return float(np.max(np.abs(decoded_mean - x.astype(np.float64)) / se))


def _mean_decoded(codec, x):
    total = np.zeros(x.size)
    for seed in range(N_SEEDS):
        e = codec.encode(x, rng=np.random.default_rng(seed))
        total += decode(e.payload, e.params)
    return total / N_SEEDS


# values off the levels: fractions spread over (0, 1) and magnitudes over 8 decades, 3 blocks of 64
X = (np.random.default_rng(42).uniform(-1, 1, 192) * np.repeat([1e-6, 1.0, 3e2], 64)).astype(np.float32)


@pytest.mark.parametrize("codec", [Int8(block=64), Int4(block=64), Int8(block=64, scale="fp16"),
                                   Int4(block=64, scale="fp16")], ids=str)
def test_stochastic_rounding_is_unbiased(codec):
    """Mean over 2000 seeds within 4.5 standard errors for all 192 elements (seeds fixed: deterministic).
    A bias of 0.1 of a level would show as ~9 standard errors."""
    assert _max_z(codec, X, _mean_decoded(codec, X)) < 4.5


def test_the_unbiasedness_check_detects_bias():
    """Control: nearest rounding of values at 0.3 of a level is biased, and the same check says so."""
    codec = Int8(block=64, rounding="nearest")
    x = X.copy()
    s = _levels(codec, x)
    x[1:64] = (0.3 * s[1:64] * np.sign(x[1:64])).astype(np.float32)  # rounds to 0: bias 0.3 level
    x[0] = np.float32(s[0] * 127)  # keep the block absmax (hence the level) fixed
    assert _max_z(codec, x, _mean_decoded(codec, x)) > 20  # 0.3 level = ~27 standard errors


def test_topk_with_int8_is_unbiased_on_the_kept_values():
    codec = TopK(fraction=0.5, values=Int8(block=16))
    x = X[64:128]  # one magnitude decade: the kept half forms 2 blocks of 16
    mean = _mean_decoded(codec, x)
    kept = np.flatnonzero(mean)
    assert kept.size == 32
    assert _max_z(Int8(block=16), x[kept], mean[kept]) < 4.5


def test_same_seed_same_bytes_other_seed_other_bytes():
    codec = Int4(block=64)
    a = codec.encode(X, rng=np.random.default_rng(1)).payload
    assert a == codec.encode(X, rng=np.random.default_rng(1)).payload
    assert a != codec.encode(X, rng=np.random.default_rng(2)).payload
    n = Int8(rounding="nearest")
    assert n.encode(X).payload == n.encode(X, rng=np.random.default_rng(5)).payload  # nearest ignores rng
