"""``fedclinic privacy plan``: the command line of :class:`fedclinic.privacy.privacy_planner.PrivacyPlanner`.

    fedclinic privacy plan --epsilon 8 --rows 73 --rows 72 --rows 72 --rounds 5 --model MODEL --labels 5
    fedclinic privacy plan --epsilon 3 --dataset site-a.jsonl --rounds 5 --params head=1925 --toml privacy.toml

Prints one row per candidate (trainable set, parameters d, sampling, rate q and steps per round at the smallest
site, noise multiplier sigma, the epsilon the sites will charge, the signal-to-noise figure) and marks the
proposal with ``*``; ``--toml`` writes the proposal as task.toml ``[training]``/``[update]``/``[privacy]``
sections, ``--json`` prints every candidate as JSON.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path
from typing import Any

from fedclinic.errors import ConfigError, FedclinicError
from fedclinic.privacy.privacy_planner import (
    SUGGESTED_OPTIMIZER,
    Candidate,
    PrivacyPlanner,
    bert_trainable_sets,
    parse_params,
)


def add_privacy_commands(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register ``privacy plan`` on an argparse ``add_subparsers()`` object (handler ``func(args) -> int``)."""
    privacy = subparsers.add_parser("privacy", help="plan differential privacy for a task")
    sub = privacy.add_subparsers(dest="privacy_command", metavar="COMMAND", required=True)
    p = sub.add_parser("plan", help="propose DP-SGD settings (trainable set, sampling, noise) for a target epsilon",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epsilon", type=float, required=True, help="target epsilon for the whole task at each site")
    p.add_argument("--delta", type=float, default=1e-5, help="target delta (default: %(default)g)")
    p.add_argument("--rows", type=int, action="append", default=[], help="one site's training rows (repeat per site)")
    p.add_argument("--dataset", action="append", default=[], help="a site's training file (.jsonl or .csv; repeat "
                                                                    "per site): its rows are counted")
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--epochs", type=int, default=1, help="local epochs per round (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="the task's (physical) batch size (default: %(default)s)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="per-example clip C (default: %(default)g)")
    p.add_argument("--accountant", choices=("rdp", "prv"), default="rdp")
    p.add_argument("--max-passes", type=int, default=0, help="full batch: at most this many steps (passes over the "
                                                             "rows) per epoch (default: no cap)")
    p.add_argument("--model", help="a BERT-family model folder: count each candidate trainable set's parameters")
    p.add_argument("--labels", type=int, default=2, help="number of classes of the head (with --model)")
    p.add_argument("--lora-rank", type=int, default=0, help="with --model: also plan LoRA adapters of this rank")
    p.add_argument("--params", action="append", default=[], help="NAME=COUNT: a trainable set by its parameter "
                                                                 "count (repeatable; instead of or besides --model)")
    p.add_argument("--json", action="store_true", help="print every candidate as JSON")
    p.add_argument("--toml", type=Path, help="write the proposal as task.toml sections to this file")
    p.set_defaults(func=_plan_command)


def count_rows(path: str | Path) -> int:
    """Training rows of a site's file: non-empty lines of a .jsonl, data rows (after the header) of a .csv."""
    path = Path(path)
    try:
        with open(path, newline="") as fh:
            if path.suffix.lower() == ".csv":
                return max(0, sum(1 for row in csv.reader(fh) if row) - 1)
            return sum(1 for line in fh if line.strip())
    except OSError as exc:
        raise ConfigError(f"cannot read the dataset {path}: {exc.strerror or exc}") from None


def planner_from_args(args: argparse.Namespace) -> PrivacyPlanner:
    rows = list(args.rows) + [count_rows(f) for f in args.dataset]
    sets = (bert_trainable_sets(args.model, args.labels, args.lora_rank) if args.model else []) + parse_params(args.params)
    if not sets:
        raise ConfigError("give --model FOLDER (a BERT-family encoder) or --params NAME=COUNT to count the trained "
                          "parameters")
    return PrivacyPlanner(epsilon=args.epsilon, delta=args.delta, rows=rows, rounds=args.rounds, epochs=args.epochs,
                          batch_size=args.batch_size, max_grad_norm=args.max_grad_norm, accountant=args.accountant,
                          sets=sets, max_passes=args.max_passes)


def candidate_json(c: Candidate, proposed: bool) -> dict[str, Any]:
    optimizer, lr = SUGGESTED_OPTIMIZER[c.trainable.kind]
    return {"proposed": proposed, "trainable_set": c.trainable.name, "parameters": c.trainable.parameters,
            "trainable": list(c.trainable.patterns), "sampling": c.sampling, "privacy": c.privacy,
            "optimizer": optimizer, "learning_rate": lr, "snr": c.snr, "epsilon": c.epsilon,
            "sites": [{"rows": n, "noise_multiplier": p.noise_multiplier, "sample_rate": p.sample_rate,
                       "steps_per_round": p.steps_per_round, "planned_epsilon": p.planned_epsilon}
                      for n, p in zip(c.rows, c.plans)]}


def toml_fragment(planner: PrivacyPlanner, c: Candidate) -> str:
    """The proposal as task.toml ``[training]``, ``[update]`` (when the set has patterns) and ``[privacy]``."""
    optimizer, lr = SUGGESTED_OPTIMIZER[c.trainable.kind]
    lines = [f"# fedclinic privacy plan: epsilon {planner.epsilon:g}, delta {planner.delta:g}, sites of "
             f"{', '.join(map(str, planner.rows))} rows, {planner.rounds} rounds x {planner.epochs} epoch(s)",
             f"# proposal: {c.trainable.name} ({c.trainable.parameters:,} parameters), {c.sampling} sampling; "
             f"noise multiplier {c.smallest.noise_multiplier:.4g} at the smallest site", "",
             "[training]", f"local_epochs = {planner.epochs}", f"batch_size = {planner.batch_size}",
             f'optimizer = "{optimizer}"', f"learning_rate = {lr!r}", ""]
    if c.trainable.model_config:
        lines += ["[model_config]", *(f'{k} = "{v}"' for k, v in c.trainable.model_config), ""]
    if c.trainable.patterns:
        pats = ", ".join("'" + p + "'" for p in c.trainable.patterns)  # TOML literal strings: no escapes
        lines += ["[update]", f"trainable = [{pats}]", ""]
    lines.append("[privacy]")
    for key, value in c.privacy.items():
        lines.append(f'{key} = "{value}"' if isinstance(value, str) else f"{key} = {value!r}")
    return "\n".join(lines) + "\n"


def table(planner: PrivacyPlanner, cands: list[Candidate], best: Candidate) -> str:
    head = (f"target epsilon {planner.epsilon:g}, delta {planner.delta:g}; sites of {', '.join(map(str, planner.rows))} "
            f"rows; {planner.rounds} rounds x {planner.epochs} epoch(s); batch {planner.batch_size}; clip "
            f"{planner.max_grad_norm:g}; {planner.accountant} accountant\n"
            "q, steps and sigma: at the smallest site; epsilon: the largest any site charges; "
            "snr = sqrt(T) q n / (sigma sqrt(d))\n\n")
    cols = ("", "trainable set", "d", "sampling", "q", "steps/round", "sigma", "epsilon", "snr")
    rows = []
    for c in cands:
        p = c.smallest
        what = c.sampling + (f" {c.privacy['logical_batch_size']}" if c.sampling == "logical" else "")
        rows.append(("*" if c is best else "", c.trainable.name, f"{c.trainable.parameters:,}", what,
                     f"{p.sample_rate:.4g}", str(p.steps_per_round), f"{p.noise_multiplier:.3f}", f"{c.epsilon:.3f}",
                     f"{c.snr:.3g}"))
    widths = [max(len(r[i]) for r in rows + [cols]) for i in range(len(cols))]
    fmt = lambda r: "  ".join(v.rjust(w) if i > 1 else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths)))  # noqa: E731
    optimizer, lr = SUGGESTED_OPTIMIZER[best.trainable.kind]
    tail = (f"\n* proposed: {best.trainable.name}, {best.sampling} sampling, optimizer {optimizer} at learning rate "
            f"{lr:g} (DP-SGD steps are clipped means: larger rates than without privacy)")
    return head + "\n".join([fmt(cols)] + [fmt(r) for r in rows]) + tail


def _plan_command(args: argparse.Namespace) -> int:
    try:
        planner = planner_from_args(args)
        cands = planner.candidates()
        best = planner.propose(cands)
    except FedclinicError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([candidate_json(c, c is best) for c in cands], indent=2))
    else:
        print(table(planner, cands, best))
    if args.toml:
        args.toml.write_text(toml_fragment(planner, best))
        if not args.json:
            print(f"proposal written to {args.toml}")
    return 0 if math.isfinite(best.snr) else 1
