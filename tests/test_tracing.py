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


def test_otlp_json_file_exporter_and_kvmesh_trace(tmp_path, capsys):
    """`otlp_endpoint: file://...` makes each process write OTLP/JSON lines itself (router and
    worker here, two providers appending to one file); `kvmesh trace` finds the request by
    its id and prints the tree: router spans, the worker's spans below kvmesh.stream, one
    span per prefill chunk, the decode summary and the finish event."""
    from kvmesh.deploy import cmd_trace
    from kvmesh.deploy.cli import main
    from kvmesh.core.otlp_file import read_spans
    from kvmesh.core.telemetry import RequestSteps

    path = tmp_path / "spans" / "spans.jsonl"
    cfg = ObservabilityConfig(tracing_exporter="otlp", otlp_endpoint=f"file://{path}")
    router_provider = tracing.setup_tracing(cfg, "kvmesh-router", set_global=False)
    worker_provider = tracing.setup_tracing(cfg, "kvmesh-worker", set_global=False)
    steps = RequestSteps([(T0 + 0.010, T0 + 0.030, 16), (T0 + 0.030, T0 + 0.050, 20)], num_prefill_chunks=2,
                         num_decode_steps=16, decode_step_s=0.75)
    tracer = tracing.get_tracer(router_provider)
    with tracer.start_as_current_span(SPAN_REQUEST, context=tracing.extract_context({"traceparent": TRACEPARENT})):
        with tracer.start_as_current_span(SPAN_STREAM) as stream:
            stream.set_attributes({tracing.ATTR_REQUEST_ID: "acme/r1", tracing.ATTR_ROUTE_PREDICTED_BLOCKS: 4,
                                   tracing.ATTR_PREFIX_HIT_BLOCKS: 4})
            request = GenerateRequest(request_id="acme/r1", prompt_token_ids=(1, 2, 3), tenant_id="acme",
                                      trace_context=tracing.inject_context())
            tracing.record_worker_spans(tracing.get_tracer(worker_provider), request, TIMINGS, USAGE,
                                        FinishReason.STOP, steps, block_size=16)
    router_provider.shutdown()
    worker_provider.shutdown()

    lines = path.read_text().splitlines()
    assert len(lines) >= 2 and all(line.startswith('{"resourceSpans"') for line in lines)
    spans = list(read_spans(lines))
    assert {s["trace_id"] for s in spans} == {CALLER_TRACE_ID}  # hex ids, as the OTLP/JSON spec has them
    chunks = [s for s in spans if s["name"] == tracing.SPAN_WORKER_PREFILL_CHUNK]
    assert sorted(c["attributes"][tracing.ATTR_CHUNK_TOKENS] for c in chunks) == [16, 20]
    by_name = {s["name"]: s for s in spans}
    assert {c["parent_id"] for c in chunks} == {by_name[SPAN_WORKER_PREFILL]["span_id"]}
    prefill = by_name[SPAN_WORKER_PREFILL]["attributes"]
    assert prefill[tracing.ATTR_PREFIX_HIT_BLOCKS] == 4 and prefill[tracing.ATTR_PREFILL_CHUNKS] == 2
    decode = by_name[SPAN_WORKER_DECODE]["attributes"]
    assert decode[tracing.ATTR_DECODE_STEPS] == 16 and decode[tracing.ATTR_DECODE_STEP_TIME_S] == 0.75

    assert main(["trace", "r1", "--file", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"trace {CALLER_TRACE_ID}"
    names = [line.strip().split("  ")[0] for line in out[1:]]
    assert names == [SPAN_REQUEST, SPAN_STREAM, SPAN_WORKER_GENERATE, SPAN_WORKER_QUEUE, SPAN_WORKER_PREFILL,
                     tracing.SPAN_WORKER_PREFILL_CHUNK, tracing.SPAN_WORKER_PREFILL_CHUNK, SPAN_WORKER_DECODE,
                     f"@ {tracing.EVENT_FINISH}"]
    indent = {line.strip().split("  ")[0]: len(line) - len(line.lstrip()) for line in out[1:]}
    assert indent[SPAN_REQUEST] < indent[SPAN_STREAM] < indent[SPAN_WORKER_GENERATE] < indent[SPAN_WORKER_PREFILL]
    assert indent[SPAN_WORKER_PREFILL] < indent[tracing.SPAN_WORKER_PREFILL_CHUNK]
    assert "route.predicted_prefix_blocks=4" in "\n".join(out) and "decode.steps=16" in "\n".join(out)
    assert main(["trace", "nobody", "--file", str(path)]) == cmd_trace.EXIT_NOT_FOUND
    (tmp_path / "bad.jsonl").write_text("not json\n")
    assert main(["trace", "r1", "--file", str(tmp_path / "bad.jsonl")]) == cmd_trace.EXIT_UNREADABLE
