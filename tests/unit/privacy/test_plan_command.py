"""``fedclinic privacy plan`` through the real command line: the table, the proposal, its task.toml fragment
(loaded by Task.from_toml) and its JSON, and a clear error for missing inputs."""

from __future__ import annotations

import json

import pytest

from fedclinic.cli import main
from fedclinic.spec.task import Task


def test_privacy_plan_table_and_toml(tmp_path, capsys):
    data = tmp_path / "site.jsonl"
    data.write_text("".join(json.dumps({"text": f"t{i}", "label": "a"}) + "\n" for i in range(60)) + "\n")
    frag = tmp_path / "privacy.toml"
    rc = main(["privacy", "plan", "--epsilon", "4", "--rows", "80", "--dataset", str(data), "--rounds", "3",
               "--params", "head=50", "--params", "layers=2000000", "--toml", str(frag)])
    out = capsys.readouterr().out
    assert rc == 0, out
    proposed = [line for line in out.splitlines() if line.startswith("*  ")]
    assert len(proposed) == 1 and proposed[0].split()[1:4] == ["head", "50", "full"], out
    assert "sites of 80, 60 rows" in out
    # the fragment completes a task file that loads and validates
    base = 'name = "t"\ndataset = "notes"\nlabels = ["a", "b"]\n'
    task_file = tmp_path / "task.toml"
    task_file.write_text(base + frag.read_text())
    task = Task.from_toml(task_file)
    assert task.privacy["sample_rate"] == 1.0 and task.privacy["target_epsilon"] == 4.0
    assert task.privacy["steps_per_round"] == 4  # ceil(60 / 16) steps of the whole smallest site
    assert (task.optimizer, task.learning_rate) == ("sgd", 2.0)


def test_privacy_plan_json(capsys):
    assert main(["privacy", "plan", "--epsilon", "8", "--rows", "1000", "--rounds", "2", "--params", "head=100",
                 "--json"]) == 0
    cands = json.loads(capsys.readouterr().out)
    assert [c["sampling"] for c in cands] == ["batch", "logical", "logical", "full"]  # 64, 256 < 1000 <= 1024
    assert sum(c["proposed"] for c in cands) == 1
    for c in cands:
        assert c["epsilon"] <= 8.0 and c["sites"][0]["rows"] == 1000
        assert c["snr"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--rows", "10"], "--model FOLDER"),
    (["--params", "head=5"], "row count"),
    (["--rows", "10", "--params", "head"], "NAME=COUNT"),
])
def test_privacy_plan_errors(argv, message, capsys):
    assert main(["privacy", "plan", "--epsilon", "8", "--rounds", "2", *argv]) == 2
    assert message in capsys.readouterr().err
