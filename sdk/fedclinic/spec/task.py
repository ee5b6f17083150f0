"""The typed, validated task definition a data scientist writes (in Python or as ``task.toml``).

A task names a built-in model family, a dataset each site holds under the same registry name, the label
set, the base model (a local pretrained folder) and the training/round settings. No code travels.

``task.toml``::

    name = "condition-classifier"
    dataset = "drugreviews"
    labels = ["Birth Control", "Depression", "Pain"]
    model = "/models/minilm"          # local pretrained folder (config.json, model.safetensors, tokenizer)
    architecture = "transformer"      # transformer | lstm | logreg

    [training]
    local_epochs = 1
    batch_size = 16
    learning_rate = 5e-5

    [rounds]
    num_rounds = 5
    min_sites = 3
    round_timeout_s = 1800
    on_quorum_miss = "retry"          # retry | fail

    [update]
    trainable = ['classifier\\..*', 'bert\\.encoder\\.layer\\.[45]\\..*']
    private = []                      # tensors each site trains and keeps, never sent (FedNER's private modules)
    codec = "topk:0.01+int8"          # how deltas travel: raw (fp32, default), fp16, bf16, int8, int4, topk:...
    downlink_codec = "int8"           # optional: the global model's change broadcast under fp16/bf16/int8/int4
    selection = "safl"                # optional: attention-selected layers on top of the patterns (fedclinic.training.safl)
    safl_top_k = 2                    # layers each site trains and sends per round (the head always)
    safl_profile_samples = 64         # rows each site profiles per round (0 = 64)
    safl_token = "cls"                # task-relevant tokens: cls | last | entities ("" = the family's default)

Every key, its type, default and meaning: docs/task-reference.md (tests/unit/spec/test_task_reference.py fails when
a key or a default here is missing there).

Limits: every number must be finite and within fedclinic.spec.validation.BOUNDS (the aggregator and the sites
check the same): local_epochs 1-1000, batch_size 1-65536, 0 < learning_rate <= 10, weight_decay 0-10,
max_grad_norm 0-1e6, max_steps 0-1e7, proximal_mu 0-1000, max_length 8-32768, num_rounds 1-1000, min_sites
1-1000, 0 < participation_fraction <= 1, 0 < round_timeout_s <= 604800 (7 days), max_round_retries 0-100,
safl_top_k 0-1000, safl_profile_samples 0-100000, strategy parameters of magnitude <= 1e6; [privacy] numbers
0-1e6; [secure_aggregation] min_cohort, threshold and degree 0-1000, bits 0-62, clip 0-1e6; [statistics] epsilon
0.01-100 (0 = exact statistics).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from fedclinic.errors import ConfigError
from fedclinic.proto import task_pb2
from fedclinic.runtime.tomlconfig import load_toml
from fedclinic.secagg.task_config import config_from_dict
from fedclinic.secagg.task_config import dict_problems as secagg_dict_problems
from fedclinic.spec.capabilities import check_optimizer_settings, pooling_problem
from fedclinic.spec.validation import bound_problem, definition_problems
from fedclinic.spec.validation import privacy_problems as spec_privacy_problems
from fedclinic.transport.codec_wire import canonical

FAMILIES = {"text-classification": ("transformer", "lstm", "logreg"),
            "token-classification": ("transformer", "transformer-crf", "cnn-bilstm-crf"),
            "question-answering": ("causal-lm",),
            "image-text-classification": ("resnet-bilstm",)}
#: families whose outputs are independent sigmoids: a task must say multi_label = true
MULTI_LABEL_FAMILIES = ("image-text-classification",)
#: families whose tasks have no label set (answers are generated text)
UNLABELLED_FAMILIES = ("question-answering",)
_TRAIN = ("local_epochs", "batch_size", "learning_rate", "optimizer", "weight_decay", "max_grad_norm", "max_steps",
          "mixed_precision", "proximal_mu", "max_length", "seed", "optimizer_state", "measure_gradient_change",
          "step_in_backward")
_ROUNDS = ("num_rounds", "min_sites", "participation_fraction", "round_timeout_s", "on_quorum_miss",
           "max_round_retries")
_UPDATE = ("trainable", "frozen", "private", "codec", "downlink_codec", "selection", "safl_top_k",
           "safl_profile_samples", "safl_token")
#: Task field -> its number in the spec, bounded by fedclinic.spec.validation.BOUNDS
_BOUNDED = {**{k: f"training.{k}" for k in ("local_epochs", "batch_size", "learning_rate", "weight_decay",
                                            "max_grad_norm", "max_steps", "proximal_mu", "max_length")},
            **{k: f"rounds.{k}" for k in ("num_rounds", "min_sites", "participation_fraction", "round_timeout_s",
                                          "max_round_retries")},
            "safl_top_k": "update.select_top_k_layers", "safl_profile_samples": "update.safl_profile_samples"}


@dataclass
class Task:
    name: str
    dataset: str
    labels: list[str] = field(default_factory=list)  # question-answering: none (leave empty)
    model: str = ""                      # local pretrained folder; or pass a ModelPackage to Client.submit
    family: str = "text-classification"
    architecture: str = "transformer"
    multi_label: bool = False
    tag_scheme: str = "BIO"              # token-classification: BIO | BIOES (labels are the entity types)
    description: str = ""
    sites: list[str] = field(default_factory=list)
    # training (per site, per round)
    local_epochs: int = 1
    batch_size: int = 16
    learning_rate: float = 5e-5
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    max_steps: int = 0
    mixed_precision: bool = False
    proximal_mu: float = 0.0
    optimizer_state: str = "reset"       # "keep": local optimizer moments persist at each site across rounds
    measure_gradient_change: bool = False  # sites report gradient_change_rate (dynamic-weighting, "code")
    #: each parameter's optimizer step in the backward pass, its gradient freed at once (peak memory: the model
    #: plus one gradient); needs max_grad_norm = 0, proximal_mu = 0, optimizer_state = "reset", no DP-SGD
    step_in_backward: bool = False
    max_length: int = 128
    seed: int = 0
    #: ``[training] pos_weight``: multi-label BCE weight of each label's positives (one positive number per label,
    #: label order), or "from-statistics:<task id>" (resolved at submit from that statistics task's label counts,
    #: fedclinic.evaluation.class_weights); empty = unweighted
    pos_weight: list[float] | str = field(default_factory=list)
    #: where pos_weight came from (set when "from-statistics:..." is resolved; recorded in the spec and the card)
    pos_weight_source: str = ""
    # rounds
    num_rounds: int = 3
    min_sites: int = 2
    participation_fraction: float = 1.0
    round_timeout_s: float = 1800.0
    on_quorum_miss: str = "retry"
    max_round_retries: int = 2
    # aggregation and what is sent
    strategy: str = "fedavg"
    strategy_params: dict[str, float | str] = field(default_factory=dict)  # numbers and names (e.g. granularity)
    trainable: list[str] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)
    #: ``[update] private``: FedNER's private modules (fedclinic.training.private_modules): tensors each site trains and
    #: keeps between rounds but never sends; e.g. fedclinic.models.fedner.PAPER_PRIVATE_PATTERNS
    private: list[str] = field(default_factory=list)
    #: ``[update] codec``: how each site encodes its delta tensors (fedclinic.codecs spec): "raw" (float32),
    #: "fp16", "bf16", "int8", "int4" (blockwise, stochastic rounding), "topk:0.01" (with error feedback at
    #: the sites) or "topk:0.01+int8"; sites must announce the codec at Hello to be assigned the task
    codec: str = "raw"
    #: ``[update] downlink_codec``: "" (full tensors) or "fp16", "bf16", "int8", "int4": each round's change of the
    #: global model is broadcast under that codec, and the global model is defined as what the sites rebuild from
    #: it (fedclinic.transport.downlink; one rounding of each round's change, no drift between sites and aggregator)
    downlink_codec: str = ""
    #: ``[update] selection``: "static" (the patterns alone) or "safl": each round every site profiles attention on
    #: ``safl_profile_samples`` of its rows (0 = 64) and trains and sends only its ``safl_top_k`` layers whose
    #: attention flows most to ``safl_token`` ("cls", "last" or "entities"; "" = the family's default), plus the
    #: task head; see fedclinic.training.safl
    selection: str = "static"
    safl_top_k: int = 0
    safl_profile_samples: int = 0
    safl_token: str = ""
    #: architecture settings applied when the initial model is packaged from ``model`` (``[model_config]``):
    #: e.g. the FedNER tagger's sizes, LSTM sizes, or HF config fields that keep shapes (dropout)
    model_config: dict[str, Any] = field(default_factory=dict)
    #: ``[privacy]``: level = "sample" (DP-SGD at every site, fedclinic.privacy.dp_sgd) with target_epsilon (for
    #: the whole task at each site) or noise_multiplier, target_delta, max_grad_norm (per-example clip C) and
    #: accountant ("rdp" | "prv"); level = "client" (clip + noise of whole updates at the aggregator), which
    #: needs strategy "dp-fedavg" (its parameters carry clip and noise); level = "distributed" (each site clips
    #: its whole update to max_grad_norm and adds its share of Skellam noise inside secure aggregation,
    #: fedclinic.secagg.dp_plan) with target_epsilon or noise_multiplier, target_delta, and optional mechanism
    #: ("skellam"), scale and rounding_beta. Empty = no differential privacy.
    #: unit (level "sample"): "example" (default: one row of a site's dataset) or "patient" (every site samples,
    #: clips and accounts per patient, by the patient id column its dataset declares; sites without one decline)
    privacy: dict[str, Any] = field(default_factory=dict)
    #: ``[secure_aggregation]``: enabled = true runs every round as a SecAgg(+) session, so the aggregator sees
    #: only the sum of the sites' (clipped, quantized) deltas, averaged with uniform weights. Optional:
    #: min_cohort (>= 3), threshold (0 = ceil(2h/3)), clip (|delta| range, default 1.0), bits (default 20),
    #: rounding ("stochastic" | "nearest"), degree (0 = complete graph). See fedclinic.secagg.task_config.
    secure_aggregation: dict[str, Any] = field(default_factory=dict)
    #: ``kind``: "train" (default: rounds, then every site that trained evaluates the final model on its held-out
    #: split), "evaluate" (no training: each site evaluates the model and sends metrics only) or "statistics" (no
    #: training: each site sends statistics of its dataset). Sites may refuse the last two by policy.
    kind: str = "train"
    #: ``[evaluation]``: model_task = "<task id>" (kind "evaluate": that finished task's final model, yours only,
    #: instead of ``model``); timeout_s (how long the evaluation phase waits for the sites; 0 = round_timeout_s)
    evaluation: dict[str, Any] = field(default_factory=dict)
    #: ``[verification]``: publish_updates = true keeps every site's committed update and lets the task's owner
    #: fetch it, so that `fedclinic task verify` recomputes each plain round's model from them (a new exposure:
    #: the owner then sees each site's update, not only aggregates; sites may refuse such tasks). Default off.
    verification: dict[str, Any] = field(default_factory=dict)
    #: ``[statistics]``: epsilon = the privacy loss of each site's answer to a statistics task (discrete Laplace
    #: noise on every released count, charged to the site's privacy ledger; fedclinic.evaluation.statistics).
    #: Empty = exact counts (small cells are suppressed either way).
    statistics: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Raise ConfigError listing every problem (and how to fix it): first the checks of this Python/TOML
        input that the spec cannot carry (unknown keys, types, the family table, labels, patterns), then the
        spec's own rules (fedclinic.spec.validation.definition_problems, as the aggregator checks them)."""
        p: list[str] = []
        if self.name and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9 ._-]{0,99}", self.name):
            p.append("name must be 1-100 letters, digits, spaces, '.', '_' or '-'")
        if self.family and self.family not in FAMILIES:
            p.append(f"family {self.family!r} is unknown; choose one of {sorted(FAMILIES)}")
        elif self.family and self.architecture not in FAMILIES[self.family]:
            p.append(f"architecture {self.architecture!r} is not one of {FAMILIES[self.family]}")
        if self.family == "token-classification":
            if not self.labels:
                p.append("labels needs at least one entity type")
            if self.tag_scheme not in ("BIO", "BIOES"):
                p.append(f"tag_scheme {self.tag_scheme!r} is not BIO or BIOES")
            if self.multi_label:
                p.append("multi_label does not apply to token-classification")
        elif self.family in UNLABELLED_FAMILIES:
            if self.labels:
                p.append(f"labels do not apply to {self.family} (answers are generated text); leave labels empty")
            if self.multi_label:
                p.append(f"multi_label does not apply to {self.family}")
        elif self.family in MULTI_LABEL_FAMILIES:
            if not self.labels:
                p.append("labels needs at least one finding")
            if not self.multi_label:
                p.append(f"{self.family} is multi-label (one sigmoid output per label, binary cross-entropy); "
                         "set multi_label = true")
        elif len(self.labels) < 2:
            p.append("labels needs at least two classes")
        if len(set(self.labels)) != len(self.labels):
            p.append("labels contains duplicates")
        p.extend(check_optimizer_settings(self.optimizer, self.optimizer_state))
        p.extend(_pos_weight_input_problems(self.pos_weight))
        p.extend(privacy_input_problems(self.privacy))
        p.extend(secure_aggregation_input_problems(self.secure_aggregation))
        p.extend(verification_input_problems(self.verification))
        p.extend(evaluation_input_problems(self.kind, self.evaluation))
        p.extend(statistics_input_problems(self.statistics))
        p.extend(problem for _, problem in self._number_problems())
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -(1 << 63) <= self.seed < (1 << 63):
            p.append(f"seed must be a whole number (64-bit), got {self.seed!r}")
        bad = _bad_strategy_params(self.strategy_params)
        if bad:
            p.append(f"strategy parameter(s) {bad} must be numbers or strings")
        if not isinstance(self.model_config, dict) or not all(isinstance(k, str) for k in self.model_config):
            p.append("model_config must be a table of settings (e.g. [model_config] lstm_hidden = 100)")
        elif "pooling" in self.model_config:
            p.extend(_pooling_problems(self.model_config["pooling"], self.family, self.architecture))
        for pat in [*self.trainable, *self.frozen, *self.private]:
            try:
                re.compile(pat)
            except re.error as exc:
                p.append(f"pattern {pat!r} is not a valid regular expression ({exc})")
        p.extend(definition_problems(self._build_spec("", checked=False)))
        if p:
            raise ConfigError(f"task {self.name!r} is invalid: " + "; ".join(p))

    def _number_problems(self) -> list[tuple[str, str]]:
        """(field, problem) for each number of this task outside its bounds (fedclinic.spec.validation.BOUNDS, the
        same message the aggregator and the sites give); 0 is not "the default" here: a Task states every value."""
        out = []
        for name, path in _BOUNDED.items():
            problem = bound_problem(path, getattr(self, name), zero_default=False)
            if problem:
                out.append((name, problem))
        return out

    def to_spec(self, tokenizer_sha256: str = "") -> task_pb2.TaskSpec:
        self.validate()
        if isinstance(self.pos_weight, str):
            raise ConfigError(f"pos_weight {self.pos_weight!r} is resolved when the task is submitted (Client.submit "
                              "reads the statistics task); or compute it with fedclinic.evaluation.class_weights."
                              "pos_weight_from_statistics")
        return self._build_spec(tokenizer_sha256, checked=True)

    def _build_spec(self, tokenizer_sha256: str, *, checked: bool) -> task_pb2.TaskSpec:
        """The TaskSpec of this task. Unchecked (``checked`` False, for validation), values the spec cannot
        hold are left out and reported by :meth:`validate`'s own checks (a bad codec travels as written, for
        the spec's rules to name)."""
        policy = {"retry": task_pb2.QUORUM_POLICY_RETRY, "fail": task_pb2.QUORUM_POLICY_FAIL}
        params = self.strategy_params if checked else {k: v for k, v in self.strategy_params.items()
                                                       if k not in _bad_strategy_params(self.strategy_params)}
        codec = self.codec
        try:
            codec = canonical_codec(self.codec)
        except ConfigError:
            if checked:
                raise
        sound_privacy = checked or not privacy_input_problems(self.privacy)
        sound_secagg = checked or not secure_aggregation_input_problems(self.secure_aggregation)
        # unchecked: a number out of bounds (reported by validate) travels as its default, which the spec can hold
        v = {f.name: getattr(self, f.name) for f in fields(self)}
        if not checked:
            defaults = {f.name: f.default for f in fields(self)}
            v.update({name: defaults[name] for name, _ in self._number_problems()})
            if isinstance(v["seed"], bool) or not isinstance(v["seed"], int) or not -(1 << 63) <= v["seed"] < (1 << 63):
                v["seed"] = 0
        return task_pb2.TaskSpec(
            name=self.name, family=self.family, architecture=self.architecture, dataset=self.dataset,
            labels=self.labels, multi_label=self.multi_label, description=self.description, sites=self.sites,
            training=task_pb2.TrainingConfig(**{k: v[k] for k in _TRAIN},
                                             pos_weight=[] if _pos_weight_input_problems(self.pos_weight)
                                             or isinstance(self.pos_weight, str) else self.pos_weight,
                                             pos_weight_source=self.pos_weight_source),
            rounds=task_pb2.RoundConfig(num_rounds=v["num_rounds"], min_sites=v["min_sites"],
                                        participation_fraction=v["participation_fraction"],
                                        round_timeout_s=v["round_timeout_s"],
                                        on_quorum_miss=policy.get(self.on_quorum_miss,
                                                                  task_pb2.QUORUM_POLICY_UNSPECIFIED),
                                        max_round_retries=v["max_round_retries"]),
            strategy=self.strategy,
            strategy_params={k: float(v) for k, v in params.items() if not isinstance(v, str)},
            strategy_options={k: v for k, v in params.items() if isinstance(v, str)},
            update=task_pb2.UpdateConfig(kind=task_pb2.UPDATE_KIND_DELTA, codec=codec,
                                         trainable_patterns=self.trainable, frozen_patterns=self.frozen,
                                         private_patterns=self.private, downlink_codec=self.downlink_codec,
                                         selection="" if self.selection == "static" else self.selection,
                                         select_top_k_layers=v["safl_top_k"],
                                         safl_profile_samples=v["safl_profile_samples"], safl_token=self.safl_token),
            privacy=privacy_config(self.privacy) if sound_privacy else task_pb2.PrivacyConfig(),
            secure_aggregation=(_secure_aggregation_config(self.secure_aggregation) if sound_secagg
                                else task_pb2.SecureAggregationConfig()),
            verification=task_pb2.VerificationConfig(
                publish_updates=self.verification.get("publish_updates") is True
                if isinstance(self.verification, dict) else False),
            kind="" if self.kind in ("", "train") or not isinstance(self.kind, str) else self.kind,
            evaluation=evaluation_config(self.evaluation) if checked or not evaluation_input_problems(
                "train", self.evaluation) else task_pb2.EvaluationConfig(),
            statistics=statistics_config(self.statistics),
            tokenizer_sha256=tokenizer_sha256)

    @classmethod
    def from_toml(cls, path: str | Path) -> "Task":
        doc = load_toml(path)
        base = Path(path).resolve().parent
        flat: dict[str, Any] = {}
        for key, value in doc.items():
            if key == "training":
                flat.update(_section(value, (*_TRAIN, "pos_weight"), "training"))
            elif key == "rounds":
                flat.update(_section(value, _ROUNDS, "rounds"))
            elif key == "update":
                flat.update(_section(value, _UPDATE, "update"))
            elif key == "strategy" and isinstance(value, dict):
                flat["strategy"] = value.get("name", "fedavg")
                flat["strategy_params"] = {k: v for k, v in value.items() if k != "name"}
            else:
                flat[key] = value
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(flat) - known)
        if unknown:
            raise ConfigError(f"{path}: unknown setting(s) {unknown}")
        required = ("name", "dataset") if flat.get("family") in UNLABELLED_FAMILIES else ("name", "dataset", "labels")
        missing = [k for k in required if k not in flat]
        if missing:
            raise ConfigError(f"{path}: missing required setting(s) {missing}")
        if flat.get("model"):
            model = Path(str(flat["model"])).expanduser()
            flat["model"] = str(model if model.is_absolute() else base / model)
        try:
            task = cls(**flat)
        except TypeError as exc:
            raise ConfigError(f"{path}: {exc}") from None
        task.validate()
        return task


def _pos_weight_input_problems(value: Any) -> list[str]:
    """What is wrong with a task's ``pos_weight`` as written (a list of numbers or "from-statistics:<task id>");
    its length and values are the spec's rules (fedclinic.spec.validation.pos_weight_problems)."""
    if isinstance(value, str):
        if not value.startswith("from-statistics:") or not value[len("from-statistics:"):].strip():
            return [f"pos_weight {value!r} must be a list of numbers (one per label) or \"from-statistics:<task id>\""]
        return []
    if not isinstance(value, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, (int, float))
                                                   for v in value):
        return [f"pos_weight must be a list of numbers (one per label), got {value!r}"]
    return []


PRIVACY_KEYS = ("level", "target_epsilon", "target_delta", "max_grad_norm", "noise_multiplier", "accountant", "unit",
                "mechanism", "scale", "rounding_beta", "logical_batch_size", "steps_per_round", "sample_rate")


def privacy_input_problems(privacy: dict[str, Any]) -> list[str]:
    """What a ``[privacy]`` section holds that a PrivacyConfig cannot: unknown keys, values of the wrong type."""
    if not privacy:
        return []
    p = [f"privacy: unknown setting {k!r} (known: {', '.join(PRIVACY_KEYS)})" for k in privacy if k not in PRIVACY_KEYS]
    for key in ("target_epsilon", "noise_multiplier", "max_grad_norm", "scale", "rounding_beta"):
        v = privacy.get(key)
        if v is not None and not _is_number(v):
            p.append(f"privacy: {key} must be a positive number, got {v!r}")
    if "target_delta" in privacy and not _is_number(privacy["target_delta"]):
        p.append(f"privacy: target_delta must be a number in (0, 1), e.g. 1e-5, got {privacy['target_delta']!r}")
    for key in ("logical_batch_size", "steps_per_round"):
        v = privacy.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            p.append(f"privacy: {key} must be a whole number >= 0 (0 = the default), got {v!r}")
    if "sample_rate" in privacy and not (_is_number(privacy["sample_rate"]) and 0 <= privacy["sample_rate"] <= 1):
        p.append(f"privacy: sample_rate must be a number in [0, 1] (1 = full-batch DP-GD, 0 = from the logical "
                 f"batch), got {privacy['sample_rate']!r}")
    if not privacy.get("level"):
        p.append('privacy: level is missing; set level = "sample" (DP-SGD at each site), "client" or "distributed"')
    for key in ("level", "accountant", "unit", "mechanism"):
        if key in privacy and not isinstance(privacy[key], str):
            p.append(f"privacy: {key} must be a string, got {privacy[key]!r}")
    return p


def privacy_problems(privacy: dict[str, Any], family: str, architecture: str, strategy: str) -> list[str]:
    """What is wrong with a task's ``[privacy]`` section (empty list when nothing): its input problems, then
    the spec's privacy rules (fedclinic.spec.validation.privacy_problems)."""
    p = privacy_input_problems(privacy)
    if p or not privacy:
        return p
    return spec_privacy_problems(task_pb2.TaskSpec(family=family, architecture=architecture, strategy=strategy,
                                                   privacy=privacy_config(privacy)))


def verification_input_problems(doc: Any) -> list[str]:
    """What a ``[verification]`` table holds that a VerificationConfig cannot."""
    if not isinstance(doc, dict):
        return ["verification must be a table (e.g. [verification] publish_updates = true)"]
    p = [f"verification: unknown setting {k!r} (known: publish_updates)" for k in doc if k != "publish_updates"]
    if "publish_updates" in doc and not isinstance(doc["publish_updates"], bool):
        p.append(f"verification: publish_updates must be true or false, got {doc['publish_updates']!r}")
    return p


EVALUATION_KEYS = ("model_task", "timeout_s")


def evaluation_input_problems(kind: Any, doc: Any) -> list[str]:
    """What ``kind`` and an ``[evaluation]`` table hold that the spec cannot."""
    p = []
    if kind not in ("train", "", "evaluate", "statistics"):
        p.append(f'kind must be "train", "evaluate" or "statistics", got {kind!r}')
    if not isinstance(doc, dict):
        return p + ['evaluation must be a table (e.g. [evaluation] model_task = "t-...")']
    p += [f"evaluation: unknown setting {k!r} (known: {', '.join(EVALUATION_KEYS)})" for k in doc
          if k not in EVALUATION_KEYS]
    if "model_task" in doc and not isinstance(doc["model_task"], str):
        p.append(f"evaluation: model_task must be a task id (a string), got {doc['model_task']!r}")
    if "timeout_s" in doc and not _is_number(doc["timeout_s"]):
        p.append(f"evaluation: timeout_s must be a number of seconds, got {doc['timeout_s']!r}")
    return p


def evaluation_config(doc: dict[str, Any]) -> task_pb2.EvaluationConfig:
    return task_pb2.EvaluationConfig(model_task=str(doc.get("model_task", "")),
                                     timeout_s=float(doc.get("timeout_s", 0.0)))


STATISTICS_KEYS = ("epsilon",)


def statistics_input_problems(doc: Any) -> list[str]:
    """What a ``[statistics]`` table holds that a StatisticsConfig cannot (its bounds are the spec's:
    ``statistics.epsilon`` in fedclinic.spec.validation.BOUNDS)."""
    if not isinstance(doc, dict):
        return ["statistics must be a table (e.g. [statistics] epsilon = 1.0)"]
    p = [f"statistics: unknown setting {k!r} (known: {', '.join(STATISTICS_KEYS)})" for k in doc
         if k not in STATISTICS_KEYS]
    if "epsilon" in doc and not _is_number(doc["epsilon"]):
        p.append(f"statistics: epsilon must be a number (0.01-100; 0 = no noise), got {doc['epsilon']!r}")
    return p


def statistics_config(doc: Any) -> task_pb2.StatisticsConfig:
    """The StatisticsConfig of a ``[statistics]`` table; what it cannot hold travels as the default (reported by
    :func:`statistics_input_problems`)."""
    eps = doc.get("epsilon", 0.0) if isinstance(doc, dict) else 0.0
    return task_pb2.StatisticsConfig(epsilon=float(eps) if _is_number(eps) else 0.0)


def secure_aggregation_input_problems(doc: dict[str, Any]) -> list[str]:
    """What a ``[secure_aggregation]`` table holds that the spec cannot (fedclinic.secagg.task_config)."""
    return secagg_dict_problems(doc)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _bad_strategy_params(params: dict[str, Any]) -> list[str]:
    return sorted(k for k, v in params.items() if isinstance(v, bool) or not isinstance(v, (int, float, str)))


def privacy_config(privacy: dict[str, Any]) -> task_pb2.PrivacyConfig:
    if not privacy:
        return task_pb2.PrivacyConfig()
    level = privacy.get("level", "")
    if level == "client":
        return task_pb2.PrivacyConfig(level="client", unit=str(privacy.get("unit", "")))
    return task_pb2.PrivacyConfig(level=level, unit=str(privacy.get("unit", "")),
                                  target_epsilon=float(privacy.get("target_epsilon") or 0.0),
                                  target_delta=float(privacy.get("target_delta", 1e-5)),
                                  max_grad_norm=float(privacy.get("max_grad_norm", 1.0)),
                                  noise_multiplier=float(privacy.get("noise_multiplier") or 0.0),
                                  accountant=str(privacy.get("accountant", "rdp")),
                                  mechanism=str(privacy.get("mechanism", "")),
                                  scale=float(privacy.get("scale") or 0.0),
                                  rounding_beta=float(privacy.get("rounding_beta") or 0.0),
                                  logical_batch_size=int(privacy.get("logical_batch_size") or 0),
                                  steps_per_round=int(privacy.get("steps_per_round") or 0),
                                  sample_rate=float(privacy.get("sample_rate") or 0.0))


def _secure_aggregation_config(doc: dict[str, Any]) -> task_pb2.SecureAggregationConfig:
    return config_from_dict(doc)


def _pooling_problems(pooling: Any, family: str, architecture: str) -> list[str]:
    if (family, architecture) != ("text-classification", "transformer"):
        return [f"[model_config] pooling applies to text-classification transformer models only, not {family} "
                f"{architecture}; remove it"]
    problem = pooling_problem(pooling)
    return [f"[model_config] {problem}"] if problem else []


def canonical_codec(spec: str) -> str:
    return canonical(spec)


def _section(value: Any, allowed: tuple[str, ...], name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"[{name}] must be a table")
    bad = sorted(set(value) - set(allowed))
    if bad:
        raise ConfigError(f"[{name}] has unknown key(s) {bad}; allowed: {list(allowed)}")
    return dict(value)
