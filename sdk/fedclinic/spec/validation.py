"""The one validator of a task spec (the ``TaskSpec`` proto), shared by the SDK, the aggregator and the agents.

Two layers of rules, each problem a sentence that says what to change:

- :func:`definition_problems` (the spec alone): every number finite and within its bounds (:data:`BOUNDS`,
  :data:`MAX_STRATEGY_PARAM`), names, round settings, secure aggregation, differential privacy, update and
  downlink codecs, the strategy and the layer selection. ``fedclinic.spec.task.Task.validate``
  reports these (after its own checks of the Python/TOML input the proto cannot carry: unknown keys, types,
  label sets, the model family table).
- :func:`submit_problems` (the spec against its initial model's manifest, as the aggregator checks it at
  ``SubmitTask``): the tokenizer hash, the tensor patterns, SAFL's layers, and what the strategy demands of
  the round and training settings (enough updates per round, measured gradients).

:func:`spec_problems` is both (the second only with a manifest) and :func:`check_spec` raises them as one
:class:`~fedclinic.errors.ConfigError` (``task spec rejected: ...``). A hospital agent can call either on an
assignment's spec. Nothing here imports torch: the aggregator image has none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedclinic.errors import ConfigError
from fedclinic.proto import task_pb2
from fedclinic.secagg import dp_plan
from fedclinic.secagg.task_config import spec_problems as secure_aggregation_problems
from fedclinic.spec import safl_settings as safl
from fedclinic.spec.capabilities import LOOP_MODELS, check_supported, step_in_backward_problems
from fedclinic.spec.selection import private_names, select_names
from fedclinic.strategies import Strategy, make_strategy
from fedclinic.transport import codec_wire, downlink
from fedclinic.transport.package import Manifest

ACCOUNTANTS = ("rdp", "prv")
#: what sample-level DP protects (``privacy.unit``; "" = "example"): one example (a row of a site's dataset), or one
#: patient (every row that shares the patient id named by the site's ``group_field``; fedclinic.privacy.dp_sgd)
PRIVACY_UNITS = ("example", "patient")


@dataclass(frozen=True)
class Bound:
    """The range of one number of the spec: ``lo`` to ``hi`` (``lo`` itself excluded when ``lo_open``), a whole
    number when ``integer``; ``zero_default``: 0 in the spec means "the default" (the proto's unset value), so it
    is accepted there too. Every bounded number must also be finite (NaN and infinities are refused)."""

    lo: float
    hi: float
    integer: bool = False
    zero_default: bool = False
    lo_open: bool = False
    hint: str = ""


#: Sane bounds of every number of a task (spec path -> Bound), the same for ``Task``, the aggregator's submit check
#: and the agent's SpecGate. Documented with the fields in fedclinic.spec.task and docs/data-scientist.md.
BOUNDS: dict[str, Bound] = {
    "training.local_epochs": Bound(1, 1000, integer=True, zero_default=True),
    "training.batch_size": Bound(1, 65536, integer=True, zero_default=True),
    "training.learning_rate": Bound(0, 10.0, lo_open=True, zero_default=True),
    "training.weight_decay": Bound(0, 10.0),
    "training.max_grad_norm": Bound(0, 1e6, hint="0 disables clipping"),
    "training.max_steps": Bound(0, 10_000_000, integer=True, hint="0 = no cap"),
    "training.proximal_mu": Bound(0, 1000.0, hint="0 disables FedProx"),
    "training.max_length": Bound(8, 32768, integer=True, zero_default=True),
    "rounds.num_rounds": Bound(1, 1000, integer=True, hint="split a longer training into several tasks, each "
                                                           "starting from the previous one's model"),
    "rounds.min_sites": Bound(1, 1000, integer=True),
    "rounds.participation_fraction": Bound(0, 1.0, lo_open=True),
    "rounds.round_timeout_s": Bound(0, 7 * 24 * 3600.0, lo_open=True, hint="seconds; at most 7 days"),
    "rounds.max_round_retries": Bound(0, 100, integer=True),
    "update.select_top_k_layers": Bound(0, 1000, integer=True),
    "update.safl_profile_samples": Bound(0, 100_000, integer=True),
    "privacy.target_epsilon": Bound(0, 1e6),
    "privacy.target_delta": Bound(0, 1.0),
    "privacy.max_grad_norm": Bound(0, 1e6),
    "privacy.noise_multiplier": Bound(0, 1e6),
    "privacy.scale": Bound(0, 1e12),
    "privacy.rounding_beta": Bound(0, 1.0),
    "privacy.logical_batch_size": Bound(0, 1 << 24, integer=True, hint="0 = the task's batch_size"),
    "privacy.steps_per_round": Bound(0, 100_000, integer=True, hint="0 = local_epochs / sampling rate"),
    "privacy.sample_rate": Bound(0, 1.0, hint="1 = full-batch DP-GD, 0 = from the logical batch"),
    "secure_aggregation.min_cohort": Bound(0, 1000, integer=True),
    "secure_aggregation.threshold": Bound(0, 1000, integer=True),
    "secure_aggregation.bits": Bound(0, 62, integer=True),
    "secure_aggregation.degree": Bound(0, 1000, integer=True),
    "secure_aggregation.clip": Bound(0, 1e6),
    "secure_aggregation.weight_cap": Bound(0, 1 << 24, integer=True),
    "secure_aggregation.metric_clip": Bound(0, 1e9),
    "evaluation.timeout_s": Bound(0, 7 * 24 * 3600.0, hint="seconds; 0 = rounds.round_timeout_s"),
    "statistics.epsilon": Bound(0.01, 100.0, zero_default=True,
                                hint="the epsilon of a statistics answer at each site; 0 = no noise"),
}
#: TaskSpec.kind values: "" trains (then evaluates the final model), the others train nothing
KINDS = ("", "evaluate", "statistics")
#: the largest magnitude of a numeric strategy parameter (server_lr, beta, byzantine, ...); each must be finite
MAX_STRATEGY_PARAM = 1e6


def bound_problem(path: str, value: object, *, zero_default: bool | None = None) -> str | None:
    """Why ``value`` cannot be the spec's number at ``path`` (a key of :data:`BOUNDS`), or None when it can.

    ``zero_default`` overrides the bound's own (``Task`` passes False: a Task states every value, 0 is not "the
    default" there). The message names the field, its range and the value, the same wherever it is checked (the
    zero a spec may hold for "the default" is documented with the field, not repeated in the message)."""
    b = BOUNDS[path]
    zero_ok = b.zero_default if zero_default is None else zero_default
    kind = "a whole number" if b.integer else "a finite number"
    what = (f"{path} must be {kind} above {_num(b.lo)} and at most {_num(b.hi)}" if b.lo_open
            else f"{path} must be {kind} from {_num(b.lo)} to {_num(b.hi)}")
    message = what + (f" ({b.hint})" if b.hint else "") + f", got {value!r}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return message
    if b.integer and not (isinstance(value, int) or (math.isfinite(value) and float(value).is_integer())):
        return message
    if not math.isfinite(value):
        return message
    if zero_ok and value == 0:
        return None
    if value > b.hi or value < b.lo or (b.lo_open and value == b.lo):
        return message
    return None


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def bounds_problems(spec: task_pb2.TaskSpec) -> list[str]:
    """Every number of the spec outside its :data:`BOUNDS` or not finite, and every strategy parameter that is not
    finite or above :data:`MAX_STRATEGY_PARAM` in magnitude."""
    p = []
    for path in BOUNDS:
        section, name = path.split(".")
        problem = bound_problem(path, getattr(getattr(spec, section), name))
        if problem:
            p.append(problem)
    for key in _bad_strategy_params(spec):
        p.append(f"strategy parameter {key!r} must be a finite number of magnitude at most "
                 f"{MAX_STRATEGY_PARAM:g}, got {spec.strategy_params[key]!r}")
    return p


def _bad_strategy_params(spec: task_pb2.TaskSpec) -> list[str]:
    return sorted(k for k, v in spec.strategy_params.items() if not (math.isfinite(v) and abs(v) <= MAX_STRATEGY_PARAM))


def strategy_of(spec: task_pb2.TaskSpec) -> Strategy:
    """The task's strategy, built from its numeric parameters and its string options (ConfigError if it
    cannot be built, or a parameter is not finite or above :data:`MAX_STRATEGY_PARAM` in magnitude)."""
    bad = _bad_strategy_params(spec)
    if bad:
        raise ConfigError(f"strategy {spec.strategy!r}: parameter(s) {bad} must be finite numbers of magnitude at "
                          f"most {MAX_STRATEGY_PARAM:g}")
    return make_strategy(spec.strategy, {**dict(spec.strategy_params), **dict(spec.strategy_options)})


def privacy_problems(spec: task_pb2.TaskSpec) -> list[str]:
    """What is wrong with the task's differential privacy (``spec.privacy`` with its strategy and model)."""
    pc = spec.privacy
    if not pc.level:
        return [f"privacy: unit {pc.unit!r} needs level = \"sample\" (the unit of sample-level DP-SGD)"] if pc.unit \
            else []
    if pc.unit and pc.level != "sample":
        return [f"privacy: unit is a setting of level \"sample\"; level {pc.level!r} protects one site's whole "
                "update, so remove unit (or use level \"sample\" with unit \"patient\")"]
    if pc.level == "client":
        return [] if spec.strategy == "dp-fedavg" else [
            'privacy level "client" clips and noises whole updates at the aggregator: use strategy '
            '"dp-fedavg" (its clip_norm and noise_multiplier set the mechanism)']
    if pc.level == dp_plan.LEVEL:
        return dp_plan.privacy_problems(spec)
    if pc.level != "sample":
        return [f'privacy level must be "sample" (DP-SGD at each site), "client" or "distributed", got {pc.level!r}']
    p = []
    try:
        check_supported(spec.family or "text-classification", spec.architecture or "transformer")
    except ConfigError as exc:
        p.append(f"privacy: {exc}")
    if (pc.target_epsilon > 0) == (pc.noise_multiplier > 0):
        p.append("privacy: give target_epsilon (the whole task's budget at each site) or noise_multiplier, not both")
    for key in ("target_epsilon", "noise_multiplier"):
        v = getattr(pc, key)
        if v < 0 or not math.isfinite(v):
            p.append(f"privacy: {key} must be a positive number, got {v!r}")
    if not (math.isfinite(pc.max_grad_norm) and pc.max_grad_norm > 0):
        p.append(f"privacy: max_grad_norm must be a positive number, got {pc.max_grad_norm!r}")
    if not 0 < pc.target_delta < 1:
        p.append(f"privacy: target_delta must be in (0, 1), e.g. 1e-5, got {pc.target_delta!r}")
    if pc.accountant not in ("", *ACCOUNTANTS):
        p.append(f"privacy: accountant must be \"rdp\" or \"prv\", got {pc.accountant!r}")
    if pc.unit not in ("", *PRIVACY_UNITS):
        p.append(f"privacy: unit must be \"example\" (one row) or \"patient\" (all of a patient's rows, for sites "
                 f"whose dataset declares a group_field), got {pc.unit!r}")
    if pc.unit == "patient" and (spec.family or "text-classification", spec.architecture or "transformer") in LOOP_MODELS:
        p.append(f"privacy: unit \"patient\" is not available for {spec.family} / {spec.architecture}: its sites clip "
                 "each row as they differentiate it (no per-layer rule), so a patient's rows cannot be clipped as one; "
                 "use unit \"example\", or a transformer architecture")
    if spec.strategy == "dp-fedavg":
        p.append('privacy level "sample" already noises at the sites; "dp-fedavg" is for level "client"')
    return p


def rounds_problems(spec: task_pb2.TaskSpec) -> list[str]:
    """What is wrong with the task's round settings (``spec.rounds``) beyond their numbers' :data:`BOUNDS`."""
    rc = spec.rounds
    p = []
    if rc.on_quorum_miss == task_pb2.QUORUM_POLICY_UNSPECIFIED:
        p.append("rounds.on_quorum_miss must be 'retry' or 'fail'")
    return p


def pos_weight_problems(spec: task_pb2.TaskSpec) -> list[str]:
    """``training.pos_weight`` (multi-label BCE class weights): empty, or one positive finite number per label of a
    multi-label text-classification task trained without sample-level DP (whose per-example loss is unweighted)."""
    weights = list(spec.training.pos_weight)
    if not weights:
        return []
    p = []
    if spec.family != "text-classification" or not spec.multi_label:
        p.append("training.pos_weight applies to multi-label text-classification tasks only (multi_label = true)")
    if len(weights) != len(spec.labels):
        p.append(f"training.pos_weight needs one number per label ({len(spec.labels)}), got {len(weights)}")
    bad = [w for w in weights if not (math.isfinite(w) and w > 0)]
    if bad:
        p.append(f"training.pos_weight values must be positive finite numbers, got {bad[:3]}")
    if spec.privacy.level == "sample":
        p.append("training.pos_weight is not supported with sample-level differential privacy yet; remove one")
    return p


def definition_problems(spec: task_pb2.TaskSpec) -> list[str]:
    """Every problem of the spec on its own (see the module docstring); empty when there is none."""
    p = []
    if not spec.name:
        p.append("name is empty")
    if not spec.family:
        p.append("family is empty")
    if not spec.dataset:
        p.append("dataset is empty (name a dataset of the sites' registries)")
    bounds = bounds_problems(spec)
    p.extend(bounds)
    p.extend(rounds_problems(spec))
    p.extend(pos_weight_problems(spec))
    t = spec.training
    p.extend(step_in_backward_problems(t.step_in_backward, max_grad_norm=t.max_grad_norm, proximal_mu=t.proximal_mu,
                                       optimizer_state=t.optimizer_state, private=spec.privacy.level == "sample"))
    if not bounds:  # it builds a session for the smallest cohort: not from absurd numbers
        p.extend(secure_aggregation_problems(spec))
    p.extend(privacy_problems(spec))
    p.extend(codec_wire.spec_problems(spec.update.codec, secure_aggregation=spec.secure_aggregation.enabled))
    p.extend(downlink.spec_problems(spec.update.downlink_codec))
    strategy: Strategy | None = None
    if not _bad_strategy_params(spec):  # those are named above
        try:
            strategy = strategy_of(spec)
        except ConfigError as exc:
            p.append(str(exc))
    u = spec.update
    selection = safl.config_problems(u.selection, u.select_top_k_layers, u.safl_profile_samples, u.safl_token,
                                     spec.family, spec.architecture)
    p.extend(selection)
    if u.selection == safl.SAFL and not selection and strategy is not None:
        p.extend(safl.composition_problems(strategy, spec.secure_aggregation.enabled))
    p.extend(kind_problems(spec))
    return p


def kind_problems(spec: task_pb2.TaskSpec) -> list[str]:
    """What the task's kind does not allow: an unknown kind; ``model_task`` outside an "evaluate" task; an
    "evaluate" or "statistics" task that asks for training-time protections it cannot use."""
    p = []
    if spec.kind not in KINDS:
        p.append(f"kind {spec.kind!r} is unknown; choose \"train\" (the default), \"evaluate\" or \"statistics\"")
    if spec.evaluation.model_task and spec.kind != "evaluate":
        p.append('[evaluation] model_task names a model to evaluate: it needs kind = "evaluate"')
    if spec.kind in ("evaluate", "statistics") and spec.secure_aggregation.enabled:
        p.append(f"a {spec.kind} task trains nothing: remove [secure_aggregation] (only metrics leave the sites)")
    return p


def submit_problems(spec: task_pb2.TaskSpec, manifest: Manifest) -> list[str]:
    """The problems of a spec against its initial model (see the module docstring); assumes a spec whose
    strategy can be built (a problem of :func:`definition_problems` otherwise, and none is added here)."""
    p = []
    rc = spec.rounds
    if spec.tokenizer_sha256:
        tokenizer = next((f for f in manifest.files if f.path == "tokenizer.json"), None)
        if tokenizer is None or tokenizer.sha256 != spec.tokenizer_sha256:
            p.append("tokenizer_sha256 does not match the model's tokenizer.json (data contract: every site "
                     "tokenizes with the tokenizer the task declares); submit the model with its own tokenizer")
    try:
        strategy = strategy_of(spec)
    except ConfigError:
        return p
    if "gradient_change_rate" in strategy.site_metrics() and not spec.training.measure_gradient_change:
        p.append(f"strategy {strategy.name!r} weights sites by their gradient_change_rate; set "
                 "training.measure_gradient_change = true")
    if rc.min_sites < strategy.min_updates():
        p.append(f"strategy {strategy.name!r} needs at least {strategy.min_updates()} updates per round; "
                 f"raise rounds.min_sites (now {rc.min_sites}) or change the strategy's parameters")
    u = spec.update
    all_names = [t.name for t in manifest.tensors]
    try:
        names = select_names(all_names, u.trainable_patterns, u.frozen_patterns, u.private_patterns)
        private_names(all_names, u.private_patterns, frozen=u.frozen_patterns)  # each must match
    except ConfigError as exc:
        p.append(str(exc))
        return p
    if u.selection == safl.SAFL and not safl.config_problems(u.selection, u.select_top_k_layers,
                                                             u.safl_profile_samples, u.safl_token, spec.family,
                                                             spec.architecture):
        p.extend(safl.model_problems(names, spec.family, u.select_top_k_layers))
    return p


def spec_problems(spec: task_pb2.TaskSpec, manifest: Manifest | None = None) -> list[str]:
    """:func:`definition_problems`, and with ``manifest`` also :func:`submit_problems`."""
    p = definition_problems(spec)
    if manifest is not None:
        p.extend(submit_problems(spec, manifest))
    return p


def check_spec(spec: task_pb2.TaskSpec, manifest: Manifest | None = None) -> None:
    """Raise ConfigError (``task spec rejected: <every problem>``) unless :func:`spec_problems` is empty."""
    problems = spec_problems(spec, manifest)
    if problems:
        raise ConfigError("task spec rejected: " + "; ".join(problems))
