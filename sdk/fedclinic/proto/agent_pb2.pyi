from fedclinic.proto import task_pb2 as _task_pb2
from fedclinic.proto import tensors_pb2 as _tensors_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Capabilities(_message.Message):
    __slots__ = ("devices", "codecs", "secure_aggregation", "families")
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    SECURE_AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    FAMILIES_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedScalarFieldContainer[str]
    codecs: _containers.RepeatedScalarFieldContainer[str]
    secure_aggregation: bool
    families: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, devices: _Optional[_Iterable[str]] = ..., codecs: _Optional[_Iterable[str]] = ..., secure_aggregation: _Optional[bool] = ..., families: _Optional[_Iterable[str]] = ...) -> None: ...

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
    __slots__ = ("protocol_version", "aggregator_version", "site_id", "codecs")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    AGGREGATOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    SITE_ID_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    aggregator_version: str
    site_id: str
    codecs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, protocol_version: _Optional[int] = ..., aggregator_version: _Optional[str] = ..., site_id: _Optional[str] = ..., codecs: _Optional[_Iterable[str]] = ...) -> None: ...

class WatchWorkRequest(_message.Message):
    __slots__ = ("protocol_version",)
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    def __init__(self, protocol_version: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("unix_ms",)
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    unix_ms: int
    def __init__(self, unix_ms: _Optional[int] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("task_id", "round", "attempt", "spec", "model", "deadline_unix_ms", "send_tensors")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SEND_TENSORS_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    round: int
    attempt: int
    spec: _task_pb2.TaskSpec
    model: _tensors_pb2.ModelManifest
    deadline_unix_ms: int
    send_tensors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, task_id: _Optional[str] = ..., round: _Optional[int] = ..., attempt: _Optional[int] = ..., spec: _Optional[_Union[_task_pb2.TaskSpec, _Mapping]] = ..., model: _Optional[_Union[_tensors_pb2.ModelManifest, _Mapping]] = ..., deadline_unix_ms: _Optional[int] = ..., send_tensors: _Optional[_Iterable[str]] = ...) -> None: ...

class CancelWork(_message.Message):
    __slots__ = ("task_id", "reason")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    reason: str
    def __init__(self, task_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class SecAggPhase(_message.Message):
    __slots__ = ("task_id", "round", "session_id", "phase", "payload")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    round: int
    session_id: str
    phase: str
    payload: bytes
    def __init__(self, task_id: _Optional[str] = ..., round: _Optional[int] = ..., session_id: _Optional[str] = ..., phase: _Optional[str] = ..., payload: _Optional[bytes] = ...) -> None: ...

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
    __slots__ = ("task_id", "model_hash", "have_sha256", "include_files")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    HAVE_SHA256_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_FILES_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    model_hash: str
    have_sha256: _containers.RepeatedScalarFieldContainer[str]
    include_files: bool
    def __init__(self, task_id: _Optional[str] = ..., model_hash: _Optional[str] = ..., have_sha256: _Optional[_Iterable[str]] = ..., include_files: _Optional[bool] = ...) -> None: ...

class DpReport(_message.Message):
    __slots__ = ("epsilon", "delta", "noise_multiplier", "max_grad_norm", "accountant")
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTANT_FIELD_NUMBER: _ClassVar[int]
    epsilon: float
    delta: float
    noise_multiplier: float
    max_grad_norm: float
    accountant: str
    def __init__(self, epsilon: _Optional[float] = ..., delta: _Optional[float] = ..., noise_multiplier: _Optional[float] = ..., max_grad_norm: _Optional[float] = ..., accountant: _Optional[str] = ...) -> None: ...

class UpdateHeader(_message.Message):
    __slots__ = ("task_id", "round", "attempt", "idempotency_key", "base_model_hash", "kind", "num_samples", "metrics", "tensors", "dp", "eval_metrics")
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
    def __init__(self, task_id: _Optional[str] = ..., round: _Optional[int] = ..., attempt: _Optional[int] = ..., idempotency_key: _Optional[str] = ..., base_model_hash: _Optional[str] = ..., kind: _Optional[_Union[_task_pb2.UpdateKind, str]] = ..., num_samples: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., tensors: _Optional[_Iterable[_Union[_tensors_pb2.TensorHeader, _Mapping]]] = ..., dp: _Optional[_Union[DpReport, _Mapping]] = ..., eval_metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

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
