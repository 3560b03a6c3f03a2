"""Protobuf <-> plain dataclasses, at the gRPC edge only (the TGI way: from_pb / to_pb).

Nothing past the gRPC servicer and the client library sees a protobuf message: the router
core works on `kvmesh.core.seams` dataclasses and the small ones defined here for what the
worker API has no type for (the request as a caller sent it, models, health, cluster stats).

Presence: proto3 `optional` sampling fields that are absent take the `SamplingParams`
defaults, so `temperature=0` (greedy) and "temperature not sent" stay different.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.router import status_map
from kvmesh.core.seams import (FinishReason, RequestDelta, RequestTimings, SamplingParams, StructuredOutput, Usage,
                               WorkerStats)
from kvmesh.core.errors import InvalidRequestError

_DEFAULT_SAMPLING = SamplingParams()
# Sampling fields declared `optional` in the proto (their absence means "default").
_OPTIONAL_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed",
                             "repetition_penalty", "presence_penalty", "frequency_penalty", "n", "speculative")
_PLAIN_SAMPLING_FIELDS = ("ignore_eos", "min_tokens", "logprobs")

_FINISH_TO_PB = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}


# ---- plain types the worker API does not have ----------------------------------------------

@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str

    def to_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class InboundRequest:
    """A Generate call as an edge decoded it: the one request form between the edges (gRPC
    message + call metadata, OpenAI body + headers, and the client that builds the message)
    and `RouterCore`, which renders chat, tokenizes and builds the worker's `GenerateRequest`.
    Exactly one of prompt / messages / prompt_token_ids is set."""

    request_id: str = ""  # "" = the router assigns one
    model: str = ""  # "" = the served model
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    priority: int = 0
    adapter: str = ""  # a registered LoRA adapter's name ("" = the one in `model`, if any)
    # A stream resumed by the client (proto GenerateRequest 9-10): the output it already has.
    resume_token_ids: tuple[int, ...] = ()
    resume_text_chars: int = 0
    # Call metadata (gRPC metadata / HTTP headers), not part of the message:
    api_key: str | None = None
    deadline_s: float | None = None  # absolute time.time()
    attempt: int = 1
    trace_context: dict[str, str] = dataclasses.field(default_factory=dict)  # traceparent, tracestate


@dataclass(frozen=True)
class ModelInfo:
    id: str
    owned_by: str = "kvmesh"
    max_model_len: int = 0
    block_size: int = 0
    parent: str = ""  # a LoRA adapter's base model ("" = a base model)


@dataclass(frozen=True)
class HealthStatus:
    serving: bool
    num_workers: int
    num_healthy_workers: int


@dataclass(frozen=True)
class ClusterTotals:
    """Sums over healthy workers, plus this router replica's admission figures."""

    num_workers: int
    num_healthy_workers: int
    kv_tokens_used: int
    kv_tokens_capacity: int
    kv_tokens_reserved: int
    num_running: int
    num_waiting: int
    queued_prompt_tokens: int
    output_tokens_per_s: float
    router_queue_len: int = 0
    router_in_flight: int = 0

    @classmethod
    def from_workers(cls, workers: Sequence[WorkerStats], router_queue_len: int = 0,
                     router_in_flight: int = 0) -> "ClusterTotals":
        healthy = [w for w in workers if w.healthy]
        return cls(num_workers=len(workers), num_healthy_workers=len(healthy),
                   kv_tokens_used=sum(w.kv_tokens_used for w in healthy),
                   kv_tokens_capacity=sum(w.kv_tokens_capacity for w in healthy),
                   kv_tokens_reserved=sum(w.kv_tokens_reserved for w in healthy),
                   num_running=sum(w.num_running for w in healthy),
                   num_waiting=sum(w.num_waiting for w in healthy),
                   queued_prompt_tokens=sum(w.queued_prompt_tokens for w in healthy),
                   output_tokens_per_s=sum(w.output_tokens_per_s for w in healthy),
                   router_queue_len=router_queue_len, router_in_flight=router_in_flight)


@dataclass(frozen=True)
class ClusterStats:
    workers: tuple[WorkerStats, ...]
    totals: ClusterTotals
    ages_s: tuple[float, ...] = ()  # per worker: seconds since its figures were read (0 = live)


@dataclass(frozen=True)
class CallMetadata:
    """What travels in gRPC request metadata rather than in the message."""

    api_key: str | None = None
    attempt: int = 1
    trace_context: dict[str, str] = dataclasses.field(default_factory=dict)  # traceparent, tracestate


# ---- sampling ----------------------------------------------------------------------------

def sampling_to_pb(sampling: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(stop=list(sampling.stop), stop_token_ids=list(sampling.stop_token_ids))
    for name in _OPTIONAL_SAMPLING_FIELDS:
        value = getattr(sampling, name)
        if value is not None:
            setattr(msg, name, value)
    for name in _PLAIN_SAMPLING_FIELDS:
        setattr(msg, name, getattr(sampling, name))
    if sampling.structured is not None:
        msg.structured.CopyFrom(structured_to_pb(sampling.structured))
    return msg


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    values = {name: getattr(msg, name) for name in _OPTIONAL_SAMPLING_FIELDS if msg.HasField(name)}
    values.update({name: getattr(msg, name) for name in _PLAIN_SAMPLING_FIELDS})
    if msg.HasField("structured"):
        values["structured"] = structured_from_pb(msg.structured)
    return dataclasses.replace(_DEFAULT_SAMPLING, stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids),
                               **values)


def structured_to_pb(structured: StructuredOutput) -> pb.StructuredOutput:
    if structured.kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    if structured.kind == "choice":
        return pb.StructuredOutput(choice=pb.ChoiceList(choices=list(structured.choices)))
    if structured.kind in ("json_schema", "regex", "grammar"):
        return pb.StructuredOutput(**{structured.kind: structured.spec})
    raise InvalidRequestError(f"unknown structured output kind {structured.kind!r}")


def structured_from_pb(msg: pb.StructuredOutput) -> StructuredOutput | None:
    """None when no constraint is set in the oneof, or json_object is false (free text)."""
    which = msg.WhichOneof("constraint")
    if which is None or (which == "json_object" and not msg.json_object):
        return None
    if which == "json_object":
        return StructuredOutput("json_object")
    if which == "choice":
        return StructuredOutput("choice", choices=tuple(msg.choice.choices))
    return StructuredOutput(which, getattr(msg, which))


# ---- Generate ----------------------------------------------------------------------------

def inbound_to_pb(request: InboundRequest) -> pb.GenerateRequest:
    """The message part of the request (api key, attempt and trace context travel as call
    metadata; the client sets them)."""
    msg = pb.GenerateRequest(request_id=request.request_id, model=request.model,
                             sampling=sampling_to_pb(request.sampling), priority=request.priority,
                             resume_token_ids=list(request.resume_token_ids),
                             resume_text_chars=request.resume_text_chars, adapter=request.adapter)
    given = [x is not None for x in (request.prompt, request.messages, request.prompt_token_ids)]
    if sum(given) != 1:
        raise InvalidRequestError("exactly one of prompt, messages and prompt_token_ids must be set")
    if request.prompt is not None:
        msg.prompt = request.prompt
    elif request.messages is not None:
        msg.chat.messages.extend(pb.ChatMessage(role=m.role, content=m.content) for m in request.messages)
    else:
        msg.prompt_token_ids.ids.extend(request.prompt_token_ids)
    return msg


def inbound_from_pb(msg: pb.GenerateRequest, call: CallMetadata | None = None,
                    deadline_s: float | None = None) -> InboundRequest:
    """The request from the message and its call metadata (`deadline_s`: absolute, from the
    call's timeout)."""
    which = msg.WhichOneof("input")
    if which is None:
        raise InvalidRequestError("one of prompt, chat and prompt_token_ids is required")
    call = call or CallMetadata()
    common = dict(request_id=msg.request_id, model=msg.model, priority=msg.priority, adapter=msg.adapter,
                  sampling=sampling_from_pb(msg.sampling), resume_token_ids=tuple(msg.resume_token_ids),
                  resume_text_chars=msg.resume_text_chars, api_key=call.api_key, deadline_s=deadline_s,
                  attempt=call.attempt, trace_context=dict(call.trace_context))
    if which == "prompt":
        return InboundRequest(prompt=msg.prompt, **common)
    if which == "chat":
        if not msg.chat.messages:
            raise InvalidRequestError("chat.messages must not be empty")
        return InboundRequest(messages=tuple(ChatMessage(m.role, m.content) for m in msg.chat.messages), **common)
    if not msg.prompt_token_ids.ids:
        raise InvalidRequestError("prompt_token_ids must not be empty")
    return InboundRequest(prompt_token_ids=tuple(msg.prompt_token_ids.ids), **common)


def delta_to_pb(delta: RequestDelta) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=delta.request_id, text=delta.text, token_ids=list(delta.token_ids),
                              sample_index=delta.sample_index, finished=delta.finished,
                              error=delta.error or "", degraded=delta.degraded or "")
    if delta.logprobs is not None:
        msg.logprobs.values.extend(delta.logprobs)
    if delta.finish_reason is not None:
        msg.finish_reason = _FINISH_TO_PB[delta.finish_reason]
    if delta.usage is not None:
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=delta.usage.prompt_tokens,
                                    completion_tokens=delta.usage.completion_tokens,
                                    cached_tokens=delta.usage.cached_tokens))
    if delta.timings is not None:
        msg.timings.CopyFrom(_timings_to_pb(delta.timings))
    return msg


def delta_from_pb(msg: pb.GenerateResponse) -> RequestDelta:
    usage = None
    if msg.HasField("usage"):
        usage = Usage(prompt_tokens=msg.usage.prompt_tokens, completion_tokens=msg.usage.completion_tokens,
                      cached_tokens=msg.usage.cached_tokens)
    return RequestDelta(
        request_id=msg.request_id, text=msg.text, token_ids=tuple(msg.token_ids),
        logprobs=tuple(msg.logprobs.values) if msg.HasField("logprobs") else None,
        finished=msg.finished, finish_reason=_FINISH_FROM_PB.get(msg.finish_reason),
        usage=usage, timings=_timings_from_pb(msg.timings) if msg.HasField("timings") else None,
        error=msg.error or None, sample_index=msg.sample_index, degraded=msg.degraded or None)


def _timings_to_pb(t: RequestTimings) -> pb.Timings:
    msg = pb.Timings(arrival_time=t.arrival_time, num_preemptions=t.num_preemptions,
                     peak_kv_tokens=t.peak_kv_tokens)
    for name in ("first_scheduled_time", "first_token_time", "finished_time"):
        if getattr(t, name) is not None:
            setattr(msg, name, getattr(t, name))
    return msg


def _timings_from_pb(msg: pb.Timings) -> RequestTimings:
    optional = {name: getattr(msg, name) if msg.HasField(name) else None
                for name in ("first_scheduled_time", "first_token_time", "finished_time")}
    return RequestTimings(arrival_time=msg.arrival_time, num_preemptions=msg.num_preemptions,
                          peak_kv_tokens=msg.peak_kv_tokens, **optional)


# ---- ListModels / Health / GetStats ------------------------------------------------------

def models_to_pb(models: Iterable[ModelInfo]) -> pb.ListModelsResponse:
    return pb.ListModelsResponse(models=[pb.ModelInfo(**dataclasses.asdict(m)) for m in models])


def models_from_pb(msg: pb.ListModelsResponse) -> list[ModelInfo]:
    return [ModelInfo(id=m.id, owned_by=m.owned_by, max_model_len=m.max_model_len, block_size=m.block_size,
                      parent=m.parent) for m in msg.models]


def health_to_pb(health: HealthStatus) -> pb.HealthResponse:
    status = pb.HealthResponse.SERVING if health.serving else pb.HealthResponse.NOT_SERVING
    return pb.HealthResponse(status=status, num_workers=health.num_workers,
                             num_healthy_workers=health.num_healthy_workers)


def health_from_pb(msg: pb.HealthResponse) -> HealthStatus:
    return HealthStatus(serving=msg.status == pb.HealthResponse.SERVING, num_workers=msg.num_workers,
                        num_healthy_workers=msg.num_healthy_workers)


# WorkerStats fields the router reads and the API does not carry (block hashes are internal).
_WORKER_STATS_NOT_IN_API = frozenset({"held_block_hashes"})


def worker_stats_to_pb(stats: WorkerStats, age_s: float = 0.0) -> pb.WorkerStats:
    fields = {f.name: getattr(stats, f.name) for f in dataclasses.fields(WorkerStats)
              if f.name not in _WORKER_STATS_NOT_IN_API}
    return pb.WorkerStats(**fields, stats_age_s=age_s)


def worker_stats_from_pb(msg: pb.WorkerStats) -> WorkerStats:
    fields = {f.name: getattr(msg, f.name) for f in dataclasses.fields(WorkerStats)
              if f.name not in _WORKER_STATS_NOT_IN_API}
    fields["resident_adapters"] = tuple(fields["resident_adapters"])
    return WorkerStats(**fields)


def cluster_stats_to_pb(stats: ClusterStats) -> pb.GetStatsResponse:
    ages = stats.ages_s or (0.0,) * len(stats.workers)
    return pb.GetStatsResponse(workers=[worker_stats_to_pb(w, age) for w, age in zip(stats.workers, ages)],
                               totals=pb.ClusterTotals(**dataclasses.asdict(stats.totals)))


def cluster_stats_from_pb(msg: pb.GetStatsResponse) -> ClusterStats:
    totals = ClusterTotals(**{f.name: getattr(msg.totals, f.name) for f in dataclasses.fields(ClusterTotals)})
    return ClusterStats(workers=tuple(worker_stats_from_pb(w) for w in msg.workers), totals=totals,
                        ages_s=tuple(w.stats_age_s for w in msg.workers))


# ---- call metadata -------------------------------------------------------------------------

_TRACE_KEYS = ("traceparent", "tracestate")


def call_metadata_to_grpc(meta: CallMetadata) -> tuple[tuple[str, str], ...]:
    pairs = [(status_map.ATTEMPT_KEY, str(meta.attempt))]
    if meta.api_key:
        pairs.append((status_map.AUTHORIZATION_KEY, f"Bearer {meta.api_key}"))
    pairs.extend((k, v) for k, v in meta.trace_context.items() if k in _TRACE_KEYS)
    return tuple(pairs)


def call_metadata_from_grpc(metadata: Iterable[tuple[str, str | bytes]] | None) -> CallMetadata:
    """Parse invocation metadata; a malformed attempt number is the caller's error."""
    pairs = list(metadata or ())
    auth = status_map.metadata_value(pairs, status_map.AUTHORIZATION_KEY)
    api_key = None
    if auth:
        scheme, _, token = auth.partition(" ")
        api_key = token.strip() if scheme.lower() == "bearer" and token.strip() else None
    raw_attempt = status_map.metadata_value(pairs, status_map.ATTEMPT_KEY)
    attempt = 1
    if raw_attempt is not None:
        if not raw_attempt.strip().isdigit() or int(raw_attempt) < 1:
            raise InvalidRequestError(f"{status_map.ATTEMPT_KEY} must be an integer >= 1, got {raw_attempt!r}")
        attempt = int(raw_attempt)
    trace = {k: v for k in _TRACE_KEYS if (v := status_map.metadata_value(pairs, k)) is not None}
    return CallMetadata(api_key=api_key, attempt=attempt, trace_context=trace)
