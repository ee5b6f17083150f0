"""The task's [secure_aggregation] settings of issue 17: weighting, weight cap and metric clip, their refusals, and
the layout (ring, metric precision) each session gets."""

from __future__ import annotations

import pytest

from fedclinic.errors import ConfigError
from fedclinic.secagg.task_config import layout_for, spec_problems
from fedclinic.spec.validation import check_spec

from tests.helpers.tasks import make_task


def _spec(**sa):
    return make_task(secure_aggregation={"enabled": True, **sa}).to_spec()


def test_the_aggregator_refuses_bad_weighting_settings_another_sdk_could_send():
    spec = _spec()
    spec.secure_aggregation.weighting = "by-loss"
    problems = " ".join(spec_problems(spec))
    assert 'weighting must be "samples" or "uniform", got \'by-loss\'' in problems
    with pytest.raises(ConfigError, match="weighting must be"):
        check_spec(spec)


def test_the_sdk_refuses_unknown_values_with_the_reason():
    with pytest.raises(ConfigError, match='weighting must be "samples" or "uniform"'):
        make_task(secure_aggregation={"enabled": True, "weighting": "by-loss"}).validate()
    with pytest.raises(ConfigError, match="metric_clip must be a number"):
        make_task(secure_aggregation={"enabled": True, "metric_clip": "1"}).validate()


@pytest.mark.parametrize("sa,cohort,ring,metric_bits", [
    ({}, 3, 64, 24),                                    # 20 bits x weights up to 65536
    ({"bits": 8, "weighting": "uniform"}, 3, 16, 14),   # int8, uniform: uint16 on the wire
    ({"bits": 8, "weighting": "uniform"}, 257, 16, 8),
    ({"bits": 8, "weighting": "uniform"}, 258, 32, 23),
    ({"bits": 8}, 3, 32, 14),                           # int8 with sample weights: uint32
    ({"bits": 12, "weight_cap": 16}, 10, 32, 24),
])
def test_each_session_gets_the_narrowest_ring_and_the_metric_precision_left(sa, cohort, ring, metric_bits):
    layout = layout_for(_spec(**sa), ("w",), ((4,),), cohort, ("accuracy",))
    assert (layout.quantizer.ring_bits, layout.metric_bits) == (ring, metric_bits)
    layout.check_cohort(cohort)
