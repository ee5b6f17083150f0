"""A task.toml simulated on the scientist's own site files, with its baselines: what ``fedclinic simulate`` runs.

Three kinds of model, each scored with :func:`fedclinic.federation.model_scores.score_model` on every site's
evaluation rows, their pool and the shared test set (``--eval``):

* **federated**: :func:`fedclinic.federation.simulate.simulate` (the site round an agent runs,
  :mod:`fedclinic.federation.site_round`, and the task's strategy) with the task's rounds, training, update
  (trainable/frozen/private patterns, codec, SAFL), participation, strategy, sample-level or client-level DP and
  secure aggregation; site ``i`` carries its ``--site`` name, so its seeds are those an agent of that name draws;
* **centralized** and **local-only**: :func:`fedclinic.federation.baselines.run_baselines` (same initial model,
  same trained tensors and settings, the same number of optimizer steps as the federation took; the rule is in
  that module).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from fedclinic.errors import ConfigError
from fedclinic.federation.baselines import run_baselines
from fedclinic.federation.model_scores import ModelScores, score_model
from fedclinic.federation.own_files import SiteRows, planned_steps

if TYPE_CHECKING:
    from fedclinic.federation.simulate import RoundRecord, SampleDP
    from fedclinic.spec.task import Task
    from fedclinic.transport.package import ModelPackage

#: the metric a table shows first, in this order of preference (each family reports one of them)
HEADLINE = ("strict_f1", "exact_match", "macro_auc", "accuracy")


def headline_metric(figures: Mapping[str, float]) -> str:
    """The headline metric among ``figures``' keys (:data:`HEADLINE`), else the first key that is not a count."""
    for name in HEADLINE:
        if name in figures:
            return name
    return next((k for k in figures if k != "eval_rows" and not k.startswith("count/")), "loss")


@dataclass
class TaskSimulation:
    """What :func:`simulate_task` measured. ``steps``: optimizer steps of each run in total (``federated`` summed
    over its sites)."""

    task_name: str
    sites: list[dict[str, Any]]
    rounds: list[dict[str, Any]]
    federated: ModelScores
    centralized: ModelScores | None = None
    local_only: dict[str, ModelScores] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def models(self) -> dict[str, ModelScores]:
        """Every scored model by its name in tables and JSON: federated, centralized, local-only/NAME."""
        out = {"federated": self.federated}
        if self.centralized is not None:
            out["centralized"] = self.centralized
        out.update({f"local-only/{name}": s for name, s in self.local_only.items()})
        return out

    def to_json(self) -> dict[str, Any]:
        """Numbers stay numbers: every figure is a JSON number."""
        return {"task": self.task_name, "sites": self.sites, "rounds": self.rounds,
                "models": {name: s.to_json() for name, s in self.models().items()},
                "steps": self.steps, "seconds": self.seconds}


def sample_dp(task: "Task") -> "SampleDP | None":
    """The simulator's DP-SGD settings for a task whose ``[privacy]`` level is ``sample`` (None for no privacy
    or ``client``, which its strategy carries); ConfigError for what the simulator cannot run."""
    from fedclinic.federation.simulate import SampleDP  # lazy: torch only when a simulation runs
    from fedclinic.spec.task import privacy_config

    p = privacy_config(task.privacy)
    if p.level in ("", "client"):
        return None
    if p.level != "sample":
        raise ConfigError(f"privacy level {p.level!r} runs over the services only (secure aggregation with the "
                          "sites' noise shares); simulate runs levels 'sample' and 'client'")
    if p.unit == "patient":
        raise ConfigError("privacy unit 'patient' needs each site's patient id column, which simulate does not "
                          "read; simulate with unit 'example' (the default)")
    return SampleDP(max_grad_norm=p.max_grad_norm, noise_multiplier=p.noise_multiplier or None,
                    target_epsilon=p.target_epsilon or None, delta=p.target_delta, accountant=p.accountant or "rdp",
                    logical_batch_size=p.logical_batch_size, sample_rate=p.sample_rate,
                    steps_per_round=p.steps_per_round)


def simulate_task(task: "Task", sites: Sequence[SiteRows], *, tests: Mapping[str, Sequence] | None = None,
                  package: "ModelPackage | None" = None, baselines: bool = True,
                  progress: Callable[[str], None] | None = None) -> TaskSimulation:
    """Simulate ``task`` over ``sites`` (rows already read, :mod:`fedclinic.federation.own_files`), then its
    baselines, and score every model. ``package``: the initial model (default: the task's model folder packaged
    as ``task submit`` packages it). ``tests``: shared test sets by name. ``progress(line)`` gets a line per round
    and per baseline."""
    # lazy: torch only when a simulation runs (the CLI imports this module to build its parser)
    from fedclinic.federation.simulate import simulate
    from fedclinic.models import build_model, load_tensors, package_for_task
    from fedclinic.secagg.task_config import effective_config
    from fedclinic.spec.safl_settings import SaflConfig
    from fedclinic.training.trainer import TrainConfig, encode, select_tensors

    say = progress or (lambda line: None)
    task.validate()
    if not sites:
        raise ConfigError("no sites to simulate: give at least one --site NAME=TRAIN[:EVAL]")
    spec = task.to_spec()
    train = TrainConfig.from_proto(spec.training, device="cpu")
    if package is None:
        package = package_for_task(task)
    tests = dict(tests or {})
    names = [s.name for s in sites]
    rounds_total = spec.rounds.num_rounds
    loaded = build_model(package)

    def encoded(rows):
        return encode(list(rows), loaded, max_length=train.max_length)

    site_eval = {s.name: encoded(s.eval) if s.eval else None for s in sites}
    test_sets = {name: encoded(rows) for name, rows in tests.items()}
    every_site_evaluates = all(d is not None for d in site_eval.values())
    started = time.monotonic()

    def on_round(r: "RoundRecord") -> None:
        m = r.metrics
        key = headline_metric({k.split("/", 1)[1]: v for k, v in m.items() if "/" in k})
        shown = " ".join(f"{where} {key} {m[f'{prefix}/{key}']:.3f}"
                         for prefix, where in (("sites", "pooled"), *((t, t) for t in tests)) if f"{prefix}/{key}" in m)
        say(f"federated round {r.round}/{rounds_total}: train loss {r.train_loss:.4f} {shown} ({r.seconds:.1f} s)")

    if len(sites) < task.min_sites:
        say(f"note: the task asks for min_sites = {task.min_sites}; with {len(sites)} sites a federation would not "
            "start its rounds (the simulation runs them anyway)")
    say(f"federated: {len(sites)} sites, {rounds_total} rounds, strategy {task.strategy}, codec {task.codec}")
    result = simulate(
        package, [encoded(s.train) for s in sites], rounds=rounds_total, train=train, strategy=task.strategy,
        strategy_params=task.strategy_params, trainable_patterns=task.trainable, frozen_patterns=task.frozen,
        private_patterns=task.private, eval_data=test_sets or None,
        site_eval_data=[site_eval[n] for n in names] if every_site_evaluates else None,
        participation=task.participation_fraction, seed=task.seed, progress=on_round,
        safl=SaflConfig.from_spec(spec), codec=spec.update.codec or "raw", dp=sample_dp(task),
        secure_aggregation=effective_config(spec.secure_aggregation) if spec.secure_aggregation.enabled else None,
        site_names=names, task_id=f"simulation:{task.name}")
    fed_seconds = time.monotonic() - started

    final = build_model(result.package)
    index = {n: i for i, n in enumerate(names)}
    before_site: Callable[[str], None] | None = None
    if result.private:
        initial = {k: package.tensors[k] for k in next(iter(result.private.values()))}

        def private_of(name: str) -> None:  # that site's model: the shared tensors and its own private ones
            load_tensors(final.module, result.private.get(index[name], initial))
        before_site = private_of
    federated = score_model(final, site_eval, test_sets, before_site=before_site)

    per_round = []
    for r in result.rounds:
        m = {(f"site/{names[_site_of(k)]}/{k.split('/', 1)[1]}" if _site_of(k) >= 0 else k): v
             for k, v in r.metrics.items()}
        per_round.append({"round": r.round, "sites": [names[i] for i in r.sites], "train_loss": float(r.train_loss),
                          "train_rows": int(r.num_samples), "seconds": float(r.seconds),
                          "metrics": {k: float(v) for k, v in m.items()}})
    steps = {"federated": sum(planned_steps(len(s.train), train.batch_size, train.local_epochs, train.max_steps)
                              for s in sites) * rounds_total}
    out = TaskSimulation(task_name=task.name, sites=[{"name": s.name, "train_rows": len(s.train),
                                                      "eval_rows": len(s.eval), "eval_source": s.eval_source}
                                                     for s in sites],
                         rounds=per_round, federated=federated, steps=steps, seconds={"federated": fed_seconds})
    if not baselines:
        return out
    trainable = select_tensors(list(package.tensors), task.trainable, task.frozen)
    marks: dict[str, float] = {}

    def start(name: str, rows: int) -> None:
        marks[name] = time.monotonic()
        what = "centralized (all sites' training rows pooled)" if len(marks) == 1 else f"local-only {name}"
        say(f"{what}: training on {rows} rows, {rounds_total * train.local_epochs} epochs")

    def score(model) -> ModelScores:
        return score_model(model, site_eval, test_sets)

    done = run_baselines(package, {s.name: s.train for s in sites}, train, rounds=rounds_total,
                         trainable=trainable, score=score, start=start)
    out.centralized, out.local_only = done.centralized, done.local
    pooled_rows = sum(len(s.train) for s in sites)
    cap = rounds_total * train.max_steps
    out.steps["centralized"] = planned_steps(pooled_rows, train.batch_size, rounds_total * train.local_epochs,
                                             cap * len(sites))
    out.steps.update({f"local-only/{s.name}": planned_steps(len(s.train), train.batch_size,
                                                            rounds_total * train.local_epochs, cap) for s in sites})
    out.seconds["baselines"] = time.monotonic() - started - fed_seconds
    return out


def _site_of(key: str) -> int:
    """``i`` of a simulator metric key ``site-{i}/...`` (reported as ``site/NAME/...``); -1 for any other key."""
    head = key.split("/", 1)[0]
    return int(head[5:]) if head.startswith("site-") and head[5:].isdigit() else -1


__all__ = ["HEADLINE", "TaskSimulation", "headline_metric", "sample_dp", "simulate_task"]
