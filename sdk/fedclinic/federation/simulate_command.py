"""``fedclinic simulate TASK.toml --site NAME=TRAIN[:EVAL] ... [--eval TEST] [--json FILE]``: the task on the
scientist's own files, federated beside its centralized and local-only baselines, before any hospital is asked.

Progress (a line per round and per baseline) goes to stderr; the side-by-side tables to stdout; ``--json`` writes
:meth:`fedclinic.federation.task_simulation.TaskSimulation.to_json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TextIO

from fedclinic.errors import ConfigError
from fedclinic.federation.own_files import DEFAULT_HOLDOUT, check_names, parse_site, read_rows, read_site
from fedclinic.federation.task_simulation import TaskSimulation, headline_metric, simulate_task
from fedclinic.spec.task import Task

#: the name of the ``--eval`` set in tables and JSON
TEST_SET = "test"


def add_simulate_command(sub) -> None:
    """Register ``fedclinic simulate``."""
    p = sub.add_parser("simulate", help="simulate a task on your own JSONL/CSV site files, with centralized and "
                                        "local-only baselines beside the federated run",
                       description="Run TASK.toml (the file `fedclinic task submit` takes) in this process over your "
                                   "own site files: the federated run (the agents' site round and the task's "
                                   "strategy), the centralized baseline (all sites' rows pooled) and each site alone, "
                                   "with the same number of optimizer steps, scored side by side.")
    p.add_argument("task", help="the task file (model folder, labels, family, training, rounds, update, privacy)")
    p.add_argument("--site", action="append", default=[], metavar="NAME=TRAIN[:EVAL]", required=True,
                   help="a simulated site and its rows (JSONL, CSV or TSV; repeat per site); EVAL: its own evaluation "
                        "file, else --holdout of TRAIN is held out")
    p.add_argument("--eval", metavar="PATH", help="a shared test file every model is also scored on")
    p.add_argument("--holdout", type=float, default=DEFAULT_HOLDOUT,
                   help=f"the fraction of a site's TRAIN rows held out for its evaluation when no EVAL file is given "
                        f"(seeded by the task seed and the site name; default {DEFAULT_HOLDOUT}; 0 = none)")
    p.add_argument("--metric", action="append", default=[],
                   help="a metric to tabulate (repeatable; default: the family's headline metric and loss)")
    p.add_argument("--no-baselines", action="store_true", help="the federated run only")
    p.add_argument("--json", metavar="FILE", help="also write every figure as JSON here")
    p.set_defaults(func=run_simulate_command)


def run_simulate_command(args: argparse.Namespace) -> int:
    task = Task.from_toml(args.task)
    sites = [parse_site(s) for s in args.site]
    check_names(sites)
    rows = [read_site(task, s, holdout=args.holdout) for s in sites]
    tests = {TEST_SET: read_rows(task, args.eval)} if args.eval else {}
    for s in rows:
        print(f"{s.name}: {len(s.train)} training rows; evaluation: {s.eval_source}", file=sys.stderr, flush=True)
    if not any(s.eval for s in rows) and not tests:
        raise ConfigError("nothing to score the models on: give --eval TEST, a site's EVAL file or --holdout > 0")
    result = simulate_task(task, rows, tests=tests, baselines=not args.no_baselines,
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    print_tables(result, args.metric, out=sys.stdout)
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=2) + "\n")
        print(f"figures written to {args.json}")
    return 0


def print_tables(result: TaskSimulation, metrics: list[str], *, out: TextIO) -> None:
    """One table per metric: a row per model (federated, centralized, local-only per site), a column per site's
    evaluation rows, the pool of the sites (weighted by their evaluation rows) and the shared test set."""
    models = result.models()
    fed = result.federated
    sample = fed.pooled or next(iter(fed.tests.values()), {})
    chosen = metrics or [headline_metric(sample), "loss"]
    site_names = [s["name"] for s in result.sites if s["name"] in fed.sites]
    cols = site_names + (["pooled"] if fed.pooled else []) + list(fed.tests)
    width = max([12] + [len(c) + 1 for c in cols])
    label_w = max(len(n) for n in models) + 2
    for metric in chosen:
        out.write(f"\n{metric:<{label_w}}" + "".join(f"{c:>{width}}" for c in cols) + f"{'steps':>{width}}\n")
        for name, scores in models.items():
            cells = [scores.sites.get(c, {}) for c in site_names]
            cells += [scores.pooled] if fed.pooled else []
            cells += [scores.tests.get(t, {}) for t in fed.tests]
            text = "".join(f"{c[metric]:>{width}.4f}" if metric in c else f"{'-':>{width}}" for c in cells)
            out.write(f"{name:<{label_w}}{text}{result.steps.get(name, 0):>{width}}\n")
    out.write("\nrows evaluated: " + ", ".join(f"{s['name']} {s['eval_rows']}" for s in result.sites)
              + "".join(f", {t} {int(v['eval_rows'])}" for t, v in fed.tests.items())
              + ". Baselines: the same initial model, trained tensors and settings, not private; steps: optimizer "
                "steps in total (federated: summed over the sites).\n")
    out.flush()


__all__ = ["TEST_SET", "add_simulate_command", "print_tables", "run_simulate_command"]
