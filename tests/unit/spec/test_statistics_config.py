"""``[statistics] epsilon``: parsed from task.toml into TaskSpec.statistics, bounded by the one validator."""

from __future__ import annotations

import math

import pytest

from fedclinic.errors import ConfigError
from fedclinic.proto import task_pb2
from fedclinic.spec.task import Task
from fedclinic.spec.validation import definition_problems


def _task(**statistics) -> Task:
    return Task(name="s", dataset="notes", labels=["a", "b"], statistics=statistics)


def test_epsilon_travels_in_the_spec_and_defaults_to_no_noise(tmp_path):
    (tmp_path / "task.toml").write_text('name = "s"\ndataset = "notes"\nlabels = ["a", "b"]\n'
                                        '[statistics]\nepsilon = 0.5\n')
    assert Task.from_toml(tmp_path / "task.toml").to_spec().statistics.epsilon == 0.5
    assert _task().to_spec().statistics.epsilon == 0.0
    assert not Task(name="s", dataset="notes", labels=["a", "b"]).to_spec().statistics.epsilon


@pytest.mark.parametrize("statistics, message", [
    ({"epsilon": 1000.0}, "statistics.epsilon must be a finite number from 0.01 to 100"),
    ({"epsilon": 0.001}, "statistics.epsilon must be"),
    ({"epsilon": -1}, "statistics.epsilon must be"),
    ({"epsilon": math.nan}, "statistics.epsilon must be"),
    ({"epsilon": "high"}, "statistics: epsilon must be a number"),
    ({"epsilon": True}, "statistics: epsilon must be a number"),
    ({"delta": 1e-5}, "statistics: unknown setting 'delta'"),
])
def test_bad_settings_are_refused_with_what_to_do(statistics, message):
    with pytest.raises(ConfigError, match=message):
        _task(**statistics).validate()


def test_the_aggregator_and_the_sites_check_the_same_bound():
    spec = task_pb2.TaskSpec(name="s", family="text-classification", dataset="notes",
                             statistics=task_pb2.StatisticsConfig(epsilon=500.0))
    assert any("statistics.epsilon" in p for p in definition_problems(spec))
    spec.statistics.epsilon = 2.0
    assert not any("statistics" in p for p in definition_problems(spec))
