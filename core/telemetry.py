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
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
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

from kvmesh.core.config import KvmeshConfig, ObservabilityConfig
from kvmesh.core.seams import FinishReason, GenerateRequest, RequestTimings, Usage
from kvmesh.core.otlp_file import OtlpJsonFileExporter, path_of_endpoint
from kvmesh.core.step_phases import StepReport, is_out_of_memory

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
SPAN_WORKER_PREFILL_CHUNK = "kvmesh.worker.prefill_chunk"

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
ATTR_CHUNK_TOKENS = "kvmesh.prefill.chunk_tokens"
ATTR_PREFILL_CHUNKS = "kvmesh.prefill.chunks"
ATTR_DECODE_STEPS = "kvmesh.decode.steps"
ATTR_DECODE_STEP_TIME_S = "kvmesh.decode.step_time_s"
# Speculative decoding, on the decode span: the method, the steps that verified drafts for
# this request, the drafts scored and the drafts kept.
ATTR_SPEC_METHOD = "kvmesh.spec.method"
ATTR_SPEC_STEPS = "kvmesh.spec.steps"
ATTR_SPEC_DRAFT_TOKENS = "kvmesh.spec.draft_tokens"
ATTR_SPEC_ACCEPTED_TOKENS = "kvmesh.spec.accepted_tokens"
# Routing truth: the prefix blocks the router expected the chosen worker to hold, and the
# blocks the worker's prefix cache actually served (cached prompt tokens // block size).
ATTR_ROUTE_PREDICTED_BLOCKS = "kvmesh.route.predicted_prefix_blocks"
# Failover (router/stages/stream.py): an event on kvmesh.stream each time its worker died and the
# stream went on on another worker, with the failed worker and the tokens streamed before.
EVENT_STREAM_RESUMED = "kvmesh.stream.resumed"
ATTR_RESUMED_FROM_WORKER = "kvmesh.resumed_from_worker"
ATTR_RESUMED_TOKENS = "kvmesh.resumed_tokens"
ATTR_PREFIX_HIT_BLOCKS = "kvmesh.prefix.hit_blocks"
ATTR_ROUTE_CANDIDATES = "kvmesh.route.candidates"
ATTR_ROUTE_PATH = "kvmesh.route.path"
ATTR_ADMISSION_WAIT_S = "kvmesh.admission.wait_s"
EVENT_FINISH = "kvmesh.finish"
# One event on the decode span per step that verified drafts for the request (its draft and
# accepted counts; attributes kvmesh.spec.draft_tokens / accepted_tokens), at the step's end.
EVENT_SPEC_STEP = "kvmesh.spec.step"

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
    if exporter_kind == "otlp" and path_of_endpoint(config.otlp_endpoint):
        # file:///path: OTLP/JSON lines, no collector (core/otlp_file.py; `kvmesh trace` reads them)
        provider.add_span_processor(BatchSpanProcessor(OtlpJsonFileExporter(path_of_endpoint(config.otlp_endpoint))))
    elif exporter_kind == "otlp":
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
                        usage: Usage | None, finish_reason: FinishReason | str | None = None,
                        steps: RequestSteps | None = None, block_size: int | None = None) -> None:
    """kvmesh.worker.generate with queue / prefill (one child per prefill chunk) / decode
    children and a finish event, from the request's timings (absolute time.time() seconds)
    and, when given, its RequestSteps. Phases that never started are not recorded."""
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

    def child(name: str, start_s: float | None, stop_s: float | None, attributes: dict, context=parent,
              events: tuple[tuple[str, dict, float], ...] = ()):
        if start_s is None:
            return None
        span = tracer.start_span(name, context=context, start_time=_ns(start_s), attributes=attributes)
        for event, event_attrs, at_s in events:
            span.add_event(event, event_attrs, timestamp=_ns(at_s))
        span.end(end_time=_ns(stop_s if stop_s is not None else end_s))
        return span

    child(SPAN_WORKER_QUEUE, timings.arrival_time, timings.first_scheduled_time or end_s, {})
    prefill_attrs: dict[str, Any] = {ATTR_CACHED_TOKENS: cached, ATTR_COMPUTED_TOKENS: max(0, prompt - cached)}
    if block_size:
        prefill_attrs[ATTR_PREFIX_HIT_BLOCKS] = cached // block_size
    if steps is not None:
        prefill_attrs[ATTR_PREFILL_CHUNKS] = steps.num_prefill_chunks
    prefill = child(SPAN_WORKER_PREFILL, timings.first_scheduled_time, timings.first_token_time, prefill_attrs)
    if prefill is not None and steps is not None:
        in_prefill = trace.set_span_in_context(prefill)
        for start_s, stop_s, tokens in steps.prefill_chunks:
            child(SPAN_WORKER_PREFILL_CHUNK, start_s, stop_s, {ATTR_CHUNK_TOKENS: tokens}, in_prefill)
    decode_attrs: dict[str, Any] = {ATTR_OUTPUT_TOKENS: output, ATTR_NUM_PREEMPTIONS: timings.num_preemptions}
    if timings.ttft_s is not None:
        decode_attrs[ATTR_TTFT_S] = timings.ttft_s
    if timings.first_token_time is not None and output >= 2:
        decode_attrs[ATTR_MEAN_ITL_S] = (end_s - timings.first_token_time) / (output - 1)
    if steps is not None:
        decode_attrs.update({ATTR_DECODE_STEPS: steps.num_decode_steps, ATTR_DECODE_STEP_TIME_S: steps.decode_step_s})
        if steps.num_spec_steps:
            decode_attrs.update({ATTR_SPEC_METHOD: steps.spec_method, ATTR_SPEC_STEPS: steps.num_spec_steps,
                                 ATTR_SPEC_DRAFT_TOKENS: steps.num_draft_tokens,
                                 ATTR_SPEC_ACCEPTED_TOKENS: steps.num_accepted_tokens})
    spec_events = () if steps is None else tuple(
        (EVENT_SPEC_STEP, {ATTR_SPEC_DRAFT_TOKENS: drafted, ATTR_SPEC_ACCEPTED_TOKENS: kept}, at_s)
        for at_s, drafted, kept in steps.spec_steps)
    child(SPAN_WORKER_DECODE, timings.first_token_time, end_s, decode_attrs, events=spec_events)
    root.add_event(EVENT_FINISH, {ATTR_FINISH_REASON: reason or "unknown"}, timestamp=_ns(end_s))
    root.end(end_time=_ns(end_s))


# ---- per-request step log (for the worker's spans) ----------------------------------------

MAX_CHUNKS_PER_REQUEST = 64  # prefill chunk spans kept per request; later chunks are only counted
MAX_SPEC_EVENTS_PER_REQUEST = 256  # speculation step events kept per request; later steps are only counted
# Requests tracked at once. A request's entry is popped when its stream ends; one that a step
# ran after its stream ended (an abort racing the step) would linger, so the oldest go first.
MAX_LOGGED_REQUESTS = 8192


@dataclass
class RequestSteps:
    """What the engine's steps did for one request: each prefill chunk (start, end as
    time.time(), tokens) and its decode steps summarised."""

    prefill_chunks: list[tuple[float, float, int]]
    num_prefill_chunks: int = 0
    num_decode_steps: int = 0
    decode_step_s: float = 0.0  # sum of the wall time of the steps that decoded it
    spec_method: str = ""  # speculative decoding: the proposer, when any step verified drafts
    num_spec_steps: int = 0  # decode steps that verified drafts for it
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # (end of the step as time.time(), drafts verified, drafts kept) per speculating step,
    # the first MAX_SPEC_EVENTS_PER_REQUEST of them
    spec_steps: list[tuple[float, int, int]] = field(default_factory=list)


class RequestStepLog:
    """A StepPhaseClock observer keeping RequestSteps per live request until the actor takes
    them at the request's end (`pop`). Locked: steps land on the engine's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: dict[str, RequestSteps] = {}

    def observe_step_report(self, report: StepReport) -> None:
        end = report.started_at + report.total_s
        with self._lock:
            for row in report.rows:
                steps = self._steps.get(row.request_id)
                if steps is None:
                    if len(self._steps) >= MAX_LOGGED_REQUESTS:
                        del self._steps[next(iter(self._steps))]  # dicts keep insertion order
                    steps = self._steps[row.request_id] = RequestSteps([])
                if row.is_prefill:
                    steps.num_prefill_chunks += 1
                    if len(steps.prefill_chunks) < MAX_CHUNKS_PER_REQUEST:
                        steps.prefill_chunks.append((report.started_at, end, row.num_tokens))
                else:
                    steps.num_decode_steps += 1
                    steps.decode_step_s += report.total_s
                    if row.num_draft_tokens:
                        steps.spec_method = report.speculative_method
                        steps.num_spec_steps += 1
                        steps.num_draft_tokens += row.num_draft_tokens
                        steps.num_accepted_tokens += row.num_accepted_tokens
                        if len(steps.spec_steps) < MAX_SPEC_EVENTS_PER_REQUEST:
                            steps.spec_steps.append((end, row.num_draft_tokens, row.num_accepted_tokens))

    def pop(self, request_id: str) -> RequestSteps | None:
        """The steps of `request_id` (an external id: n > 1 samples, `<id>#k/i`, are merged)."""
        with self._lock:
            keys = [k for k in self._steps if k == request_id or k.startswith(request_id + "#")]
            parts = [self._steps.pop(k) for k in keys]
        if not parts:
            return None
        merged = RequestSteps(sorted(c for p in parts for c in p.prefill_chunks)[:MAX_CHUNKS_PER_REQUEST])
        for p in parts:
            merged.num_prefill_chunks += p.num_prefill_chunks
            merged.num_decode_steps += p.num_decode_steps
            merged.decode_step_s += p.decode_step_s
            merged.spec_method = merged.spec_method or p.spec_method
            merged.num_spec_steps += p.num_spec_steps
            merged.num_draft_tokens += p.num_draft_tokens
            merged.num_accepted_tokens += p.num_accepted_tokens
        merged.spec_steps = sorted(e for p in parts for e in p.spec_steps)[:MAX_SPEC_EVENTS_PER_REQUEST]
        return merged

    def __len__(self) -> int:
        with self._lock:
            return len(self._steps)


# ---- engine metrics ----------------------------------------------------------------------

METRICS_PREFIX = "kvmesh_"
# Seconds: one CPU decode step of a tiny model (~1 ms) to a long GPU prefill chunk (~seconds).
STEP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
STEP_PHASE_BUCKETS_S = (0.00005, 0.0001, 0.00025, 0.0005, *STEP_BUCKETS_S)
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
SPEC_ACCEPTED_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16)
FILL_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


@dataclass(frozen=True)
class ModelInfoLabels:
    """The labels of kvmesh_model_info: what this worker actually serves (dtypes resolved)."""

    model: str
    revision: str
    dtype: str  # the weights' compute dtype, e.g. float32 / bfloat16 ("auto" resolved)
    weight_quant: str  # as served (quant.weight auto resolved): none | int8 | int4 | int4_awq | gguf
    kv_cache_dtype: str  # the effective KV storage dtype
    version: str  # the kvmesh package version
    model_type: str = ""  # the HF family (llama, qwen2, qwen3, phi3, gemma2, ...)
    forward_path: str = ""  # what serves small steps: native amx | native avx512_bf16 | native fma | compiled | eager
    forward_path_reason: str = ""  # why (the native step's refusal when it is not the native step)

    @classmethod
    def of_engine(cls, engine, config: KvmeshConfig) -> "ModelInfoLabels":
        from importlib.metadata import PackageNotFoundError, version

        try:
            kvmesh_version = version("kvmesh")
        except PackageNotFoundError:
            kvmesh_version = "unknown"
        # The first parameter is the token embedding: kept in the compute dtype under every
        # weight quantization, so its dtype is the model's resolved dtype.
        weights = next(engine.runner.model.parameters(), None) if hasattr(engine.runner, "model") else None
        dtype = str(weights.dtype).removeprefix("torch.") if weights is not None else config.model.dtype
        parts = engine.parts
        return cls(engine.model_name, config.model.revision, dtype, parts.weight_quant, parts.kv_cache_dtype,
                   kvmesh_version, str(getattr(parts.hf_config, "model_type", "")), parts.forward_path,
                   parts.forward_path_reason)


@dataclass(frozen=True)
class MemoryReading:
    """One rank's memory, bytes. On CUDA: torch's allocator (allocated = live tensors, reserved =
    held by the caching allocator, peak = max allocated since start). On CPU there is no
    caching allocator: allocated = the tensors the engine holds (weights + KV pool + swap),
    reserved = the process RSS (what it holds from the OS), peak = the RSS high-water mark."""

    device: str
    allocated_bytes: int
    reserved_bytes: int
    peak_bytes: int


def read_memory(device, tensor_bytes: int) -> MemoryReading:
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        return MemoryReading(str(device), torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device),
                             torch.cuda.max_memory_allocated(device))
    import resource

    import psutil

    rss = psutil.Process().memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return MemoryReading("cpu", tensor_bytes, rss, max(peak, rss))


def read_gpu_health(device) -> tuple[float, float] | None:
    """(utilisation 0..1, temperature in C) from NVML, or None: not CUDA, no pynvml, no driver."""
    if getattr(device, "type", "cpu") != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        util = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
        temp = pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
        return float(util), float(temp)
    except Exception:  # ImportError or any NVML error: the gauges stay absent
        return None


class EngineMetrics:
    """Worker-process metrics the router cannot derive, shipped to the router as `snapshot()`
    bytes (Prometheus text format) in every WorkerPoll and merged into /metrics:

    compute   step time, per-phase step time, GPU utilisation / temperature (NVML, CUDA only)
    batch     tokens per step split prefill / decode, token fill rate (tokens / step budget)
    memory    allocated / reserved / peak bytes, KV pool bytes, KV tokens peak / mean, OOMs
    cost      per-tenant prefill and decode compute seconds
    spec      speculative decoding per method: drafts scored, drafts kept, verifying
              request-steps (acceptance rate = kept / scored; mean kept per step = kept /
              request-steps), kept drafts per request-step as a histogram
    identity  kvmesh_model_info

    `observe_step_report` is a StepPhaseClock observer (engine step thread); `snapshot` reads
    the memory probes (actor event loop). prometheus_client is thread-safe."""

    def __init__(self, worker_id: str = "", model_info: ModelInfoLabels | None = None, device=None,
                 tensor_bytes: int = 0, kv_pool_bytes: int = 0, planned_bytes: dict[str, int] | None = None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self._registry = CollectorRegistry(auto_describe=True)
        self.worker_id = worker_id
        self._device = device
        self._tensor_bytes = tensor_bytes
        w = ["worker"]
        self.step_time = Histogram(METRICS_PREFIX + "step_time_seconds",
                                   "Engine step time (schedule + prepare + forward + sample + output).", w,
                                   buckets=STEP_BUCKETS_S, registry=r)
        self.step_phase = Histogram(METRICS_PREFIX + "step_phase_seconds", "Engine step time by phase.",
                                    [*w, "phase"], buckets=STEP_PHASE_BUCKETS_S, registry=r)
        self.step_tokens = Histogram(METRICS_PREFIX + "step_tokens", "Tokens in one engine step, prefill vs decode.",
                                     [*w, "kind"], buckets=STEP_TOKEN_BUCKETS, registry=r)
        self.step_fill = Histogram(METRICS_PREFIX + "step_token_fill_ratio",
                                   "Tokens in the step / the step's token budget (max_num_batched_tokens).", w,
                                   buckets=FILL_BUCKETS, registry=r)
        self.lora_rows = Histogram(METRICS_PREFIX + "lora_rows",
                                   "Token rows carrying a LoRA adapter in one engine step (steps with at least "
                                   "one; _sum / _count = adapter rows per such step).", w,
                                   buckets=STEP_TOKEN_BUCKETS, registry=r)
        self.oom = Counter(METRICS_PREFIX + "oom", "Engine steps that failed out of memory.", w, registry=r)
        self.oom.labels(worker_id)
        self.tenant_compute = Counter(METRICS_PREFIX + "tenant_compute_seconds",
                                      "Engine step seconds attributed to a tenant by its share of the step's "
                                      "tokens, prefill vs decode.", ["tenant", "phase"], registry=r)
        mem = [*w, "rank", "device"]
        self.mem_allocated = Gauge(METRICS_PREFIX + "memory_allocated_bytes",
                                   "Bytes in live tensors (CUDA allocator; on CPU weights + KV pool + swap).", mem,
                                   registry=r)
        self.mem_reserved = Gauge(METRICS_PREFIX + "memory_reserved_bytes",
                                  "Bytes held (CUDA caching allocator; on CPU the process RSS).", mem, registry=r)
        self.mem_peak = Gauge(METRICS_PREFIX + "memory_peak_bytes",
                              "High-water mark (CUDA max allocated; on CPU max RSS) since the worker started.", mem,
                              registry=r)
        self.kv_pool_bytes = Gauge(METRICS_PREFIX + "kv_pool_bytes", "Bytes of the KV block pool (all layers).",
                                   w, registry=r)
        self.kv_pool_bytes.labels(worker_id).set(kv_pool_bytes)
        self.planned_bytes = Gauge(METRICS_PREFIX + "memory_planned_bytes",
                                   "The engine's memory plan by part (weights, draft weights, activations, CUDA "
                                   "graphs, sampler, runtime, KV pool, draft KV pool): every device allocation "
                                   "counted before the KV pool was sized (kv/device_plan.py); and swap_space, the "
                                   "host swap space's ceiling (resident only as blocks are swapped out).",
                                   [*w, "part"], registry=r)
        for part, nbytes in (planned_bytes or {}).items():
            self.planned_bytes.labels(worker_id, part).set(nbytes)
        self.kv_tokens_peak = Gauge(METRICS_PREFIX + "kv_tokens_peak",
                                    "Most KV tokens held at once over the scheduler's stats window.", w, registry=r)
        self.kv_tokens_mean = Gauge(METRICS_PREFIX + "kv_tokens_mean",
                                    "Mean KV tokens held per step over the scheduler's stats window.", w, registry=r)
        self.gpu_util = Gauge(METRICS_PREFIX + "gpu_utilization_ratio", "GPU utilisation (NVML), 0..1.", w,
                              registry=r)
        self.gpu_temp = Gauge(METRICS_PREFIX + "gpu_temperature_celsius", "GPU temperature (NVML).", w, registry=r)
        # Process start, as Prometheus' process_start_time_seconds: changes() of it counts restarts.
        self.start_time = Gauge(METRICS_PREFIX + "worker_start_time_seconds",
                                "When this worker process started (unix seconds).", w, registry=r)
        self.start_time.labels(worker_id).set(time.time())
        self.model_info = Gauge(METRICS_PREFIX + "model_info", "What the worker serves (value always 1).",
                                [*w, "model", "revision", "dtype", "weight_quant", "kv_cache_dtype", "version",
                                 "model_type", "forward_path", "forward_path_reason"], registry=r)
        if model_info is not None:
            self.model_info.labels(worker_id, model_info.model, model_info.revision, model_info.dtype,
                                   model_info.weight_quant, model_info.kv_cache_dtype, model_info.version,
                                   model_info.model_type, model_info.forward_path,
                                   model_info.forward_path_reason).set(1)

        spec = [*w, "method"]
        self.spec_draft_tokens = Counter(METRICS_PREFIX + "spec_draft_tokens",
                                         "Speculative decoding: drafted tokens scored by the target.", spec, registry=r)
        self.spec_accepted_tokens = Counter(METRICS_PREFIX + "spec_accepted_tokens",
                                            "Speculative decoding: drafted tokens the target kept.", spec, registry=r)
        self.spec_verified = Counter(METRICS_PREFIX + "spec_verified_requests",
                                     "Speculative decoding: request-steps that verified drafts.", spec, registry=r)
        self.spec_accepted_per_step = Histogram(METRICS_PREFIX + "spec_accepted_per_step",
                                                "Drafted tokens kept per speculating request per step.", spec,
                                                buckets=SPEC_ACCEPTED_BUCKETS, registry=r)

    def observe_step(self, step_time_s: float) -> None:
        self.step_time.labels(self.worker_id).observe(step_time_s)

    def observe_step_report(self, report: StepReport) -> None:
        if report.failure is not None and is_out_of_memory(report.failure):
            self.oom.labels(self.worker_id).inc()
        total_s = report.total_s
        self.observe_step(total_s)
        for phase, seconds in report.phase_s.items():
            self.step_phase.labels(self.worker_id, phase).observe(seconds)
        prefill, decode = report.prefill_tokens, report.decode_tokens
        if prefill:
            self.step_tokens.labels(self.worker_id, "prefill").observe(prefill)
        if decode:
            self.step_tokens.labels(self.worker_id, "decode").observe(decode)
        self.step_fill.labels(self.worker_id).observe(report.token_fill_ratio)
        if report.lora_rows:
            self.lora_rows.labels(self.worker_id).observe(report.lora_rows)
        self._observe_speculation(report)
        if prefill + decode:
            # A step's cost is shared by its rows in proportion to their tokens.
            for row in report.rows:
                self.tenant_compute.labels(row.tenant_id, "prefill" if row.is_prefill else "decode").inc(
                    total_s * row.num_tokens / (prefill + decode))

    def _observe_speculation(self, report: StepReport) -> None:
        labels = (self.worker_id, report.speculative_method)
        for row in report.rows:
            if row.num_draft_tokens:
                self.spec_draft_tokens.labels(*labels).inc(row.num_draft_tokens)
                self.spec_accepted_tokens.labels(*labels).inc(row.num_accepted_tokens)
                self.spec_verified.labels(*labels).inc()
                self.spec_accepted_per_step.labels(*labels).observe(row.num_accepted_tokens)

    def set_kv_window(self, peak_kv_tokens: int, mean_kv_tokens: float) -> None:
        self.kv_tokens_peak.labels(self.worker_id).set(peak_kv_tokens)
        self.kv_tokens_mean.labels(self.worker_id).set(mean_kv_tokens)

    def _read_probes(self) -> None:
        if self._device is None:
            return
        try:
            m = read_memory(self._device, self._tensor_bytes)
            labels = (self.worker_id, "0", m.device)  # rank 0 = this process; TP ranks run elsewhere
            self.mem_allocated.labels(*labels).set(m.allocated_bytes)
            self.mem_reserved.labels(*labels).set(m.reserved_bytes)
            self.mem_peak.labels(*labels).set(m.peak_bytes)
            gpu = read_gpu_health(self._device)
            if gpu is not None:
                self.gpu_util.labels(self.worker_id).set(gpu[0])
                self.gpu_temp.labels(self.worker_id).set(gpu[1])
        except Exception:  # a probe must never break the stats poll
            logger.exception("reading memory / GPU probes failed")

    def register(self, collector) -> None:
        """Add a custom collector (e.g. core/kv_tier_metrics.py) to this worker's snapshot."""
        self._registry.register(collector)

    def snapshot(self) -> bytes:
        from prometheus_client import generate_latest

        self._read_probes()
        return generate_latest(self._registry)
