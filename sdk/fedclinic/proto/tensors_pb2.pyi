from fedclinic.proto import task_pb2 as _task_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorHeader(_message.Message):
    __slots__ = ("name", "dtype", "shape", "codec", "sha256", "encoded_nbytes", "codec_params")
    class CodecParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    ENCODED_NBYTES_FIELD_NUMBER: _ClassVar[int]
    CODEC_PARAMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    codec: str
    sha256: str
    encoded_nbytes: int
    codec_params: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., codec: _Optional[str] = ..., sha256: _Optional[str] = ..., encoded_nbytes: _Optional[int] = ..., codec_params: _Optional[_Mapping[str, str]] = ...) -> None: ...

class DownlinkDelta(_message.Message):
    __slots__ = ("name", "base_sha256", "header")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BASE_SHA256_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    name: str
    base_sha256: str
    header: TensorHeader
    def __init__(self, name: _Optional[str] = ..., base_sha256: _Optional[str] = ..., header: _Optional[_Union[TensorHeader, _Mapping]] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("name", "header", "offset", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    header: TensorHeader
    offset: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., header: _Optional[_Union[TensorHeader, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("path", "offset", "data", "total_nbytes", "sha256")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    data: bytes
    total_nbytes: int
    sha256: str
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_nbytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class FileInfo(_message.Message):
    __slots__ = ("path", "nbytes", "sha256")
    PATH_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    path: str
    nbytes: int
    sha256: str
    def __init__(self, path: _Optional[str] = ..., nbytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class ModelManifest(_message.Message):
    __slots__ = ("model_hash", "tensors", "files")
    MODEL_HASH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    model_hash: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorHeader]
    files: _containers.RepeatedCompositeFieldContainer[FileInfo]
    def __init__(self, model_hash: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorHeader, _Mapping]]] = ..., files: _Optional[_Iterable[_Union[FileInfo, _Mapping]]] = ...) -> None: ...

class ModelChunk(_message.Message):
    __slots__ = ("manifest", "file", "tensor", "statement")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    STATEMENT_FIELD_NUMBER: _ClassVar[int]
    manifest: ModelManifest
    file: FileChunk
    tensor: TensorChunk
    statement: _task_pb2.SignedStatement
    def __init__(self, manifest: _Optional[_Union[ModelManifest, _Mapping]] = ..., file: _Optional[_Union[FileChunk, _Mapping]] = ..., tensor: _Optional[_Union[TensorChunk, _Mapping]] = ..., statement: _Optional[_Union[_task_pb2.SignedStatement, _Mapping]] = ...) -> None: ...
