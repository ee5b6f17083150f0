from fedclinic.proto import control_pb2 as _control_pb2
from fedclinic.proto import task_pb2 as _task_pb2
from fedclinic.proto import tensors_pb2 as _tensors_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Capabilities(_message.Message):
    __slots__ = ("devices", "codecs", "secure_aggregation", "families", "features")
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    SECURE_AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    FAMILIES_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedScalarFieldContainer[str]
    codecs: _containers.RepeatedScalarFieldContainer[str]
    secure_aggregation: bool
    families: _containers.RepeatedScalarFieldContainer[str]
    features: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, devices: _Optional[_Iterable[str]] = ..., codecs: _Optional[_Iterable[str]] = ..., secure_aggregation: _Optional[bool] = ..., families: _Optional[_Iterable[str]] = ..., features: _Optional[_Iterable[str]] = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ("protocol_version", "agent_version", "capabilities")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    agent_version: str
    capabilities: Capabilities
    def __init__(self, protocol_version: _Optional[int] = ..., agent_version: _Optional[str] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ...) -> None: ...

class HelloResponse(_message.Message):
    __slots__ = ("protocol_version", "aggregator_version", "site_id", "codecs", "features")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    AGGREGATOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    SITE_ID_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    aggregator_version: str
    site_id: str
    codecs: _containers.RepeatedScalarFieldContainer[str]
    features: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, protocol_version: _Optional[int] = ..., aggregator_version: _Optional[str] = ..., site_id: _Optional[str] = ..., codecs: _Optional[_Iterable[str]] = ..., features: _Optional[_Iterable[str]] = ...) -> None: ...

class WatchWorkRequest(_message.Message):
    __slots__ = ("protocol_version", "open_tasks")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    OPEN_TASKS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    open_tasks: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, protocol_version: _Optional[int] = ..., open_tasks: _Optional[_Iterable[str]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("unix_ms",)
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    unix_ms: int
    def __init__(self, unix_ms: _Optional[int] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("task_id", "round", "attempt", "spec", "model", "deadline_unix_ms", "send_tensors", "downlink_deltas", "signed_task", "work")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SEND_TENSORS_FIELD_NUMBER: _ClassVar[int]
    DOWNLINK_DELTAS_FIELD_NUMBER: _ClassVar[int]
    SIGNED_TASK_FIELD_NUMBER: _ClassVar[int]
    WORK_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    round: int
    attempt: int
    spec: _task_pb2.TaskSpec
    model: _tensors_pb2.ModelManifest
    deadline_unix_ms: int
    send_tensors: _containers.RepeatedScalarFieldContainer[str]
    downlink_deltas: _containers.RepeatedCompositeFieldContainer[_tensors_pb2.DownlinkDelta]
    signed_task: _task_pb2.SignedStatement
    work: str
    def __init__(self, task_id: _Optional[str] = ..., round: _Optional[int] = ..., attempt: _Optional[int] = ..., spec: _Optional[_Union[_task_pb2.TaskSpec, _Mapping]] = ..., model: _Optional[_Union[_tensors_pb2.ModelManifest, _Mapping]] = ..., deadline_unix_ms: _Optional[int] = ..., send_tensors: _Optional[_Iterable[str]] = ..., downlink_deltas: _Optional[_Iterable[_Union[_tensors_pb2.DownlinkDelta, _Mapping]]] = ..., signed_task: _Optional[_Union[_task_pb2.SignedStatement, _Mapping]] = ..., work: _Optional[str] = ...) -> None: ...

class CancelWork(_message.Message):
    __slots__ = ("task_id", "reason", "completed")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    reason: str
    completed: bool
    def __init__(self, task_id: _Optional[str] = ..., reason: _Optional[str] = ..., completed: _Optional[bool] = ...) -> None: ...

class SecAggSetup(_message.Message):
    __slots__ = ("cohort", "threshold", "degree", "clip", "bits", "rounding", "vector_length", "tensor_order", "model_hash", "nonce", "attempt", "ring_bits", "weight_cap", "metric_names", "metric_clip", "per_tensor_counts", "metric_bits", "index_fraction", "dp_mechanism", "dp_scale", "dp_site_variance", "dp_clip_norm", "dp_rounding_beta")
    COHORT_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    DEGREE_FIELD_NUMBER: _ClassVar[int]
    CLIP_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    ROUNDING_FIELD_NUMBER: _ClassVar[int]
    VECTOR_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ORDER_FIELD_NUMBER: _ClassVar[int]
    MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    RING_BITS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_CAP_FIELD_NUMBER: _ClassVar[int]
    METRIC_NAMES_FIELD_NUMBER: _ClassVar[int]
    METRIC_CLIP_FIELD_NUMBER: _ClassVar[int]
    PER_TENSOR_COUNTS_FIELD_NUMBER: _ClassVar[int]
    METRIC_BITS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FRACTION_FIELD_NUMBER: _ClassVar[int]
    DP_MECHANISM_FIELD_NUMBER: _ClassVar[int]
    DP_SCALE_FIELD_NUMBER: _ClassVar[int]
    DP_SITE_VARIANCE_FIELD_NUMBER: _ClassVar[int]
    DP_CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    DP_ROUNDING_BETA_FIELD_NUMBER: _ClassVar[int]
    cohort: _containers.RepeatedScalarFieldContainer[str]
    threshold: int
    degree: int
    clip: float
    bits: int
    rounding: str
    vector_length: int
    tensor_order: _containers.RepeatedScalarFieldContainer[str]
    model_hash: str
    nonce: bytes
    attempt: int
    ring_bits: int
    weight_cap: int
    metric_names: _containers.RepeatedScalarFieldContainer[str]
    metric_clip: float
    per_tensor_counts: bool
    metric_bits: int
    index_fraction: float
    dp_mechanism: str
    dp_scale: float
    dp_site_variance: float
    dp_clip_norm: float
    dp_rounding_beta: float
    def __init__(self, cohort: _Optional[_Iterable[str]] = ..., threshold: _Optional[int] = ..., degree: _Optional[int] = ..., clip: _Optional[float] = ..., bits: _Optional[int] = ..., rounding: _Optional[str] = ..., vector_length: _Optional[int] = ..., tensor_order: _Optional[_Iterable[str]] = ..., model_hash: _Optional[str] = ..., nonce: _Optional[bytes] = ..., attempt: _Optional[int] = ..., ring_bits: _Optional[int] = ..., weight_cap: _Optional[int] = ..., metric_names: _Optional[_Iterable[str]] = ..., metric_clip: _Optional[float] = ..., per_tensor_counts: _Optional[bool] = ..., metric_bits: _Optional[int] = ..., index_fraction: _Optional[float] = ..., dp_mechanism: _Optional[str] = ..., dp_scale: _Optional[float] = ..., dp_site_variance: _Optional[float] = ..., dp_clip_norm: _Optional[float] = ..., dp_rounding_beta: _Optional[float] = ...) -> None: ...

class SecAggPublicKeys(_message.Message):
    __slots__ = ("mask_public_key", "encryption_public_key", "keys_statement")
    MASK_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    ENCRYPTION_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    KEYS_STATEMENT_FIELD_NUMBER: _ClassVar[int]
    mask_public_key: bytes
    encryption_public_key: bytes
    keys_statement: _task_pb2.SignedStatement
    def __init__(self, mask_public_key: _Optional[bytes] = ..., encryption_public_key: _Optional[bytes] = ..., keys_statement: _Optional[_Union[_task_pb2.SignedStatement, _Mapping]] = ...) -> None: ...

class SecAggKeyEntry(_message.Message):
    __slots__ = ("site_id", "mask_public_key", "encryption_public_key", "keys_statement")
    SITE_ID_FIELD_NUMBER: _ClassVar[int]
    MASK_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    ENCRYPTION_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    KEYS_STATEMENT_FIELD_NUMBER: _ClassVar[int]
    site_id: str
    mask_public_key: bytes
    encryption_public_key: bytes
    keys_statement: _task_pb2.SignedStatement
    def __init__(self, site_id: _Optional[str] = ..., mask_public_key: _Optional[bytes] = ..., encryption_public_key: _Optional[bytes] = ..., keys_statement: _Optional[_Union[_task_pb2.SignedStatement, _Mapping]] = ...) -> None: ...

class SecAggKeyDirectory(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[SecAggKeyEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[SecAggKeyEntry, _Mapping]]] = ...) -> None: ...

class SecAggShareKeys(_message.Message):
    __slots__ = ("ciphertexts",)
    class CiphertextsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    CIPHERTEXTS_FIELD_NUMBER: _ClassVar[int]
    ciphertexts: _containers.ScalarMap[str, bytes]
    def __init__(self, ciphertexts: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class SecAggMaskedInputRequest(_message.Message):
    __slots__ = ("alive", "ciphertexts")
    class CiphertextsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    CIPHERTEXTS_FIELD_NUMBER: _ClassVar[int]
    alive: _containers.RepeatedScalarFieldContainer[str]
    ciphertexts: _containers.ScalarMap[str, bytes]
    def __init__(self, alive: _Optional[_Iterable[str]] = ..., ciphertexts: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class SecAggSurvivors(_message.Message):
    __slots__ = ("survivors",)
    SURVIVORS_FIELD_NUMBER: _ClassVar[int]
    survivors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, survivors: _Optional[_Iterable[str]] = ...) -> None: ...

class SecAggSurvivorsSignature(_message.Message):
    __slots__ = ("statement",)
    STATEMENT_FIELD_NUMBER: _ClassVar[int]
    statement: _task_pb2.SignedStatement
    def __init__(self, statement: _Optional[_Union[_task_pb2.SignedStatement, _Mapping]] = ...) -> None: ...

class SecAggUnmaskRequest(_message.Message):
    __slots__ = ("survivors", "dropped", "model_hash", "survivor_signatures")
    class SurvivorSignaturesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _task_pb2.SignedStatement
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_task_pb2.SignedStatement, _Mapping]] = ...) -> None: ...
    SURVIVORS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    SURVIVOR_SIGNATURES_FIELD_NUMBER: _ClassVar[int]
    survivors: _containers.RepeatedScalarFieldContainer[str]
    dropped: _containers.RepeatedScalarFieldContainer[str]
    model_hash: str
    survivor_signatures: _containers.MessageMap[str, _task_pb2.SignedStatement]
    def __init__(self, survivors: _Optional[_Iterable[str]] = ..., dropped: _Optional[_Iterable[str]] = ..., model_hash: _Optional[str] = ..., survivor_signatures: _Optional[_Mapping[str, _task_pb2.SignedStatement]] = ...) -> None: ...

class SecAggUnmaskResponse(_message.Message):
    __slots__ = ("self_mask_shares", "mask_key_shares")
    class SelfMaskSharesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    class MaskKeySharesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    SELF_MASK_SHARES_FIELD_NUMBER: _ClassVar[int]
    MASK_KEY_SHARES_FIELD_NUMBER: _ClassVar[int]
    self_mask_shares: _containers.ScalarMap[str, bytes]
    mask_key_shares: _containers.ScalarMap[str, bytes]
    def __init__(self, self_mask_shares: _Optional[_Mapping[str, bytes]] = ..., mask_key_shares: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class SecAggAbort(_message.Message):
    __slots__ = ("reason", "rejoin")
    REASON_FIELD_NUMBER: _ClassVar[int]
    REJOIN_FIELD_NUMBER: _ClassVar[int]
    reason: str
    rejoin: bool
    def __init__(self, reason: _Optional[str] = ..., rejoin: _Optional[bool] = ...) -> None: ...

class SecAggJoin(_message.Message):
    __slots__ = ("attempt", "model_hash", "vector_length", "metric_names")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    VECTOR_LENGTH_FIELD_NUMBER: _ClassVar[int]
    METRIC_NAMES_FIELD_NUMBER: _ClassVar[int]
    attempt: int
    model_hash: str
    vector_length: int
    metric_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, attempt: _Optional[int] = ..., model_hash: _Optional[str] = ..., vector_length: _Optional[int] = ..., metric_names: _Optional[_Iterable[str]] = ...) -> None: ...

class SecAggPhase(_message.Message):
    __slots__ = ("task_id", "round", "session_id", "setup", "key_directory", "masked_input_request", "unmask_request", "abort", "join", "advertise_keys", "share_keys", "unmask_response", "survivors_request", "survivors_signature")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SETUP_FIELD_NUMBER: _ClassVar[int]
    KEY_DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    MASKED_INPUT_REQUEST_FIELD_NUMBER: _ClassVar[int]
    UNMASK_REQUEST_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    JOIN_FIELD_NUMBER: _ClassVar[int]
    ADVERTISE_KEYS_FIELD_NUMBER: _ClassVar[int]
    SHARE_KEYS_FIELD_NUMBER: _ClassVar[int]
    UNMASK_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    SURVIVORS_REQUEST_FIELD_NUMBER: _ClassVar[int]
    SURVIVORS_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    round: int
    session_id: str
    setup: SecAggSetup
    key_directory: SecAggKeyDirectory
    masked_input_request: SecAggMaskedInputRequest
    unmask_request: SecAggUnmaskRequest
    abort: SecAggAbort
    join: SecAggJoin
    advertise_keys: SecAggPublicKeys
    share_keys: SecAggShareKeys
    unmask_response: SecAggUnmaskResponse
    survivors_request: SecAggSurvivors
    survivors_signature: SecAggSurvivorsSignature
    def __init__(self, task_id: _Optional[str] = ..., round: _Optional[int] = ..., session_id: _Optional[str] = ..., setup: _Optional[_Union[SecAggSetup, _Mapping]] = ..., key_directory: _Optional[_Union[SecAggKeyDirectory, _Mapping]] = ..., masked_input_request: _Optional[_Union[SecAggMaskedInputRequest, _Mapping]] = ..., unmask_request: _Optional[_Union[SecAggUnmaskRequest, _Mapping]] = ..., abort: _Optional[_Union[SecAggAbort, _Mapping]] = ..., join: _Optional[_Union[SecAggJoin, _Mapping]] = ..., advertise_keys: _Optional[_Union[SecAggPublicKeys, _Mapping]] = ..., share_keys: _Optional[_Union[SecAggShareKeys, _Mapping]] = ..., unmask_response: _Optional[_Union[SecAggUnmaskResponse, _Mapping]] = ..., survivors_request: _Optional[_Union[SecAggSurvivors, _Mapping]] = ..., survivors_signature: _Optional[_Union[SecAggSurvivorsSignature, _Mapping]] = ...) -> None: ...

class SecAggAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkItem(_message.Message):
    __slots__ = ("heartbeat", "assignment", "cancel", "secagg")
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    SECAGG_FIELD_NUMBER: _ClassVar[int]
    heartbeat: Heartbeat
    assignment: Assignment
    cancel: CancelWork
    secagg: SecAggPhase
    def __init__(self, heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., assignment: _Optional[_Union[Assignment, _Mapping]] = ..., cancel: _Optional[_Union[CancelWork, _Mapping]] = ..., secagg: _Optional[_Union[SecAggPhase, _Mapping]] = ...) -> None: ...

class FetchModelRequest(_message.Message):
    __slots__ = ("task_id", "model_hash", "have_sha256", "include_files", "latest", "delta_names", "resume_tensor", "resume_offset")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    HAVE_SHA256_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_FILES_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    DELTA_NAMES_FIELD_NUMBER: _ClassVar[int]
    RESUME_TENSOR_FIELD_NUMBER: _ClassVar[int]
    RESUME_OFFSET_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    model_hash: str
    have_sha256: _containers.RepeatedScalarFieldContainer[str]
    include_files: bool
    latest: bool
    delta_names: _containers.RepeatedScalarFieldContainer[str]
    resume_tensor: str
    resume_offset: int
    def __init__(self, task_id: _Optional[str] = ..., model_hash: _Optional[str] = ..., have_sha256: _Optional[_Iterable[str]] = ..., include_files: _Optional[bool] = ..., latest: _Optional[bool] = ..., delta_names: _Optional[_Iterable[str]] = ..., resume_tensor: _Optional[str] = ..., resume_offset: _Optional[int] = ...) -> None: ...

class DpReport(_message.Message):
    __slots__ = ("epsilon", "delta", "noise_multiplier", "max_grad_norm", "accountant", "unit")
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTANT_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    epsilon: float
    delta: float
    noise_multiplier: float
    max_grad_norm: float
    accountant: str
    unit: str
    def __init__(self, epsilon: _Optional[float] = ..., delta: _Optional[float] = ..., noise_multiplier: _Optional[float] = ..., max_grad_norm: _Optional[float] = ..., accountant: _Optional[str] = ..., unit: _Optional[str] = ...) -> None: ...

class UpdateHeader(_message.Message):
    __slots__ = ("task_id", "round", "attempt", "idempotency_key", "base_model_hash", "kind", "num_samples", "metrics", "tensors", "dp", "eval_metrics", "secagg_session_id", "upload_id", "resume_offset", "statement")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class EvalMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    EVAL_METRICS_FIELD_NUMBER: _ClassVar[int]
    SECAGG_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STATEMENT_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    round: int
    attempt: int
    idempotency_key: str
    base_model_hash: str
    kind: _task_pb2.UpdateKind
    num_samples: int
    metrics: _containers.ScalarMap[str, float]
    tensors: _containers.RepeatedCompositeFieldContainer[_tensors_pb2.TensorHeader]
    dp: DpReport
    eval_metrics: _containers.ScalarMap[str, float]
    secagg_session_id: str
    upload_id: str
    resume_offset: int
    statement: _task_pb2.SignedStatement
    def __init__(self, task_id: _Optional[str] = ..., round: _Optional[int] = ..., attempt: _Optional[int] = ..., idempotency_key: _Optional[str] = ..., base_model_hash: _Optional[str] = ..., kind: _Optional[_Union[_task_pb2.UpdateKind, str]] = ..., num_samples: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., tensors: _Optional[_Iterable[_Union[_tensors_pb2.TensorHeader, _Mapping]]] = ..., dp: _Optional[_Union[DpReport, _Mapping]] = ..., eval_metrics: _Optional[_Mapping[str, float]] = ..., secagg_session_id: _Optional[str] = ..., upload_id: _Optional[str] = ..., resume_offset: _Optional[int] = ..., statement: _Optional[_Union[_task_pb2.SignedStatement, _Mapping]] = ...) -> None: ...

class UpdateCommit(_message.Message):
    __slots__ = ("total_encoded_nbytes",)
    TOTAL_ENCODED_NBYTES_FIELD_NUMBER: _ClassVar[int]
    total_encoded_nbytes: int
    def __init__(self, total_encoded_nbytes: _Optional[int] = ...) -> None: ...

class UpdateChunk(_message.Message):
    __slots__ = ("header", "tensor", "commit", "secagg")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    SECAGG_FIELD_NUMBER: _ClassVar[int]
    header: UpdateHeader
    tensor: _tensors_pb2.TensorChunk
    commit: UpdateCommit
    secagg: SecAggPhase
    def __init__(self, header: _Optional[_Union[UpdateHeader, _Mapping]] = ..., tensor: _Optional[_Union[_tensors_pb2.TensorChunk, _Mapping]] = ..., commit: _Optional[_Union[UpdateCommit, _Mapping]] = ..., secagg: _Optional[_Union[SecAggPhase, _Mapping]] = ...) -> None: ...

class UpdateReceipt(_message.Message):
    __slots__ = ("update_id", "duplicate", "stored_nbytes", "round")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    STORED_NBYTES_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    duplicate: bool
    stored_nbytes: int
    round: int
    def __init__(self, update_id: _Optional[str] = ..., duplicate: _Optional[bool] = ..., stored_nbytes: _Optional[int] = ..., round: _Optional[int] = ...) -> None: ...

class QueryUploadRequest(_message.Message):
    __slots__ = ("task_id", "upload_id")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    upload_id: str
    def __init__(self, task_id: _Optional[str] = ..., upload_id: _Optional[str] = ...) -> None: ...

class QueryUploadResponse(_message.Message):
    __slots__ = ("verified_nbytes", "expires_unix_ms")
    VERIFIED_NBYTES_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    verified_nbytes: int
    expires_unix_ms: int
    def __init__(self, verified_nbytes: _Optional[int] = ..., expires_unix_ms: _Optional[int] = ...) -> None: ...

class DeclineRequest(_message.Message):
    __slots__ = ("task_id", "round", "reason", "permanent")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PERMANENT_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    round: int
    reason: str
    permanent: bool
    def __init__(self, task_id: _Optional[str] = ..., round: _Optional[int] = ..., reason: _Optional[str] = ..., permanent: _Optional[bool] = ...) -> None: ...

class DeclineResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HoldRequest(_message.Message):
    __slots__ = ("task_id", "round", "reason")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    round: int
    reason: str
    def __init__(self, task_id: _Optional[str] = ..., round: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class HoldResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResultValues(_message.Message):
    __slots__ = ("model", "values")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    model: str
    values: _containers.ScalarMap[str, float]
    def __init__(self, model: _Optional[str] = ..., values: _Optional[_Mapping[str, float]] = ...) -> None: ...

class SubmitResultRequest(_message.Message):
    __slots__ = ("task_id", "round", "work", "model_hash", "results", "min_cell_rows")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WORK_FIELD_NUMBER: _ClassVar[int]
    MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    MIN_CELL_ROWS_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    round: int
    work: str
    model_hash: str
    results: _containers.RepeatedCompositeFieldContainer[ResultValues]
    min_cell_rows: int
    def __init__(self, task_id: _Optional[str] = ..., round: _Optional[int] = ..., work: _Optional[str] = ..., model_hash: _Optional[str] = ..., results: _Optional[_Iterable[_Union[ResultValues, _Mapping]]] = ..., min_cell_rows: _Optional[int] = ...) -> None: ...

class SubmitResultResponse(_message.Message):
    __slots__ = ("stored", "note")
    STORED_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    stored: int
    note: str
    def __init__(self, stored: _Optional[int] = ..., note: _Optional[str] = ...) -> None: ...
