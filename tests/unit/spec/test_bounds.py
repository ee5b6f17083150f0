"""Every number of a task is finite and within its bound (fedclinic.spec.validation.BOUNDS), refused with the same
message by ``Task`` (the SDK), by the spec validator on a raw proto (the aggregator at SubmitTask) and by the
agent's SpecGate."""

from __future__ import annotations

import math

import pytest

from fedclinic.errors import ConfigError
from fedclinic.proto import agent_pb2
from fedclinic.spec.task import Task
from fedclinic.spec.validation import BOUNDS, MAX_STRATEGY_PARAM, check_spec, definition_problems

from tests.helpers.tasks import make_task

INF, NAN = math.inf, math.nan

#: (Task field, spec path, hostile value): the issue's examples and each bound just past its edge
CASES = [
    ("round_timeout_s", "rounds.round_timeout_s", INF),
    ("round_timeout_s", "rounds.round_timeout_s", 1e300),
    ("round_timeout_s", "rounds.round_timeout_s", NAN),
    ("round_timeout_s", "rounds.round_timeout_s", 7 * 24 * 3600 + 1.0),
    ("num_rounds", "rounds.num_rounds", 10**9),
    ("num_rounds", "rounds.num_rounds", 1001),
    ("min_sites", "rounds.min_sites", 1001),
    ("min_sites", "rounds.min_sites", -1),
    ("max_round_retries", "rounds.max_round_retries", -1),
    ("max_round_retries", "rounds.max_round_retries", 101),
    ("participation_fraction", "rounds.participation_fraction", NAN),
    ("learning_rate", "training.learning_rate", INF),
    ("learning_rate", "training.learning_rate", NAN),
    ("learning_rate", "training.learning_rate", -0.1),
    ("learning_rate", "training.learning_rate", 11.0),
    ("batch_size", "training.batch_size", -8),
    ("batch_size", "training.batch_size", 65537),
    ("local_epochs", "training.local_epochs", -1),
    ("local_epochs", "training.local_epochs", 1001),
    ("max_length", "training.max_length", 32769),
    ("max_length", "training.max_length", -16),
    ("max_steps", "training.max_steps", -1),
    ("max_steps", "training.max_steps", 10_000_001),
    ("weight_decay", "training.weight_decay", INF),
    ("weight_decay", "training.weight_decay", -0.1),
    ("max_grad_norm", "training.max_grad_norm", NAN),
    ("proximal_mu", "training.proximal_mu", 1e300),
    ("safl_profile_samples", "update.safl_profile_samples", 100_001),
]


def _spec_with(path: str, value):
    spec = make_task().to_spec()
    section, name = path.split(".")
    setattr(getattr(spec, section), name, value)
    return spec


@pytest.mark.parametrize("field,path,value", CASES)
def test_task_refuses_each_number_out_of_bounds(field, path, value):
    with pytest.raises(ConfigError) as exc:
        make_task(**{field: value}).validate()
    assert f"{path} must be a" in str(exc.value) and "got" in str(exc.value)


@pytest.mark.parametrize("field,path,value", [c for c in CASES if not (BOUNDS[c[1]].integer and abs(c[2]) >= 2**31)])
def test_the_raw_spec_is_refused_with_the_same_message(field, path, value):
    """The proto path (what the aggregator checks at SubmitTask and a site's SpecGate on an assignment)."""
    spec = _spec_with(path, value)
    with pytest.raises(ConfigError) as raw:
        check_spec(spec)
    with pytest.raises(ConfigError) as sdk:
        make_task(**{field: value}).validate()
    ours = [p for p in definition_problems(spec) if p.startswith(path)]
    assert len(ours) == 1 and ours[0] in str(raw.value) and ours[0] in str(sdk.value)


@pytest.mark.parametrize("field", ["num_rounds", "batch_size"])
def test_a_float_or_string_for_a_whole_number_is_refused_not_raised(field):
    for value in (1e10, 2.5, "5"):
        with pytest.raises(ConfigError, match=f"{field} must be a whole number"):
            make_task(**{field: value}).validate()


def test_seed_out_of_64_bits_is_refused():
    with pytest.raises(ConfigError, match="seed must be a whole number"):
        make_task(seed=1 << 64).validate()


@pytest.mark.parametrize("value", [INF, -INF, NAN, MAX_STRATEGY_PARAM * 10, -1e300])
@pytest.mark.parametrize("strategy,param", [("fedavg", "server_lr"), ("multi-krum", "byzantine")])
def test_strategy_params_must_be_finite_and_bounded(strategy, param, value):
    with pytest.raises(ConfigError, match=f"strategy parameter '{param}' must be a finite number"):
        make_task(strategy=strategy, strategy_params={param: value}).validate()
    spec = make_task().to_spec()
    spec.strategy, spec.strategy_params[param] = strategy, value
    with pytest.raises(ConfigError, match=f"strategy parameter '{param}' must be a finite number"):
        check_spec(spec)


@pytest.mark.parametrize("path,value", [("secure_aggregation.min_cohort", 10**9), ("secure_aggregation.degree", 10**6),
                                        ("secure_aggregation.threshold", 10**6), ("secure_aggregation.bits", 63),
                                        ("secure_aggregation.clip", INF), ("privacy.target_epsilon", INF),
                                        ("privacy.noise_multiplier", 1e300)])
def test_secure_aggregation_and_privacy_numbers_are_bounded(path, value):
    spec = _spec_with(path, value)
    spec.secure_aggregation.enabled = path.startswith("secure")
    assert any(p.startswith(f"{path} must be a") for p in definition_problems(spec))


def test_proto_zero_means_the_default_but_task_zero_is_refused():
    spec = make_task().to_spec()
    spec.training.batch_size = spec.training.local_epochs = spec.training.max_length = 0
    spec.training.learning_rate = 0
    assert not [p for p in definition_problems(spec) if p.startswith("training.")]
    with pytest.raises(ConfigError, match="training.batch_size must be a whole number from 1 to 65536, got 0"):
        make_task(batch_size=0).validate()


def test_values_at_the_bounds_pass():
    make_task(num_rounds=1000, min_sites=1000, round_timeout_s=7 * 24 * 3600, learning_rate=10.0, batch_size=65536,
              local_epochs=1000, max_length=32768, max_round_retries=100, strategy_params={"server_lr": 1e6}).validate()


def test_the_sites_spec_gate_refuses_the_same_numbers():
    from hospital_agent.gates import SpecGate
    from fedclinic.transport.wire import manifest_to_proto

    from tests.helpers.text_models import tiny_package

    a = agent_pb2.Assignment(task_id="t", round=1, spec=_spec_with("rounds.round_timeout_s", INF),
                             model=manifest_to_proto(tiny_package().manifest()))
    verdict = SpecGate().check(a)
    assert not verdict.proceed and verdict.permanent and "rounds.round_timeout_s must be a finite number" in verdict.reason
