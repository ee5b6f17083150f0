"""``fedclinic simulate`` on a scientist's own JSONL/CSV files: the tables, the JSON figures against the shared
functions, the held-out split, the baselines' step rule and a bad site file's error."""

from __future__ import annotations

import json

import pytest

from fedclinic.cli import main
from fedclinic.errors import ConfigError
from fedclinic.federation.baselines import baseline_config
from fedclinic.federation.own_files import holdout_split, parse_site, planned_steps, read_rows, read_site
from fedclinic.spec.task import Task
from fedclinic.training.trainer import TrainConfig

from tests.helpers.own_files import own_files, write_jsonl
from tests.helpers.text_models import make_examples


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """One `fedclinic simulate` run over three sites (two JSONL with held-out rows, one CSV with its own EVAL
    file) and a shared test file: (files, stdout, stderr, JSON)."""
    folder = tmp_path_factory.mktemp("own")
    files = own_files(folder)
    write_jsonl(folder / "c-eval.jsonl", make_examples(8, 4))
    out_json = folder / "figures.json"
    import contextlib
    import io

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = main(["simulate", str(files["task"]), "--site", f"a={files['a']}", "--site", f"b={files['b']}",
                   "--site", f"c={files['c']}:{folder / 'c-eval.jsonl'}", "--eval", str(files["test"]),
                   "--json", str(out_json)])
    assert rc == 0, stderr.getvalue()
    return files, stdout.getvalue(), stderr.getvalue(), json.loads(out_json.read_text())


def test_prints_federated_centralized_and_local_only_side_by_side(ran):
    _, out, err, doc = ran
    table = out.strip().split("\n\n")[0].splitlines()
    assert table[0].split() == ["accuracy", "a", "b", "c", "pooled", "test", "steps"]
    assert [line.split()[0] for line in table[1:]] == ["federated", "centralized", "local-only/a", "local-only/b",
                                                       "local-only/c"]
    assert "federated round 2/2" in err and "local-only c: training on 24 rows" in err  # progress, on stderr
    assert "min_sites" not in err  # three sites: the task's quorum
    assert [s["eval_rows"] for s in doc["sites"]] == [6, 4, 8]
    assert doc["sites"][2]["eval_source"].endswith("c-eval.jsonl")
    # the same number of optimizer steps: federated = sum over sites and rounds; centralized over the pooled rows
    assert doc["steps"]["federated"] == 2 * (3 + 2 + 3) == doc["steps"]["centralized"]
    assert doc["steps"]["local-only/b"] == 2 * 2


def test_json_figures_equal_the_shared_functions(ran):
    """The JSON's federated and baseline figures are those of simulate(), train_baseline() and score_model()
    called directly on the same rows."""
    from fedclinic.federation.baselines import train_baseline
    from fedclinic.federation.model_scores import pool_by_rows, score_model
    from fedclinic.federation.own_files import SiteFiles
    from fedclinic.federation.simulate import simulate
    from fedclinic.models import build_model, package_for_task
    from fedclinic.training.trainer import encode

    files, _, _, doc = ran
    task = Task.from_toml(files["task"])
    sites = [read_site(task, SiteFiles("a", files["a"])), read_site(task, SiteFiles("b", files["b"])),
             read_site(task, SiteFiles("c", files["c"], files["task"].parent / "c-eval.jsonl"))]
    package = package_for_task(task)
    loaded = build_model(package)
    cfg = TrainConfig.from_proto(task.to_spec().training, device="cpu")

    def enc(rows):
        return encode(rows, loaded, max_length=16)

    site_eval = {s.name: enc(s.eval) for s in sites}
    tests = {"test": enc(read_rows(task, files["test"]))}
    result = simulate(package, [enc(s.train) for s in sites], rounds=2, train=cfg, site_names=["a", "b", "c"],
                      task_id="simulation:own-files")
    fed = score_model(build_model(result.package), site_eval, tests)
    assert doc["models"]["federated"] == json.loads(json.dumps(fed.to_json()))
    assert doc["rounds"][1]["train_loss"] == result.rounds[1].train_loss
    central = score_model(train_baseline(package, [ex for s in sites for ex in s.train],
                                         baseline_config(cfg, rounds=2, sites=3), list(package.tensors)),
                          site_eval, tests)
    assert doc["models"]["centralized"] == json.loads(json.dumps(central.to_json()))
    local_b = score_model(train_baseline(package, sites[1].train, baseline_config(cfg, rounds=2),
                                         list(package.tensors)), site_eval, tests)
    assert doc["models"]["local-only/b"] == json.loads(json.dumps(local_b.to_json()))
    # pooled: weighted by each site's evaluation rows
    pooled = doc["models"]["centralized"]["pooled"]
    by_site = doc["models"]["centralized"]["sites"]
    assert pooled == pool_by_rows(by_site)
    for key in ("accuracy", "loss", "macro_f1"):
        assert pooled[key] == pytest.approx(sum(m[key] * m["eval_rows"] for m in by_site.values()) / 18)
    assert pooled["eval_rows"] == 18


def test_a_bad_site_file_gives_the_agents_error(tmp_path, capsys):
    files = own_files(tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "heart chest", "label": "cardio"}\n{"text": "aura", "label": "derm"}\n')
    rc = main(["simulate", str(files["task"]), "--site", f"a={files['a']}", "--site", f"x={bad}"])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"{bad}: row 2: unknown label 'derm'; allowed labels are ['cardio', 'neuro']" in err


@pytest.mark.parametrize("arg, match", [
    ("a", "give NAME=TRAIN or NAME=TRAIN:EVAL"),
    ("centralized=x.jsonl", "the centralized baseline's"),
])
def test_site_argument_errors(arg, match):
    with pytest.raises(ConfigError, match=match):
        parse_site(arg)


def test_site_argument_forms(tmp_path):
    assert parse_site("a=/d/t.jsonl:/d/e.csv").eval is not None
    assert parse_site("a=/d/t.jsonl").eval is None
    odd = tmp_path / "x:y.jsonl"  # an existing file whose name holds ':' is a TRAIN file, not TRAIN:EVAL
    odd.write_text("")
    assert parse_site(f"a={odd}").train == odd and parse_site(f"a={odd}").eval is None


def test_holdout_is_seeded_disjoint_and_complete():
    rows = list(range(50))
    train, held = holdout_split(rows, 0.2, seed=3, site="a")
    assert len(held) == 10 and sorted(train + held) == rows
    assert holdout_split(rows, 0.2, seed=3, site="a") == (train, held)
    assert holdout_split(rows, 0.2, seed=3, site="b")[1] != held  # each site its own draw
    assert holdout_split(rows, 0.0, seed=3, site="a") == (rows, [])
    with pytest.raises(ConfigError, match="too few to hold some out"):
        holdout_split([1], 0.2, seed=0, site="a")


def test_baseline_steps_rule():
    cfg = TrainConfig(local_epochs=2, batch_size=8, max_steps=0)
    assert baseline_config(cfg, rounds=3).local_epochs == 6
    capped = baseline_config(TrainConfig(local_epochs=2, batch_size=8, max_steps=5), rounds=3, sites=4)
    assert capped.max_steps == 60
    # local-only: exactly the steps the site takes over the federated run
    assert planned_steps(19, 8, 6) == 3 * planned_steps(19, 8, 2)


def test_fewer_sites_than_the_quorum_are_noted_and_no_baselines_means_federated_only(tmp_path):
    from fedclinic.federation.own_files import SiteFiles
    from fedclinic.federation.task_simulation import simulate_task

    files = own_files(tmp_path)
    task = Task.from_toml(files["task"])
    lines: list[str] = []
    result = simulate_task(task, [read_site(task, SiteFiles("a", files["a"])), read_site(task, SiteFiles(
        "b", files["b"]))], baselines=False, progress=lines.append)
    assert any("min_sites = 3; with 2 sites" in line for line in lines)
    assert list(result.models()) == ["federated"] and set(result.federated.sites) == {"a", "b"}


def test_the_tasks_privacy_becomes_the_simulators_dp_sgd_or_a_clear_refusal():
    from fedclinic.federation.task_simulation import sample_dp

    base = dict(name="p", dataset="d", labels=["cardio", "neuro"], architecture="logreg")
    dp = sample_dp(Task(**base, privacy={"level": "sample", "target_epsilon": 4.0, "max_grad_norm": 0.5,
                                         "logical_batch_size": 12}))
    assert (dp.target_epsilon, dp.noise_multiplier, dp.max_grad_norm, dp.delta, dp.logical_batch_size) == \
        (4.0, None, 0.5, 1e-5, 12)
    assert sample_dp(Task(**base)) is None
    with pytest.raises(ConfigError, match="patient id column"):
        sample_dp(Task(**base, privacy={"level": "sample", "target_epsilon": 4.0, "unit": "patient"}))
    with pytest.raises(ConfigError, match="runs over the services only"):
        sample_dp(Task(**base, privacy={"level": "distributed", "target_epsilon": 4.0}))


def test_a_secure_aggregation_task_simulates_with_the_aggregators_defaults(tmp_path):
    """[secure_aggregation] enabled = true with nothing else: the defaults the aggregator fills in (clip, bits,
    cohort) run; the masked, uniformly weighted mean lands near the plain sample-weighted one."""
    from fedclinic.federation.own_files import SiteFiles
    from fedclinic.federation.task_simulation import simulate_task

    files = own_files(tmp_path)
    task = Task.from_toml(files["task"])
    sites = [read_site(task, SiteFiles(n, files[n])) for n in ("a", "b", "c")]
    plain = simulate_task(task, sites, baselines=False)
    task.secure_aggregation = {"enabled": True}
    secure = simulate_task(task, sites, baselines=False)
    assert secure.federated.pooled["loss"] == pytest.approx(plain.federated.pooled["loss"], abs=0.02)
    assert secure.federated.pooled["loss"] != plain.federated.pooled["loss"]
