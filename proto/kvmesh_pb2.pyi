from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "logprobs", "n", "speculative", "structured")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    logprobs: bool
    n: int
    speculative: bool
    structured: StructuredOutput
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[bool] = ..., n: _Optional[int] = ..., speculative: _Optional[bool] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: ChoiceList
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt", "chat", "prompt_token_ids", "sampling", "priority", "adapter", "resume_token_ids", "resume_text_chars")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt: str
    chat: ChatMessages
    prompt_token_ids: TokenIds
    sampling: SamplingParams
    priority: int
    adapter: str
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resume_text_chars: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., adapter: _Optional[str] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., resume_text_chars: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Logprobs(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("arrival_time", "first_scheduled_time", "first_token_time", "finished_time", "num_preemptions", "peak_kv_tokens")
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    FIRST_SCHEDULED_TIME_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TIME_FIELD_NUMBER: _ClassVar[int]
    FINISHED_TIME_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PEAK_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    arrival_time: float
    first_scheduled_time: float
    first_token_time: float
    finished_time: float
    num_preemptions: int
    peak_kv_tokens: int
    def __init__(self, arrival_time: _Optional[float] = ..., first_scheduled_time: _Optional[float] = ..., first_token_time: _Optional[float] = ..., finished_time: _Optional[float] = ..., num_preemptions: _Optional[int] = ..., peak_kv_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "logprobs", "sample_index", "finished", "finish_reason", "usage", "timings", "error", "degraded")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: Logprobs
    sample_index: int
    finished: bool
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    error: str
    degraded: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Union[Logprobs, _Mapping]] = ..., sample_index: _Optional[int] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., error: _Optional[str] = ..., degraded: _Optional[str] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "owned_by", "max_model_len", "block_size", "parent")
    ID_FIELD_NUMBER: _ClassVar[int]
    OWNED_BY_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    id: str
    owned_by: str
    max_model_len: int
    block_size: int
    parent: str
    def __init__(self, id: _Optional[str] = ..., owned_by: _Optional[str] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., parent: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "num_workers", "num_healthy_workers")
    class ServingStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        SERVING_STATUS_UNSPECIFIED: _ClassVar[HealthResponse.ServingStatus]
        SERVING: _ClassVar[HealthResponse.ServingStatus]
        NOT_SERVING: _ClassVar[HealthResponse.ServingStatus]
    SERVING_STATUS_UNSPECIFIED: HealthResponse.ServingStatus
    SERVING: HealthResponse.ServingStatus
    NOT_SERVING: HealthResponse.ServingStatus
    STATUS_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_HEALTHY_WORKERS_FIELD_NUMBER: _ClassVar[int]
    status: HealthResponse.ServingStatus
    num_workers: int
    num_healthy_workers: int
    def __init__(self, status: _Optional[_Union[HealthResponse.ServingStatus, str]] = ..., num_workers: _Optional[int] = ..., num_healthy_workers: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "healthy", "block_size", "num_blocks_total", "num_blocks_used", "num_blocks_cached", "num_blocks_free", "kv_tokens_used", "kv_tokens_capacity", "kv_tokens_reserved", "num_running", "num_waiting", "queued_prompt_tokens", "prefix_cache_hit_rate", "output_tokens_per_s", "num_preemptions_recompute", "num_preemptions_swap", "prefix_event_seq", "stats_age_s", "num_preemptions_priority", "num_outgrown_estimates", "tokens_to_compute", "kv_tokens_reserved_shared", "num_preemptions_priority_kv", "lora_slots_total", "resident_adapters", "num_adapter_loads", "num_adapter_evictions", "num_waiting_for_adapter")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_RESERVED_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_SWAP_FIELD_NUMBER: _ClassVar[int]
    PREFIX_EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    STATS_AGE_S_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTGROWN_ESTIMATES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TO_COMPUTE_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_RESERVED_SHARED_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_PRIORITY_KV_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    NUM_ADAPTER_LOADS_FIELD_NUMBER: _ClassVar[int]
    NUM_ADAPTER_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FOR_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    healthy: bool
    block_size: int
    num_blocks_total: int
    num_blocks_used: int
    num_blocks_cached: int
    num_blocks_free: int
    kv_tokens_used: int
    kv_tokens_capacity: int
    kv_tokens_reserved: int
    num_running: int
    num_waiting: int
    queued_prompt_tokens: int
    prefix_cache_hit_rate: float
    output_tokens_per_s: float
    num_preemptions_recompute: int
    num_preemptions_swap: int
    prefix_event_seq: int
    stats_age_s: float
    num_preemptions_priority: int
    num_outgrown_estimates: int
    tokens_to_compute: int
    kv_tokens_reserved_shared: int
    num_preemptions_priority_kv: int
    lora_slots_total: int
    resident_adapters: _containers.RepeatedScalarFieldContainer[str]
    num_adapter_loads: int
    num_adapter_evictions: int
    num_waiting_for_adapter: int
    def __init__(self, worker_id: _Optional[str] = ..., healthy: _Optional[bool] = ..., block_size: _Optional[int] = ..., num_blocks_total: _Optional[int] = ..., num_blocks_used: _Optional[int] = ..., num_blocks_cached: _Optional[int] = ..., num_blocks_free: _Optional[int] = ..., kv_tokens_used: _Optional[int] = ..., kv_tokens_capacity: _Optional[int] = ..., kv_tokens_reserved: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., queued_prompt_tokens: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., output_tokens_per_s: _Optional[float] = ..., num_preemptions_recompute: _Optional[int] = ..., num_preemptions_swap: _Optional[int] = ..., prefix_event_seq: _Optional[int] = ..., stats_age_s: _Optional[float] = ..., num_preemptions_priority: _Optional[int] = ..., num_outgrown_estimates: _Optional[int] = ..., tokens_to_compute: _Optional[int] = ..., kv_tokens_reserved_shared: _Optional[int] = ..., num_preemptions_priority_kv: _Optional[int] = ..., lora_slots_total: _Optional[int] = ..., resident_adapters: _Optional[_Iterable[str]] = ..., num_adapter_loads: _Optional[int] = ..., num_adapter_evictions: _Optional[int] = ..., num_waiting_for_adapter: _Optional[int] = ...) -> None: ...

class ClusterTotals(_message.Message):
    __slots__ = ("num_workers", "num_healthy_workers", "kv_tokens_used", "kv_tokens_capacity", "kv_tokens_reserved", "num_running", "num_waiting", "queued_prompt_tokens", "output_tokens_per_s", "router_queue_len", "router_in_flight")
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_HEALTHY_WORKERS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_RESERVED_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    ROUTER_QUEUE_LEN_FIELD_NUMBER: _ClassVar[int]
    ROUTER_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    num_workers: int
    num_healthy_workers: int
    kv_tokens_used: int
    kv_tokens_capacity: int
    kv_tokens_reserved: int
    num_running: int
    num_waiting: int
    queued_prompt_tokens: int
    output_tokens_per_s: float
    router_queue_len: int
    router_in_flight: int
    def __init__(self, num_workers: _Optional[int] = ..., num_healthy_workers: _Optional[int] = ..., kv_tokens_used: _Optional[int] = ..., kv_tokens_capacity: _Optional[int] = ..., kv_tokens_reserved: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., queued_prompt_tokens: _Optional[int] = ..., output_tokens_per_s: _Optional[float] = ..., router_queue_len: _Optional[int] = ..., router_in_flight: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("workers", "totals")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStats]
    totals: ClusterTotals
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStats, _Mapping]]] = ..., totals: _Optional[_Union[ClusterTotals, _Mapping]] = ...) -> None: ...
