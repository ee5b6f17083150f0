"""A scientist's own site files for ``fedclinic simulate`` and file-based experiment grids: naming them, reading
them with the readers a hospital agent uses, and choosing each site's evaluation rows.

A site is given as ``NAME=TRAIN`` or ``NAME=TRAIN:EVAL`` (JSONL, CSV or TSV files; the format from the suffix,
the columns the agent's defaults: ``text`` and ``label``, ``entities``, ``question``/``answer``/``context``...).
Every file is read by :func:`fedclinic.data.text.read_dataset` for the task's family and labels, the function the
agent's ``prepare_data`` calls, so a bad row fails here with the error (file, row, what to do) a site would give.

Evaluation rows of a site: its EVAL file when given; otherwise a seeded held-out fraction ``holdout`` of its
TRAIN rows (:func:`holdout_split`): the rows are permuted with
``SeedSequence([HOLDOUT_DOMAIN, seed mod 2^64, site_key(NAME)])`` (the task's seed, the site's name) and the first
``max(1, round(holdout * n))`` held out; the rest train. ``holdout = 0`` keeps every row for training (the site
then has no evaluation rows of its own).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from fedclinic.errors import ConfigError
from fedclinic.federation.baselines import CENTRALIZED
from fedclinic.federation.site_round import site_key

if TYPE_CHECKING:
    from fedclinic.proto import task_pb2
    from fedclinic.spec.task import Task

#: separates the held-out permutation from every other seed derived from (seed, site)
HOLDOUT_DOMAIN = 0x401D_0017
#: the default held-out fraction of a site given without an EVAL file
DEFAULT_HOLDOUT = 0.2


@dataclass(frozen=True)
class SiteFiles:
    """One simulated site: its name, training file and optional evaluation file."""

    name: str
    train: Path
    eval: Path | None = None


@dataclass
class SiteRows:
    """A site's rows as read: training rows, evaluation rows and where the evaluation rows came from."""

    name: str
    train: list
    eval: list
    eval_source: str


def parse_site(text: str) -> SiteFiles:
    """``NAME=TRAIN`` or ``NAME=TRAIN:EVAL`` -> :class:`SiteFiles`; ConfigError saying the form otherwise. A TRAIN
    path that exists with a ``:`` in it is taken whole."""
    name, sep, paths = text.partition("=")
    name = name.strip()
    if not sep or not name or not paths:
        raise ConfigError(f"--site {text!r}: give NAME=TRAIN or NAME=TRAIN:EVAL (JSONL, CSV or TSV files)")
    if name == CENTRALIZED:
        raise ConfigError(f"--site {text!r}: the name {CENTRALIZED!r} is the centralized baseline's; choose another")
    if ":" in paths and not Path(paths).exists():
        train, _, evaluation = paths.rpartition(":")
        if not train or not evaluation:
            raise ConfigError(f"--site {text!r}: give NAME=TRAIN or NAME=TRAIN:EVAL (JSONL, CSV or TSV files)")
        return SiteFiles(name, Path(train), Path(evaluation))
    return SiteFiles(name, Path(paths))


def check_names(sites: Sequence[SiteFiles]) -> None:
    """ConfigError unless there is at least one site and every name is used once."""
    if not sites:
        raise ConfigError("no sites: give at least one --site NAME=TRAIN[:EVAL]")
    names = [s.name for s in sites]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"site name(s) {dup} given more than once; every --site needs its own name")


def read_rows(task: "Task | task_pb2.TaskSpec", path: str | os.PathLike[str]) -> list:
    """The examples of one file for ``task`` (a Task or a TaskSpec: its family, labels, multi_label), read as an
    agent reads its dataset; a DatasetError naming the file and row for a bad one."""
    # lazy: the data readers' dependencies load when a file is read (the CLI imports this module for its parser)
    from fedclinic.data.text import read_dataset

    return read_dataset(task.family, path, label_set=list(task.labels) or None, multi_label=task.multi_label)


def holdout_split(rows: Sequence, fraction: float, *, seed: int, site: str) -> tuple[list, list]:
    """``(train, eval)`` of a site's ``rows``: the seeded held-out split of the module docstring."""
    if not (isinstance(fraction, (int, float)) and 0 <= fraction < 1):
        raise ConfigError(f"the held-out fraction must be in [0, 1), got {fraction!r}")
    if fraction == 0:
        return list(rows), []
    n = len(rows)
    if n < 2:
        raise ConfigError(f"site {site!r} has {n} row(s): too few to hold some out for evaluation; give it an "
                          f"evaluation file ({site}=TRAIN:EVAL) or --holdout 0")
    held = min(n - 1, max(1, round(fraction * n)))
    order = np.random.default_rng(np.random.SeedSequence(
        [HOLDOUT_DOMAIN, int(seed) & 0xFFFF_FFFF_FFFF_FFFF, site_key(site)])).permutation(n)
    return [rows[i] for i in sorted(order[held:])], [rows[i] for i in sorted(order[:held])]


def read_site(task: "Task", site: SiteFiles, *, holdout: float = DEFAULT_HOLDOUT) -> SiteRows:
    """A site's training and evaluation rows (its EVAL file, or the seeded held-out fraction of TRAIN)."""
    rows = read_rows(task, site.train)
    if site.eval is not None:
        return SiteRows(site.name, rows, read_rows(task, site.eval), str(site.eval))
    train, evaluation = holdout_split(rows, holdout, seed=task.seed, site=site.name)
    source = (f"{len(evaluation)} of {len(rows)} rows of {site.train} held out (fraction {holdout:g}, seeded by the "
              f"task seed {task.seed} and the site name)") if evaluation else "none (--holdout 0)"
    return SiteRows(site.name, train, evaluation, source)


def planned_steps(rows: int, batch_size: int, epochs: int, max_steps: int = 0) -> int:
    """Optimizer steps of ``epochs`` epochs over ``rows`` rows in batches of ``batch_size`` (capped at
    ``max_steps`` when > 0), as :func:`fedclinic.training.trainer.train_local` counts them."""
    total = math.ceil(rows / batch_size) * epochs
    return min(total, max_steps) if max_steps else total


__all__ = ["DEFAULT_HOLDOUT", "HOLDOUT_DOMAIN", "SiteFiles", "SiteRows", "check_names", "holdout_split",
           "parse_site", "planned_steps", "read_rows", "read_site"]
