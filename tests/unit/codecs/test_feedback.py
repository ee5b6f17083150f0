"""Error feedback (fedclinic.codecs.ErrorFeedback): the residual carries exactly what was not sent, and it
survives saves, reloads and restarts."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
import safetensors.numpy
from hypothesis import given, settings, strategies as st

from fedclinic.codecs import CodecInputError, ErrorFeedback, IntegrityError, decode, parse_codec

SPECS = ["topk:0.05", "topk:k=3,idx=raw", "topk:0.1+int8:block=16", "topk:0.2+int4:block=8,rounding=nearest",
         "int8:block=32", "int4:block=64,rounding=nearest", "topk:0.1+bf16", "fp16"]


@settings(max_examples=120, deadline=None)
@given(spec=st.sampled_from(SPECS), n=st.integers(0, 300), rounds=st.integers(1, 6),
       scales=st.lists(st.floats(1e-6, 1e3), min_size=6, max_size=6), seed=st.integers(0, 2 ** 32 - 1))
def test_sent_plus_residual_equals_sum_of_inputs(spec, n, rounds, scales, seed):
    """sum_t s_t + r_T = sum_t x_t within the stated float32 rounding:
    2^-24 sum_t (|y_t| + |r_{t+1}|) + 2T 2^-150 per coordinate (plus float64 summation slack here)."""
    rng = np.random.default_rng(seed)
    ef = ErrorFeedback(spec)
    sum_x, sum_s, slack, mag = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n)
    for t in range(rounds):
        x = (rng.standard_normal(n) * scales[t]).astype(np.float32)
        r = ef.residual("w")
        y = x + r if r is not None else x
        enc = ef.encode("w", x, rng=rng)
        ef.commit()
        s = decode(enc.payload, enc.params).astype(np.float64)
        r_next = ef.residual("w")
        slack += 2.0 ** -24 * (np.abs(y) + np.abs(r_next)) + 2 * 2.0 ** -150
        sum_x += x
        sum_s += s
        mag += np.abs(x) + np.abs(s)
    gap = np.abs(sum_s + ef.residual("w") - sum_x)
    assert np.all(gap <= slack + 2.0 ** -50 * mag)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 400), fraction=st.floats(0.001, 1.0), seed=st.integers(0, 2 ** 32 - 1))
def test_topk_fp32_residual_update_is_exact(n, fraction, seed):
    """With fp32 values every coordinate is sent whole or kept whole: r_{t+1} + s_t == y_t bit for bit."""
    rng = np.random.default_rng(seed)
    ef = ErrorFeedback(f"topk:{fraction!r}")
    for _ in range(3):
        x = rng.standard_normal(n).astype(np.float32)
        r = ef.residual("w")
        y = x + r if r is not None else x
        enc = ef.encode("w", x)
        ef.commit()
        s = decode(enc.payload, enc.params)
        assert np.array_equal(ef.residual("w") + s, y)
        assert np.count_nonzero(s) <= enc.params["k"]


def test_residual_is_what_the_codec_dropped():
    ef = ErrorFeedback("topk:k=2")
    x = np.array([5, -1, 0.5, -7, 2], np.float32)
    enc = ef.encode("w", x)
    assert ef.residual("w") is None and ef.pending == ("w",)  # staged, not committed
    ef.commit()
    assert np.array_equal(decode(enc.payload, enc.params), [5, 0, 0, -7, 0])
    assert np.array_equal(ef.residual("w"), [0, -1, 0.5, 0, 2])
    enc = ef.encode("w", np.zeros(5, np.float32))  # next round sends the largest leftovers
    assert np.array_equal(decode(enc.payload, enc.params), [0, -1, 0, 0, 2])


def _run(ef, xs, rngs):
    out = []
    for x, rng in zip(xs, rngs):
        out.append({k: ef.encode(k, v, rng=rng).payload for k, v in x.items()})
        ef.commit()
    return out


def test_restart_continues_exactly_like_an_uninterrupted_run(tmp_path):
    spec = "topk:0.1+int8:block=16"
    rng = np.random.default_rng(7)
    xs = [{"a.weight": rng.standard_normal((20, 30)).astype(np.float32),
           "b.bias": rng.standard_normal(7).astype(np.float32),
           "c.scalar": np.array(rng.standard_normal(), np.float32)} for _ in range(5)]
    seeds = [np.random.default_rng(100 + t) for t in range(5)]
    straight = _run(ErrorFeedback(spec), xs, seeds)

    seeds = [np.random.default_rng(100 + t) for t in range(5)]
    ef = ErrorFeedback(spec)
    first = _run(ef, xs[:3], seeds[:3])
    ef.save(tmp_path / "ef.safetensors")
    del ef
    ef2 = ErrorFeedback.load(tmp_path / "ef.safetensors")  # the codec comes from the file
    assert ef2.codec == parse_codec(spec)
    assert ef2.residual("c.scalar").shape == ()
    second = _run(ef2, xs[3:], seeds[3:])
    assert first + second == straight


def test_staged_residuals_survive_a_crash_and_commit_or_discard(tmp_path):
    path = tmp_path / "ef.safetensors"
    ef = ErrorFeedback("topk:k=1")
    ef.encode("w", np.array([1, 2, 3], np.float32))
    ef.commit()
    committed = ef.residual("w")
    ef.encode("w", np.array([10, 0, 0], np.float32))
    staged = ef._pending["w"].copy()
    ef.save(path)  # crash after the upload, before the ack was processed
    again = ErrorFeedback.load(path)
    assert again.pending == ("w",) and np.array_equal(again.residual("w"), committed)
    again.commit()  # the resent update was acknowledged
    assert np.array_equal(again.residual("w"), staged)
    other = ErrorFeedback.load(path)
    other.discard()  # the update was abandoned
    assert other.pending == () and np.array_equal(other.residual("w"), committed)


def test_saved_file_is_private_atomic_safetensors(tmp_path):
    path = tmp_path / "ef.safetensors"
    ef = ErrorFeedback("int8:block=4,rounding=nearest")
    ef.encode("w", np.arange(9, dtype=np.float32) / 7)
    ef.commit()
    ef.encode("empty", np.zeros((0, 4), np.float32))
    ef.commit()
    ef.save(path)
    ef.save(path)  # replacing an existing file
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.listdir(tmp_path) == ["ef.safetensors"]  # no temporary left behind
    tensors = safetensors.numpy.load(path.read_bytes())  # a plain safetensors file: no pickle anywhere
    assert set(tensors) == {"committed/w", "committed/empty"}
    assert ErrorFeedback.load(path).residual("empty").shape == (0, 4)


def test_corrupt_or_foreign_files_are_refused(tmp_path):
    path = tmp_path / "ef.safetensors"
    ef = ErrorFeedback("topk:0.5")
    ef.encode("w", np.ones(4, np.float32))
    ef.commit()
    ef.save(path)
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(IntegrityError, match="unreadable.*delete it"):
        ErrorFeedback.load(path)
    path.write_bytes(safetensors.numpy.save({"committed/w": np.ones(2, np.float32)}))
    with pytest.raises(IntegrityError, match="format"):
        ErrorFeedback.load(path)
    path.write_bytes(safetensors.numpy.save({"committed/w": np.ones(2, np.float64)},
                                            metadata={"format": "fedclinic-error-feedback/1", "codec": "fp16"}))
    with pytest.raises(IntegrityError, match="float64"):
        ErrorFeedback.load(path)
    with pytest.raises(FileNotFoundError):
        ErrorFeedback.load(tmp_path / "missing")


def test_shape_change_and_bad_input_are_refused():
    ef = ErrorFeedback("topk:0.5")
    ef.encode("w", np.ones(4, np.float32))
    ef.commit()
    with pytest.raises(CodecInputError, match=r"shape \(5,\).*reset\('w'\)"):
        ef.encode("w", np.ones(5, np.float32))
    with pytest.raises(CodecInputError, match="non-finite"):
        ef.encode("w", np.array([1, np.nan, 0, 0], np.float32))
    ef.reset("w")
    ef.encode("w", np.ones(5, np.float32))
    assert ef.pending == ("w",) and ef.names == ()
