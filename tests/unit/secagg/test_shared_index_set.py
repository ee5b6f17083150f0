"""Secure top-k (issue 17): a ``topk:F`` task sums only a shared random index set of ``ceil(F * P)`` coordinates.
Every member derives the same set from the session's public parameters, each session a new one; the decoded sum
is the weighted mean on the set (within the layout's bound) and exact zeros elsewhere; the set is in the digest."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from fedclinic.codecs import ErrorFeedback
from fedclinic.proto import task_pb2
from fedclinic.secagg import SessionParams, run_round
from fedclinic.secagg.errors import SecAggConfigError
from fedclinic.secagg.quantize import Quantizer
from fedclinic.secagg.task_config import index_fraction_of, layout_for
from fedclinic.secagg.vector_layout import VectorLayout, draw_index_set, index_seed, smallest_pairs

MODEL = hashlib.sha256(b"model").digest()
COHORT = tuple(f"site-{i:02d}" for i in range(4))
NAMES = ("layer.0.w", "layer.1.w", "head.b")
SHAPES = ((30, 40), (200,), (7,))
P = 1200 + 200 + 7


def _spec(codec: str, **secagg) -> task_pb2.TaskSpec:
    spec = task_pb2.TaskSpec()
    spec.update.codec = codec
    spec.secure_aggregation.CopyFrom(task_pb2.SecureAggregationConfig(enabled=True, clip=0.5, bits=16, **secagg))
    return spec


def _layout(seed: bytes, codec: str = "topk:0.05") -> VectorLayout:
    return layout_for(_spec(codec), NAMES, SHAPES, len(COHORT), ("accuracy",), index_seed=seed)


def test_every_member_derives_the_same_set_and_each_session_a_new_one():
    seed = index_seed("task", 3, MODEL, b"n" * 16)
    members = [_layout(index_seed("task", 3, MODEL, b"n" * 16)) for _ in COHORT]  # each derives it on its own
    sets = [m.index_set() for m in members]
    assert all(np.array_equal(s, sets[0]) for s in sets)
    assert len({m.digest() for m in members}) == 1
    assert sets[0].size == math.ceil(0.05 * P) and np.all(np.diff(sets[0]) > 0) and sets[0][-1] < P
    assert members[0].length == math.ceil(0.05 * P) + 2 + 1  # the m values + one metric (2 slots) + one count
    other = _layout(index_seed("task", 3, MODEL, b"m" * 16))  # another session (nonce) of the same round
    later = _layout(index_seed("task", 4, MODEL, b"n" * 16))
    assert not np.array_equal(other.index_set(), sets[0]) and not np.array_equal(later.index_set(), sets[0])
    assert other.digest() != members[0].digest()
    # pinned: the draw uses only PCG64's raw stream, so a numpy upgrade cannot split a cohort
    assert draw_index_set(b"pin", 20, 4).tolist() == [2, 3, 9, 14]
    assert draw_index_set(b"pin", 10**5, 3).tolist() == [7252, 18190, 96902]
    assert np.array_equal(draw_index_set(seed, P, P), np.arange(P))


def test_the_block_wise_draw_keeps_the_smallest_keys():
    from fedclinic.secagg import vector_layout as vl
    gen = np.random.PCG64(int.from_bytes(hashlib.sha256(b"fedclinic-index-set/1" + b"s").digest(), "little"))
    keys = gen.random_raw(5000)
    want = np.sort(np.lexsort((np.arange(5000), keys))[:321])
    old = vl._INDEX_BLOCK
    try:
        vl._INDEX_BLOCK = 777  # several blocks
        assert np.array_equal(draw_index_set(b"s", 5000, 321), want)
    finally:
        vl._INDEX_BLOCK = old
    assert np.array_equal(draw_index_set(b"s", 5000, 321), want)


def test_ties_at_the_cut_off_go_to_the_smaller_positions():
    keys = np.array([5, 1, 5, 5, 0, 5], np.uint64)
    pos = np.array([10, 11, 12, 13, 14, 15], np.int64)
    k, p = smallest_pairs(keys, pos, 4)
    assert sorted(p.tolist()) == [10, 11, 12, 14] and sorted(k.tolist()) == [0, 1, 5, 5]
    assert smallest_pairs(keys, pos, 9)[1].tolist() == pos.tolist()


def test_the_digest_changes_with_the_fraction():
    seed = index_seed("task", 1, MODEL, b"n" * 16)
    digests = {_layout(seed, c).digest() for c in ("topk:0.05", "topk:0.1", "raw")}
    assert len(digests) == 3
    assert _layout(seed, "raw").length == P + 3 and not _layout(seed, "raw").sparse
    assert index_fraction_of(_spec("topk:0.1")) == 0.1
    assert index_fraction_of(_spec("topk:0.1+int8")) == 0.0  # refused by codec_wire.spec_problems
    with pytest.raises(SecAggConfigError, match="index_fraction"):
        VectorLayout((("a", 3),), Quantizer(clip=1.0, bits=8), index_fraction=1.5)


def test_decode_is_the_weighted_mean_on_the_set_and_zero_elsewhere():
    rng = np.random.default_rng(7)
    layout = _layout(index_seed("task", 2, MODEL, b"k" * 16), "topk:0.1")
    deltas = {c: {n: rng.uniform(-0.5, 0.5, s).astype(np.float32) for n, s in zip(NAMES, SHAPES)} for c in COHORT}
    samples = dict(zip(COHORT, (12, 700, 45, 3000)))
    acc = dict(zip(COHORT, (0.5, 0.7, 0.9, 0.6)))
    updates = {c: layout.encode(deltas[c], weight=layout.weight_of(samples[c]), metrics={"accuracy": acc[c]})
               for c in COHORT}
    assert all(u.shape == (layout.length,) for u in updates.values())
    params = SessionParams("task", 2, COHORT, MODEL, layout.length, quantizer=layout.quantizer,
                           layout_digest=layout.digest())
    got = layout.decode(run_round(params, updates).quantized_sum)
    keep = np.zeros(P, bool)
    keep[layout.index_set()] = True
    total = sum(samples.values())
    offset = 0
    for name, shape in zip(NAMES, SHAPES):
        size = int(np.prod(shape))
        mask = keep[offset:offset + size]
        plain = sum(samples[c] * deltas[c][name].astype(np.float64).ravel() for c in COHORT) / total
        mean = got.tensors[name]
        assert np.abs(mean[mask] - plain[mask]).max(initial=0.0) <= layout.error_bound(), name
        assert np.all(mean[~mask] == 0.0), name  # not rescaled by 1/F, not decoded as -clip
        offset += size
    assert abs(got.metrics["accuracy"] - sum(samples[c] * acc[c] for c in COHORT) / total) \
        <= layout.metric_error_bound()


def test_error_feedback_carries_the_unsent_coordinates():
    ef = ErrorFeedback("topk:0.1")
    x = np.arange(10, dtype=np.float32)
    y = ef.with_residual("w", x)
    sent = np.zeros(10, bool)
    sent[[1, 4]] = True
    ef.stage("w", np.where(sent, 0, y).astype(np.float32))
    ef.commit()
    y2 = ef.with_residual("w", np.ones(10, np.float32))
    assert np.array_equal(y2, np.where(sent, 1.0, x + 1.0))
    assert ef.with_residual("w", np.ones(3, np.float32)).tolist() == [1, 1, 1]  # model changed: residual dropped
