"""A site reads a secure top-k session's layout from the setup: the fraction must be its own task's, and the index
set it derives from the setup's nonce is the aggregator's (same digest), so a setup that changes either is refused."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from fedclinic.proto import agent_pb2, task_pb2
from fedclinic.secagg import SecAggError
from fedclinic.secagg.task_config import layout_for
from fedclinic.secagg.vector_layout import index_seed
from hospital_agent.secure_aggregation import _encode, _Job, _layout_of

MODEL = hashlib.sha256(b"m").hexdigest()
NAMES, SHAPES = ("w", "b"), ((40, 5), (3,))


def _spec(codec: str) -> task_pb2.TaskSpec:
    spec = task_pb2.TaskSpec()
    spec.update.codec = codec
    spec.secure_aggregation.CopyFrom(task_pb2.SecureAggregationConfig(enabled=True, clip=0.5, bits=12))
    return spec


def _setup(spec: task_pb2.TaskSpec, nonce: bytes) -> tuple[agent_pb2.SecAggSetup, object]:
    layout = layout_for(spec, NAMES, SHAPES, 3, index_seed=index_seed("t", 1, bytes.fromhex(MODEL), nonce))
    q = layout.quantizer
    return agent_pb2.SecAggSetup(
        cohort=["a", "b", "c"], clip=q.clip, bits=q.bits, rounding=q.rounding, vector_length=layout.length,
        tensor_order=list(NAMES), model_hash=MODEL, nonce=nonce, ring_bits=q.ring_bits, weight_cap=q.weight_cap,
        metric_clip=layout.metric_clip, metric_bits=layout.metric_bits,
        index_fraction=layout.index_fraction if layout.sparse else 0.0), layout


def _job(fraction: float) -> _Job:
    vec = np.linspace(-0.4, 0.4, 203, dtype=np.float32)
    return _Job("t", 1, 1, MODEL, NAMES, vec, (200, 3), frozenset(NAMES), 10, index_fraction=fraction)


def test_the_site_derives_the_aggregators_index_set_and_sends_only_it():
    setup, theirs = _setup(_spec("topk:0.1"), b"n" * 16)
    job = _job(0.1)
    mine = _layout_of(job, setup)
    assert mine.digest() == theirs.digest() and np.array_equal(mine.index_set(), theirs.index_set())
    job.layout = mine
    assert _encode(job).shape == (21 + 1,)  # ceil(0.1 * 203) values + one count slot


def test_a_setup_with_another_fraction_is_refused():
    dense, _ = _setup(_spec("raw"), b"n" * 16)
    with pytest.raises(SecAggError, match="fraction 0 of the update's values .* task codec gives 0.1"):
        _layout_of(_job(0.1), dense)
    sparse, _ = _setup(_spec("topk:0.1"), b"n" * 16)
    with pytest.raises(SecAggError, match="fraction 0.1 .* gives 0"):
        _layout_of(_job(0.0), sparse)
