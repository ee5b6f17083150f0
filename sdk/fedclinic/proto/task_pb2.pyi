from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class QuorumPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    QUORUM_POLICY_UNSPECIFIED: _ClassVar[QuorumPolicy]
    QUORUM_POLICY_RETRY: _ClassVar[QuorumPolicy]
    QUORUM_POLICY_FAIL: _ClassVar[QuorumPolicy]

class UpdateKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPDATE_KIND_UNSPECIFIED: _ClassVar[UpdateKind]
    UPDATE_KIND_DELTA: _ClassVar[UpdateKind]
QUORUM_POLICY_UNSPECIFIED: QuorumPolicy
QUORUM_POLICY_RETRY: QuorumPolicy
QUORUM_POLICY_FAIL: QuorumPolicy
UPDATE_KIND_UNSPECIFIED: UpdateKind
UPDATE_KIND_DELTA: UpdateKind

class TrainingConfig(_message.Message):
    __slots__ = ("local_epochs", "batch_size", "learning_rate", "optimizer", "weight_decay", "max_grad_norm", "max_steps", "mixed_precision", "proximal_mu", "max_length", "seed", "optimizer_state", "measure_gradient_change", "pos_weight", "pos_weight_source", "step_in_backward")
    LOCAL_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    MIXED_PRECISION_FIELD_NUMBER: _ClassVar[int]
    PROXIMAL_MU_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STATE_FIELD_NUMBER: _ClassVar[int]
    MEASURE_GRADIENT_CHANGE_FIELD_NUMBER: _ClassVar[int]
    POS_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    POS_WEIGHT_SOURCE_FIELD_NUMBER: _ClassVar[int]
    STEP_IN_BACKWARD_FIELD_NUMBER: _ClassVar[int]
    local_epochs: int
    batch_size: int
    learning_rate: float
    optimizer: str
    weight_decay: float
    max_grad_norm: float
    max_steps: int
    mixed_precision: bool
    proximal_mu: float
    max_length: int
    seed: int
    optimizer_state: str
    measure_gradient_change: bool
    pos_weight: _containers.RepeatedScalarFieldContainer[float]
    pos_weight_source: str
    step_in_backward: bool
    def __init__(self, local_epochs: _Optional[int] = ..., batch_size: _Optional[int] = ..., learning_rate: _Optional[float] = ..., optimizer: _Optional[str] = ..., weight_decay: _Optional[float] = ..., max_grad_norm: _Optional[float] = ..., max_steps: _Optional[int] = ..., mixed_precision: _Optional[bool] = ..., proximal_mu: _Optional[float] = ..., max_length: _Optional[int] = ..., seed: _Optional[int] = ..., optimizer_state: _Optional[str] = ..., measure_gradient_change: _Optional[bool] = ..., pos_weight: _Optional[_Iterable[float]] = ..., pos_weight_source: _Optional[str] = ..., step_in_backward: _Optional[bool] = ...) -> None: ...

class RoundConfig(_message.Message):
    __slots__ = ("num_rounds", "min_sites", "participation_fraction", "round_timeout_s", "on_quorum_miss", "max_round_retries")
    NUM_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    MIN_SITES_FIELD_NUMBER: _ClassVar[int]
    PARTICIPATION_FRACTION_FIELD_NUMBER: _ClassVar[int]
    ROUND_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ON_QUORUM_MISS_FIELD_NUMBER: _ClassVar[int]
    MAX_ROUND_RETRIES_FIELD_NUMBER: _ClassVar[int]
    num_rounds: int
    min_sites: int
    participation_fraction: float
    round_timeout_s: float
    on_quorum_miss: QuorumPolicy
    max_round_retries: int
    def __init__(self, num_rounds: _Optional[int] = ..., min_sites: _Optional[int] = ..., participation_fraction: _Optional[float] = ..., round_timeout_s: _Optional[float] = ..., on_quorum_miss: _Optional[_Union[QuorumPolicy, str]] = ..., max_round_retries: _Optional[int] = ...) -> None: ...

class UpdateConfig(_message.Message):
    __slots__ = ("kind", "codec", "trainable_patterns", "frozen_patterns", "private_patterns", "select_top_k_layers", "selection", "safl_profile_samples", "safl_token", "downlink_codec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_PATTERNS_FIELD_NUMBER: _ClassVar[int]
    FROZEN_PATTERNS_FIELD_NUMBER: _ClassVar[int]
    PRIVATE_PATTERNS_FIELD_NUMBER: _ClassVar[int]
    SELECT_TOP_K_LAYERS_FIELD_NUMBER: _ClassVar[int]
    SELECTION_FIELD_NUMBER: _ClassVar[int]
    SAFL_PROFILE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAFL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DOWNLINK_CODEC_FIELD_NUMBER: _ClassVar[int]
    kind: UpdateKind
    codec: str
    trainable_patterns: _containers.RepeatedScalarFieldContainer[str]
    frozen_patterns: _containers.RepeatedScalarFieldContainer[str]
    private_patterns: _containers.RepeatedScalarFieldContainer[str]
    select_top_k_layers: int
    selection: str
    safl_profile_samples: int
    safl_token: str
    downlink_codec: str
    def __init__(self, kind: _Optional[_Union[UpdateKind, str]] = ..., codec: _Optional[str] = ..., trainable_patterns: _Optional[_Iterable[str]] = ..., frozen_patterns: _Optional[_Iterable[str]] = ..., private_patterns: _Optional[_Iterable[str]] = ..., select_top_k_layers: _Optional[int] = ..., selection: _Optional[str] = ..., safl_profile_samples: _Optional[int] = ..., safl_token: _Optional[str] = ..., downlink_codec: _Optional[str] = ...) -> None: ...

class PrivacyConfig(_message.Message):
    __slots__ = ("level", "target_epsilon", "target_delta", "max_grad_norm", "noise_multiplier", "accountant", "unit", "mechanism", "scale", "rounding_beta", "logical_batch_size", "steps_per_round", "sample_rate")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    TARGET_EPSILON_FIELD_NUMBER: _ClassVar[int]
    TARGET_DELTA_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTANT_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    MECHANISM_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    ROUNDING_BETA_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    level: str
    target_epsilon: float
    target_delta: float
    max_grad_norm: float
    noise_multiplier: float
    accountant: str
    unit: str
    mechanism: str
    scale: float
    rounding_beta: float
    logical_batch_size: int
    steps_per_round: int
    sample_rate: float
    def __init__(self, level: _Optional[str] = ..., target_epsilon: _Optional[float] = ..., target_delta: _Optional[float] = ..., max_grad_norm: _Optional[float] = ..., noise_multiplier: _Optional[float] = ..., accountant: _Optional[str] = ..., unit: _Optional[str] = ..., mechanism: _Optional[str] = ..., scale: _Optional[float] = ..., rounding_beta: _Optional[float] = ..., logical_batch_size: _Optional[int] = ..., steps_per_round: _Optional[int] = ..., sample_rate: _Optional[float] = ...) -> None: ...

class SecureAggregationConfig(_message.Message):
    __slots__ = ("enabled", "threshold", "min_cohort", "clip", "bits", "rounding", "degree", "weighting", "weight_cap", "metric_clip")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MIN_COHORT_FIELD_NUMBER: _ClassVar[int]
    CLIP_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    ROUNDING_FIELD_NUMBER: _ClassVar[int]
    DEGREE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTING_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_CAP_FIELD_NUMBER: _ClassVar[int]
    METRIC_CLIP_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    threshold: int
    min_cohort: int
    clip: float
    bits: int
    rounding: str
    degree: int
    weighting: str
    weight_cap: int
    metric_clip: float
    def __init__(self, enabled: _Optional[bool] = ..., threshold: _Optional[int] = ..., min_cohort: _Optional[int] = ..., clip: _Optional[float] = ..., bits: _Optional[int] = ..., rounding: _Optional[str] = ..., degree: _Optional[int] = ..., weighting: _Optional[str] = ..., weight_cap: _Optional[int] = ..., metric_clip: _Optional[float] = ...) -> None: ...

class TaskSpec(_message.Message):
    __slots__ = ("name", "family", "architecture", "dataset", "labels", "multi_label", "training", "rounds", "strategy", "strategy_params", "update", "privacy", "secure_aggregation", "sites", "tokenizer_sha256", "description", "strategy_options", "verification", "kind", "evaluation", "statistics")
    class StrategyParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class StrategyOptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    MULTI_LABEL_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_PARAMS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_FIELD_NUMBER: _ClassVar[int]
    SECURE_AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    SITES_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SHA256_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    EVALUATION_FIELD_NUMBER: _ClassVar[int]
    STATISTICS_FIELD_NUMBER: _ClassVar[int]
    name: str
    family: str
    architecture: str
    dataset: str
    labels: _containers.RepeatedScalarFieldContainer[str]
    multi_label: bool
    training: TrainingConfig
    rounds: RoundConfig
    strategy: str
    strategy_params: _containers.ScalarMap[str, float]
    update: UpdateConfig
    privacy: PrivacyConfig
    secure_aggregation: SecureAggregationConfig
    sites: _containers.RepeatedScalarFieldContainer[str]
    tokenizer_sha256: str
    description: str
    strategy_options: _containers.ScalarMap[str, str]
    verification: VerificationConfig
    kind: str
    evaluation: EvaluationConfig
    statistics: StatisticsConfig
    def __init__(self, name: _Optional[str] = ..., family: _Optional[str] = ..., architecture: _Optional[str] = ..., dataset: _Optional[str] = ..., labels: _Optional[_Iterable[str]] = ..., multi_label: _Optional[bool] = ..., training: _Optional[_Union[TrainingConfig, _Mapping]] = ..., rounds: _Optional[_Union[RoundConfig, _Mapping]] = ..., strategy: _Optional[str] = ..., strategy_params: _Optional[_Mapping[str, float]] = ..., update: _Optional[_Union[UpdateConfig, _Mapping]] = ..., privacy: _Optional[_Union[PrivacyConfig, _Mapping]] = ..., secure_aggregation: _Optional[_Union[SecureAggregationConfig, _Mapping]] = ..., sites: _Optional[_Iterable[str]] = ..., tokenizer_sha256: _Optional[str] = ..., description: _Optional[str] = ..., strategy_options: _Optional[_Mapping[str, str]] = ..., verification: _Optional[_Union[VerificationConfig, _Mapping]] = ..., kind: _Optional[str] = ..., evaluation: _Optional[_Union[EvaluationConfig, _Mapping]] = ..., statistics: _Optional[_Union[StatisticsConfig, _Mapping]] = ...) -> None: ...

class StatisticsConfig(_message.Message):
    __slots__ = ("epsilon",)
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    epsilon: float
    def __init__(self, epsilon: _Optional[float] = ...) -> None: ...

class EvaluationConfig(_message.Message):
    __slots__ = ("model_task", "timeout_s")
    MODEL_TASK_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    model_task: str
    timeout_s: float
    def __init__(self, model_task: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class VerificationConfig(_message.Message):
    __slots__ = ("publish_updates",)
    PUBLISH_UPDATES_FIELD_NUMBER: _ClassVar[int]
    publish_updates: bool
    def __init__(self, publish_updates: _Optional[bool] = ...) -> None: ...

class SignedStatement(_message.Message):
    __slots__ = ("purpose", "payload", "signature", "certificate_pem")
    PURPOSE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_PEM_FIELD_NUMBER: _ClassVar[int]
    purpose: str
    payload: bytes
    signature: bytes
    certificate_pem: bytes
    def __init__(self, purpose: _Optional[str] = ..., payload: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., certificate_pem: _Optional[bytes] = ...) -> None: ...
