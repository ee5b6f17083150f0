"""fedclinic experiment: config checks, a real tiny grid in worker processes, resume, report."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from fedclinic.cli import main
from fedclinic.errors import ConfigError
from fedclinic.federation.experiment import PRESETS, load_experiment, report, run_experiment

TINY = """
[experiment]
name = "tiny"
rounds = 2
seeds = [0, 1]
workers = 2

[data.s]
kind = "synthetic"
alpha = 0.5
beta = 0.5
num_clients = 5
data_seed = 3

[defaults]
local_epochs = 1
batch_size = 10
clients_per_round = 3
learning_rate = 0.01
max_grad_norm = 0.0

[algorithms.FedAvg]
paper = { max_accuracy = 0.5, min_loss = 1.0 }

[algorithms.FedPA]
proximal_mu = 0.03
strategy_params = { server_lr = 2.0 }
"""


def _config(tmp_path, text=TINY):
    path = tmp_path / "exp.toml"
    path.write_text(text)
    return path


def test_presets_map_to_strategy_and_optimizer(tmp_path):
    exp = load_experiment(_config(tmp_path), tmp_path / "out")
    by_name = {a.name: a for a in exp.algorithms}
    assert (by_name["FedAvg"].strategy, by_name["FedAvg"].train["optimizer"]) == ("fedavg", "sgd")
    assert by_name["FedAvg"].train["proximal_mu"] == 0.0
    assert (by_name["FedPA"].strategy, by_name["FedPA"].train["optimizer"], by_name["FedPA"].train["proximal_mu"]) == \
        ("fedatt", "sgd", 0.03)
    assert PRESETS["FedPAP"] == ("fedatt", "padam", True) and PRESETS["FedAvgS"] == ("fedavg", "self_adam", False)
    assert len(exp.runs()) == 4


@pytest.mark.parametrize("patch, match", [
    (("rounds = 2", "rounds = 0"), "experiment.rounds must be an integer >= 1"),
    (('kind = "synthetic"', 'kind = "mnist"'), "data.s.kind must be one of"),
    (("[algorithms.FedAvg]", "[algorithms.FedMagic]"), "FedMagic: not a preset"),
    (("proximal_mu = 0.03", "proximal_mu = -1"), "proximal_mu must be a finite number >= 0"),
    (("server_lr = 2.0", "server_lr = 2.0, granularity = \"layer\""), "granularity"),
    (("batch_size = 10", "batch_size = 10\nlocal_epoch = 3"), r"defaults: unknown setting\(s\) \['local_epoch'\]"),
])
def test_config_errors_are_reported_with_the_setting(tmp_path, patch, match):
    with pytest.raises(ConfigError, match=match):
        load_experiment(_config(tmp_path, TINY.replace(*patch)))


def test_grid_runs_writes_csv_plot_summary_and_resumes(tmp_path):
    exp = load_experiment(_config(tmp_path), tmp_path / "out")
    logs: list[str] = []
    rows = run_experiment(exp, log=logs.append)
    assert len(rows) == 2 * 2 * 2 and "4 to run" in logs[0]
    out = tmp_path / "out"
    assert (out / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(out / "rounds.csv") as fh:
        table = list(csv.DictReader(fh))
    assert {r["algorithm"] for r in table} == {"FedAvg", "FedPA"}
    assert all(0 <= float(r["accuracy"]) <= 1 and float(r["loss"]) > 0 for r in table)
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["runs"]) == 4
    # the same seed gives the same run; a different seed a different one
    fedavg = {r["seed"]: [(x["accuracy"], x["loss"]) for x in rows
                          if x["algorithm"] == "FedAvg" and x["seed"] == r["seed"]] for r in rows}
    assert fedavg[0] != fedavg[1]
    # resume: a finished grid runs nothing; a deleted run is redone identically
    victim = out / "runs" / "s__FedAvg__seed1.csv"
    before = victim.read_text()
    victim.unlink()
    logs.clear()
    run_experiment(exp, log=logs.append)
    assert "3 already done, 1 to run" in logs[0]
    after = victim.read_text().splitlines()
    assert [line.rsplit(",", 1)[0] for line in after] == [line.rsplit(",", 1)[0] for line in before.splitlines()]
    md = report(out)
    assert "| FedAvg |" in md and "| 0.50 |" in md and "| FedPA |" in md


def test_cli_run_and_report(tmp_path, capsys):
    import torch

    one_seed = _config(tmp_path, TINY.replace("seeds = [0, 1]", "seeds = [0]").replace("rounds = 2", "rounds = 1"))
    threads = torch.get_num_threads()
    assert main(["experiment", "run", str(one_seed), "--output", str(tmp_path / "o"), "--workers", "1"]) == 0
    assert torch.get_num_threads() == threads  # one worker runs here, and gives torch's threads back
    out = capsys.readouterr().out
    assert "[2/2]" in out and "| algorithm | max accuracy |" in out
    assert main(["experiment", "report", str(tmp_path / "o")]) == 0
    assert main(["experiment", "report", str(tmp_path / "missing")]) == 2
    assert "run `fedclinic experiment run CONFIG.toml` first" in capsys.readouterr().err


def test_simulate_keeps_each_sites_optimizer_state_and_evaluates_named_sets():
    from fedclinic.assets.synthetic import synthetic
    from fedclinic.models.feature_classification import build, encode_features, package_feature_model
    from fedclinic.federation.simulate import simulate
    from fedclinic.training.trainer import TrainConfig

    pkg = package_feature_model(num_features=60, labels=[str(i) for i in range(10)])
    model = build(pkg)
    clients = synthetic(0.5, 0.5, num_clients=3, seed=1)
    sites = [encode_features(c.x_train, c.y_train, model) for c in clients]
    test = encode_features(np.concatenate([c.x_test for c in clients]), np.concatenate([c.y_test for c in clients]),
                           model)
    runs = {}
    for policy in ("reset", "keep"):
        cfg = TrainConfig(local_epochs=1, batch_size=10, learning_rate=0.01, optimizer="self_adam", max_grad_norm=0,
                          optimizer_state=policy)
        runs[policy] = simulate(pkg, sites, rounds=2, train=cfg, eval_data={"test": test})
        assert set(runs[policy].rounds[0].metrics) >= {"test/accuracy", "test/loss", "test/n"}
    # round 1 is identical (nothing kept yet); round 2 differs because moments carried over
    r1 = [r.rounds[0].metrics["test/loss"] for r in runs.values()]
    r2 = [r.rounds[1].metrics["test/loss"] for r in runs.values()]
    assert r1[0] == r1[1] and r2[0] != r2[1]


FILES_GRID = """
[experiment]
name = "own-files"
rounds = 2
seeds = [0]
workers = 1

[data.notes]
kind = "files"
task = "task.toml"
sites = { a = "a.jsonl", b = "b.jsonl", c = "c.csv" }
test = "test.jsonl"

[algorithms.FedAvg]
learning_rate = 0.1

[algorithms.FedProx]
learning_rate = 0.1
proximal_mu = 0.01
"""


def test_files_kind_runs_a_grid_over_jsonl_and_csv_sites(tmp_path, capsys):
    """A 2-cell grid (two algorithms, one seed) over three site files, read as an agent reads them; the test
    accuracy is the global model's on the test file, as a direct simulation over the same rows computes it."""
    from fedclinic.federation.experiment import run_one
    from tests.helpers.own_files import own_files

    own_files(tmp_path)
    config = _config(tmp_path, FILES_GRID)
    assert main(["experiment", "run", str(config), "--output", str(tmp_path / "out")]) == 0
    assert "[2/2]" in capsys.readouterr().out
    with open(tmp_path / "out" / "rounds.csv") as fh:
        table = list(csv.DictReader(fh))
    assert [(r["data"], r["algorithm"], r["round"]) for r in table] == [
        ("notes", "FedAvg", "1"), ("notes", "FedAvg", "2"), ("notes", "FedProx", "1"), ("notes", "FedProx", "2")]
    exp = load_experiment(config, tmp_path / "out")
    again = run_one("notes", exp.data["notes"], exp.algorithms[0], 0, 2)
    assert [float(r["accuracy"]) for r in table[:2]] == [r["accuracy"] for r in again]


@pytest.mark.parametrize("patch, match", [
    (('sites = { a = "a.jsonl", b = "b.jsonl", c = "c.csv" }', 'sites = "a.jsonl"'), "data.notes.sites must be a table"),
    (('test = "test.jsonl"', 'test = "test.jsonl"\nshuffle = true'), r"unknown setting\(s\) \['shuffle'\]"),
    (('c = "c.csv"', 'c = "missing.csv"'), "missing.csv: file not found"),
])
def test_files_kind_errors_name_the_setting(tmp_path, patch, match):
    from tests.helpers.own_files import own_files

    own_files(tmp_path)
    with pytest.raises(ConfigError, match=match):
        load_experiment(_config(tmp_path, FILES_GRID.replace(*patch)))


def test_files_kind_reports_a_bad_row_before_any_run(tmp_path):
    from tests.helpers.own_files import own_files

    own_files(tmp_path)
    (tmp_path / "b.jsonl").write_text('{"text": "aura", "label": "neuro"}\n{"text": "", "label": "neuro"}\n')
    with pytest.raises(ConfigError, match=r"data\.notes: .*b\.jsonl: row 2: empty text in field 'text'"):
        load_experiment(_config(tmp_path, FILES_GRID))
