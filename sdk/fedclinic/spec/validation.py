"""The one validator of a task spec (the ``TaskSpec`` proto), shared by the SDK, the aggregator and the agents.

Two layers of rules, each problem a sentence that says what to change:

- :func:`definition_problems` (the spec alone): names, round settings, secure aggregation, differential
  privacy, update and downlink codecs, the strategy and the layer selection. ``fedclinic.spec.task.Task.validate``
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

from fedclinic.errors import ConfigError
from fedclinic.proto import task_pb2
from fedclinic.secagg.task_config import spec_problems as secure_aggregation_problems
from fedclinic.spec import safl_settings as safl
from fedclinic.spec.capabilities import check_supported
from fedclinic.spec.selection import private_names, select_names
from fedclinic.strategies import Strategy, make_strategy
from fedclinic.transport import codec_wire, downlink
from fedclinic.transport.package import Manifest

ACCOUNTANTS = ("rdp", "prv")


def strategy_of(spec: task_pb2.TaskSpec) -> Strategy:
    """The task's strategy, built from its numeric parameters and its string options (ConfigError if it
    cannot be built)."""
    return make_strategy(spec.strategy, {**dict(spec.strategy_params), **dict(spec.strategy_options)})


def privacy_problems(spec: task_pb2.TaskSpec) -> list[str]:
    """What is wrong with the task's differential privacy (``spec.privacy`` with its strategy and model)."""
    pc = spec.privacy
    if not pc.level:
        return []
    if pc.level == "client":
        return [] if spec.strategy == "dp-fedavg" else [
            'privacy level "client" clips and noises whole updates at the aggregator: use strategy '
            '"dp-fedavg" (its clip_norm and noise_multiplier set the mechanism)']
    if pc.level != "sample":
        return [f'privacy level must be "sample" (DP-SGD at each site) or "client", got {pc.level!r}']
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
    if spec.strategy == "dp-fedavg":
        p.append('privacy level "sample" already noises at the sites; "dp-fedavg" is for level "client"')
    return p


def rounds_problems(spec: task_pb2.TaskSpec) -> list[str]:
    """What is wrong with the task's round settings (``spec.rounds``)."""
    rc = spec.rounds
    p = []
    if rc.num_rounds < 1:
        p.append("rounds.num_rounds must be >= 1")
    if rc.min_sites < 1:
        p.append("rounds.min_sites must be >= 1")
    if not 0 < rc.participation_fraction <= 1:
        p.append("rounds.participation_fraction must be in (0, 1]")
    if not rc.round_timeout_s > 0:
        p.append("rounds.round_timeout_s must be > 0")
    if rc.on_quorum_miss == task_pb2.QUORUM_POLICY_UNSPECIFIED:
        p.append("rounds.on_quorum_miss must be 'retry' or 'fail'")
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
    p.extend(rounds_problems(spec))
    p.extend(secure_aggregation_problems(spec))
    p.extend(privacy_problems(spec))
    p.extend(codec_wire.spec_problems(spec.update.codec, secure_aggregation=spec.secure_aggregation.enabled))
    p.extend(downlink.spec_problems(spec.update.downlink_codec))
    try:
        strategy: Strategy | None = strategy_of(spec)
    except ConfigError as exc:
        p.append(str(exc))
        strategy = None
    u = spec.update
    selection = safl.config_problems(u.selection, u.select_top_k_layers, u.safl_profile_samples, u.safl_token,
                                     spec.family, spec.architecture)
    p.extend(selection)
    if u.selection == safl.SAFL and not selection and strategy is not None:
        p.extend(safl.composition_problems(strategy, spec.secure_aggregation.enabled))
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
