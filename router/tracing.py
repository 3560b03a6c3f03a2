"""OpenTelemetry tracing: one trace per request, from the ingress to the worker's decode.

Span names (stable: dashboards and tests key on them):

    router process                          worker process
    kvmesh.request   (root, SERVER)         kvmesh.worker.generate   (child of kvmesh.stream's
    ├── kvmesh.auth                         ├── kvmesh.worker.queue    trace, via the carrier)
    ├── kvmesh.quota                        ├── kvmesh.worker.prefill  cached / computed tokens
    ├── kvmesh.admission                    └── kvmesh.worker.decode   tokens, TTFT, mean ITL
    ├── kvmesh.route   worker, matched prefix blocks, policy
    └── kvmesh.stream  (open while deltas flow; the worker spans hang below it)

The W3C `traceparent` arrives in HTTP headers or gRPC metadata, is extracted into the root
span's parent, and leaves again in `GenerateRequest.trace_context` (a plain dict, pickled
over the Ray call). The worker process records its spans itself (core/telemetry.py, its own
TracerProvider set up from the same `observability` config), so one trace spans both
processes without the router rebuilding anything.

The shared pieces (provider setup, propagation, span names and attributes, the worker's span
recorder) live in kvmesh.core.telemetry and are re-exported here: the worker may not import
router/, and both sides must agree on the names.

Router side:

    provider = setup_tracing(config.observability, "kvmesh-router")
    tracer = get_tracer(provider)
    with tracer.start_as_current_span(SPAN_REQUEST, context=extract_context(request.headers),
                                      kind=SpanKind.SERVER):
        with tracer.start_as_current_span(SPAN_AUTH):
            tenant = authenticator.authenticate(key)
        ...
        with tracer.start_as_current_span(SPAN_ROUTE) as span:
            set_route_attributes(span, worker_id="w1", matched_prefix_blocks=12, policy="prefix_aware")
        with tracer.start_as_current_span(SPAN_STREAM):
            request = GenerateRequest(..., trace_context=inject_context())

Worker side (worker/runtime/actor.py), when the request finishes (any finish reason):

    record_worker_spans(get_tracer(provider), request, final.timings, final.usage, final.finish_reason)

Sampling is ParentBased(TraceIdRatioBased(ratio)): a caller's sampled flag wins, and a new
trace is kept with probability `trace_sampling_ratio`. Exporter `none` samples nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

# Re-exported for the router (names listed so linters see them used).
from kvmesh.core.telemetry import (ATTR_ATTEMPT, ATTR_CACHED_TOKENS, ATTR_COMPUTED_TOKENS, ATTR_FINISH_REASON,
                                     ATTR_MEAN_ITL_S, ATTR_NUM_PREEMPTIONS, ATTR_OUTPUT_TOKENS, ATTR_PROMPT_TOKENS,
                                     ATTR_REQUEST_ID, ATTR_ROUTE_MATCHED_BLOCKS, ATTR_ROUTE_POLICY, ATTR_ROUTE_WORKER,
                                     ATTR_TENANT, ATTR_TTFT_S, SPAN_ADMISSION, SPAN_AUTH, SPAN_QUOTA, SPAN_REQUEST,
                                     SPAN_ROUTE, SPAN_STREAM, SPAN_WORKER_DECODE, SPAN_WORKER_GENERATE,
                                     SPAN_WORKER_PREFILL, SPAN_WORKER_QUEUE, TRACER_NAME, extract_context,
                                     get_tracer, inject_context, record_worker_spans, setup_tracing,
                                     start_worker_span)
from kvmesh.router.routing import worker_load_tokens
from kvmesh.core.seams import WorkerStats
from kvmesh.core.telemetry import (ATTR_ADMISSION_WAIT_S, ATTR_CHUNK_TOKENS, ATTR_DECODE_STEP_TIME_S,
                                     ATTR_DECODE_STEPS, ATTR_PREFILL_CHUNKS, ATTR_PREFIX_HIT_BLOCKS,
                                     ATTR_ROUTE_CANDIDATES, ATTR_ROUTE_PATH, ATTR_ROUTE_PREDICTED_BLOCKS,
                                     EVENT_FINISH, SPAN_WORKER_PREFILL_CHUNK)

__all__ = ["ATTR_ATTEMPT", "ATTR_CACHED_TOKENS", "ATTR_COMPUTED_TOKENS", "ATTR_FINISH_REASON", "ATTR_MEAN_ITL_S",
           "ATTR_NUM_PREEMPTIONS", "ATTR_OUTPUT_TOKENS", "ATTR_PROMPT_TOKENS", "ATTR_REQUEST_ID",
           "ATTR_ROUTE_MATCHED_BLOCKS", "ATTR_ROUTE_POLICY", "ATTR_ROUTE_WORKER", "ATTR_TENANT", "ATTR_TTFT_S",
           "SPAN_ADMISSION", "SPAN_AUTH", "SPAN_QUOTA", "SPAN_REQUEST", "SPAN_ROUTE", "SPAN_STREAM",
           "SPAN_WORKER_DECODE", "SPAN_WORKER_GENERATE", "SPAN_WORKER_PREFILL", "SPAN_WORKER_QUEUE", "TRACER_NAME",
           "SpanKind", "Status", "StatusCode", "extract_context", "get_tracer", "inject_context",
           "record_worker_spans", "set_route_attributes", "set_route_candidates",
           "ATTR_ADMISSION_WAIT_S", "ATTR_CHUNK_TOKENS", "ATTR_DECODE_STEP_TIME_S", "ATTR_DECODE_STEPS",
           "ATTR_PREFILL_CHUNKS", "ATTR_PREFIX_HIT_BLOCKS", "ATTR_ROUTE_CANDIDATES", "ATTR_ROUTE_PATH",
           "ATTR_ROUTE_PREDICTED_BLOCKS", "EVENT_FINISH", "SPAN_WORKER_PREFILL_CHUNK", "setup_tracing", "start_worker_span", "trace"]


def set_route_candidates(span: trace.Span, decision, matched_blocks: Mapping[str, int],
                         eligible: Sequence[WorkerStats], extra_load_tokens: Mapping[str, int] | None = None) -> None:
    """The routing decision's path and every candidate's score: cached prefix blocks and load
    (tokens), as `worker matched=N load=T` strings (OTel attributes hold lists of strings)."""
    span.set_attributes({
        ATTR_ROUTE_PATH: decision.path.value,
        ATTR_ROUTE_CANDIDATES: [f"{w.worker_id} matched={matched_blocks.get(w.worker_id, 0)} "
                                f"load={worker_load_tokens(w, (extra_load_tokens or {}).get(w.worker_id, 0))}"
                                for w in eligible]})


def set_route_attributes(span: trace.Span, worker_id: str, matched_prefix_blocks: int, policy: str) -> None:
    span.set_attributes({ATTR_ROUTE_WORKER: worker_id, ATTR_ROUTE_MATCHED_BLOCKS: matched_prefix_blocks,
                         ATTR_ROUTE_POLICY: policy})
