"""A site of a distributed-DP task reads the session's noise plan from the setup and checks it against its own plan
from the signed task: the aggregator's layout is accepted (same digest) and the site's input carries its noise; a
setup without noise, with less noise or with another scale is refused, and a plain task refuses a noisy setup."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from aggregator_service.distributed_dp import setup_fields
from fedclinic.proto import agent_pb2, task_pb2
from fedclinic.secagg import SecAggError
from fedclinic.secagg.skellam_encoding import signed
from fedclinic.secagg.task_config import layout_for
from hospital_agent.secure_aggregation import _encode, _Job, _layout_of

MODEL = hashlib.sha256(b"m").hexdigest()
NAMES, SHAPES, SIZES = ("w", "b"), ((40, 5), (3,)), (200, 3)


def _spec(level: str = "distributed") -> task_pb2.TaskSpec:
    spec = task_pb2.TaskSpec(name="t", family="text-classification", dataset="d", strategy="fedavg")
    spec.rounds.num_rounds, spec.rounds.min_sites = 2, 3
    spec.secure_aggregation.CopyFrom(task_pb2.SecureAggregationConfig(enabled=True, weighting="uniform"))
    if level:
        spec.privacy.CopyFrom(task_pb2.PrivacyConfig(level=level, target_epsilon=2.0, target_delta=1e-5,
                                                     max_grad_norm=0.5))
    return spec


def _setup(spec: task_pb2.TaskSpec, **override) -> tuple[agent_pb2.SecAggSetup, object]:
    layout = layout_for(spec, NAMES, SHAPES, 3)
    q = layout.quantizer
    fields = {**setup_fields(layout), **override}
    return agent_pb2.SecAggSetup(
        cohort=["a", "b", "c"], clip=q.clip, bits=q.bits, rounding=q.rounding, vector_length=layout.length,
        tensor_order=list(NAMES), model_hash=MODEL, nonce=b"n" * 16, ring_bits=q.ring_bits, weight_cap=q.weight_cap,
        metric_clip=layout.metric_clip, metric_bits=layout.metric_bits, **fields), layout


def _job(spec: task_pb2.TaskSpec) -> _Job:
    return _Job("t", 1, 1, MODEL, NAMES, np.zeros(203, np.float32), SIZES, frozenset(NAMES), 10,
                metrics={"accuracy": 0.9}, spec=spec)


def test_the_site_builds_the_aggregators_layout_and_adds_its_noise():
    spec = _spec()
    setup, theirs = _setup(spec)
    assert setup.dp_mechanism == "skellam" and setup.dp_site_variance > 0
    job = _job(spec)
    job.layout = _layout_of(job, setup)
    assert job.layout.digest() == theirs.digest()
    a, b = _encode(job), _encode(job)
    assert a.shape == (204,) and a[-1] == 1  # 203 noised values and a count of one; no metric slots
    noise = signed(a[:203], job.layout.dp.ring_bits).astype(np.float64)  # a zero update: only the noise
    assert noise.std() > 0.3 * np.sqrt(job.layout.dp.site_variance) and not np.array_equal(a, b)


@pytest.mark.parametrize("override,why", [
    ({"dp_mechanism": ""}, "asks for distributed DP .* adds no noise"),
    ({"dp_site_variance": 1.0}, "needs at least"),
    ({"dp_scale": 3.0}, "scale"),
    ({"dp_clip_norm": 5.0}, "clip norm"),
])
def test_a_setup_that_weakens_the_plan_is_refused(override, why):
    spec = _spec()
    setup, _ = _setup(spec, **override)
    with pytest.raises(SecAggError, match=why):
        _layout_of(_job(spec), setup)


def test_a_plain_task_refuses_a_noisy_setup():
    noisy, _ = _setup(_spec())
    with pytest.raises(SecAggError, match="does not plan"):
        _layout_of(_job(_spec(level="")), noisy)
