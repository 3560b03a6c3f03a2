"""Tracing and metrics across the real cluster: two router replicas (Serve), one CPU worker
actor with the tiny random Llama, a real redis-server for quotas, a real OTLP/gRPC receiver
on loopback that both the router replicas and the worker export to, and `/metrics` scraped
over HTTP after a known workload.

Batch span export is made fast (OTEL_BSP_SCHEDULE_DELAY, inherited by every Ray process) so
spans arrive within a fraction of a second instead of the SDK's default 5 s.
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from e2e_cluster import TEST_HASH_ITERATIONS, scrape, serving, settled_scrape, tiny_cluster_config, total, wait_for
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc
from kvmesh.router import tracing
from kvmesh.router.tenants import generate_api_key, hash_api_key
from kvmesh.core.otlp_file import request_to_json_line

# e2e: a Ray cluster with the Serve app (`pytest -m "not e2e"` skips the module)
pytestmark = [pytest.mark.e2e, pytest.mark.shared_ray, pytest.mark.timeout(300)]

APP_NAME = "kvmesh-obs"
KEY = generate_api_key()
TIGHT_KEY = generate_api_key()
# 40 tokens = 2 full blocks of 16 + 8: a repeat finds 32 tokens in the prefix cache.
PROMPT_IDS = list(range(1000, 1040))
MAX_TOKENS = 6


class _Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal OTLP collector: keeps every exported span with its service name, and writes
    each export as an OTLP/JSON line (a collector's file exporter) for `kvmesh trace`."""

    def __init__(self, json_path):
        self.spans: list[tuple[str, object]] = []
        self.json_path = json_path
        self._lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 (OTLP's name)
        with self._lock:
            with open(self.json_path, "a", encoding="utf-8") as f:
                f.write(request_to_json_line(request))
            for resource_spans in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend((attrs.get("service.name", ""), s) for s in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id_hex: str) -> dict[str, tuple[str, object]]:
        with self._lock:
            return {s.name: (service, s) for service, s in self.spans if s.trace_id.hex() == trace_id_hex}

    def all_named(self, trace_id_hex: str, name: str) -> list:
        with self._lock:
            return [s for _, s in self.spans if s.trace_id.hex() == trace_id_hex and s.name == name]


@pytest.fixture(scope="module")
def receiver(tmp_path_factory):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    rec = _Receiver(tmp_path_factory.mktemp("otlp") / "spans.jsonl")
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rec, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield rec, f"http://127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, redis_server, receiver):
    _, endpoint = receiver
    tenants = {"auth_required": True, "redis_url": redis_server.url, "tenants": [
        {"id": "acme", "api_key_hashes": [hash_api_key(KEY, TEST_HASH_ITERATIONS)]},
        # 8 output tokens a minute: one request of max_tokens 6 fits, a second one does not.
        {"id": "tight", "api_key_hashes": [hash_api_key(TIGHT_KEY, TEST_HASH_ITERATIONS)],
         "output_tokens_per_minute": 8},
    ]}
    config = tiny_cluster_config(tiny_model_dir, num_workers=1, router={"num_replicas": 2, "policy": "prefix_aware"},
                                 tenants=tenants,
                                 observability={"tracing_exporter": "otlp", "otlp_endpoint": endpoint})
    with serving(config, APP_NAME, env={"OTEL_BSP_SCHEDULE_DELAY": "100"}):
        yield config


@pytest.fixture(scope="module")
def http_base(cluster) -> str:
    return f"http://127.0.0.1:{cluster.router.http_port}"


@pytest.fixture(scope="module")
def stub(cluster):
    channel = grpc.insecure_channel(f"127.0.0.1:{cluster.router.grpc_port}")
    yield kvmesh_pb2_grpc.KvmeshStub(channel)
    channel.close()


def _complete(http_base: str, key: str, prompt_ids=PROMPT_IDS, max_tokens: int = MAX_TOKENS,
              headers: dict | None = None, request_id: str | None = None) -> httpx.Response:
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if request_id:
        body["request_id"] = request_id
    return httpx.post(f"{http_base}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}", **(headers or {})})


def _grpc_generate(stub, key: str, metadata: tuple = ()) -> list:
    sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=PROMPT_IDS), sampling=sampling)
    return list(stub.Generate(request, metadata=(("authorization", f"Bearer {key}"), *metadata), timeout=60))


def _attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        value = getattr(a.value, kind)
        out[a.key] = [getattr(v, v.WhichOneof("value")) for v in value.values] if kind == "array_value" else value
    return out


def _wait_for_trace(rec: _Receiver, trace_id: str, names: set[str]) -> dict:
    return wait_for(lambda: (spans := rec.trace(trace_id)) and names <= set(spans) and spans,
                    timeout_s=30, what=f"spans {sorted(names)} of trace {trace_id}")


ROUTER_SPANS = {tracing.SPAN_REQUEST, tracing.SPAN_AUTH, tracing.SPAN_QUOTA, tracing.SPAN_ADMISSION,
                tracing.SPAN_ROUTE, tracing.SPAN_STREAM}
WORKER_SPANS = {tracing.SPAN_WORKER_GENERATE, tracing.SPAN_WORKER_QUEUE, tracing.SPAN_WORKER_PREFILL,
                tracing.SPAN_WORKER_DECODE, tracing.SPAN_WORKER_PREFILL_CHUNK}


def test_one_trace_from_client_through_router_and_worker(cluster, http_base, stub, receiver, capsys):
    """HTTP with a traceparent header, then the same prompt over gRPC with a traceparent in
    metadata: each is one trace from the caller's span through the router replica's spans to
    the spans the worker process exported, with the second one's cache hit on its spans."""
    rec, _ = receiver
    first_trace, first_parent = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    reply = _complete(http_base, KEY, headers={"traceparent": f"00-{first_trace}-{first_parent}-01"},
                      request_id="obs-first")
    assert reply.status_code == 200, reply.text
    spans = _wait_for_trace(rec, first_trace, ROUTER_SPANS | WORKER_SPANS)
    services = {name: service for name, (service, _) in spans.items()}
    span = {name: s for name, (_, s) in spans.items()}
    assert {services[n] for n in ROUTER_SPANS} == {"kvmesh-router"}
    assert {services[n] for n in WORKER_SPANS} == {"kvmesh-worker"}  # exported by the worker process
    assert span[tracing.SPAN_REQUEST].parent_span_id.hex() == first_parent
    for child in (tracing.SPAN_AUTH, tracing.SPAN_QUOTA, tracing.SPAN_ADMISSION, tracing.SPAN_ROUTE,
                  tracing.SPAN_STREAM):
        assert span[child].parent_span_id == span[tracing.SPAN_REQUEST].span_id, child
    assert span[tracing.SPAN_WORKER_GENERATE].parent_span_id == span[tracing.SPAN_STREAM].span_id
    for child in (tracing.SPAN_WORKER_QUEUE, tracing.SPAN_WORKER_PREFILL, tracing.SPAN_WORKER_DECODE):
        assert span[child].parent_span_id == span[tracing.SPAN_WORKER_GENERATE].span_id, child
    route = _attrs(span[tracing.SPAN_ROUTE])
    assert route[tracing.ATTR_ROUTE_WORKER] == "worker-0" and route[tracing.ATTR_ROUTE_POLICY] == "prefix_aware"
    # The routing decision with every candidate's score, and the admission's wait.
    candidates = route[tracing.ATTR_ROUTE_CANDIDATES]
    assert len(candidates) == 1 and candidates[0].startswith("worker-0 matched=0 load=")
    assert route[tracing.ATTR_ROUTE_PATH]
    assert span[tracing.SPAN_ROUTE].parent_span_id == span[tracing.SPAN_REQUEST].span_id
    assert _attrs(span[tracing.SPAN_ADMISSION])[tracing.ATTR_ADMISSION_WAIT_S] >= 0
    # One span per prefill chunk (40 prompt tokens fit one step), the decode summarised, the finish.
    chunks = rec.all_named(first_trace, tracing.SPAN_WORKER_PREFILL_CHUNK)
    assert [_attrs(c)[tracing.ATTR_CHUNK_TOKENS] for c in chunks] == [len(PROMPT_IDS)]
    assert chunks[0].parent_span_id == span[tracing.SPAN_WORKER_PREFILL].span_id
    decode_summary = _attrs(span[tracing.SPAN_WORKER_DECODE])
    assert decode_summary[tracing.ATTR_DECODE_STEPS] == MAX_TOKENS - 1  # the first token came from the prefill
    assert decode_summary[tracing.ATTR_DECODE_STEP_TIME_S] > 0 and decode_summary[tracing.ATTR_NUM_PREEMPTIONS] == 0
    assert [e.name for e in span[tracing.SPAN_WORKER_GENERATE].events] == [tracing.EVENT_FINISH]
    # Routing truth: nothing predicted, nothing hit.
    stream = _attrs(span[tracing.SPAN_STREAM])
    assert stream[tracing.ATTR_ROUTE_PREDICTED_BLOCKS] == 0 and stream[tracing.ATTR_PREFIX_HIT_BLOCKS] == 0
    assert _attrs(span[tracing.SPAN_REQUEST])[tracing.ATTR_TENANT] == "acme"
    decode = _attrs(span[tracing.SPAN_WORKER_DECODE])
    assert decode[tracing.ATTR_OUTPUT_TOKENS] == MAX_TOKENS
    assert decode[tracing.ATTR_TTFT_S] > 0 and decode[tracing.ATTR_MEAN_ITL_S] > 0
    usage = reply.json()["usage"]
    prefill = _attrs(span[tracing.SPAN_WORKER_PREFILL])
    assert prefill[tracing.ATTR_CACHED_TOKENS] == usage["prompt_tokens_details"]["cached_tokens"]
    assert prefill[tracing.ATTR_CACHED_TOKENS] + prefill[tracing.ATTR_COMPUTED_TOKENS] == len(PROMPT_IDS)

    # The router replicas learn the worker's cached blocks from its prefix events.
    second_trace, second_parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    wait_for(lambda: any(w.num_blocks_cached >= 2 for w in stub.GetStats(pb.GetStatsRequest()).workers),
             what="the first prompt's blocks cached")
    import time
    time.sleep(0.5)  # a few stats refreshes (0.1 s) so both replicas applied the prefix events
    deltas = _grpc_generate(stub, KEY, (("traceparent", f"00-{second_trace}-{second_parent}-01"),))
    assert deltas[-1].usage.cached_tokens == 32
    span = {name: s for name, (_, s) in _wait_for_trace(rec, second_trace, ROUTER_SPANS | WORKER_SPANS).items()}
    assert span[tracing.SPAN_REQUEST].parent_span_id.hex() == second_parent
    assert _attrs(span[tracing.SPAN_ROUTE])[tracing.ATTR_ROUTE_MATCHED_BLOCKS] == 2
    prefill = _attrs(span[tracing.SPAN_WORKER_PREFILL])
    assert prefill[tracing.ATTR_CACHED_TOKENS] == 32 and prefill[tracing.ATTR_COMPUTED_TOKENS] == 8
    # Routing truth on both sides: the router predicted 2 blocks, the worker's cache served 2.
    assert prefill[tracing.ATTR_PREFIX_HIT_BLOCKS] == 2
    stream = _attrs(span[tracing.SPAN_STREAM])
    assert stream[tracing.ATTR_ROUTE_PREDICTED_BLOCKS] == 2 and stream[tracing.ATTR_PREFIX_HIT_BLOCKS] == 2
    assert [_attrs(c)[tracing.ATTR_CHUNK_TOKENS] for c in rec.all_named(second_trace,
                                                                         tracing.SPAN_WORKER_PREFILL_CHUNK)] == [8]

    # `kvmesh trace` on the same spans as OTLP/JSON lines: the first request's tree by its id.
    from kvmesh.deploy.cli import main
    assert main(["trace", "obs-first", "--file", str(rec.json_path)]) == 0
    out = capsys.readouterr().out
    tree = [line.strip().split("  ")[0] for line in out.splitlines()[1:]]
    assert tree.index(tracing.SPAN_REQUEST) < tree.index(tracing.SPAN_WORKER_GENERATE) \
        < tree.index(tracing.SPAN_WORKER_PREFILL_CHUNK) < tree.index(f"@ {tracing.EVENT_FINISH}")
    assert set(tree) >= ROUTER_SPANS | WORKER_SPANS and out.splitlines()[0] == f"trace {first_trace}"


COUNTERS = ("kvmesh_prompt_tokens_total", "kvmesh_cached_prompt_tokens_total", "kvmesh_generation_tokens_total")
HISTOGRAMS = ("kvmesh_time_to_first_token_seconds_count", "kvmesh_e2e_request_latency_seconds_count",
              "kvmesh_request_queue_time_seconds_count", "kvmesh_request_prefill_time_seconds_count",
              "kvmesh_request_decode_time_seconds_count", "kvmesh_inter_token_latency_seconds_count")


def _figures(http_base: str, settled: bool = False) -> dict:
    samples = settled_scrape(http_base) if settled else scrape(http_base)
    figures = {name: total(samples, name, tenant="acme") for name in COUNTERS}
    figures.update({name: total(samples, name) for name in HISTOGRAMS})
    for reason in ("quota", "unauthenticated", "invalid"):
        figures[f"rejections:{reason}"] = total(samples, "kvmesh_rejections_total", reason=reason)
    return figures


def test_metrics_equal_a_known_workload(cluster, http_base, stub):
    """Scrape, run N requests (HTTP and gRPC, spread by Serve over both replicas) and some
    rejections, scrape again: the counters moved by exactly the workload's token counts,
    histograms by the number of requests, rejections by reason."""
    before = _figures(http_base, settled=True)
    num_requests, prompt_tokens, cached_tokens = 6, 0, 0
    for i in range(num_requests):
        ids = [2000 + 50 * (i % 3) + j for j in range(20 + i)]  # prompts repeat: some cache hits
        if i % 2:
            usage = _complete(http_base, KEY, prompt_ids=ids).json()["usage"]
            prompt_tokens += usage["prompt_tokens"]
            cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
            assert usage["completion_tokens"] == MAX_TOKENS
        else:
            sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), sampling=sampling)
            final = list(stub.Generate(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=60))[-1]
            prompt_tokens += final.usage.prompt_tokens
            cached_tokens += final.usage.cached_tokens
    assert prompt_tokens == sum(20 + i for i in range(num_requests))
    assert _complete(http_base, "kvm.0011223344556677.wrong").status_code == 401
    assert _complete(http_base, KEY, max_tokens=10_000).status_code == 400
    assert _complete(http_base, TIGHT_KEY).status_code == 200  # uses 6 of 8 output tokens a minute
    quota_reply = _complete(http_base, TIGHT_KEY)
    assert quota_reply.status_code == 429 and float(quota_reply.headers["retry-after"]) > 0

    expected = dict(before)
    expected["kvmesh_prompt_tokens_total"] += prompt_tokens
    expected["kvmesh_cached_prompt_tokens_total"] += cached_tokens
    expected["kvmesh_generation_tokens_total"] += num_requests * MAX_TOKENS
    for name in HISTOGRAMS:
        expected[name] += num_requests + 1  # + the tight tenant's admitted request
    for reason in ("quota", "unauthenticated", "invalid"):
        expected[f"rejections:{reason}"] += 1
    # Peers publish every 2 s: wait until the merged view caught up, then it must be exact.
    try:
        wait_for(lambda: _figures(http_base) == expected, timeout_s=15, what="merged metrics")
    except AssertionError:
        assert _figures(http_base) == expected


def test_worker_gauges_and_step_time_present(cluster, http_base):
    samples = scrape(http_base)
    names = {name for name, _ in samples}
    for name in ("kvmesh_num_requests_running", "kvmesh_num_requests_waiting", "kvmesh_kv_cache_usage_ratio",
                 "kvmesh_kv_blocks_used", "kvmesh_kv_blocks_cached", "kvmesh_kv_blocks_free",
                 "kvmesh_kv_block_fragmentation_ratio", "kvmesh_batch_fill_ratio", "kvmesh_preemptions_total",
                 "kvmesh_quota_store_fallback_active", "kvmesh_prefix_cache_queries_total",
                 "kvmesh_prefix_cache_hits_total"):
        assert name in names, name
    assert total(samples, "kvmesh_step_time_seconds_count", worker="worker-0") > 0  # from the worker process
    assert total(samples, "kvmesh_kv_blocks_free") > 0
    assert total(samples, "kvmesh_preemptions_total", mode="swap") == 0
    # Both replicas appear (the board merges them), neither on fallback limits.
    fallback = [v for (n, _), v in samples.items() if n == "kvmesh_quota_store_fallback_active"]
    assert fallback == [0.0, 0.0]


def test_every_layer_exported_after_real_requests(cluster, http_base):
    """After the requests above (and one that times out here): the memory, batch, compute,
    request, cost and routing layers are all in the router's /metrics, with values the
    workload implies."""
    before = settled_scrape(http_base)
    timed_out = _complete(http_base, KEY, max_tokens=50, headers={"x-kvmesh-timeout-s": "0.001"})
    assert timed_out.status_code == 504, timed_out.text
    wait_for(lambda: total(scrape(http_base), "kvmesh_request_timeouts_total")
             == total(before, "kvmesh_request_timeouts_total") + 1, timeout_s=15, what="the timeout counted")
    samples = settled_scrape(http_base)
    assert total(samples, "kvmesh_requests_total", finish_reason="error") == \
        total(before, "kvmesh_requests_total", finish_reason="error")  # a timeout is not an error
    assert total(samples, "kvmesh_requests_total", finish_reason="timeout") == \
        total(before, "kvmesh_requests_total", finish_reason="timeout") + 1
    worker = {"worker": "worker-0"}
    # compute layer
    for phase in ("schedule", "prepare", "forward", "sample", "output"):
        assert total(samples, "kvmesh_step_phase_seconds_count", phase=phase, **worker) > 0, phase
    # batch layer
    assert total(samples, "kvmesh_step_tokens_sum", kind="prefill", **worker) > 0
    assert total(samples, "kvmesh_step_tokens_sum", kind="decode", **worker) > 0
    fill_count = total(samples, "kvmesh_step_token_fill_ratio_count", **worker)
    assert fill_count == total(samples, "kvmesh_step_time_seconds_count", **worker) > 0
    assert 0 < total(samples, "kvmesh_step_token_fill_ratio_sum", **worker) <= fill_count
    # memory layer (CPU: tensors, RSS, max RSS), KV pool, KV tokens over the window, OOMs
    for name in ("kvmesh_memory_allocated_bytes", "kvmesh_memory_reserved_bytes", "kvmesh_memory_peak_bytes"):
        assert total(samples, name, rank="0", device="cpu", **worker) > 0, name
    assert total(samples, "kvmesh_kv_pool_bytes", **worker) > 0
    assert ("kvmesh_kv_tokens_peak", (("worker", "worker-0"),)) in samples
    assert total(samples, "kvmesh_kv_tokens_peak", **worker) >= total(samples, "kvmesh_kv_tokens_mean", **worker)
    assert total(samples, "kvmesh_oom_total", **worker) == 0
    # request layer: the router's own queue, model info
    assert total(samples, "kvmesh_router_queue_time_seconds_count") >= 8
    info = [dict(labels) for name, labels in samples if name == "kvmesh_model_info"]
    assert len(info) == 1 and info[0]["worker"] == "worker-0" and info[0]["dtype"] == "float32"
    assert info[0]["weight_quant"] == "none" and info[0]["revision"] == "main" and info[0]["version"]
    assert info[0]["kv_cache_dtype"] and info[0]["model"]
    # cost: both phases of acme's requests were computed somewhere
    assert total(samples, "kvmesh_tenant_compute_seconds_total", tenant="acme", phase="prefill") > 0
    assert total(samples, "kvmesh_tenant_compute_seconds_total", tenant="acme", phase="decode") > 0
    # routing truth: the repeated prompts were predicted and hit
    assert total(samples, "kvmesh_route_predicted_prefix_blocks_total") >= 2
    assert total(samples, "kvmesh_route_hit_prefix_blocks_total") >= 2
    assert total(samples, "kvmesh_route_prefix_blocks_error_count") >= 8
    # Every name the Grafana dashboard and the PrometheusRule query is in this /metrics, except
    # the NVML gauges, which exist only on CUDA workers (absent, not zero, elsewhere).
    from kvmesh.deploy import grafana_dashboard
    queried = grafana_dashboard.queried_metric_names(grafana_dashboard.dashboard_json())
    queried |= grafana_dashboard.queried_metric_names(grafana_dashboard.ALERTS_TEMPLATE.read_text())
    cuda_only = {"kvmesh_gpu_utilization_ratio", "kvmesh_gpu_temperature_celsius"}
    assert cuda_only <= queried and len(queried) >= 30
    assert sorted(queried - cuda_only - {name for name, _ in samples}) == []
