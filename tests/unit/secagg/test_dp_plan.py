"""Privacy level "distributed": what the one spec validator refuses (the SDK's Task and the aggregator's submit check
run it), the plan both sides derive from the spec, and a site's check of a session's noise against its own plan."""

from __future__ import annotations

import re

import pytest

from fedclinic.errors import ConfigError
from fedclinic.proto import task_pb2
from fedclinic.secagg import SecAggRefusal, dp_plan
from fedclinic.secagg.task_config import floor_of, layout_for
from fedclinic.spec.validation import definition_problems

from tests.helpers.tasks import make_task

PRIVACY = {"level": "distributed", "target_epsilon": 4.0, "max_grad_norm": 0.5}
SECURE = {"enabled": True, "weighting": "uniform"}


def _problems(**kw) -> str:
    with pytest.raises(ConfigError) as info:
        make_task(**kw).validate()
    return str(info.value)


def test_a_sound_distributed_task_is_accepted_and_its_spec_carries_the_plan():
    task = make_task(privacy={**PRIVACY, "scale": 1024.0, "rounding_beta": 0.25, "mechanism": "skellam"},
                     secure_aggregation=SECURE)
    task.validate()
    spec = task.to_spec()
    assert spec.privacy.scale == 1024.0 and spec.privacy.rounding_beta == 0.25
    assert spec.privacy.mechanism == "skellam" and not definition_problems(spec)


@pytest.mark.parametrize("kw,why", [
    (dict(privacy=PRIVACY), "set \\[secure_aggregation\\] enabled = true"),
    (dict(privacy=PRIVACY, secure_aggregation={"enabled": True}), 'weighting = "uniform".*sensitivity bound'),
    (dict(privacy=PRIVACY, secure_aggregation={"enabled": True, "weighting": "samples"}), 'weighting = "uniform"'),
    (dict(privacy=PRIVACY, secure_aggregation=SECURE, codec="topk:0.1"), "needs update codec 'raw'"),
    (dict(privacy=PRIVACY, secure_aggregation=SECURE, codec="int8"), "needs update codec 'raw'"),
    (dict(privacy={**PRIVACY, "noise_multiplier": 1.0}, secure_aggregation=SECURE), "not both"),
    (dict(privacy={**PRIVACY, "mechanism": "gaussian"}, secure_aggregation=SECURE), "mechanism must be one of"),
    (dict(privacy={**PRIVACY, "rounding_beta": 1.0}, secure_aggregation=SECURE), "rounding_beta"),
    (dict(privacy=PRIVACY, secure_aggregation=SECURE, strategy="dp-fedavg"), 'strategy "dp-fedavg" would clip'),
])
def test_refusals_at_submit(kw, why):
    problems = _problems(**kw)
    assert re.search(why, problems), problems


def test_the_aggregator_runs_the_same_validator_on_a_spec_no_sdk_checked():
    spec = task_pb2.TaskSpec(name="t", family="text-classification", dataset="d", strategy="fedavg")
    spec.privacy.level, spec.privacy.target_epsilon, spec.privacy.max_grad_norm = "distributed", 2.0, 1.0
    spec.secure_aggregation.enabled = True
    assert any('weighting = "uniform"' in p for p in definition_problems(spec))


def _spec(**privacy) -> task_pb2.TaskSpec:
    spec = task_pb2.TaskSpec(name="t", family="text-classification", dataset="d", strategy="fedavg")
    spec.rounds.num_rounds, spec.rounds.min_sites = 3, 3
    spec.secure_aggregation.enabled, spec.secure_aggregation.weighting = True, "uniform"
    spec.privacy.level, spec.privacy.target_delta, spec.privacy.max_grad_norm = "distributed", 1e-5, 1.0
    spec.privacy.target_epsilon = 2.0
    for k, v in privacy.items():
        setattr(spec.privacy, k, v)
    return spec


def test_the_plan_is_made_for_the_fewest_survivors_and_drops_the_metric_slots():
    spec = _spec()
    spec.secure_aggregation.min_cohort = 4
    assert floor_of(spec) == 4
    layout = layout_for(spec, ("w", "b"), ((300,), (20,)), 6, ("accuracy",))
    assert layout.metric_names == () and layout.dp is not None and layout.dp.values == 320
    assert layout.dp.site_variance == dp_plan.site_variance(spec, 320, 4)
    eps = dp_plan.epsilon_after(spec, 320, 4, [4, 4, 4])
    assert eps == pytest.approx(2.0, rel=1e-6) and eps <= 2.0
    assert dp_plan.epsilon_after(spec, 320, 4, [6, 5, 4]) < eps


def test_a_site_refuses_less_noise_or_another_encoding_than_its_signed_task_plans():
    spec = _spec()
    mu = dp_plan.site_variance(spec, 500, 3)
    ok = dict(mechanism="skellam", scale=dp_plan.scale_of(spec, 500), clip_norm=1.0, beta=dp_plan.beta_of(spec))
    dp_plan.check_setup(spec, 500, 3, site_variance_told=mu, **ok)
    dp_plan.check_setup(spec, 500, 3, site_variance_told=2 * mu, **ok)  # more noise only helps the privacy
    with pytest.raises(SecAggRefusal, match="needs at least"):
        dp_plan.check_setup(spec, 500, 3, site_variance_told=0.9 * mu, **ok)
    with pytest.raises(SecAggRefusal, match="clip norm"):
        dp_plan.check_setup(spec, 500, 3, site_variance_told=mu, **{**ok, "clip_norm": 2.0})
    with pytest.raises(SecAggRefusal, match="scale"):
        dp_plan.check_setup(spec, 500, 3, site_variance_told=mu, **{**ok, "scale": ok["scale"] * 2})
    with pytest.raises(SecAggRefusal, match="mechanism"):
        dp_plan.check_setup(spec, 500, 3, site_variance_told=mu, **{**ok, "mechanism": "gaussian"})
