"""Privacy accounting: (epsilon, delta) of a whole task, and the noise that meets a target (torch-free).

Used by the ``dp-fedavg`` strategy (:mod:`.client_dp`) and by DP-SGD at the sites (through
:mod:`fedclinic.privacy.accounting`).

DP-SGD (Abadi et al. 2016) with Poisson sampling at rate ``q = batch_size / n``, per-sample clipping to norm
C and Gaussian noise of standard deviation ``sigma * C`` is the subsampled Gaussian mechanism applied ``T``
times. Its privacy loss is computed by Opacus' accountants (the library the product uses for DP-SGD):

``rdp``
    Renyi DP of the sampled Gaussian mechanism (Mironov et al. 2019), composed additively over steps and
    converted to (epsilon, delta) at the best order. Conservative, fast.
``prv``
    Privacy random variables (Gopi et al. 2021): the privacy-loss distribution composed numerically by FFT.
    Tighter (smaller epsilon for the same noise), slower.

Golden values (tests): sigma 1.5, q 0.04, 2250 steps, delta 1e-5 -> RDP epsilon 7.329, PRV 6.779.

A **task** at a site runs ``rounds x local_steps`` DP-SGD steps on the same dataset, so its budget is
planned for all of them at once: :func:`plan_task` returns the noise multiplier for which the whole task
spends at most ``target_epsilon``. :class:`TaskAccountant` keeps what was actually run (a history of
``(sigma, q, steps)``), serialises it as JSON (never pickle) so the state survives restarts, and answers the
cumulative epsilon after every round.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

from fedclinic.errors import ConfigError

ACCOUNTANTS = ("rdp", "prv")
#: the most noisy steps a task's own sampling rate may imply per round (the bound of privacy.steps_per_round)
MAX_STEPS_PER_ROUND = 100_000


def _check_accountant(kind: str) -> str:
    if kind not in ACCOUNTANTS:
        raise ConfigError(f"privacy accountant {kind!r} is unknown; choose one of {', '.join(ACCOUNTANTS)}")
    return kind


def _opacus_accountant(kind: str):
    from opacus.accountants import PRVAccountant, RDPAccountant

    return RDPAccountant() if _check_accountant(kind) == "rdp" else PRVAccountant()


def epsilon_of(history: list[tuple[float, float, int]], delta: float, accountant: str = "rdp") -> float:
    """Epsilon at ``delta`` after running every ``(noise_multiplier, sample_rate, steps)`` entry in turn."""
    _check_delta(delta)
    steps = [(float(s), float(q), int(n)) for s, q, n in history if int(n) > 0]
    if not steps:
        return 0.0
    acc = _opacus_accountant(accountant)
    acc.history = steps
    with warnings.catch_warnings():
        # RDP warns when the best order is the largest one tried; the bound stays valid (only looser)
        warnings.simplefilter("ignore", UserWarning)
        return float(acc.get_epsilon(delta=delta))


def epsilon_from_rdp(orders: "list[float] | tuple[float, ...]", rdp: "list[float] | tuple[float, ...]",
                     delta: float) -> tuple[float, float]:
    """(epsilon, best order) at ``delta`` from RDP values at ``orders``: the conversion Opacus' RDP accountant uses
    (Balle et al., AISTATS 2020, "Hypothesis testing interpretations and Renyi differential privacy", Thm. 21)::

        eps = min over alpha of  rdp(alpha) + log((alpha - 1) / alpha) - (log delta + log alpha) / (alpha - 1)

    Torch-free (pure math), for mechanisms Opacus has no accountant for (the Skellam mechanism of distributed DP,
    :mod:`.skellam_accounting`); ``test_skellam_accounting`` checks it against Opacus' ``get_privacy_spent``."""
    _check_delta(delta)
    if len(orders) != len(rdp) or not orders:
        raise ValueError("epsilon_from_rdp needs one RDP value per order")
    best, best_order = math.inf, float(orders[0])
    for a, r in zip(orders, rdp):
        if not a > 1:
            raise ValueError(f"RDP orders must be > 1, got {a}")
        eps = r + math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1)
        if eps < best:
            best, best_order = eps, float(a)
    return max(0.0, best), best_order


def _check_delta(delta: float) -> None:
    if not (0.0 < delta < 1.0):
        raise ConfigError(f"delta must be in (0, 1), got {delta}; use less than 1/n for n records (e.g. 1e-5)")


def noise_for_target(target_epsilon: float, delta: float, sample_rate: float, steps: int,
                     accountant: str = "rdp", tolerance: float = 0.01) -> float:
    """The smallest noise multiplier (to ``tolerance`` in epsilon) for which ``steps`` steps at ``sample_rate``
    spend at most ``target_epsilon`` at ``delta``. Binary search over sigma with the chosen accountant."""
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ConfigError(f"target epsilon must be a positive number, got {target_epsilon}")
    _check_delta(delta)
    if not (0.0 < sample_rate <= 1.0):
        raise ConfigError(f"sample rate must be in (0, 1], got {sample_rate}")
    if steps <= 0:
        raise ConfigError(f"a private task needs at least one training step, got {steps}")
    lo, hi = 0.0, 2.0
    while epsilon_of([(hi, sample_rate, steps)], delta, accountant) > target_epsilon:
        lo, hi = hi, 2 * hi
        if hi > 1e4:
            raise ConfigError(f"no noise level reaches epsilon {target_epsilon} for {steps} steps at sample "
                              f"rate {sample_rate:.4g}; raise the target epsilon or train for fewer rounds/epochs")
    while True:
        mid = (lo + hi) / 2
        eps = epsilon_of([(mid, sample_rate, steps)], delta, accountant)
        if eps > target_epsilon:
            lo = mid
        else:
            hi = mid
            if target_epsilon - eps <= tolerance:
                return hi
        if hi - lo < 1e-6:
            return hi


@dataclass(frozen=True)
class TaskPlan:
    """The DP-SGD parameters of one task at one site, fixed before its first round."""

    noise_multiplier: float
    sample_rate: float
    steps_per_round: int
    rounds: int
    delta: float
    accountant: str
    planned_epsilon: float     # epsilon after all rounds, at ``delta``

    @property
    def total_steps(self) -> int:
        return self.steps_per_round * self.rounds


def plan_task(*, num_examples: int, batch_size: int, local_epochs: int, rounds: int, delta: float,
              accountant: str = "rdp", target_epsilon: float | None = None,
              noise_multiplier: float | None = None, logical_batch_size: int = 0, sample_rate: float = 0.0,
              steps_per_round: int = 0) -> TaskPlan:
    """Plan DP-SGD for a task and either the noise for ``target_epsilon`` over all rounds or the epsilon a given
    ``noise_multiplier`` spends. Exactly one of the two must be given.

    Sampling rate: ``sample_rate`` when given (1 = full-batch DP-GD: every row in every step), else
    ``q = min(1, L / num_examples)`` with the logical batch ``L = logical_batch_size or batch_size`` (the
    physical ``batch_size`` only bounds how many rows DP-SGD processes at once, :mod:`fedclinic.privacy.dp_sgd`).
    Steps per round: ``steps_per_round`` when given, else ``local_epochs * ceil(1/q)`` (one expected pass per
    epoch). ``num_examples`` counts the privacy units: rows, or patients for a per-patient task (then the batch
    sizes count expected patients per step)."""
    if num_examples <= 0:
        raise ConfigError("the dataset is empty; nothing can be trained privately")
    if batch_size <= 0 or local_epochs <= 0 or rounds <= 0:
        raise ConfigError("batch_size, local_epochs and rounds must be positive for a private task")
    if (target_epsilon is None) == (noise_multiplier is None):
        raise ConfigError("give either target_epsilon or noise_multiplier for a private task, not both or neither")
    if logical_batch_size < 0 or steps_per_round < 0 or not (0.0 <= sample_rate <= 1.0):
        raise ConfigError(f"logical_batch_size and steps_per_round must be >= 0 and sample_rate in [0, 1] (0 = the "
                          f"default), got {logical_batch_size}, {steps_per_round}, {sample_rate}")
    _check_accountant(accountant)
    q = float(sample_rate) if sample_rate > 0 else min(1.0, (logical_batch_size or batch_size) / num_examples)
    steps = int(steps_per_round) if steps_per_round > 0 else local_epochs * math.ceil(1.0 / q)
    if sample_rate > 0 and steps > MAX_STEPS_PER_ROUND:
        raise ConfigError(f"sample_rate {sample_rate:g} means {steps} steps per round (local_epochs / q); give a "
                          f"larger sample_rate or steps_per_round (at most {MAX_STEPS_PER_ROUND})")
    if target_epsilon is not None:
        sigma = noise_for_target(target_epsilon, delta, q, steps * rounds, accountant)
    else:
        sigma = float(noise_multiplier)  # type: ignore[arg-type]
        if not (sigma > 0 and math.isfinite(sigma)):
            raise ConfigError(f"noise_multiplier must be positive, got {noise_multiplier}")
    eps = epsilon_of([(sigma, q, steps * rounds)], delta, accountant)
    return TaskPlan(sigma, q, steps, rounds, delta, accountant, eps)


def plan_for_config(privacy: Any, *, num_examples: int, batch_size: int, local_epochs: int,
                    rounds: int) -> TaskPlan:
    """:func:`plan_task` for a task's ``PrivacyConfig`` (level "sample") at a site with ``num_examples`` rows: the
    one plan every site, ``fedclinic privacy plan`` and the simulator compute, so all show the same epsilon."""
    return plan_task(num_examples=num_examples, batch_size=batch_size, local_epochs=local_epochs,
                     rounds=max(1, rounds), delta=privacy.target_delta or 1e-5,
                     accountant=privacy.accountant or "rdp", target_epsilon=privacy.target_epsilon or None,
                     noise_multiplier=privacy.noise_multiplier or None,
                     logical_batch_size=privacy.logical_batch_size, sample_rate=privacy.sample_rate,
                     steps_per_round=privacy.steps_per_round)


@dataclass
class TaskAccountant:
    """What DP-SGD actually ran for one task on one dataset: ``(sigma, q, steps)`` entries, in order, and the
    privacy ``unit`` they protect ("example": one row; "patient": all of one patient's rows, q over patients)."""

    accountant: str
    delta: float
    history: list[tuple[float, float, int]] = field(default_factory=list)
    unit: str = "example"

    def __post_init__(self) -> None:
        _check_accountant(self.accountant)
        _check_delta(self.delta)

    def record(self, noise_multiplier: float, sample_rate: float, steps: int) -> None:
        if steps <= 0:
            return
        if self.history and self.history[-1][:2] == (noise_multiplier, sample_rate):
            s, q, n = self.history[-1]
            self.history[-1] = (s, q, n + steps)
        else:
            self.history.append((float(noise_multiplier), float(sample_rate), int(steps)))

    def epsilon(self) -> float:
        return epsilon_of(self.history, self.delta, self.accountant)

    def with_steps(self, noise_multiplier: float, sample_rate: float, steps: int) -> "TaskAccountant":
        """A copy that has also run ``steps`` more steps (what a round will spend, before it is charged)."""
        nxt = TaskAccountant(self.accountant, self.delta, list(self.history), self.unit)
        nxt.record(noise_multiplier, sample_rate, steps)
        return nxt

    def to_json(self) -> str:
        return json.dumps({"accountant": self.accountant, "delta": self.delta,
                           "history": [list(h) for h in self.history], "unit": self.unit})

    @classmethod
    def from_json(cls, text: str) -> "TaskAccountant":
        try:
            doc: dict[str, Any] = json.loads(text)
            history = [(float(s), float(q), int(n)) for s, q, n in doc["history"]]
            return cls(str(doc["accountant"]), float(doc["delta"]), history, str(doc.get("unit", "example")))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"privacy accountant state is not valid JSON of the expected shape: {exc}") from exc
