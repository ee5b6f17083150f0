from fedclinic.proto import task_pb2 as _task_pb2
from fedclinic.proto import tensors_pb2 as _tensors_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TaskState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_STATE_UNSPECIFIED: _ClassVar[TaskState]
    TASK_STATE_QUEUED: _ClassVar[TaskState]
    TASK_STATE_RUNNING: _ClassVar[TaskState]
    TASK_STATE_COMPLETED: _ClassVar[TaskState]
    TASK_STATE_FAILED: _ClassVar[TaskState]
    TASK_STATE_CANCELLED: _ClassVar[TaskState]

class RoundState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUND_STATE_UNSPECIFIED: _ClassVar[RoundState]
    ROUND_STATE_OPEN: _ClassVar[RoundState]
    ROUND_STATE_CLOSED: _ClassVar[RoundState]
    ROUND_STATE_FAILED: _ClassVar[RoundState]
TASK_STATE_UNSPECIFIED: TaskState
TASK_STATE_QUEUED: TaskState
TASK_STATE_RUNNING: TaskState
TASK_STATE_COMPLETED: TaskState
TASK_STATE_FAILED: TaskState
TASK_STATE_CANCELLED: TaskState
ROUND_STATE_UNSPECIFIED: RoundState
ROUND_STATE_OPEN: RoundState
ROUND_STATE_CLOSED: RoundState
ROUND_STATE_FAILED: RoundState

class SubmitTaskHeader(_message.Message):
    __slots__ = ("spec", "idempotency_key", "model", "signed_task")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SIGNED_TASK_FIELD_NUMBER: _ClassVar[int]
    spec: _task_pb2.TaskSpec
    idempotency_key: str
    model: _tensors_pb2.ModelManifest
    signed_task: _task_pb2.SignedStatement
    def __init__(self, spec: _Optional[_Union[_task_pb2.TaskSpec, _Mapping]] = ..., idempotency_key: _Optional[str] = ..., model: _Optional[_Union[_tensors_pb2.ModelManifest, _Mapping]] = ..., signed_task: _Optional[_Union[_task_pb2.SignedStatement, _Mapping]] = ...) -> None: ...

class SubmitTaskCommit(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubmitTaskChunk(_message.Message):
    __slots__ = ("header", "file", "tensor", "commit")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    header: SubmitTaskHeader
    file: _tensors_pb2.FileChunk
    tensor: _tensors_pb2.TensorChunk
    commit: SubmitTaskCommit
    def __init__(self, header: _Optional[_Union[SubmitTaskHeader, _Mapping]] = ..., file: _Optional[_Union[_tensors_pb2.FileChunk, _Mapping]] = ..., tensor: _Optional[_Union[_tensors_pb2.TensorChunk, _Mapping]] = ..., commit: _Optional[_Union[SubmitTaskCommit, _Mapping]] = ...) -> None: ...

class SiteReport(_message.Message):
    __slots__ = ("site_id", "num_samples", "uplink_bytes", "metrics", "eval_metrics", "uplink_fp32_bytes", "uplink_wire_bytes", "selected_layers", "downlink_bytes", "downlink_wire_bytes", "eval_rows", "eval_suppressed")
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
    SITE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    UPLINK_BYTES_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    EVAL_METRICS_FIELD_NUMBER: _ClassVar[int]
    UPLINK_FP32_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPLINK_WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SELECTED_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DOWNLINK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DOWNLINK_WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    EVAL_SUPPRESSED_FIELD_NUMBER: _ClassVar[int]
    site_id: str
    num_samples: int
    uplink_bytes: int
    metrics: _containers.ScalarMap[str, float]
    eval_metrics: _containers.ScalarMap[str, float]
    uplink_fp32_bytes: int
    uplink_wire_bytes: int
    selected_layers: _containers.RepeatedScalarFieldContainer[int]
    downlink_bytes: int
    downlink_wire_bytes: int
    eval_rows: int
    eval_suppressed: bool
    def __init__(self, site_id: _Optional[str] = ..., num_samples: _Optional[int] = ..., uplink_bytes: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., eval_metrics: _Optional[_Mapping[str, float]] = ..., uplink_fp32_bytes: _Optional[int] = ..., uplink_wire_bytes: _Optional[int] = ..., selected_layers: _Optional[_Iterable[int]] = ..., downlink_bytes: _Optional[int] = ..., downlink_wire_bytes: _Optional[int] = ..., eval_rows: _Optional[int] = ..., eval_suppressed: _Optional[bool] = ...) -> None: ...

class RoundSummary(_message.Message):
    __slots__ = ("round", "state", "attempt", "sites_target", "sites_assigned", "reports", "metrics", "uplink_bytes", "downlink_bytes", "opened_unix_ms", "closed_unix_ms", "deadline_unix_ms", "model_hash", "declined", "downlink_wire_bytes", "held", "ddp_epsilon", "ddp_delta", "ddp_noise_sites", "ddp_noise_stddev", "ddp_mechanism", "eval_sites", "eval_model_hash")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    SITES_TARGET_FIELD_NUMBER: _ClassVar[int]
    SITES_ASSIGNED_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    UPLINK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DOWNLINK_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPENED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CLOSED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    DECLINED_FIELD_NUMBER: _ClassVar[int]
    DOWNLINK_WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    DDP_EPSILON_FIELD_NUMBER: _ClassVar[int]
    DDP_DELTA_FIELD_NUMBER: _ClassVar[int]
    DDP_NOISE_SITES_FIELD_NUMBER: _ClassVar[int]
    DDP_NOISE_STDDEV_FIELD_NUMBER: _ClassVar[int]
    DDP_MECHANISM_FIELD_NUMBER: _ClassVar[int]
    EVAL_SITES_FIELD_NUMBER: _ClassVar[int]
    EVAL_MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    round: int
    state: RoundState
    attempt: int
    sites_target: int
    sites_assigned: _containers.RepeatedScalarFieldContainer[str]
    reports: _containers.RepeatedCompositeFieldContainer[SiteReport]
    metrics: _containers.ScalarMap[str, float]
    uplink_bytes: int
    downlink_bytes: int
    opened_unix_ms: int
    closed_unix_ms: int
    deadline_unix_ms: int
    model_hash: str
    declined: _containers.RepeatedScalarFieldContainer[str]
    downlink_wire_bytes: int
    held: _containers.RepeatedScalarFieldContainer[str]
    ddp_epsilon: float
    ddp_delta: float
    ddp_noise_sites: int
    ddp_noise_stddev: float
    ddp_mechanism: str
    eval_sites: int
    eval_model_hash: str
    def __init__(self, round: _Optional[int] = ..., state: _Optional[_Union[RoundState, str]] = ..., attempt: _Optional[int] = ..., sites_target: _Optional[int] = ..., sites_assigned: _Optional[_Iterable[str]] = ..., reports: _Optional[_Iterable[_Union[SiteReport, _Mapping]]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., uplink_bytes: _Optional[int] = ..., downlink_bytes: _Optional[int] = ..., opened_unix_ms: _Optional[int] = ..., closed_unix_ms: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., model_hash: _Optional[str] = ..., declined: _Optional[_Iterable[str]] = ..., downlink_wire_bytes: _Optional[int] = ..., held: _Optional[_Iterable[str]] = ..., ddp_epsilon: _Optional[float] = ..., ddp_delta: _Optional[float] = ..., ddp_noise_sites: _Optional[int] = ..., ddp_noise_stddev: _Optional[float] = ..., ddp_mechanism: _Optional[str] = ..., eval_sites: _Optional[int] = ..., eval_model_hash: _Optional[str] = ...) -> None: ...

class TaskStatus(_message.Message):
    __slots__ = ("task_id", "spec", "state", "current_round", "rounds", "error", "owner", "created_unix_ms", "updated_unix_ms", "initial_model_hash", "final_model_hash", "signed", "results", "site_statistics", "pooled_statistics")
    class SiteStatisticsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: StatisticsValues
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[StatisticsValues, _Mapping]] = ...) -> None: ...
    class PooledStatisticsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CURRENT_ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    INITIAL_MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    FINAL_MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    SIGNED_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    SITE_STATISTICS_FIELD_NUMBER: _ClassVar[int]
    POOLED_STATISTICS_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    spec: _task_pb2.TaskSpec
    state: TaskState
    current_round: int
    rounds: _containers.RepeatedCompositeFieldContainer[RoundSummary]
    error: str
    owner: str
    created_unix_ms: int
    updated_unix_ms: int
    initial_model_hash: str
    final_model_hash: str
    signed: bool
    results: ResultPhase
    site_statistics: _containers.MessageMap[str, StatisticsValues]
    pooled_statistics: _containers.ScalarMap[str, float]
    def __init__(self, task_id: _Optional[str] = ..., spec: _Optional[_Union[_task_pb2.TaskSpec, _Mapping]] = ..., state: _Optional[_Union[TaskState, str]] = ..., current_round: _Optional[int] = ..., rounds: _Optional[_Iterable[_Union[RoundSummary, _Mapping]]] = ..., error: _Optional[str] = ..., owner: _Optional[str] = ..., created_unix_ms: _Optional[int] = ..., updated_unix_ms: _Optional[int] = ..., initial_model_hash: _Optional[str] = ..., final_model_hash: _Optional[str] = ..., signed: _Optional[bool] = ..., results: _Optional[_Union[ResultPhase, _Mapping]] = ..., site_statistics: _Optional[_Mapping[str, StatisticsValues]] = ..., pooled_statistics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class StatisticsValues(_message.Message):
    __slots__ = ("values",)
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.ScalarMap[str, float]
    def __init__(self, values: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ResultCell(_message.Message):
    __slots__ = ("site_id", "model", "values", "suppressed", "rows")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SITE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SUPPRESSED_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    site_id: str
    model: str
    values: _containers.ScalarMap[str, float]
    suppressed: bool
    rows: int
    def __init__(self, site_id: _Optional[str] = ..., model: _Optional[str] = ..., values: _Optional[_Mapping[str, float]] = ..., suppressed: _Optional[bool] = ..., rows: _Optional[int] = ...) -> None: ...

class PooledResult(_message.Message):
    __slots__ = ("model", "values", "sites", "note")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SITES_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    model: str
    values: _containers.ScalarMap[str, float]
    sites: int
    note: str
    def __init__(self, model: _Optional[str] = ..., values: _Optional[_Mapping[str, float]] = ..., sites: _Optional[int] = ..., note: _Optional[str] = ...) -> None: ...

class ResultPhase(_message.Message):
    __slots__ = ("work", "round", "open", "model_hash", "opened_unix_ms", "deadline_unix_ms", "closed_unix_ms", "cells", "pooled", "declined", "waiting")
    WORK_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    OPENED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CLOSED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CELLS_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    DECLINED_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    work: str
    round: int
    open: bool
    model_hash: str
    opened_unix_ms: int
    deadline_unix_ms: int
    closed_unix_ms: int
    cells: _containers.RepeatedCompositeFieldContainer[ResultCell]
    pooled: _containers.RepeatedCompositeFieldContainer[PooledResult]
    declined: _containers.RepeatedScalarFieldContainer[str]
    waiting: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, work: _Optional[str] = ..., round: _Optional[int] = ..., open: _Optional[bool] = ..., model_hash: _Optional[str] = ..., opened_unix_ms: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., closed_unix_ms: _Optional[int] = ..., cells: _Optional[_Iterable[_Union[ResultCell, _Mapping]]] = ..., pooled: _Optional[_Iterable[_Union[PooledResult, _Mapping]]] = ..., declined: _Optional[_Iterable[str]] = ..., waiting: _Optional[_Iterable[str]] = ...) -> None: ...

class GetTaskRequest(_message.Message):
    __slots__ = ("task_id",)
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    def __init__(self, task_id: _Optional[str] = ...) -> None: ...

class ListTasksRequest(_message.Message):
    __slots__ = ("include_finished",)
    INCLUDE_FINISHED_FIELD_NUMBER: _ClassVar[int]
    include_finished: bool
    def __init__(self, include_finished: _Optional[bool] = ...) -> None: ...

class ListTasksResponse(_message.Message):
    __slots__ = ("tasks",)
    TASKS_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[TaskStatus]
    def __init__(self, tasks: _Optional[_Iterable[_Union[TaskStatus, _Mapping]]] = ...) -> None: ...

class WatchTaskRequest(_message.Message):
    __slots__ = ("task_id", "after_seq")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    after_seq: int
    def __init__(self, task_id: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class TaskEvent(_message.Message):
    __slots__ = ("seq", "kind", "message", "status", "unix_ms")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    kind: str
    message: str
    status: TaskStatus
    unix_ms: int
    def __init__(self, seq: _Optional[int] = ..., kind: _Optional[str] = ..., message: _Optional[str] = ..., status: _Optional[_Union[TaskStatus, _Mapping]] = ..., unix_ms: _Optional[int] = ...) -> None: ...

class CancelTaskRequest(_message.Message):
    __slots__ = ("task_id", "reason")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    reason: str
    def __init__(self, task_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ControlFetchModelRequest(_message.Message):
    __slots__ = ("task_id", "round", "have_sha256", "resume_tensor", "resume_offset")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    HAVE_SHA256_FIELD_NUMBER: _ClassVar[int]
    RESUME_TENSOR_FIELD_NUMBER: _ClassVar[int]
    RESUME_OFFSET_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    round: int
    have_sha256: _containers.RepeatedScalarFieldContainer[str]
    resume_tensor: str
    resume_offset: int
    def __init__(self, task_id: _Optional[str] = ..., round: _Optional[int] = ..., have_sha256: _Optional[_Iterable[str]] = ..., resume_tensor: _Optional[str] = ..., resume_offset: _Optional[int] = ...) -> None: ...

class GetTaskRecordsRequest(_message.Message):
    __slots__ = ("task_id", "first_round")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_ROUND_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    first_round: int
    def __init__(self, task_id: _Optional[str] = ..., first_round: _Optional[int] = ...) -> None: ...

class RoundRecords(_message.Message):
    __slots__ = ("round", "attempt", "base_model_hash", "model_hash", "state", "statements", "secure", "survivors", "secure_sum_sha256", "secure_params_json", "updates_published")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATEMENTS_FIELD_NUMBER: _ClassVar[int]
    SECURE_FIELD_NUMBER: _ClassVar[int]
    SURVIVORS_FIELD_NUMBER: _ClassVar[int]
    SECURE_SUM_SHA256_FIELD_NUMBER: _ClassVar[int]
    SECURE_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    UPDATES_PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    round: int
    attempt: int
    base_model_hash: str
    model_hash: str
    state: int
    statements: _containers.RepeatedCompositeFieldContainer[_task_pb2.SignedStatement]
    secure: bool
    survivors: _containers.RepeatedScalarFieldContainer[str]
    secure_sum_sha256: str
    secure_params_json: str
    updates_published: bool
    def __init__(self, round: _Optional[int] = ..., attempt: _Optional[int] = ..., base_model_hash: _Optional[str] = ..., model_hash: _Optional[str] = ..., state: _Optional[int] = ..., statements: _Optional[_Iterable[_Union[_task_pb2.SignedStatement, _Mapping]]] = ..., secure: _Optional[bool] = ..., survivors: _Optional[_Iterable[str]] = ..., secure_sum_sha256: _Optional[str] = ..., secure_params_json: _Optional[str] = ..., updates_published: _Optional[bool] = ...) -> None: ...

class TaskRecords(_message.Message):
    __slots__ = ("task_id", "spec", "initial_model_hash", "final_model_hash", "state", "rounds", "next_round")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    INITIAL_MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    FINAL_MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_ROUND_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    spec: _task_pb2.TaskSpec
    initial_model_hash: str
    final_model_hash: str
    state: int
    rounds: _containers.RepeatedCompositeFieldContainer[RoundRecords]
    next_round: int
    def __init__(self, task_id: _Optional[str] = ..., spec: _Optional[_Union[_task_pb2.TaskSpec, _Mapping]] = ..., initial_model_hash: _Optional[str] = ..., final_model_hash: _Optional[str] = ..., state: _Optional[int] = ..., rounds: _Optional[_Iterable[_Union[RoundRecords, _Mapping]]] = ..., next_round: _Optional[int] = ...) -> None: ...

class FetchTaskBlobRequest(_message.Message):
    __slots__ = ("task_id", "sha256")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    sha256: str
    def __init__(self, task_id: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class BlobChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...
