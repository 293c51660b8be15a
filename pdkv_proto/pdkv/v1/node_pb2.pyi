from pdkv_proto.pdkv.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AdapterRef(_message.Message):
    __slots__ = ("name", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    digest: bytes
    def __init__(self, name: _Optional[str] = ..., digest: _Optional[bytes] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _types_pb2.SamplingParams
    cache_salt: str
    adapter: AdapterRef
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., adapter: _Optional[_Union[AdapterRef, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "first_logprob", "finished", "finish_reason", "stop_token_id", "stop_string", "text", "prompt", "kv_transfer_params", "first_top_logprobs", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    first_logprob: float
    finished: bool
    finish_reason: _types_pb2.FinishReason
    stop_token_id: int
    stop_string: str
    text: str
    prompt: _types_pb2.PromptUsage
    kv_transfer_params: bytes
    first_top_logprobs: _types_pb2.TopLogprobs
    prompt_logprobs: _types_pb2.PromptLogprobs
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_logprob: _Optional[float] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[_types_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ..., text: _Optional[str] = ..., prompt: _Optional[_Union[_types_pb2.PromptUsage, _Mapping]] = ..., kv_transfer_params: _Optional[bytes] = ..., first_top_logprobs: _Optional[_Union[_types_pb2.TopLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[_types_pb2.PromptLogprobs, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "first_token_id", "kv_transfer_params", "resume_output_token_ids", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    RESUME_OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _types_pb2.SamplingParams
    cache_salt: str
    first_token_id: int
    kv_transfer_params: bytes
    resume_output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    adapter: AdapterRef
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., first_token_id: _Optional[int] = ..., kv_transfer_params: _Optional[bytes] = ..., resume_output_token_ids: _Optional[_Iterable[int]] = ..., adapter: _Optional[_Union[AdapterRef, _Mapping]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finished", "finish_reason", "stop_token_id", "stop_string", "prompt", "top_logprobs", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finished: bool
    finish_reason: _types_pb2.FinishReason
    stop_token_id: int
    stop_string: str
    prompt: _types_pb2.PromptUsage
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_types_pb2.TopLogprobs]
    prompt_logprobs: _types_pb2.PromptLogprobs
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[_types_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ..., prompt: _Optional[_Union[_types_pb2.PromptUsage, _Mapping]] = ..., top_logprobs: _Optional[_Iterable[_Union[_types_pb2.TopLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Union[_types_pb2.PromptLogprobs, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("check_integrity",)
    CHECK_INTEGRITY_FIELD_NUMBER: _ClassVar[int]
    check_integrity: bool
    def __init__(self, check_integrity: _Optional[bool] = ...) -> None: ...

class NodeStats(_message.Message):
    __slots__ = ("node_id", "role", "engine_id", "num_requests", "integrity_checked", "integrity_ok", "integrity_error", "kv_endpoint", "connector_stats", "model_fingerprint", "block_size", "hash_algo", "counters", "gauges", "histograms", "kv_events_endpoint", "kv_events_replay_endpoint", "kv_events_epoch", "dtype", "deterministic", "adapters", "runtime_lora", "max_lora_rank", "stats_age_s", "max_model_len")
    class ConnectorStatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class GaugesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class HistogramsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Histogram
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Histogram, _Mapping]] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_CHECKED_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_OK_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_ERROR_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    CONNECTOR_STATS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    GAUGES_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAMS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_REPLAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_EPOCH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_LORA_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    STATS_AGE_S_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    engine_id: str
    num_requests: int
    integrity_checked: bool
    integrity_ok: bool
    integrity_error: str
    kv_endpoint: str
    connector_stats: _containers.ScalarMap[str, float]
    model_fingerprint: str
    block_size: int
    hash_algo: str
    counters: _containers.ScalarMap[str, float]
    gauges: _containers.ScalarMap[str, float]
    histograms: _containers.MessageMap[str, Histogram]
    kv_events_endpoint: str
    kv_events_replay_endpoint: str
    kv_events_epoch: str
    dtype: str
    deterministic: bool
    adapters: _containers.RepeatedCompositeFieldContainer[_types_pb2.AdapterInfo]
    runtime_lora: bool
    max_lora_rank: int
    stats_age_s: float
    max_model_len: int
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[str] = ..., engine_id: _Optional[str] = ..., num_requests: _Optional[int] = ..., integrity_checked: _Optional[bool] = ..., integrity_ok: _Optional[bool] = ..., integrity_error: _Optional[str] = ..., kv_endpoint: _Optional[str] = ..., connector_stats: _Optional[_Mapping[str, float]] = ..., model_fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., hash_algo: _Optional[str] = ..., counters: _Optional[_Mapping[str, float]] = ..., gauges: _Optional[_Mapping[str, float]] = ..., histograms: _Optional[_Mapping[str, Histogram]] = ..., kv_events_endpoint: _Optional[str] = ..., kv_events_replay_endpoint: _Optional[str] = ..., kv_events_epoch: _Optional[str] = ..., dtype: _Optional[str] = ..., deterministic: _Optional[bool] = ..., adapters: _Optional[_Iterable[_Union[_types_pb2.AdapterInfo, _Mapping]]] = ..., runtime_lora: _Optional[bool] = ..., max_lora_rank: _Optional[int] = ..., stats_age_s: _Optional[float] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class Histogram(_message.Message):
    __slots__ = ("bounds", "counts", "sum")
    BOUNDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    bounds: _containers.RepeatedScalarFieldContainer[float]
    counts: _containers.RepeatedScalarFieldContainer[int]
    sum: float
    def __init__(self, bounds: _Optional[_Iterable[float]] = ..., counts: _Optional[_Iterable[int]] = ..., sum: _Optional[float] = ...) -> None: ...
