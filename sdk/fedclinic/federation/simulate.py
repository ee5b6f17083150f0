"""In-process federated simulation with the very code the agent and the aggregator run.

Per round ``r``::

    S_r   = the participating sites (all, or a seeded sample of ceil(participation * K), at least 1)
    for i in S_r:                       # sequentially, one warm model shared by the simulated sites
        load the global tensors -> [SAFL: choose site i's top-k layers, fedclinic.training.safl.select_layers]
        -> train_local(seed_{r,i}) -> d_i = local - global on the trainable (SAFL: selected + head) tensors
        w_i = strategy.weight_for(n_i, metrics_i)   # n_i, or a metric the site reports (train_loss, ...)
        strategy.accept(d_i, weight=w_i, site=f"site-{i}")
    global.update(strategy.finalize())  # e.g. FedAvg: w <- w + eta * sum n_i d_i / sum n_i
    evaluate the new global model on eval_data (if given)

Every site's examples are tokenized once (``encode``) and reused in every round. Per-site per-round
training seeds are derived from ``seed`` with ``numpy.random.SeedSequence([seed, train.seed, round, site])``, so a run
is reproducible and sites do not share shuffles.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from fedclinic.data.text import Example
from fedclinic.errors import ConfigError
from fedclinic.models import build_model, load_tensors, module_tensors
from fedclinic.transport.package import ModelPackage
from fedclinic.training import safl as safl_layers
from fedclinic.strategies import make_strategy
from fedclinic.training import private_modules
from fedclinic.spec.selection import select_names
from fedclinic.training.trainer import (
    TrainConfig,
    compute_delta,
    encode,
    evaluate,
    train_local,
)


@dataclass
class RoundRecord:
    round: int                       # 1-based
    sites: list[int]                 # indices into site_data of the sites that trained
    train_loss: float                # sample-weighted mean of the sites' local training losses
    num_samples: int                 # examples over the participating sites
    metrics: dict[str, float] = field(default_factory=dict)  # global model on eval_data after the round
    seconds: float = 0.0             # wall time of the round (training + aggregation + evaluation)
    #: SAFL: site index -> the layers it trained and sent this round (ascending), and its score A_l per layer
    selected_layers: dict[int, list[int]] = field(default_factory=dict)
    layer_scores: dict[int, dict[int, float]] = field(default_factory=dict)


@dataclass
class SimulationResult:
    rounds: list[RoundRecord]
    package: ModelPackage            # the final global model
    trainable: list[str]             # tensor names that were trained and aggregated
    initial_metrics: dict[str, float] = field(default_factory=dict)  # global model on eval_data before round 1
    #: site index -> that site's private tensors after its last round (private_patterns; never aggregated)
    private: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)


def site_seed(seed: int, train_seed: int, round_: int, site: int) -> int:
    """The local training seed of ``site`` in ``round_`` (a 31-bit int from a SeedSequence)."""
    keys = [int(seed) & 0xFFFFFFFF, int(train_seed) & 0xFFFFFFFF, round_, site]
    return int(np.random.SeedSequence(keys).generate_state(1)[0] >> 1)


def simulate(
    package: ModelPackage,
    site_data: Sequence[Sequence[Example] | Any],
    *,
    rounds: int,
    train: TrainConfig,
    strategy: str = "fedavg",
    strategy_params: Mapping[str, float] | None = None,
    trainable_patterns: Sequence[str] = (),
    frozen_patterns: Sequence[str] = (),
    private_patterns: Sequence[str] = (),
    eval_data: Sequence[Example] | Mapping[str, Any] | None = None,
    site_eval_data: Sequence[Sequence[Example] | Any] | None = None,
    participation: float = 1.0,
    seed: int = 0,
    progress: Callable[[RoundRecord], None] | None = None,
    safl: "safl_layers.SaflConfig | None" = None,
) -> SimulationResult:
    """Run ``rounds`` federated rounds over ``site_data`` starting from ``package``; returns the history.

    ``site_data`` holds one entry per site: a list of :class:`Example` (tokenized once here) or data already
    encoded for the model's family (anything with ``batch``, e.g. ``FeatureData``). ``eval_data`` is one
    evaluation set (metrics ``accuracy``, ``loss``, ...) or a mapping ``name -> set`` (metrics ``name/accuracy``,
    ...), e.g. ``{"test": all sites' test rows, "train": all sites' training rows}`` for the FLCMC protocol:
    accuracy and loss weighted by each site's sample count over *all* sites, every round.
    With ``train.optimizer_state == "keep"`` each site's optimizer moments carry over between its rounds.

    ``private_patterns`` (FedNER's private modules): matching tensors are trained at each site, kept by
    that site from round to round, and never given to the strategy. The global model keeps their initial
    values. ``site_eval_data`` (one set per site) evaluates, after every round, each site's model (the
    global shared tensors plus that site's private ones): metrics ``site-{i}/accuracy``, ... and their
    sample-weighted mean ``sites/accuracy``, ....

    ``safl`` (:class:`fedclinic.training.safl.SaflConfig`): every round each site profiles the global model's attention
    on a seeded sample of its rows (``fedclinic.training.safl.profile_seed(train.seed, round, "site-{i}")``, as an agent
    named ``site-{i}`` would), trains and sends its top-k layers and the head; the strategy averages each tensor
    over the sites that sent it. ``RoundRecord.selected_layers`` / ``layer_scores`` record the choices.
    """
    if not isinstance(rounds, int) or rounds < 1:
        raise ConfigError(f"rounds must be an integer >= 1, got {rounds!r}")
    if not site_data:
        raise ConfigError("site_data is empty; give one example list per simulated site")
    if not (isinstance(participation, (int, float)) and 0 < participation <= 1):
        raise ConfigError(f"participation must be in (0, 1], got {participation!r}")
    train.validate()
    strat = make_strategy(strategy, strategy_params)

    loaded = build_model(package)
    names = select_names(list(package.tensors), trainable_patterns, frozen_patterns, private_patterns)
    private_names = private_modules.private_names(package.tensors, private_patterns, frozen=frozen_patterns)
    if site_eval_data is not None and len(site_eval_data) != len(site_data):
        raise ConfigError(f"site_eval_data has {len(site_eval_data)} sets for {len(site_data)} sites")
    if safl is not None:
        problems = safl_layers.config_problems(safl_layers.SAFL, safl.top_k, safl.profile_samples, safl.token,
                                               loaded.family, loaded.architecture)
        problems += [] if problems else (safl_layers.composition_problems(strat, False)
                                         + safl_layers.model_problems(names, loaded.family, safl.top_k))
        if problems:
            raise ConfigError("SAFL cannot run: " + "; ".join(problems))
        names = safl_layers.sendable(names, loaded.family)

    def prepared(rows):
        return rows if hasattr(rows, "batch") else encode(list(rows), loaded, max_length=train.max_length)

    encoded = [prepared(rows) for rows in site_data]
    if isinstance(eval_data, Mapping):
        eval_sets = {f"{name}/": prepared(rows) for name, rows in eval_data.items()}
    else:
        eval_sets = {"": prepared(eval_data)} if eval_data is not None and len(eval_data) else {}

    def evaluate_all() -> dict[str, float]:
        return {prefix + k: v for prefix, data in eval_sets.items() for k, v in evaluate(loaded, data).items()}

    global_tensors: dict[str, np.ndarray] = {k: np.array(v, copy=True) for k, v in package.tensors.items()}
    site_eval = [prepared(rows) for rows in site_eval_data] if site_eval_data is not None else []
    private: dict[int, dict[str, np.ndarray]] = {}
    initial_private = {n: global_tensors[n] for n in private_names}  # a site's values before its first round

    def evaluate_sites() -> dict[str, float]:
        out: dict[str, float] = {}
        totals: dict[str, float] = {}
        n_total = 0
        if site_eval:
            load_tensors(loaded.module, global_tensors)  # once; per site only its private tensors change
        for i, data in enumerate(site_eval):
            if private_names:
                load_tensors(loaded.module, private.get(i) or initial_private)
            m = evaluate(loaded, data)
            out.update({f"site-{i}/{k}": v for k, v in m.items()})
            for k, v in m.items():
                if k != "n":
                    totals[k] = totals.get(k, 0.0) + v * m["n"]
            n_total += int(m["n"])
        out.update({f"sites/{k}": v / n_total for k, v in totals.items()} if n_total else {})
        return out

    initial = {**evaluate_all(), **evaluate_sites()}
    optimizer_states: dict[int, dict] = {}

    k_sites = len(site_data)
    per_round = max(1, math.ceil(participation * k_sites - 1e-9))
    history: list[RoundRecord] = []
    for r in range(1, rounds + 1):
        started = time.perf_counter()
        if per_round >= k_sites:
            chosen = list(range(k_sites))
        else:
            rng = np.random.default_rng(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, r, 0x5E1EC7]))
            chosen = sorted(int(i) for i in rng.choice(k_sites, size=per_round, replace=False))
        strat.begin(global_tensors)
        before = {n: global_tensors[n] for n in names}
        loss_sum = 0.0
        n_sum = 0
        selected: dict[int, list[int]] = {}
        scores: dict[int, dict[int, float]] = {}
        for i in chosen:
            load_tensors(loaded.module, {**global_tensors, **private.get(i, {})})
            cfg = replace(train, seed=site_seed(seed, train.seed, r, i))
            sent = names
            metrics_i: dict[str, float] = {}
            if safl is not None:
                choice = safl_layers.select_layers(loaded, encoded[i], safl, names,
                                                   seed=safl_layers.profile_seed(train.seed, r, f"site-{i}"))
                sent, selected[i], scores[i] = choice.tensors, choice.layers, choice.scores
                metrics_i = choice.metrics()
            result = train_local(loaded, encoded[i], cfg, trainable=sent + private_names,
                                 optimizer_state=optimizer_states.get(i))
            if private_names:
                private[i] = module_tensors(loaded.module, private_names)
            if result.optimizer_state is not None:
                optimizer_states[i] = result.optimizer_state
            delta = compute_delta(before, module_tensors(loaded.module, sent), sent)
            strat.accept(delta, weight=strat.weight_for(result.num_samples, {**result.reported_metrics(), **metrics_i}),
                         site=f"site-{i}")
            loss_sum += result.loss * result.num_samples
            n_sum += result.num_samples
        new = strat.finalize()
        global_tensors = {**global_tensors, **new}
        metrics: dict[str, float] = {}
        if eval_sets:
            load_tensors(loaded.module, global_tensors)
            metrics = evaluate_all()
        metrics.update(evaluate_sites())
        record = RoundRecord(round=r, sites=chosen, train_loss=loss_sum / n_sum, num_samples=n_sum,
                             metrics=metrics, seconds=time.perf_counter() - started, selected_layers=selected,
                             layer_scores=scores)
        history.append(record)
        if progress is not None:
            progress(record)
    final = ModelPackage(tensors=global_tensors, files=dict(package.files))
    return SimulationResult(rounds=history, package=final, trainable=names, initial_metrics=initial,
                            private=private)


__all__ = ["RoundRecord", "SimulationResult", "simulate", "site_seed"]
