"""Telemetry of one process, usable from the worker (which may not import router/):
OpenTelemetry setup, W3C propagation, the worker's spans, and the engine's Prometheus metrics.

router/tracing.py re-exports the tracing half, so router and worker share one definition of
span names, attributes and provider setup; dependencies still point router -> worker.

Worker spans (recorded in the worker process, exported by its own provider, children of the
router's kvmesh.stream span whose context rides in `GenerateRequest.trace_context`):

    kvmesh.worker.generate            request id, tenant, prompt tokens, preemptions, finish reason
    ├── kvmesh.worker.queue           arrival -> first scheduled
    ├── kvmesh.worker.prefill         first scheduled -> first token; cached / computed tokens
    └── kvmesh.worker.decode          first token -> finish; tokens, TTFT, mean ITL

They are recorded once, at request end, from RequestTimings with explicit start/end times,
so the engine's step loop never touches the tracer.

Sampling is ParentBased(TraceIdRatioBased(ratio)): a caller's sampled flag wins, and a new
trace is kept with probability `trace_sampling_ratio`. Exporter `none` samples nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor,
                                            SpanExporter)
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvmesh.core.config import ObservabilityConfig
from kvmesh.core.seams import FinishReason, GenerateRequest, RequestTimings, Usage

logger = logging.getLogger(__name__)

TRACER_NAME = "kvmesh"

SPAN_REQUEST = "kvmesh.request"
SPAN_AUTH = "kvmesh.auth"
SPAN_QUOTA = "kvmesh.quota"
SPAN_ADMISSION = "kvmesh.admission"
SPAN_ROUTE = "kvmesh.route"
SPAN_STREAM = "kvmesh.stream"
SPAN_WORKER_GENERATE = "kvmesh.worker.generate"
SPAN_WORKER_QUEUE = "kvmesh.worker.queue"
SPAN_WORKER_PREFILL = "kvmesh.worker.prefill"
SPAN_WORKER_DECODE = "kvmesh.worker.decode"

ATTR_TENANT = "kvmesh.tenant"
ATTR_REQUEST_ID = "kvmesh.request_id"
ATTR_ATTEMPT = "kvmesh.attempt"
ATTR_ROUTE_WORKER = "kvmesh.route.worker"
ATTR_ROUTE_MATCHED_BLOCKS = "kvmesh.route.matched_prefix_blocks"
ATTR_ROUTE_POLICY = "kvmesh.route.policy"
ATTR_PROMPT_TOKENS = "kvmesh.prompt_tokens"
ATTR_CACHED_TOKENS = "kvmesh.prefill.cached_tokens"
ATTR_COMPUTED_TOKENS = "kvmesh.prefill.computed_tokens"
ATTR_OUTPUT_TOKENS = "kvmesh.decode.tokens"
ATTR_TTFT_S = "kvmesh.decode.ttft_s"
ATTR_MEAN_ITL_S = "kvmesh.decode.mean_itl_s"
ATTR_FINISH_REASON = "kvmesh.finish_reason"
ATTR_NUM_PREEMPTIONS = "kvmesh.num_preemptions"

_PROPAGATOR = TraceContextTextMapPropagator()
_global_provider_set = False


def setup_tracing(config: ObservabilityConfig, service_name: str, *, span_exporter: SpanExporter | None = None,
                  set_global: bool = True) -> TracerProvider:
    """A TracerProvider exporting per `config` (`span_exporter` overrides, for tests).

    With `set_global`, the first call in a process also installs it as OpenTelemetry's
    global provider (OpenTelemetry allows that once per process)."""
    global _global_provider_set
    exporter_kind = config.tracing_exporter if span_exporter is None else "custom"
    sampler = ALWAYS_OFF if exporter_kind == "none" else ParentBased(TraceIdRatioBased(config.trace_sampling_ratio))
    provider = TracerProvider(sampler=sampler, resource=Resource.create({"service.name": service_name}))
    if exporter_kind == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        endpoint = config.otlp_endpoint or ""
        provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))))
    elif exporter_kind == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(service_name=service_name)))
    elif exporter_kind == "custom":
        provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    if set_global and not _global_provider_set:
        trace.set_tracer_provider(provider)
        _global_provider_set = True
    logger.info("tracing: exporter=%s sampling_ratio=%s service=%s", exporter_kind,
                config.trace_sampling_ratio, service_name)
    return provider


def get_tracer(provider: trace.TracerProvider | None = None) -> trace.Tracer:
    """kvmesh's tracer from `provider`, or from the global provider (a no-op until set)."""
    return (provider or trace.get_tracer_provider()).get_tracer(TRACER_NAME)


# ---- propagation -------------------------------------------------------------------------

def _lowercase_carrier(carrier: Mapping[str, Any] | Iterable[tuple[str, Any]] | None) -> dict[str, str]:
    if carrier is None:
        return {}
    items = carrier.items() if isinstance(carrier, Mapping) else carrier
    out = {}
    for key, value in items:
        if isinstance(value, bytes):  # gRPC binary metadata ("-bin" keys) is never a traceparent
            continue
        out[str(key).lower()] = str(value)
    return out


def extract_context(carrier: Mapping[str, Any] | Iterable[tuple[str, Any]] | None) -> otel_context.Context:
    """Parent context from HTTP headers (a mapping), gRPC metadata (`context.invocation_metadata()`,
    a sequence of (key, value)) or a `GenerateRequest.trace_context` dict. No or bad traceparent:
    an empty context, so the span becomes a new root."""
    return _PROPAGATOR.extract(carrier=_lowercase_carrier(carrier))


def inject_context(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """The current (or given) span context as a W3C carrier dict, for GenerateRequest.trace_context."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier


# ---- span helpers ------------------------------------------------------------------------

def start_worker_span(tracer: trace.Tracer, request: GenerateRequest, name: str, **kwargs):
    """A live span on the worker, child of the router's span carried in the request (use as a
    context manager, like `tracer.start_as_current_span`)."""
    return tracer.start_as_current_span(name, context=extract_context(request.trace_context), **kwargs)


def _ns(t_s: float) -> int:
    return int(t_s * 1e9)


def record_worker_spans(tracer: trace.Tracer, request: GenerateRequest, timings: RequestTimings,
                        usage: Usage | None, finish_reason: FinishReason | str | None = None) -> None:
    """kvmesh.worker.generate with queue / prefill / decode children, from the request's
    timings (absolute time.time() seconds). Phases that never started are not recorded."""
    end_s = timings.finished_time or time.time()
    reason = finish_reason.value if isinstance(finish_reason, FinishReason) else finish_reason
    prompt = usage.prompt_tokens if usage else 0
    cached = usage.cached_tokens if usage else 0
    output = usage.completion_tokens if usage else 0
    root = tracer.start_span(SPAN_WORKER_GENERATE, context=extract_context(request.trace_context),
                             kind=SpanKind.INTERNAL, start_time=_ns(timings.arrival_time))
    root.set_attributes({ATTR_REQUEST_ID: request.request_id, ATTR_TENANT: request.tenant_id,
                         ATTR_ATTEMPT: request.attempt, ATTR_PROMPT_TOKENS: prompt,
                         ATTR_NUM_PREEMPTIONS: timings.num_preemptions})
    if reason:
        root.set_attribute(ATTR_FINISH_REASON, reason)
    if reason == FinishReason.ERROR.value:
        root.set_status(Status(StatusCode.ERROR))
    parent = trace.set_span_in_context(root)

    def child(name: str, start_s: float | None, stop_s: float | None, attributes: dict) -> None:
        if start_s is None:
            return
        span = tracer.start_span(name, context=parent, start_time=_ns(start_s), attributes=attributes)
        span.end(end_time=_ns(stop_s if stop_s is not None else end_s))

    child(SPAN_WORKER_QUEUE, timings.arrival_time, timings.first_scheduled_time or end_s, {})
    child(SPAN_WORKER_PREFILL, timings.first_scheduled_time, timings.first_token_time,
          {ATTR_CACHED_TOKENS: cached, ATTR_COMPUTED_TOKENS: max(0, prompt - cached)})
    decode_attrs: dict[str, Any] = {ATTR_OUTPUT_TOKENS: output}
    if timings.ttft_s is not None:
        decode_attrs[ATTR_TTFT_S] = timings.ttft_s
    if timings.first_token_time is not None and output >= 2:
        decode_attrs[ATTR_MEAN_ITL_S] = (end_s - timings.first_token_time) / (output - 1)
    child(SPAN_WORKER_DECODE, timings.first_token_time, end_s, decode_attrs)
    root.end(end_time=_ns(end_s))


# ---- engine metrics ----------------------------------------------------------------------

METRICS_PREFIX = "kvmesh_"
# Seconds: one CPU decode step of a tiny model (~1 ms) to a long GPU prefill chunk (~seconds).
STEP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class EngineMetrics:
    """Worker-process metrics the router cannot derive (step time). Shipped to the router as
    `snapshot()` bytes (Prometheus text format) in every WorkerPoll, merged into /metrics."""

    def __init__(self, worker_id: str = ""):
        from prometheus_client import CollectorRegistry, Histogram

        self._registry = CollectorRegistry(auto_describe=True)
        self.step_time = Histogram(METRICS_PREFIX + "step_time_seconds",
                                   "Engine step time (schedule + forward + sample).", ["worker"],
                                   buckets=STEP_BUCKETS_S, registry=self._registry)
        self.worker_id = worker_id

    def observe_step(self, step_time_s: float) -> None:
        self.step_time.labels(self.worker_id).observe(step_time_s)

    def snapshot(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self._registry)
