"""The centralized and local-only baselines beside a federated run: the one implementation that ``fedclinic demo``
and ``fedclinic simulate`` (:mod:`fedclinic.federation.task_simulation`) both use.

Both baselines start from the federated run's initial model, train the same tensors with the same local
settings (optimizer, learning rate, batch size B, max_length, seed) in one process, without DP-SGD, codec,
secure aggregation or SAFL (they are what the data could give without federation; nothing of them is private).

The rule for their length: **the same number of optimizer steps as the federation took in total**. A task of R
rounds and E local epochs trains site i for ``R * E * ceil(n_i / B)`` steps over the run (with ``max_steps`` M,
at most ``R * M``). So each baseline trains ``R * E`` epochs over its rows (:func:`baseline_config`):

* local-only, site i alone: ``R * E * ceil(n_i / B)`` steps (capped at ``R * M``), exactly the steps site i
  took in the federation;
* centralized, all K sites' training rows pooled: ``R * E * ceil(sum_i n_i / B)`` steps (capped at ``R * K * M``):
  the federation's total ``sum_i R * E * ceil(n_i / B)`` less at most one partial batch per site and epoch
  (``ceil`` of a sum is at most the sum of the ``ceil``\\ s, by less than K).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Generic, Mapping, Sequence, TypeVar

if TYPE_CHECKING:  # torch-heavy: imported where a baseline trains
    from fedclinic.models import LoadedModel
    from fedclinic.training.trainer import TrainConfig
    from fedclinic.transport.package import ModelPackage

T = TypeVar("T")

#: the name :func:`run_baselines` reports the centralized baseline under (local-only ones: the site's name)
CENTRALIZED = "centralized"


def baseline_config(train: "TrainConfig", *, rounds: int, sites: int = 1) -> "TrainConfig":
    """The settings of a baseline over ``sites`` sites' rows of a task with ``rounds`` rounds of ``train``:
    ``rounds * local_epochs`` epochs, ``max_steps`` (when the task caps a round) ``rounds * sites * max_steps``;
    everything else as ``train``. See the module docstring for why this is the same number of steps."""
    return replace(train, local_epochs=rounds * train.local_epochs,
                   max_steps=rounds * sites * train.max_steps if train.max_steps else 0)


def train_baseline(package: "ModelPackage", rows: Sequence, cfg: "TrainConfig", trainable: Sequence[str]
                   ) -> "LoadedModel":
    """A fresh model of ``package`` trained on ``rows`` (examples of its family) with ``cfg``, only the tensors
    named in ``trainable`` changing; returns it loaded (for scoring)."""
    # lazy: torch only where a baseline trains (the CLI imports the demo and simulate modules to build its parser)
    from fedclinic.models import build_model
    from fedclinic.training import trainer as training

    loaded = build_model(package)
    training.train_local(loaded, training.encode(list(rows), loaded, max_length=cfg.max_length), cfg,
                         trainable=trainable)
    return loaded


@dataclass
class Baselines(Generic[T]):
    """What the baselines scored: the centralized model's score and each site's local-only model's."""

    centralized: T
    local: dict[str, T] = field(default_factory=dict)


def run_baselines(package: "ModelPackage", site_train: Mapping[str, Sequence], train: "TrainConfig", *, rounds: int,
                  trainable: Sequence[str], score: Callable[["LoadedModel"], T],
                  report: Callable[[str, int, T], None] | None = None,
                  start: Callable[[str, int], None] | None = None) -> Baselines[T]:
    """Train and score the centralized baseline (every site's rows of ``site_train`` pooled, in site order) and
    one local-only baseline per site, in that order, each with :func:`baseline_config` of ``train`` over
    ``rounds`` rounds. ``score(model)`` measures a trained model; ``start(name, rows)`` is called before each
    baseline trains and ``report(name, rows, score)`` after it (name: :data:`CENTRALIZED` or the site's)."""
    pooled = [ex for rows in site_train.values() for ex in rows]

    def one(name: str, rows: Sequence, sites: int) -> T:
        if start is not None:
            start(name, len(rows))
        result = score(train_baseline(package, rows, baseline_config(train, rounds=rounds, sites=sites), trainable))
        if report is not None:
            report(name, len(rows), result)
        return result

    out: Baselines[T] = Baselines(centralized=one(CENTRALIZED, pooled, len(site_train)))
    for name, rows in site_train.items():
        out.local[name] = one(name, rows, 1)
    return out


def mean_of(scores: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The unweighted mean of each key over ``scores`` (the keys of the first): the demo's local-only mean."""
    return {k: sum(m[k] for m in scores) / len(scores) for k in scores[0]}


__all__ = ["Baselines", "CENTRALIZED", "baseline_config", "mean_of", "run_baselines", "train_baseline"]
