"""Tracing: span tree and attributes with the SDK's in-memory exporter, and a real OTLP/gRPC
export to a TraceService receiver running inside the test on 127.0.0.1:0."""

import pickle
import queue
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from kvmesh.core.config import ObservabilityConfig
from kvmesh.router import tracing
from kvmesh.router.tracing import (SPAN_ADMISSION, SPAN_AUTH, SPAN_QUOTA, SPAN_REQUEST, SPAN_ROUTE, SPAN_STREAM,
                                   SPAN_WORKER_DECODE, SPAN_WORKER_GENERATE, SPAN_WORKER_PREFILL,
                                   SPAN_WORKER_QUEUE)
from kvmesh.core.seams import FinishReason, GenerateRequest, RequestTimings, Usage

CALLER_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01"
ROUTER_SPANS = [SPAN_AUTH, SPAN_QUOTA, SPAN_ADMISSION, SPAN_ROUTE, SPAN_STREAM, SPAN_REQUEST]
WORKER_SPANS = [SPAN_WORKER_QUEUE, SPAN_WORKER_PREFILL, SPAN_WORKER_DECODE, SPAN_WORKER_GENERATE]

T0 = 1_790_000_000.0  # absolute time.time() seconds
TIMINGS = RequestTimings(arrival_time=T0, first_scheduled_time=T0 + 0.010, first_token_time=T0 + 0.050,
                         finished_time=T0 + 0.850)
USAGE = Usage(prompt_tokens=100, completion_tokens=17, cached_tokens=64)


def serve_one_request(router_provider, worker_provider, carrier) -> GenerateRequest:
    """What router_core and the worker do for one request, in span terms."""
    tracer = tracing.get_tracer(router_provider)
    with tracer.start_as_current_span(SPAN_REQUEST, context=tracing.extract_context(carrier), kind=SpanKind.SERVER):
        for name in (SPAN_AUTH, SPAN_QUOTA, SPAN_ADMISSION):
            with tracer.start_as_current_span(name):
                pass
        with tracer.start_as_current_span(SPAN_ROUTE) as span:
            tracing.set_route_attributes(span, worker_id="w1", matched_prefix_blocks=4, policy="prefix_aware")
        with tracer.start_as_current_span(SPAN_STREAM):
            request = GenerateRequest(request_id="r1", prompt_token_ids=(1, 2, 3), tenant_id="acme",
                                      trace_context=tracing.inject_context())
            # The request crosses the Ray call pickled; the worker sees only the dict.
            on_worker = pickle.loads(pickle.dumps(request))
            tracing.record_worker_spans(tracing.get_tracer(worker_provider), on_worker, TIMINGS, USAGE,
                                        FinishReason.STOP)
    return request


def in_memory_provider(ratio=1.0):
    exporter = InMemorySpanExporter()
    cfg = ObservabilityConfig(tracing_exporter="console", trace_sampling_ratio=ratio)
    return tracing.setup_tracing(cfg, "test", span_exporter=exporter, set_global=False), exporter


def test_span_tree_names_attributes_and_links():
    router_provider, router_spans = in_memory_provider()
    worker_provider, worker_spans = in_memory_provider()
    request = serve_one_request(router_provider, worker_provider, {"Traceparent": TRACEPARENT})
    assert request.trace_context["traceparent"].startswith(f"00-{CALLER_TRACE_ID}-")

    router = {s.name: s for s in router_spans.get_finished_spans()}
    worker = {s.name: s for s in worker_spans.get_finished_spans()}
    assert sorted(router) == sorted(ROUTER_SPANS) and sorted(worker) == sorted(WORKER_SPANS)
    everything = [*router.values(), *worker.values()]
    assert {format(s.context.trace_id, "032x") for s in everything} == {CALLER_TRACE_ID}

    root = router[SPAN_REQUEST]
    assert root.kind == SpanKind.SERVER
    assert format(root.parent.span_id, "016x") == CALLER_SPAN_ID and root.parent.is_remote
    for name in (SPAN_AUTH, SPAN_QUOTA, SPAN_ADMISSION, SPAN_ROUTE, SPAN_STREAM):
        assert router[name].parent.span_id == root.context.span_id
    assert router[SPAN_ROUTE].attributes[tracing.ATTR_ROUTE_WORKER] == "w1"
    assert router[SPAN_ROUTE].attributes[tracing.ATTR_ROUTE_MATCHED_BLOCKS] == 4

    generate = worker[SPAN_WORKER_GENERATE]
    assert generate.parent.span_id == router[SPAN_STREAM].context.span_id
    for name in (SPAN_WORKER_QUEUE, SPAN_WORKER_PREFILL, SPAN_WORKER_DECODE):
        assert worker[name].parent.span_id == generate.context.span_id
    prefill, decode = worker[SPAN_WORKER_PREFILL], worker[SPAN_WORKER_DECODE]
    assert prefill.attributes[tracing.ATTR_CACHED_TOKENS] == 64
    assert prefill.attributes[tracing.ATTR_COMPUTED_TOKENS] == 36
    assert decode.attributes[tracing.ATTR_OUTPUT_TOKENS] == 17
    assert decode.attributes[tracing.ATTR_TTFT_S] == pytest.approx(0.05)
    assert decode.attributes[tracing.ATTR_MEAN_ITL_S] == pytest.approx(0.8 / 16)
    # Explicit times from RequestTimings, in ns.
    assert (prefill.end_time - prefill.start_time) / 1e9 == pytest.approx(0.04, abs=1e-6)
    assert generate.start_time == int(T0 * 1e9)
    assert generate.attributes[tracing.ATTR_FINISH_REASON] == "stop"


def test_grpc_metadata_carrier_and_missing_traceparent():
    provider, spans = in_memory_provider()
    metadata = (("user-agent", "grpc-python"), ("traceparent", TRACEPARENT), ("x-bin", b"\x00"))
    tracer = tracing.get_tracer(provider)
    with tracer.start_as_current_span(SPAN_REQUEST, context=tracing.extract_context(metadata)):
        pass
    with tracer.start_as_current_span(SPAN_REQUEST, context=tracing.extract_context({"traceparent": "garbage"})):
        pass
    first, second = spans.get_finished_spans()
    assert format(first.context.trace_id, "032x") == CALLER_TRACE_ID
    assert second.parent is None and format(second.context.trace_id, "032x") != CALLER_TRACE_ID


def test_parent_based_sampling():
    provider, spans = in_memory_provider(ratio=0.0)
    tracer = tracing.get_tracer(provider)
    with tracer.start_as_current_span(SPAN_REQUEST):  # new trace, ratio 0: dropped
        flags = int(tracing.inject_context()["traceparent"].rsplit("-", 1)[1], 16)
        assert flags & 0x01 == 0  # propagated as not sampled
    with tracer.start_as_current_span(SPAN_REQUEST, context=tracing.extract_context({"traceparent": TRACEPARENT})):
        pass  # the caller sampled it: kept
    assert [format(s.context.trace_id, "032x") for s in spans.get_finished_spans()] == [CALLER_TRACE_ID]
    none_provider = tracing.setup_tracing(ObservabilityConfig(), "test", set_global=False)
    with tracing.get_tracer(none_provider).start_as_current_span(SPAN_REQUEST) as span:
        assert not span.is_recording()


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.requests: queue.Queue = queue.Queue()

    def Export(self, request, context):
        self.requests.put(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def otlp_receiver():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    receiver = _Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield receiver, f"http://127.0.0.1:{port}"
    server.stop(grace=None)


def test_real_otlp_grpc_export(otlp_receiver):
    receiver, endpoint = otlp_receiver
    cfg = ObservabilityConfig(tracing_exporter="otlp", otlp_endpoint=endpoint)
    router_provider = tracing.setup_tracing(cfg, "kvmesh-router", set_global=False)
    worker_provider = tracing.setup_tracing(cfg, "kvmesh-worker", set_global=False)
    serve_one_request(router_provider, worker_provider, {"traceparent": TRACEPARENT})
    assert router_provider.force_flush(10_000) and worker_provider.force_flush(10_000)

    spans, services = {}, set()
    while len(spans) < len(ROUTER_SPANS) + len(WORKER_SPANS):
        export = receiver.requests.get(timeout=10)
        for resource_spans in export.resource_spans:
            attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            services.add(attrs["service.name"])
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans[span.name] = span
    assert sorted(spans) == sorted(ROUTER_SPANS + WORKER_SPANS)
    assert services == {"kvmesh-router", "kvmesh-worker"}
    assert {s.trace_id.hex() for s in spans.values()} == {CALLER_TRACE_ID}
    assert spans[SPAN_REQUEST].parent_span_id.hex() == CALLER_SPAN_ID
    assert spans[SPAN_WORKER_GENERATE].parent_span_id == spans[SPAN_STREAM].span_id
    assert spans[SPAN_WORKER_DECODE].parent_span_id == spans[SPAN_WORKER_GENERATE].span_id
    assert spans[SPAN_ROUTE].parent_span_id == spans[SPAN_REQUEST].span_id
    prefill_attrs = {a.key: a.value.int_value for a in spans[SPAN_WORKER_PREFILL].attributes}
    assert prefill_attrs[tracing.ATTR_CACHED_TOKENS] == 64 and prefill_attrs[tracing.ATTR_COMPUTED_TOKENS] == 36
    route_attrs = {a.key: a.value for a in spans[SPAN_ROUTE].attributes}
    assert route_attrs[tracing.ATTR_ROUTE_POLICY].string_value == "prefix_aware"
    router_provider.shutdown()
    worker_provider.shutdown()
