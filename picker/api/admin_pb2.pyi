from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExplainRequest(_message.Message):
    __slots__ = ("path", "body", "headers")
    class HeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PATH_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    path: str
    body: bytes
    headers: _containers.ScalarMap[str, str]
    def __init__(self, path: _Optional[str] = ..., body: _Optional[bytes] = ..., headers: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ScoredEndpoint(_message.Message):
    __slots__ = ("address", "total", "scores")
    class ScoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    address: str
    total: float
    scores: _containers.ScalarMap[str, float]
    def __init__(self, address: _Optional[str] = ..., total: _Optional[float] = ..., scores: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ProfileExplanation(_message.Message):
    __slots__ = ("name", "picked", "candidates")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PICKED_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    name: str
    picked: _containers.RepeatedScalarFieldContainer[str]
    candidates: _containers.RepeatedCompositeFieldContainer[ScoredEndpoint]
    def __init__(self, name: _Optional[str] = ..., picked: _Optional[_Iterable[str]] = ..., candidates: _Optional[_Iterable[_Union[ScoredEndpoint, _Mapping]]] = ...) -> None: ...

class ExplainResponse(_message.Message):
    __slots__ = ("model", "kind", "priority", "primary_profile", "profiles")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_PROFILE_FIELD_NUMBER: _ClassVar[int]
    PROFILES_FIELD_NUMBER: _ClassVar[int]
    model: str
    kind: str
    priority: int
    primary_profile: str
    profiles: _containers.RepeatedCompositeFieldContainer[ProfileExplanation]
    def __init__(self, model: _Optional[str] = ..., kind: _Optional[str] = ..., priority: _Optional[int] = ..., primary_profile: _Optional[str] = ..., profiles: _Optional[_Iterable[_Union[ProfileExplanation, _Mapping]]] = ...) -> None: ...

class ListEndpointsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EndpointState(_message.Message):
    __slots__ = ("address", "labels", "ready", "waiting", "running", "kv_cache_usage", "in_flight", "metrics_age_seconds")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    METRICS_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    address: str
    labels: _containers.ScalarMap[str, str]
    ready: bool
    waiting: float
    running: float
    kv_cache_usage: float
    in_flight: int
    metrics_age_seconds: float
    def __init__(self, address: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., ready: _Optional[bool] = ..., waiting: _Optional[float] = ..., running: _Optional[float] = ..., kv_cache_usage: _Optional[float] = ..., in_flight: _Optional[int] = ..., metrics_age_seconds: _Optional[float] = ...) -> None: ...

class ListEndpointsResponse(_message.Message):
    __slots__ = ("endpoints",)
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    endpoints: _containers.RepeatedCompositeFieldContainer[EndpointState]
    def __init__(self, endpoints: _Optional[_Iterable[_Union[EndpointState, _Mapping]]] = ...) -> None: ...
