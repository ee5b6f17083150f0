"""Experiment grids in the simulator: algorithms x data settings x seeds -> per-round CSV, PNG curves, Markdown.

``fedclinic experiment run CONFIG.toml`` runs every (data setting, algorithm, seed) of the grid with
:func:`fedclinic.federation.simulate.simulate`, the code the agent and the aggregator run, and writes to the output
folder (default ``experiments/out/NAME``)::

    runs/<data>__<algorithm>__seed<k>.csv   one row per round (written atomically; a finished run is skipped
                                            when the experiment is run again, so an interrupted grid resumes)
    rounds.csv                              all runs' rows together
    summary.json                            per run: max accuracy, min loss, mean seconds per round
    <data>.png                              accuracy and loss per round, mean over seeds with a min-max band

``fedclinic experiment report FOLDER`` prints a Markdown table (mean +- std over seeds of the maximum
accuracy and minimum loss of each algorithm), next to the paper's numbers when the config gives them.

A files setting's sites are read with the agents' readers (:mod:`fedclinic.federation.own_files`, as
``fedclinic simulate`` reads them; a bad row stops the grid before any run with the file and row), its model is
the task's; ``accuracy`` is on its test file, or on all sites' evaluation rows together (pooled by rows); a
multi-label task's ``accuracy`` column is its exact match (every label decision right).

Metrics follow FLCMC's protocol (its spec section 5): after every round the global model is evaluated on every
client. ``accuracy`` = sum_k correct_k / sum_k n_k^test over the test splits of all clients, ``loss`` = the
sample-weighted training cross-entropy over all clients' training splits (without any proximal term).

The config (TOML)::

    [experiment]
    name = "flcmc-table8"
    rounds = 100
    seeds = [0, 1, 2]
    workers = 2                      # processes, each one torch thread (1: the runs run in this process)

    [data.synthetic_05_05]           # one or more data settings
    kind = "synthetic"               # FedProx Synthetic(alpha, beta); iid = true for the IID variant
    alpha = 0.5
    beta = 0.5
    num_clients = 30
    data_seed = 328

    [data.notes]                     # or the scientist's own JSONL/CSV files as sites
    kind = "files"
    task = "task.toml"               # its model folder, labels, family and [training] (the algorithms' settings
                                     # override them); paths relative to this config's folder
    sites = { a = "a.jsonl", b = "b.csv", c = "c.jsonl:c-eval.jsonl" }   # NAME = "TRAIN" or "TRAIN:EVAL"
    test = "test.jsonl"              # optional; else every site's evaluation rows together (EVAL, or holdout)
    holdout = 0.2                    # a site without EVAL: this fraction of TRAIN held out, seeded by the task seed

    [defaults]                       # training settings shared by every algorithm (TrainConfig fields)
    local_epochs = 20
    batch_size = 10
    clients_per_round = 10

    [algorithms.FedAttS]             # preset name (see PRESETS) or strategy/optimizer given explicitly
    learning_rate = 0.001
    strategy_params = { server_lr = 4.0 }
    paper = { max_accuracy = 0.79, min_loss = 0.47 }
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from fedclinic.runtime.durable_file import write_atomically
from fedclinic.errors import ConfigError, FedclinicError
from fedclinic.runtime.tomlconfig import load_toml
from fedclinic.assets.synthetic import synthetic
from fedclinic.federation.own_files import DEFAULT_HOLDOUT, SiteFiles, SiteRows, parse_site, read_rows, read_site
from fedclinic.federation.simulate import simulate
from fedclinic.models.feature_classification import build, encode_features, package_feature_model
from fedclinic.strategies import make_strategy
from fedclinic.spec.task import Task
from fedclinic.training.trainer import TrainConfig

#: FLCMC's algorithm matrix (spec 2.10): name -> (strategy, local optimizer, whether mu applies)
PRESETS: dict[str, tuple[str, str, bool]] = {
    "FedAvg": ("fedavg", "sgd", False),
    "FedProx": ("fedavg", "sgd", True),
    "FedAtt": ("fedatt", "sgd", False),
    "FedPA": ("fedatt", "sgd", True),
    "FedAvgT": ("fedavg", "adam", False),
    "FedAvgS": ("fedavg", "self_adam", False),
    "FedProxP": ("fedavg", "padam", True),
    "FedAttS": ("fedatt", "self_adam", False),
    "FedPAP": ("fedatt", "padam", True),
}

ROUND_COLUMNS = ("data", "algorithm", "seed", "round", "accuracy", "loss", "test_loss", "seconds")
_ALGO_KEYS = {"preset", "strategy", "strategy_params", "paper", "clients_per_round"}
_DATA_KINDS = ("synthetic", "files")
#: the settings of a ``kind = "files"`` data setting
_FILES_KEYS = {"kind", "task", "sites", "test", "holdout"}


@dataclass(frozen=True)
class Algorithm:
    name: str
    strategy: str
    strategy_params: dict[str, float]
    train: dict[str, Any]              # TrainConfig fields
    clients_per_round: int
    paper: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Experiment:
    name: str
    output: Path
    rounds: int
    seeds: list[int]
    workers: int
    data: dict[str, dict[str, Any]]
    algorithms: list[Algorithm]

    def runs(self) -> list[tuple[str, Algorithm, int]]:
        return [(d, a, s) for d in self.data for a in self.algorithms for s in self.seeds]


def load_experiment(path: str | os.PathLike[str], output: str | os.PathLike[str] | None = None) -> Experiment:
    """Read and check an experiment config; every problem is reported at once as a ConfigError."""
    doc = load_toml(path)
    src = str(path)
    problems: list[str] = []
    exp = doc.get("experiment", {})
    name = str(exp.get("name") or Path(path).stem)
    rounds = exp.get("rounds", 30)
    seeds = exp.get("seeds", [0])
    workers = exp.get("workers", min(2, os.cpu_count() or 1))
    if not isinstance(rounds, int) or rounds < 1:
        problems.append(f"experiment.rounds must be an integer >= 1, got {rounds!r}")
    if not (isinstance(seeds, list) and seeds and all(isinstance(s, int) for s in seeds)):
        problems.append(f"experiment.seeds must be a non-empty list of integers, got {seeds!r}")
    if not isinstance(workers, int) or workers < 1:
        problems.append(f"experiment.workers must be an integer >= 1, got {workers!r}")
    data = dict(doc.get("data") or {})
    if not data:
        problems.append("no [data.NAME] section: give at least one data setting (kind = \"synthetic\" or \"files\")")
    for dname, d in data.items():
        if d.get("kind") not in _DATA_KINDS:
            problems.append(f"data.{dname}.kind must be one of {_DATA_KINDS}, got {d.get('kind')!r}")
        elif d.get("kind") == "files":
            data[dname] = _files_setting(dname, d, Path(path).resolve().parent, problems)
    defaults = dict(doc.get("defaults") or {})
    default_cpr = defaults.pop("clients_per_round", 10)
    train_fields = {f.name for f in fields(TrainConfig)}
    algorithms: list[Algorithm] = []
    for aname, a in (doc.get("algorithms") or {}).items():
        a = dict(a)
        preset = PRESETS.get(a.get("preset", aname))
        strategy = a.get("strategy", preset[0] if preset else None)
        unknown = sorted(set(a) - _ALGO_KEYS - train_fields)
        if unknown:
            problems.append(f"algorithms.{aname}: unknown setting(s) {unknown}")
        if strategy is None:
            problems.append(f"algorithms.{aname}: not a preset ({', '.join(PRESETS)}); give strategy and optimizer")
            continue
        train = {**{k: v for k, v in defaults.items() if k in train_fields},
                 **{k: v for k, v in a.items() if k in train_fields}}
        if preset:
            train.setdefault("optimizer", preset[1])
            if not preset[2]:
                train["proximal_mu"] = 0.0
        try:
            TrainConfig(**train)
        except (ConfigError, TypeError) as exc:
            problems.append(f"algorithms.{aname}: {exc}")
        algorithms.append(Algorithm(name=aname, strategy=strategy, strategy_params=dict(a.get("strategy_params", {})),
                                    train=train, clients_per_round=int(a.get("clients_per_round", default_cpr)),
                                    paper=dict(a.get("paper", {}))))
    bad_defaults = sorted(set(defaults) - train_fields)
    if bad_defaults:
        problems.append(f"defaults: unknown setting(s) {bad_defaults}")
    if not algorithms and not problems:
        problems.append("no [algorithms.NAME] section: give at least one algorithm")
    for a in algorithms:
        try:
            make_strategy(a.strategy, a.strategy_params)
        except ConfigError as exc:
            problems.append(f"algorithms.{a.name}: {exc}")
    if problems:
        raise ConfigError(f"{src}: " + "; ".join(problems))
    out = Path(output) if output else Path(exp.get("output") or Path("experiments") / "out" / name)
    return Experiment(name=name, output=out, rounds=rounds, seeds=list(seeds), workers=workers, data=dict(data),
                      algorithms=algorithms)


# ------------------------------------------------------------------------------------------------------------
# one run (in a worker process)


def _load_synthetic(d: Mapping[str, Any], model):
    import numpy as np

    clients = synthetic(float(d.get("alpha", 0.0)), float(d.get("beta", 0.0)), num_clients=int(d.get("num_clients", 30)),
                        seed=int(d.get("data_seed", 0)), iid=bool(d.get("iid", False)))
    sites = [encode_features(c.x_train, c.y_train, model) for c in clients]
    test = encode_features(np.concatenate([c.x_test for c in clients]), np.concatenate([c.y_test for c in clients]),
                           model)
    train = encode_features(np.concatenate([c.x_train for c in clients]),
                            np.concatenate([c.y_train for c in clients]), model)
    return sites, {"test": test, "train": train}


def _files_setting(dname: str, d: Mapping[str, Any], base: Path, problems: list[str]) -> dict[str, Any]:
    """A ``kind = "files"`` setting with its paths made absolute (relative ones are relative to the config's
    folder), its task and every site file read once here so that a bad row is reported before any run starts."""
    where = f"data.{dname}"
    unknown = sorted(set(d) - _FILES_KEYS)
    if unknown:
        problems.append(f"{where}: unknown setting(s) {unknown}; a files setting takes {sorted(_FILES_KEYS)}")
    sites = d.get("sites")
    if not (isinstance(sites, dict) and sites and all(isinstance(v, str) for v in sites.values())):
        problems.append(f"{where}.sites must be a table NAME = \"TRAIN\" or \"TRAIN:EVAL\" (one or more sites), "
                        f"got {sites!r}")
        return dict(d)
    if not isinstance(d.get("task"), str):
        problems.append(f"{where}.task must name a task file (its model folder, labels and family), got "
                        f"{d.get('task')!r}")
        return dict(d)
    out = {**d, "task": str(base / d["task"]), "sites": {}}
    try:
        for name, spec in sites.items():
            site = parse_site(f"{name}={spec}")
            site = SiteFiles(site.name, base / site.train, base / site.eval if site.eval else None)
            out["sites"][name] = f"{site.train}:{site.eval}" if site.eval else str(site.train)
        if isinstance(d.get("test"), str):
            out["test"] = str(base / d["test"])
        _load_files_rows(out)
    except FedclinicError as exc:
        problems.append(f"{where}: {exc}")
    return out


def _load_files_rows(d: Mapping[str, Any]) -> tuple[Task, list[SiteRows], list]:
    """The task, each site's rows and the test rows of a files setting (own_files' readers and held-out rule)."""
    task = Task.from_toml(d["task"])
    sites = [read_site(task, parse_site(f"{name}={spec}"), holdout=float(d.get("holdout", DEFAULT_HOLDOUT)))
             for name, spec in d["sites"].items()]
    test = read_rows(task, d["test"]) if d.get("test") else [ex for s in sites for ex in s.eval]
    if not test:
        raise ConfigError("no evaluation rows: give test = FILE, a site's TRAIN:EVAL or holdout > 0")
    return task, sites, test


def _load_files(d: Mapping[str, Any]):
    """(package, sites' encoded training rows, {"test", "train"} eval sets, the task's training settings) of a
    files setting: accuracy on its test file (or every site's evaluation rows together, i.e. pooled by rows) and
    the loss over every site's training rows, as the synthetic kind reports them."""
    from fedclinic.models import build_model, package_for_task
    from fedclinic.training.trainer import encode

    task, sites, test = _load_files_rows(d)
    package = package_for_task(task)
    loaded = build_model(package)
    spec = task.to_spec()
    base = {k: v for k, v in vars(TrainConfig.from_proto(spec.training)).items() if k != "device"}

    def enc(rows):
        return encode(list(rows), loaded, max_length=task.max_length)

    return (package, [enc(s.train) for s in sites],
            {"test": enc(test), "train": enc([ex for s in sites for ex in s.train])}, base)


def run_one(data_name: str, data: Mapping[str, Any], algorithm: Algorithm, seed: int, rounds: int) -> list[dict]:
    """Simulate one (data, algorithm, seed) and return its per-round rows (ROUND_COLUMNS)."""
    import torch

    torch.set_num_threads(1)
    base: dict[str, Any] = {}
    if data.get("kind") == "files":  # the task's model and training settings; the algorithm's override them
        package, sites, eval_sets, base = _load_files(data)
    else:
        package = package_feature_model(num_features=int(data.get("dim", 60)),
                                        labels=[str(i) for i in range(int(data.get("num_classes", 10)))])
        sites, eval_sets = _load_synthetic(data, build(package))
    participation = min(1.0, algorithm.clients_per_round / len(sites))
    cfg = TrainConfig(**{**base, **algorithm.train, "seed": seed, "device": "cpu"})
    result = simulate(package, sites, rounds=rounds, train=cfg, strategy=algorithm.strategy,
                      strategy_params=algorithm.strategy_params, participation=participation,
                      eval_data=eval_sets, seed=seed)
    return [{"data": data_name, "algorithm": algorithm.name, "seed": seed, "round": r.round,
             "accuracy": _headline_accuracy(r.metrics), "loss": r.metrics["train/loss"],
             "test_loss": r.metrics["test/loss"], "seconds": r.seconds} for r in result.rounds]


def _headline_accuracy(metrics: dict[str, float]) -> float:
    """The grid's ``accuracy`` column: ``test/accuracy``, or for a multi-label task (which reports no plain
    accuracy) ``test/exact_match``, the share of rows whose every label decision is right."""
    return metrics["test/accuracy"] if "test/accuracy" in metrics else metrics["test/exact_match"]


def _run_path(out: Path, data_name: str, algorithm: str, seed: int) -> Path:
    return out / "runs" / f"{data_name}__{algorithm}__seed{seed}.csv"


def _write_csv(path: Path, rows: list[dict]) -> None:
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, fieldnames=ROUND_COLUMNS)
    w.writeheader()
    w.writerows(rows)
    write_atomically(path, text.getvalue().encode("utf-8"), mode=0o644)


def _read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    for r in rows:
        r["seed"], r["round"] = int(r["seed"]), int(r["round"])
        for k in ("accuracy", "loss", "test_loss", "seconds"):
            r[k] = float(r[k])
    return rows


def _finished_runs(exp: Experiment, todo: list[tuple[str, Algorithm, int]]):
    """Run ``todo`` and yield ``((data, algorithm, seed), rows)`` as each run finishes.

    Several at a time: one spawned worker process each (no forked torch state; each imports torch afresh, seconds
    of CPU). One at a time (``workers = 1``, or one run left to do): here, in this process, which gives the same
    rows (every run is seeded) without starting a process; torch's thread count is restored afterwards."""
    workers = min(exp.workers, len(todo))
    if workers <= 1:
        import torch

        threads = torch.get_num_threads()
        try:
            for d, a, s in todo:
                yield (d, a, s), run_one(d, exp.data[d], a, s, exp.rounds)
        finally:
            torch.set_num_threads(threads)
        return
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = {pool.submit(run_one, d, exp.data[d], a, s, exp.rounds): (d, a, s) for d, a, s in todo}
        for fut in as_completed(futures):
            yield futures[fut], fut.result()


def run_experiment(exp: Experiment, *, log: Callable[[str], None] = print) -> list[dict]:
    """Run every missing run of the grid (``exp.workers`` at a time), then write rounds.csv, summary.json, PNGs."""
    exp.output.mkdir(parents=True, exist_ok=True)
    todo = []
    for d, a, s in exp.runs():
        path = _run_path(exp.output, d, a.name, s)
        if path.exists() and len(_read_csv(path)) == exp.rounds:
            continue
        todo.append((d, a, s))
    total = len(exp.runs())
    log(f"experiment {exp.name}: {total} runs, {total - len(todo)} already done, {len(todo)} to run "
        f"on {exp.workers} worker(s); output in {exp.output}")
    started = time.monotonic()
    for i, ((d, a, s), rows) in enumerate(_finished_runs(exp, todo), start=1):
        _write_csv(_run_path(exp.output, d, a.name, s), rows)
        elapsed = time.monotonic() - started
        eta = elapsed / i * (len(todo) - i)
        best = max(r["accuracy"] for r in rows)
        log(f"[{i}/{len(todo)}] {d} {a.name} seed {s}: max accuracy {best:.3f}, "
            f"min loss {min(r['loss'] for r in rows):.3f} ({elapsed:.0f} s elapsed, ~{eta:.0f} s left)")
    rows = [r for d, a, s in exp.runs() for r in _read_csv(_run_path(exp.output, d, a.name, s))]
    _write_csv(exp.output / "rounds.csv", rows)
    summary = summarize(rows)
    config = {"name": exp.name, "rounds": exp.rounds, "seeds": exp.seeds,
              "algorithms": {a.name: {"strategy": a.strategy, "strategy_params": a.strategy_params, "train": a.train,
                                      "clients_per_round": a.clients_per_round, "paper": a.paper}
                             for a in exp.algorithms},
              "data": exp.data, "wall_seconds": round(time.monotonic() - started, 1)}
    (exp.output / "summary.json").write_text(json.dumps({"config": config, "runs": summary}, indent=2) + "\n")
    plot(rows, exp.output)
    log(f"wrote {exp.output / 'rounds.csv'}, summary.json and {len(exp.data)} plot(s)")
    return rows


# ------------------------------------------------------------------------------------------------------------
# summaries, plots, report


def summarize(rows: list[dict]) -> list[dict]:
    """Per run: max accuracy (and its round), min loss, mean seconds per round."""
    runs: dict[tuple, list[dict]] = {}
    for r in rows:
        runs.setdefault((r["data"], r["algorithm"], r["seed"]), []).append(r)
    out = []
    for (d, a, s), rs in runs.items():
        best = max(rs, key=lambda r: r["accuracy"])
        finite = [r["loss"] for r in rs if math.isfinite(r["loss"])]
        out.append({"data": d, "algorithm": a, "seed": s, "max_accuracy": best["accuracy"],
                    "max_accuracy_round": best["round"], "min_loss": min(finite) if finite else float("nan"),
                    "final_accuracy": rs[-1]["accuracy"], "final_loss": rs[-1]["loss"],
                    "ms_per_round": 1000 * sum(r["seconds"] for r in rs) / len(rs)})
    return out


def _mean_std(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0


def plot(rows: list[dict], out: Path) -> list[Path]:
    """One PNG per data setting: accuracy and loss per round, mean over seeds, min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for d in sorted({r["data"] for r in rows}):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for algo in dict.fromkeys(r["algorithm"] for r in rows if r["data"] == d):
            by_round: dict[int, list[dict]] = {}
            for r in rows:
                if r["data"] == d and r["algorithm"] == algo:
                    by_round.setdefault(r["round"], []).append(r)
            xs = sorted(by_round)
            for ax, key in zip(axes, ("accuracy", "loss")):
                vals = [[r[key] for r in by_round[x]] for x in xs]
                mean = [sum(v) / len(v) for v in vals]
                line, = ax.plot(xs, mean, label=algo, linewidth=1.2)
                ax.fill_between(xs, [min(v) for v in vals], [max(v) for v in vals], color=line.get_color(), alpha=0.15)
        axes[0].set_ylabel("test accuracy (all clients, sample-weighted)")
        axes[1].set_ylabel("training loss (all clients, sample-weighted)")
        axes[1].set_yscale("log")
        for ax in axes:
            ax.set_xlabel("round")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{d}: mean over seeds, band = min..max")
        fig.tight_layout()
        path = out / f"{d}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def report(folder: str | os.PathLike[str], *, tolerance: float = 0.03) -> str:
    """A Markdown table of an experiment folder (reads summary.json; the paper's numbers where configured)."""
    path = Path(folder) / "summary.json"
    if not path.exists():
        raise ConfigError(f"{path} does not exist; run `fedclinic experiment run CONFIG.toml` first")
    doc = json.loads(path.read_text())
    config, runs = doc["config"], doc["runs"]
    lines = [f"Experiment `{config['name']}`: {config['rounds']} rounds, seeds {config['seeds']}. "
             "Mean ± std over seeds of each run's maximum accuracy and minimum loss.", ""]
    for d in dict.fromkeys(r["data"] for r in runs):
        lines += [f"**{d}**", "",
                  "| algorithm | max accuracy | paper | Δ | min loss | paper | ms / round |",
                  "|---|---|---|---|---|---|---|"]
        for algo, spec in config["algorithms"].items():
            rs = [r for r in runs if r["data"] == d and r["algorithm"] == algo]
            if not rs:
                continue
            acc = _mean_std([r["max_accuracy"] for r in rs])
            loss = _mean_std([r["min_loss"] for r in rs])
            ms = sum(r["ms_per_round"] for r in rs) / len(rs)
            paper = spec.get("paper") or {}
            pa, pl = paper.get("max_accuracy"), paper.get("min_loss")
            delta = "" if pa is None else f"{acc[0] - pa:+.3f}" + (" ✓" if abs(acc[0] - pa) <= tolerance else "")
            lines.append(f"| {algo} | {acc[0]:.3f} ± {acc[1]:.3f} | {'' if pa is None else f'{pa:.2f}'} | {delta} | "
                         f"{loss[0]:.3f} ± {loss[1]:.3f} | {'' if pl is None else f'{pl:.2f}'} | {ms:.0f} |")
        lines.append("")
    return "\n".join(lines)


def add_experiment_commands(sub) -> None:
    """``fedclinic experiment run|report``."""
    exp = sub.add_parser("experiment", help="run simulator experiment grids and report them")
    esub = exp.add_subparsers(dest="experiment_cmd", required=True)
    p = esub.add_parser("run", help="run CONFIG.toml (resumes: finished runs are kept)")
    p.add_argument("config")
    p.add_argument("--output", help="output folder (default: experiment.output or experiments/NAME)")
    p.add_argument("--workers", type=int, help="processes to run at once (default: experiment.workers)")
    p.set_defaults(func=_run_command)
    p = esub.add_parser("report", help="print a Markdown table of an experiment folder")
    p.add_argument("folder")
    p.set_defaults(func=lambda args: print(report(args.folder)))


def _run_command(args) -> int:
    exp = load_experiment(args.config, args.output)
    if args.workers:
        if args.workers < 1:
            raise ConfigError("--workers must be >= 1")
        exp = replace(exp, workers=args.workers)
    run_experiment(exp, log=lambda m: print(m, flush=True))
    print(report(exp.output))
    return 0
