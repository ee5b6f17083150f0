"""The site policy of non-training work: min_cell_rows, allow_evaluation, allow_statistics (defaults, and a bad
value named with what to write); and the task kinds a spec may carry."""

from __future__ import annotations

import pytest

from fedclinic.errors import ConfigError
from fedclinic.spec.task import Task
from hospital_agent.config import AgentConfig

from tests.helpers.agent_toml import AGENT_TOML

AGENT = AGENT_TOML + '''[datasets.notes]
path = "notes.jsonl"
'''


def _load(tmp_path, policy: str = "") -> AgentConfig:
    (tmp_path / "agent.toml").write_text(AGENT + ("[policy]\n" + policy if policy else ""))
    return AgentConfig.load(tmp_path / "agent.toml")


def test_defaults_allow_both_kinds_with_k_10(tmp_path):
    p = _load(tmp_path).policy
    assert (p.min_cell_rows, p.allow_evaluation, p.allow_statistics) == (10, True, True)
    p = _load(tmp_path, "min_cell_rows = 25\nallow_evaluation = false\nallow_statistics = false\n").policy
    assert (p.min_cell_rows, p.allow_evaluation, p.allow_statistics) == (25, False, False)


@pytest.mark.parametrize("policy, message", [
    ("min_cell_rows = 0\n", "min_cell_rows must be an integer 1-1000000"),
    ('min_cell_rows = "10"\n', "min_cell_rows must be an integer"),
    ('allow_evaluation = "no"\n', "allow_evaluation must be true or false"),
    ("allow_statistics = 1\n", "allow_statistics must be true or false"),
])
def test_a_bad_value_is_named(tmp_path, policy, message):
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, policy)


def test_task_kinds_and_the_evaluation_table():
    base = dict(name="x", dataset="notes", labels=["a", "b"])
    assert Task(**base).to_spec().kind == ""  # "train" travels as the default ""
    spec = Task(**base, kind="statistics").to_spec()
    assert spec.kind == "statistics"
    for kw, message in ((dict(kind="predict"), 'kind must be "train", "evaluate" or "statistics"'),
                        (dict(evaluation={"model_task": "t-1"}), 'needs kind = "evaluate"'),
                        (dict(kind="evaluate", evaluation={"modeltask": "t-1"}), "unknown setting 'modeltask'"),
                        (dict(kind="evaluate", evaluation={"timeout_s": -1}), "timeout_s")):
        with pytest.raises(ConfigError, match=message):
            Task(**base, **kw).validate()
