"""``fedclinic privacy plan``: propose a sample-level DP-SGD configuration for a target (epsilon, delta).

A developer gives the target, each site's row count, the rounds and the local epochs; the planner lists candidate
configurations -- which tensors train (the *trainable set*, ``d`` parameters) and how each site samples its noisy
steps (the task's batch, a larger logical batch, or every row: full-batch DP-GD) -- and for each one the noise
multiplier every site will plan and the epsilon it will charge. Both come from
:func:`fedclinic.strategies.dp_accounting.plan_for_config` on the ``PrivacyConfig`` the candidate writes, the very
function the agents admit a task with, so the epsilon shown is the one the sites' ledgers will charge.

Which candidate: DP-SGD at one site runs ``T`` steps; step ``t`` adds the clipped per-example gradients of its
Poisson sample (expected ``q n`` rows, each of norm at most ``C``) and Gaussian noise ``N(0, sigma^2 C^2 I_d)``
(Abadi et al. 2016, Algorithm 1). Over the task the clipped signal adds up to at most ``T q n C`` while the noise
adds up to norm about ``sigma C sqrt(T d)``, so the figure

    snr = sqrt(T) * q * n / (sigma * sqrt(d))

is the signal-to-noise ratio of what the site's updates carry (for aligned gradients: an upper bound of the
signal). It falls with ``sqrt(d)`` -- the reason the demo's 3.7 M-parameter trainable set learns nothing at epsilon
8 (docs/results/privacy.md) -- and rises with the rows per step ``q n`` faster than ``sigma`` does, which is why
small sites do best with full batches. The planner proposes the candidate with the largest ``snr`` at the smallest
site (ties: fewer parameters). A full-batch candidate runs the same number of steps per round as the task's
batch would (``epochs * ceil(n / batch_size)`` at the smallest site), each over every row, or at most
``max_passes`` per epoch when given (a compute budget: each full-batch step is one pass over the rows; for
``q = 1`` the ``snr`` hardly depends on the number of steps, since sigma grows as its square root).

Learning rates: per-example clipping bounds each row's gradient by ``C`` and the step divides by ``q n``, so a
DP step is a clipped mean gradient, typically much smaller than the unclipped one; DP-SGD needs plain SGD at a
larger rate than the non-private run. :data:`SUGGESTED_OPTIMIZER` gives the settings measured on the demo
(docs/results/privacy.md), not a rule.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from fedclinic.errors import ConfigError
from fedclinic.proto import task_pb2
from fedclinic.spec.selection import select_names
from fedclinic.strategies.dp_accounting import TaskPlan, plan_for_config

#: trainable-set name -> (optimizer, learning rate) measured with DP-SGD on the demo (docs/results/privacy.md)
SUGGESTED_OPTIMIZER = {"head": ("sgd", 2.0), "lora": ("sgd", 0.5), "layers": ("sgd", 0.5)}
#: logical batches tried besides the task's batch and the full batch (when smaller than the smallest site)
LOGICAL_BATCHES = (64, 256, 1024)


@dataclass(frozen=True)
class TrainableSet:
    """Tensors to train: a name, the task's ``trainable`` patterns and their parameter count ``d``."""

    name: str
    parameters: int
    patterns: tuple[str, ...] = ()
    kind: str = "layers"   # "head" | "lora" | "layers": which entry of SUGGESTED_OPTIMIZER applies
    #: the task's [model_config] the count assumes (bert_trainable_sets: mean pooling, no pooler)
    model_config: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Candidate:
    """One configuration: a trainable set, a sampling choice, and every site's plan for it."""

    trainable: TrainableSet
    sampling: str                        # "batch" | "logical" | "full"
    privacy: dict[str, Any]              # the task's [privacy] section for it
    plans: tuple[TaskPlan, ...]          # one per site, in the order of the rows given
    rows: tuple[int, ...]

    @property
    def snr(self) -> float:
        """min over sites of ``sqrt(T) q n / (sigma sqrt(d))`` (see the module docstring)."""
        return min(math.sqrt(p.total_steps) * p.sample_rate * n / (p.noise_multiplier * math.sqrt(
            self.trainable.parameters)) for p, n in zip(self.plans, self.rows))

    @property
    def epsilon(self) -> float:
        """The largest epsilon any site will charge (each plans for the target, so at most the target)."""
        return max(p.planned_epsilon for p in self.plans)

    @property
    def smallest(self) -> TaskPlan:
        return self.plans[self.rows.index(min(self.rows))]


@dataclass
class PrivacyPlanner:
    """Candidates and the proposal for a task of ``rounds`` rounds x ``epochs`` local epochs at sites of ``rows``
    rows, target ``(epsilon, delta)``, physical batch ``batch_size`` and clip ``max_grad_norm``."""

    epsilon: float
    delta: float
    rows: Sequence[int]
    rounds: int
    epochs: int = 1
    batch_size: int = 16
    max_grad_norm: float = 1.0
    accountant: str = "rdp"
    sets: Sequence[TrainableSet] = field(default_factory=list)
    #: compute budget of a full-batch candidate: at most this many passes over the site's rows per epoch (each
    #: full-batch step is one pass); 0 = no cap (as many steps as the task's batch would take)
    max_passes: int = 0

    def __post_init__(self) -> None:
        if not self.rows or any(int(n) <= 0 for n in self.rows):
            raise ConfigError(f"give every site's training row count (each > 0), got {list(self.rows)}")
        if not self.sets:
            raise ConfigError("no trainable set to plan for: give the model folder or parameter counts")
        if self.rounds <= 0 or self.epochs <= 0 or self.batch_size <= 0 or self.max_passes < 0:
            raise ConfigError("rounds, epochs and batch_size must be positive (max_passes >= 0)")

    def privacy_section(self, sampling: str, logical_batch: int = 0) -> dict[str, Any]:
        """The task's ``[privacy]`` for one sampling choice (``Task.privacy``; spec.task.privacy_config)."""
        out: dict[str, Any] = {"level": "sample", "target_epsilon": self.epsilon, "target_delta": self.delta,
                               "max_grad_norm": self.max_grad_norm, "accountant": self.accountant}
        if sampling == "logical":
            out["logical_batch_size"] = int(logical_batch)
        elif sampling == "full":
            out["sample_rate"] = 1.0
            steps = math.ceil(min(self.rows) / self.batch_size)
            out["steps_per_round"] = self.epochs * (min(steps, self.max_passes) if self.max_passes > 0 else steps)
        return out

    def _plans(self, section: dict[str, Any]) -> tuple[TaskPlan, ...]:
        from fedclinic.spec.task import privacy_config  # the same conversion a submitted task goes through

        pc: task_pb2.PrivacyConfig = privacy_config(section)
        # a site's plan depends on its row count only: sites of the same size share one noise search
        by_rows = {n: plan_for_config(pc, num_examples=n, batch_size=self.batch_size, local_epochs=self.epochs,
                                      rounds=self.rounds) for n in sorted({int(n) for n in self.rows})}
        return tuple(by_rows[int(n)] for n in self.rows)

    def candidates(self) -> list[Candidate]:
        """Every trainable set x {the task's batch, each logical batch below the smallest site, the full batch}."""
        samplings = [("batch", 0)] + [("logical", b) for b in LOGICAL_BATCHES if self.batch_size < b < min(self.rows)]
        samplings.append(("full", 0))
        plans = {s: self._plans(self.privacy_section(*s)) for s in samplings}  # the accounting is d-independent
        return [Candidate(ts, s[0], self.privacy_section(*s), plans[s], tuple(int(n) for n in self.rows))
                for ts in self.sets for s in samplings]

    def propose(self, candidates: Sequence[Candidate] | None = None) -> Candidate:
        """The candidate with the largest :attr:`Candidate.snr` (ties: fewer parameters)."""
        cands = list(candidates if candidates is not None else self.candidates())
        return max(cands, key=lambda c: (round(c.snr, 9), -c.trainable.parameters))


def bert_trainable_sets(folder: str | Path, num_labels: int, lora_rank: int = 0) -> list[TrainableSet]:
    """The demo-style trainable sets of a BERT-family encoder classifier with mean pooling (no pooler), counted
    from its ``config.json``: the head (``H K + K``), the head and the top 1 / top 2 layers, every layer, and with
    ``lora_rank`` r the head plus query/value adapters in every layer (``4 r H`` per layer). A layer holds
    ``4 (H^2 + H)`` attention, ``2 H I + I + H`` feed-forward and ``4 H`` LayerNorm parameters."""
    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(path.read_text())
        hidden, layers, inter = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["intermediate_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: cannot read hidden_size, num_hidden_layers and intermediate_size ({exc}); give "
                          "--params NAME=COUNT instead") from None
    if num_labels < 2:
        raise ConfigError(f"a classifier needs at least 2 labels, got {num_labels}")
    head = hidden * num_labels + num_labels
    layer = 4 * (hidden * hidden + hidden) + 2 * hidden * inter + inter + hidden + 4 * hidden
    top = layers - 1
    mean = (("pooling", "mean"),)
    sets = [TrainableSet("head", head, (r"classifier\..*",), "head", mean),
            TrainableSet("head+top1", head + layer, (r"classifier\..*", rf"bert\.encoder\.layer\.{top}\..*"),
                         model_config=mean),
            TrainableSet("head+top2", head + 2 * layer,
                         (r"classifier\..*", rf"bert\.encoder\.layer\.({top - 1}|{top})\..*"), model_config=mean),
            TrainableSet("all", head + layers * layer, (r"classifier\..*", r"bert\.encoder\.layer\.\d+\..*"),
                         model_config=mean)]
    if lora_rank > 0:
        sets.insert(1, TrainableSet(f"lora-r{lora_rank}", head + layers * 4 * lora_rank * hidden,
                                    (r"classifier\..*", r".*\.lora_[AB]"), "lora", mean))
    return sets


def sets_from_sizes(sizes: Mapping[str, int], sets: Mapping[str, tuple[Sequence[str], str]]) -> list[TrainableSet]:
    """Trainable sets counted on a model's tensors: ``sizes`` maps tensor name -> element count, ``sets`` maps a
    set's name -> (its trainable patterns, its kind). Patterns select names as a task's ``trainable`` does
    (:func:`fedclinic.spec.selection.select_names`)."""
    out = []
    for name, (patterns, kind) in sets.items():
        chosen = select_names(list(sizes), list(patterns))
        if not chosen:
            raise ConfigError(f"trainable set {name!r}: no tensor of the model matches {list(patterns)}")
        out.append(TrainableSet(name, sum(int(sizes[t]) for t in chosen), tuple(patterns), kind))
    return out


def parse_params(items: Sequence[str]) -> list[TrainableSet]:
    """``NAME=COUNT`` entries (``head=1925``) as trainable sets; a name starting with "head" or "lora" gets that
    kind's suggested optimizer."""
    out = []
    for item in items:
        name, _, count = item.partition("=")
        try:
            d = int(count)
        except ValueError:
            d = 0
        if not name or d <= 0:
            raise ConfigError(f"--params takes NAME=COUNT with COUNT > 0 (e.g. head=1925), got {item!r}")
        kind = "head" if name.startswith("head") and "+" not in name else "lora" if name.startswith("lora") else "layers"
        out.append(TrainableSet(name, d, (), kind))
    return out
