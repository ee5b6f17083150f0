"""Privacy accounting: the issue's golden values, noise calibration, task plans and resumable state."""

from __future__ import annotations

import math

import pytest

from fedclinic.errors import ConfigError
from fedclinic.privacy.accounting import TaskAccountant, epsilon_of, noise_for_target, plan_task


def test_golden_values_rdp_and_prv():
    history = [(1.5, 0.04, 2250)]
    assert epsilon_of(history, 1e-5, "rdp") == pytest.approx(7.329, abs=0.01)
    assert epsilon_of(history, 1e-5, "prv") == pytest.approx(6.777, abs=0.01)


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_noise_for_target_meets_the_target_tightly(accountant):
    sigma = noise_for_target(8.0, 1e-5, 0.04, 2250, accountant)
    eps = epsilon_of([(sigma, 0.04, 2250)], 1e-5, accountant)
    assert 8.0 - 0.01 <= eps <= 8.0
    assert epsilon_of([(sigma * 0.97, 0.04, 2250)], 1e-5, accountant) > 8.0  # a little less noise overspends


def test_more_steps_or_less_noise_spend_more():
    base = epsilon_of([(1.0, 0.01, 1000)], 1e-5)
    assert epsilon_of([(1.0, 0.01, 2000)], 1e-5) > base
    assert epsilon_of([(0.8, 0.01, 1000)], 1e-5) > base
    assert epsilon_of([], 1e-5) == 0.0


def test_plan_covers_every_round():
    plan = plan_task(num_examples=500, batch_size=20, local_epochs=2, rounds=5, delta=1e-5, target_epsilon=4.0)
    assert plan.sample_rate == pytest.approx(0.04)
    assert plan.steps_per_round == 2 * 25 and plan.total_steps == 250
    assert plan.planned_epsilon <= 4.0 + 1e-9
    one_round = plan_task(num_examples=500, batch_size=20, local_epochs=2, rounds=1, delta=1e-5, target_epsilon=4.0)
    assert one_round.noise_multiplier < plan.noise_multiplier  # fewer steps need less noise for the same target
    fixed = plan_task(num_examples=500, batch_size=20, local_epochs=2, rounds=5, delta=1e-5, noise_multiplier=1.1)
    assert fixed.noise_multiplier == 1.1 and fixed.planned_epsilon == pytest.approx(
        epsilon_of([(1.1, 0.04, 250)], 1e-5))


@pytest.mark.parametrize("kwargs, match", [
    (dict(target_epsilon=1.0, noise_multiplier=1.0), "either target_epsilon or noise_multiplier"),
    (dict(), "either target_epsilon or noise_multiplier"),
    (dict(target_epsilon=-1.0), "positive"),
    (dict(target_epsilon=1.0, accountant="gdp"), "unknown"),
    (dict(target_epsilon=1.0, delta=1.5), "delta must be in"),
    (dict(target_epsilon=1.0, num_examples=0), "empty"),
    (dict(noise_multiplier=0.0), "positive"),
])
def test_bad_plans_are_refused_clearly(kwargs, match):
    args = dict(num_examples=100, batch_size=10, local_epochs=1, rounds=3, delta=1e-5)
    args.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        plan_task(**args)


def test_task_accountant_composes_rounds_and_survives_a_restart():
    acc = TaskAccountant("rdp", 1e-5)
    for _ in range(3):
        acc.record(1.2, 0.05, 40)
    assert acc.history == [(1.2, 0.05, 120)]  # equal rounds merge into one entry
    acc.record(1.5, 0.05, 40)
    eps = acc.epsilon()
    assert eps == pytest.approx(epsilon_of([(1.2, 0.05, 120), (1.5, 0.05, 40)], 1e-5))
    restored = TaskAccountant.from_json(acc.to_json())
    assert restored == acc and restored.epsilon() == eps
    ahead = acc.with_steps(1.5, 0.05, 40)
    assert ahead.epsilon() > eps and acc.history[-1] == (1.5, 0.05, 40)  # the original is unchanged
    with pytest.raises(ConfigError, match="not valid JSON"):
        TaskAccountant.from_json('{"accountant": "rdp"}')
    assert math.isfinite(eps)
