from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FeatureRow(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class PredictRequest(_message.Message):
    __slots__ = ("texts", "features", "contexts", "images")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    features: _containers.RepeatedCompositeFieldContainer[FeatureRow]
    contexts: _containers.RepeatedScalarFieldContainer[str]
    images: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., features: _Optional[_Iterable[_Union[FeatureRow, _Mapping]]] = ..., contexts: _Optional[_Iterable[str]] = ..., images: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Entity(_message.Message):
    __slots__ = ("start", "end", "label", "text")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    label: str
    text: str
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ..., label: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class Prediction(_message.Message):
    __slots__ = ("label", "labels", "scores", "entities", "answer", "threshold", "thresholds")
    class ScoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class ThresholdsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LABEL_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    ENTITIES_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    THRESHOLDS_FIELD_NUMBER: _ClassVar[int]
    label: str
    labels: _containers.RepeatedScalarFieldContainer[str]
    scores: _containers.ScalarMap[str, float]
    entities: _containers.RepeatedCompositeFieldContainer[Entity]
    answer: str
    threshold: float
    thresholds: _containers.ScalarMap[str, float]
    def __init__(self, label: _Optional[str] = ..., labels: _Optional[_Iterable[str]] = ..., scores: _Optional[_Mapping[str, float]] = ..., entities: _Optional[_Iterable[_Union[Entity, _Mapping]]] = ..., answer: _Optional[str] = ..., threshold: _Optional[float] = ..., thresholds: _Optional[_Mapping[str, float]] = ...) -> None: ...

class PredictResponse(_message.Message):
    __slots__ = ("predictions",)
    PREDICTIONS_FIELD_NUMBER: _ClassVar[int]
    predictions: _containers.RepeatedCompositeFieldContainer[Prediction]
    def __init__(self, predictions: _Optional[_Iterable[_Union[Prediction, _Mapping]]] = ...) -> None: ...

class DescribeModelRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelDescription(_message.Message):
    __slots__ = ("family", "labels", "multi_label", "threshold", "image_size", "thresholds")
    class ThresholdsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    MULTI_LABEL_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    THRESHOLDS_FIELD_NUMBER: _ClassVar[int]
    family: str
    labels: _containers.RepeatedScalarFieldContainer[str]
    multi_label: bool
    threshold: float
    image_size: int
    thresholds: _containers.ScalarMap[str, float]
    def __init__(self, family: _Optional[str] = ..., labels: _Optional[_Iterable[str]] = ..., multi_label: _Optional[bool] = ..., threshold: _Optional[float] = ..., image_size: _Optional[int] = ..., thresholds: _Optional[_Mapping[str, float]] = ...) -> None: ...
