"""In-process federated simulation with the very code the agent and the aggregator run.

Per round ``r``::

    S_r   = the participating sites (all, or a sample of ceil(participation * K) seeded by (seed, r), at least 1)
    for i in S_r:                       # sequentially, one warm model shared by the simulated sites
        load the global tensors -> fedclinic.federation.site_round.run_site_round(site = site_names[i], round = r)
        (the site's whole round as an agent runs it: seed, [SAFL selection], training [DP-SGD],
         d_i = local - global on the sent tensors, the task's codec with error feedback)
        w_i = strategy.weight_for(n_i, metrics_i)   # n_i, or a metric the site reports (train_loss, ...)
        strategy.accept(decode(C(d_i)), weight=w_i, site=site_names[i])
    [secure aggregation: the sites' flattened d_i are masked and summed in-process (fedclinic.secagg.inprocess);
     the strategy gets their mean, weight 1, as the aggregator does]
    global.update(strategy.finalize())  # e.g. FedAvg: w <- w + eta * sum n_i d_i / sum n_i
    evaluate the new global model on eval_data (if given)

Every site's examples are tokenized once (``encode``) and reused in every round. Site ``i`` is named
``site_names[i]`` (default ``"site-{i}"``); its training seed in round ``r`` is
``fedclinic.federation.site_round.site_seed(train.seed, r, name)``, the derivation an agent of that name uses, so a
simulated task trains the models a federation of agents with those names trains. ``seed`` only chooses the
participating sites.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Sequence

import numpy as np

from fedclinic.transport import codec_wire
from fedclinic.codecs import ErrorFeedback
from fedclinic.data.text import Example
from fedclinic.errors import ConfigError
from fedclinic.models import build_model, load_tensors
from fedclinic.evaluation.combine import weighted_metrics
from fedclinic.transport.package import ModelPackage
from fedclinic.training import safl as safl_layers
from fedclinic.strategies import make_strategy
from fedclinic.training import private_modules
from fedclinic.proto import task_pb2
from fedclinic.spec.selection import select_names
from fedclinic.federation.site_round import SiteRoundInput, SiteRoundResult, run_site_round
from fedclinic.training.trainer import TrainConfig, encode, evaluate


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


@dataclass(frozen=True)
class SampleDP:
    """Sample-level DP-SGD for every simulated site, planned per site as an agent plans it
    (:func:`fedclinic.privacy.accounting.plan_task` over the task's rounds): ``q = batch_size / n_i`` (or the
    logical batch / fixed rate below),
    ``local_epochs * ceil(1/q)`` steps per round, and the noise multiplier given or the one that meets
    ``target_epsilon`` at ``delta``; ``max_grad_norm`` is the per-example clip C."""

    max_grad_norm: float = 1.0
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta: float = 1e-5
    accountant: str = "rdp"
    #: the logical batch, fixed sampling rate and steps per round of the task's [privacy] section (0 = default;
    #: :func:`fedclinic.strategies.dp_accounting.plan_task`)
    logical_batch_size: int = 0
    sample_rate: float = 0.0
    steps_per_round: int = 0
    #: seed of DP-SGD's sampler and noise at every site and round (None: drawn from the OS, as at a site); a
    #: simulation protects nothing, so a fixed value only makes a private run reproducible
    entropy: int | None = None
    #: per-patient DP (``privacy.unit = "patient"``): for each site, the patient id of each of its rows (in
    #: ``site_data`` order); sites then sample, clip and plan over patients (fedclinic.privacy.patient_groups)
    patient_ids: Sequence[Sequence[Hashable]] | None = None

    def for_site(self, num_examples: int, train: TrainConfig, rounds: int):
        """The :class:`fedclinic.privacy.dp_sgd.DPSGD` settings of one site's rounds (``num_examples``: its privacy
        units, rows or patients)."""
        # lazy: opacus loads only for a private simulation
        from fedclinic.privacy.accounting import plan_task
        from fedclinic.privacy.dp_sgd import DPSGD

        plan = plan_task(num_examples=num_examples, batch_size=train.batch_size, local_epochs=train.local_epochs,
                         rounds=rounds, delta=self.delta, accountant=self.accountant,
                         target_epsilon=self.target_epsilon, noise_multiplier=self.noise_multiplier,
                         logical_batch_size=self.logical_batch_size, sample_rate=self.sample_rate,
                         steps_per_round=self.steps_per_round)
        return DPSGD(plan.noise_multiplier, self.max_grad_norm, plan.sample_rate, plan.steps_per_round)



def _units(dp: SampleDP, site: int, rows: int) -> int:
    """What a site's DP-SGD counts: its rows, or its patients under per-patient DP."""
    return rows if dp.patient_ids is None else len(set(dp.patient_ids[site]))

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
    codec: str = codec_wire.RAW,
    dp: SampleDP | None = None,
    secure_aggregation: "task_pb2.SecureAggregationConfig | None" = None,
    site_names: Sequence[str] | None = None,
    task_id: str = "simulation",
    site_rounds: "Callable[[int, int, SiteRoundResult], None] | None" = None,
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

    As a task's ``[update]``, ``[privacy]`` and ``[secure_aggregation]`` do at the agents: ``codec`` (e.g.
    ``"topk:0.05+int8"``) encodes every site's update, with its error feedback kept per site, and the strategy
    gets the decoded deltas; ``dp`` trains every site with DP-SGD; ``secure_aggregation`` (a
    ``SecureAggregationConfig``, defaults filled in as the aggregator does) sums the sites' updates masked, in
    process, and gives the strategy their mean. ``site_names`` names the sites (their seeds, the strategy's
    ``site``, the secure-aggregation cohort); ``task_id`` keys the codecs' stochastic rounding as the task id does
    at an agent. ``site_rounds(round, site index, result)`` is called after each site's round with what the site
    computed (its seed, delta and encoded update, fedclinic.federation.site_round.SiteRoundResult).
    """
    if not isinstance(rounds, int) or rounds < 1:
        raise ConfigError(f"rounds must be an integer >= 1, got {rounds!r}")
    if not site_data:
        raise ConfigError("site_data is empty; give one example list per simulated site")
    if not (isinstance(participation, (int, float)) and 0 < participation <= 1):
        raise ConfigError(f"participation must be in (0, 1], got {participation!r}")
    train.validate()
    strat = make_strategy(strategy, strategy_params)
    names_of = list(site_names) if site_names is not None else [f"site-{i}" for i in range(len(site_data))]
    if len(names_of) != len(site_data) or len(set(names_of)) != len(names_of):
        raise ConfigError(f"site_names must name each of the {len(site_data)} sites once, got {names_of!r}")
    problems = codec_wire.spec_problems(codec, secure_aggregation=secure_aggregation is not None)
    if problems:
        raise ConfigError("; ".join(problems))
    if secure_aggregation is not None and not codec_wire.is_raw(codec):
        raise ConfigError(f"the simulator runs secure aggregation with codec 'raw' only; secure {codec!r} (a shared "
                          "random index set) runs in a local federation (fedclinic.federation.local_federation)")
    if secure_aggregation is not None and safl is not None:
        raise ConfigError("secure aggregation sums one vector of the same tensors from every site; SAFL sites send "
                          "different layers: use one or the other")
    if secure_aggregation is not None:
        from fedclinic.secagg.config import MIN_COHORT_FLOOR  # lazy: cryptography only for a secure simulation

        floor = max(MIN_COHORT_FLOOR, secure_aggregation.min_cohort)
        if max(1, math.ceil(participation * len(site_data) - 1e-9)) < floor:
            raise ConfigError(f"secure aggregation needs at least {floor} sites per round; this simulation has "
                              f"{max(1, math.ceil(participation * len(site_data) - 1e-9))}")

    loaded = build_model(package)
    # in the order of the model's manifest (by name), as an Assignment's send list gives them to an agent
    names = select_names(sorted(package.tensors), trainable_patterns, frozen_patterns, private_patterns)
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
        """Each site's model on its own set, and ``sites/...`` combined as the aggregator combines the sites'
        evaluations (fedclinic.evaluation.combine: weighted by rows evaluated, counts summed)."""
        out: dict[str, float] = {}
        per_site: dict[str, dict[str, float]] = {}
        if site_eval:
            load_tensors(loaded.module, global_tensors)  # once; per site only its private tensors change
        for i, data in enumerate(site_eval):
            if private_names:
                load_tensors(loaded.module, private.get(i) or initial_private)
            m = evaluate(loaded, data)
            out.update({f"site-{i}/{k}": v for k, v in m.items()})
            per_site[f"site-{i}"] = {**{k: v for k, v in m.items() if k != "n"}, "eval_rows": m["n"]}
        pooled = weighted_metrics(per_site)
        out.update({f"sites/{k}": v for k, v in pooled.items() if k != "eval_rows"} if pooled.get("eval_rows") else {})
        return out

    initial = {**evaluate_all(), **evaluate_sites()}
    optimizer_states: dict[int, dict] = {}
    feedback: dict[int, ErrorFeedback] = {}

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
        secure_updates: dict[str, np.ndarray] = {}
        for i in chosen:
            load_tensors(loaded.module, global_tensors)
            out = run_site_round(loaded, encoded[i], SiteRoundInput(
                task_id=task_id, site=names_of[i], round=r, send=names, train=train, private=private_names,
                codec=codec, safl=safl, optimizer_state=optimizer_states.get(i),
                dp=dp.for_site(_units(dp, i, len(encoded[i])), train, rounds) if dp is not None else None,
                dp_groups=dp.patient_ids[i] if dp is not None and dp.patient_ids is not None else None,
                private_values=private.get(i, initial_private) if private_names else None,
                feedback=feedback.get(i), dp_entropy=dp.entropy if dp is not None else None))
            if site_rounds is not None:
                site_rounds(r, i, out)
            result = out.train
            if private_names:
                private[i] = out.private_values
            if result.optimizer_state is not None:
                optimizer_states[i] = result.optimizer_state
            if out.selection is not None:
                selected[i], scores[i] = out.selection.layers, out.selection.scores
            if secure_aggregation is not None:
                secure_updates[names_of[i]] = np.concatenate(
                    [np.asarray(out.delta[n], np.float32).ravel() for n in out.send]) if out.send \
                    else np.zeros(0, np.float32)
            else:
                strat.accept(out.update.decoded(), weight=strat.weight_for(result.num_samples, out.metrics),
                             site=names_of[i])
            if out.feedback is not None:  # delivered in-process: the staged residual becomes the site's
                out.feedback.commit()
                feedback[i] = out.feedback
            loss_sum += result.loss * result.num_samples
            n_sum += result.num_samples
        if secure_aggregation is not None:
            strat.accept(_secure_mean(secure_aggregation, task_id, r, secure_updates, before), weight=1.0,
                         site="secure-aggregation")
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


def _secure_mean(cfg: "task_pb2.SecureAggregationConfig", task_id: str, round_: int, updates: dict[str, np.ndarray],
                 before: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One secure-aggregation session over ``updates`` (site -> flattened delta, in the order of ``before``),
    run in process with the task's quantizer, degree and threshold; the survivors' mean, unflattened."""
    # lazy: cryptography only for a secure simulation
    from fedclinic.secagg.config import MIN_COHORT_FLOOR, SessionParams
    from fedclinic.secagg.inprocess import run_round
    from fedclinic.secagg.task_config import quantizer_of

    length = sum(int(a.size) for a in before.values())
    model_hash = hashlib.sha256(f"fedclinic-simulation\0{task_id}\0{round_}".encode()).digest()
    params = SessionParams(task_id=task_id, round=round_, cohort=tuple(sorted(updates)), model_hash=model_hash,
                           vector_length=length, quantizer=quantizer_of(cfg), degree=cfg.degree or None,
                           threshold=cfg.threshold)
    result = run_round(params, updates, min_cohort=max(MIN_COHORT_FLOOR, cfg.min_cohort))
    mean = result.total / np.float32(len(result.survivors))
    out: dict[str, np.ndarray] = {}
    offset = 0
    for name, arr in before.items():
        out[name] = mean[offset:offset + arr.size].reshape(arr.shape)
        offset += arr.size
    return out


__all__ = ["RoundRecord", "SampleDP", "SimulationResult", "simulate"]
