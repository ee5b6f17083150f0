"""Distributed DP through whole in-process secure-aggregation sessions (fedclinic.secagg.inprocess): each site encodes
its update with its own Skellam share, the sessions run every phase with and without a dropout, and the unmasked,
decoded mean carries noise of exactly the planned variance ``m mu_site / (gamma m)^2`` for ``m`` survivors -- the
dropped site's share is gone, the survivors' shares suffice, and nothing is added after unmasking.

Statistics: with zero updates the decoded mean times ``gamma m`` *is* the survivors' noise sum, ``Skellam(m mu_site)``
per value, i.i.d. over values and sessions. Over ``n`` = 5 sessions x 4000 values, the sample variance's standard
error is ``sqrt((V + 2 V^2) / n)`` (Skellam's fourth central moment is ``V + 3 V^2``); the bounds are 5.3 standard
errors (normal approximation, two-sided false-failure probability 1.2e-7), with fixed keys so each run is
deterministic. A site that added no noise (or an aggregator that added its own) moves the variance by a factor
4/3 or more, i.e. by > 60 standard errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedclinic.privacy.secure_random import SecureRandom
from fedclinic.privacy.skellam_noise import skellam_noise
from fedclinic.proto import task_pb2
from fedclinic.secagg import Phase
from fedclinic.secagg.inprocess import run_round
from fedclinic.secagg.task_config import floor_of, layout_for, session_params

Z = 5.3
VALUES = 4000
SESSIONS = 5
COHORT = ("site-a", "site-b", "site-c", "site-d")


def _spec() -> task_pb2.TaskSpec:
    spec = task_pb2.TaskSpec(name="ddp", family="text-classification", dataset="d", strategy="fedavg")
    spec.rounds.num_rounds, spec.rounds.min_sites = 4, 3
    spec.secure_aggregation.enabled, spec.secure_aggregation.weighting = True, "uniform"
    spec.privacy.level, spec.privacy.target_epsilon, spec.privacy.target_delta = "distributed", 3.0, 1e-5
    spec.privacy.max_grad_norm = 0.5
    return spec


def _session(spec, layout, updates, rng, *, drop=None, seed: int):
    params = session_params(spec, task_id="ddp", round_number=seed, cohort=COHORT, model_hash_hex="00" * 32,
                            vector_length=layout.length, quantizer=layout.quantizer, layout_digest=layout.digest())
    inputs = {c: layout.encode({"w": updates[c]}, weight=1, dp_random=rng,
                               dp_noise=skellam_noise(rng, layout.dp.site_variance, layout.values)) for c in COHORT}
    result = run_round(params, inputs, drop=drop, min_cohort=floor_of(spec))
    return result, layout.decode(result.quantized_sum)


@pytest.mark.parametrize("drop,survivors", [(None, 4), ({Phase.MASKED_INPUT: ["site-d"]}, 3),
                                            ({Phase.UNMASK: ["site-b"]}, 4)])
def test_the_unmasked_mean_carries_exactly_the_survivors_noise(drop, survivors):
    spec = _spec()
    layout = layout_for(spec, ("w",), ((VALUES,),), len(COHORT))
    dp = layout.dp
    assert dp is not None and layout.metric_names == () and layout.quantizer.weight_cap == 1
    rng = SecureRandom(key=f"sessions-{survivors}-{bool(drop)}".encode().ljust(32, b"."))
    zeros = {c: np.zeros(VALUES, np.float32) for c in COHORT}
    noise = []
    for s in range(SESSIONS):
        result, decoded = _session(spec, layout, zeros, rng, drop=drop, seed=s + 1)
        assert len(result.survivors) == survivors and decoded.tensor_weights["w"] == survivors
        scaled = decoded.tensors["w"].astype(np.float64) * dp.scale * survivors
        # integers: nothing was added after unmasking
        np.testing.assert_allclose(scaled, np.round(scaled), atol=1e-3 * np.abs(scaled).max())
        noise.append(np.round(scaled))
    x = np.concatenate(noise)
    v, n = survivors * dp.site_variance, x.size
    assert abs(x.mean()) <= Z * math.sqrt(v / n)
    assert abs(x.var() - v) <= Z * math.sqrt((v + 2 * v * v) / n), (x.var() / v, survivors)
    # in update units: the planned per-value variance of the released mean, m mu_site / (gamma m)^2
    assert dp.noise_stddev(survivors) ** 2 == pytest.approx(v / (dp.scale * survivors) ** 2)


def test_the_fewest_survivors_meet_the_target_and_known_updates_come_through():
    spec = _spec()
    layout = layout_for(spec, ("w",), ((VALUES,),), len(COHORT))
    dp = layout.dp
    sens = dp.sensitivity
    floor = floor_of(spec)
    assert floor == 3
    assert sens.epsilon([floor * dp.site_variance] * 4, 1e-5) == pytest.approx(3.0, rel=1e-6)
    assert sens.epsilon([4 * dp.site_variance] * 4, 1e-5) < 3.0  # a round with all four adds noise, spends less
    gen = np.random.default_rng(7)
    updates = {}
    for c in COHORT:
        u = gen.normal(size=VALUES).astype(np.float32)
        updates[c] = u * (2.0 if c == "site-a" else 0.2) / np.linalg.norm(u)  # site-a is above the clip norm 0.5
    rng = SecureRandom(key=b"known".ljust(32, b"."))
    result, decoded = _session(spec, layout, updates, rng, drop={Phase.MASKED_INPUT: ["site-c"]}, seed=9)
    kept = [c for c in COHORT if c != "site-c"]
    clipped = [updates[c] * min(1.0, 0.5 / float(np.linalg.norm(updates[c]))) for c in kept]
    err = decoded.tensors["w"].astype(np.float64) - np.mean(clipped, axis=0)
    sd = dp.noise_stddev(3)
    assert abs(err.mean()) <= Z * sd / math.sqrt(VALUES) + 1 / dp.scale
    assert abs(err.var() / sd ** 2 - 1) <= Z * math.sqrt(2 / VALUES) + 0.01  # + the rounding's share (< 1/4 step^2)
