"""RouterMetrics / EngineMetrics: a known synthetic workload, scraped with prometheus_client's
parser; and `kvmesh stats` scraping a real HTTP /metrics endpoint."""

import argparse
import asyncio
import http.server
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from e2e_cluster import shared_ray
from kvmesh.deploy import cmd_stats
from kvmesh.router.metrics import (EngineMetrics, MetricsBoard, RouterMetrics,
                                   get_board, get_or_create_board, kill_board, start_publishing)
from kvmesh.core.seams import FinishReason, RequestTimings, Usage, WorkerStats

# (tenant, timings as offsets from arrival (scheduled, first token, finished), usage, finish)
WORKLOAD = [
    ("acme", (0.01, 0.05, 0.45), Usage(prompt_tokens=100, completion_tokens=9, cached_tokens=32), FinishReason.STOP),
    ("acme", (0.2, 0.3, 2.3), Usage(prompt_tokens=50, completion_tokens=21, cached_tokens=0), FinishReason.LENGTH),
    ("beta", (1.0, 3.0, 3.0), Usage(prompt_tokens=7, completion_tokens=1, cached_tokens=0), FinishReason.STOP),
    ("beta", (0.5, None, None), Usage(prompt_tokens=12, completion_tokens=0, cached_tokens=0), FinishReason.ABORT),
]


def scrape(body: bytes) -> dict[tuple, float]:
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def run_workload(metrics: RouterMetrics, arrival: float = 1000.0) -> None:
    for tenant, (sched, first, done), usage, reason in WORKLOAD:
        timings = RequestTimings(arrival_time=arrival, first_scheduled_time=arrival + sched,
                                 first_token_time=None if first is None else arrival + first,
                                 finished_time=None if done is None else arrival + done)
        metrics.observe_request_end(tenant, timings, usage, reason)


def worker_stats(worker_id: str, used: int, tokens_used: int) -> WorkerStats:
    return WorkerStats(worker_id=worker_id, healthy=True, block_size=16, num_blocks_total=100,
                       num_blocks_used=used, num_blocks_cached=10, num_blocks_free=90 - used,
                       kv_tokens_used=tokens_used, kv_tokens_capacity=1600, kv_tokens_reserved=0,
                       num_running=3, num_waiting=2, queued_prompt_tokens=0, prefix_cache_hit_rate=0.0,
                       output_tokens_per_s=0.0, num_preemptions_recompute=4, num_preemptions_swap=1)


def test_counters_equal_the_workload_token_counts():
    metrics = RouterMetrics(replica_id="r0", max_num_seqs=4)
    run_workload(metrics)
    s = scrape(metrics.render())
    assert value(s, "kvmesh_prompt_tokens_total", tenant="acme") == 150
    assert value(s, "kvmesh_prompt_tokens_total", tenant="beta") == 19
    assert value(s, "kvmesh_generation_tokens_total", tenant="acme") == 30
    assert value(s, "kvmesh_generation_tokens_total", tenant="beta") == 1
    assert value(s, "kvmesh_cached_prompt_tokens_total", tenant="acme") == 32
    assert value(s, "kvmesh_prefix_cache_queries_total") == 169
    assert value(s, "kvmesh_prefix_cache_hits_total") == 32
    assert value(s, "kvmesh_requests_total", finish_reason="stop", tenant="acme") == 1
    assert value(s, "kvmesh_requests_total", finish_reason="stop", tenant="beta") == 1
    assert value(s, "kvmesh_requests_total", finish_reason="length", tenant="acme") == 1
    assert value(s, "kvmesh_requests_total", finish_reason="abort", tenant="beta") == 1


def test_histogram_counts_and_buckets():
    metrics = RouterMetrics(replica_id="r0")
    run_workload(metrics)
    s = scrape(metrics.render())
    # TTFT 0.05, 0.3, 3.0 (the aborted request has none).
    assert value(s, "kvmesh_time_to_first_token_seconds_count") == 3
    assert value(s, "kvmesh_time_to_first_token_seconds_sum") == pytest.approx(3.35)
    assert value(s, "kvmesh_time_to_first_token_seconds_bucket", le="0.06") == 1
    assert value(s, "kvmesh_time_to_first_token_seconds_bucket", le="0.5") == 2
    assert value(s, "kvmesh_time_to_first_token_seconds_bucket", le="2.5") == 2
    assert value(s, "kvmesh_time_to_first_token_seconds_bucket", le="+Inf") == 3
    assert value(s, "kvmesh_request_queue_time_seconds_count") == 4
    assert value(s, "kvmesh_request_queue_time_seconds_sum") == pytest.approx(1.71)
    assert value(s, "kvmesh_request_prefill_time_seconds_sum") == pytest.approx(0.04 + 0.1 + 2.0)
    assert value(s, "kvmesh_request_decode_time_seconds_count") == 3
    assert value(s, "kvmesh_e2e_request_latency_seconds_sum") == pytest.approx(0.45 + 2.3 + 3.0)
    # ITL: only requests with >= 2 tokens: 0.4/8 = 0.05 and 2.0/20 = 0.1.
    assert value(s, "kvmesh_inter_token_latency_seconds_count") == 2
    assert value(s, "kvmesh_inter_token_latency_seconds_sum") == pytest.approx(0.15)
    assert value(s, "kvmesh_inter_token_latency_seconds_bucket", le="0.075") == 1


def test_rejections_retries_and_quota_fallback():
    metrics = RouterMetrics(replica_id="r0")
    for reason in ("quota", "quota", "overload", "unauthenticated"):
        metrics.observe_rejection(reason)
    metrics.observe_retry()
    with pytest.raises(ValueError):
        metrics.observe_rejection("bored")
    metrics.set_quota_fallback(True)
    s = scrape(metrics.render())
    assert value(s, "kvmesh_rejections_total", reason="quota") == 2
    assert value(s, "kvmesh_rejections_total", reason="overload") == 1
    assert value(s, "kvmesh_rejections_total", reason="invalid") == 0
    assert value(s, "kvmesh_rejections_total", reason="unauthenticated") == 1
    assert value(s, "kvmesh_retries_seen_total") == 1
    assert value(s, "kvmesh_quota_store_fallback_active", replica="r0") == 1
    metrics.set_quota_fallback(False)
    assert value(scrape(metrics.render()), "kvmesh_quota_store_fallback_active", replica="r0") == 0


def test_routing_decisions_are_counted_by_path_every_path_present_from_the_start():
    metrics = RouterMetrics(replica_id="r0")
    assert value(scrape(metrics.render()), "kvmesh_routing_decisions_total", path="prefix_imbalanced") == 0
    for path in ("prefix_match", "prefix_match", "no_prefix"):
        metrics.observe_route(path)
    with pytest.raises(ValueError):
        metrics.observe_route("coin_toss")
    s = scrape(metrics.render())
    assert value(s, "kvmesh_routing_decisions_total", path="prefix_match") == 2
    assert value(s, "kvmesh_routing_decisions_total", path="no_prefix") == 1
    assert value(s, "kvmesh_routing_decisions_total", path="prefix_spill") == 0


def test_worker_gauges_from_stats():
    metrics = RouterMetrics(replica_id="r0", max_num_seqs=4)
    metrics.update_worker_stats([worker_stats("w0", used=20, tokens_used=300),
                                 worker_stats("w1", used=0, tokens_used=0)])
    s = scrape(metrics.render())
    assert value(s, "kvmesh_kv_cache_usage_ratio", worker="w0") == pytest.approx(0.2)
    assert value(s, "kvmesh_kv_blocks_used", worker="w0") == 20
    assert value(s, "kvmesh_kv_blocks_free", worker="w0") == 70
    assert value(s, "kvmesh_kv_blocks_cached", worker="w1") == 10
    # 20 blocks x 16 slots = 320 slots for 300 tokens: 20 empty slots.
    assert value(s, "kvmesh_kv_block_fragmentation_ratio", worker="w0") == pytest.approx(20 / 320)
    assert value(s, "kvmesh_batch_fill_ratio", worker="w1") == pytest.approx(0.75)
    assert value(s, "kvmesh_num_requests_waiting", worker="w0") == 2
    assert value(s, "kvmesh_preemptions_total", worker="w0", mode="recompute") == 4
    assert value(s, "kvmesh_preemptions_total", worker="w1", mode="swap") == 1
    metrics.update_worker_stats([worker_stats("w1", used=0, tokens_used=0)])
    assert ("kvmesh_kv_blocks_used", (("worker", "w0"),)) not in scrape(metrics.render())


def test_render_merges_peer_replicas_and_engine_snapshots():
    a, b = RouterMetrics(replica_id="a"), RouterMetrics(replica_id="b")
    run_workload(a)
    run_workload(b)
    b.observe_rejection("overload")
    b.set_quota_fallback(True)
    engine = EngineMetrics(worker_id="w0")
    for step_time_s in (0.004, 0.03, 0.03):
        engine.observe_step(step_time_s)
    s = scrape(a.render([b.snapshot(), engine.snapshot()]))
    assert value(s, "kvmesh_prompt_tokens_total", tenant="acme") == 300
    assert value(s, "kvmesh_time_to_first_token_seconds_count") == 6
    assert value(s, "kvmesh_time_to_first_token_seconds_bucket", le="0.5") == 4
    assert value(s, "kvmesh_rejections_total", reason="overload") == 1
    assert value(s, "kvmesh_quota_store_fallback_active", replica="a") == 0
    assert value(s, "kvmesh_quota_store_fallback_active", replica="b") == 1
    assert value(s, "kvmesh_step_time_seconds_count", worker="w0") == 3
    assert value(s, "kvmesh_step_time_seconds_bucket", worker="w0", le="0.005") == 1
    assert not any(name.endswith("_created") for name, _ in s)


def run_cli(argv: list[str]) -> int:
    """The `kvmesh stats` subcommand as the CLI wires it (only this module's parser)."""
    parser = argparse.ArgumentParser(prog="kvmesh")
    cmd_stats.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


class _MetricsHandler(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def test_kvmesh_stats_scrapes_a_live_metrics_endpoint(capsys):
    metrics = RouterMetrics(replica_id="r0", max_num_seqs=4)
    run_workload(metrics)
    metrics.observe_rejection("quota")
    metrics.update_worker_stats([worker_stats("w0", used=20, tokens_used=300)])
    _MetricsHandler.body = metrics.render()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _MetricsHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        summary = cmd_stats.summarize(cmd_stats.scrape(url))
        assert summary.requests_by_reason == {"stop": 2, "length": 1, "abort": 1}
        assert summary.prompt_tokens == 169 and summary.generation_tokens == 31
        assert summary.rejections == {"quota": 1, "overload": 0, "deadline": 0, "evicted": 0, "invalid": 0,
                                      "unauthenticated": 0, "adapter_not_found": 0, "permission_denied": 0}
        assert summary.prefix_cache_hit_ratio == pytest.approx(32 / 169)
        assert summary.workers["w0"]["kv_cache_usage_ratio"] == pytest.approx(0.2)
        # TTFT p50 lies in the (0.25, 0.5] bucket: 3 observations, the 2nd is 0.3.
        assert 0.25 < summary.ttft_quantiles_s[0.5] <= 0.5
        assert run_cli(["stats", "--url", url]) == 0
        out = capsys.readouterr().out
        assert "w0" in out and "stop" in out and "prompt tokens" in out
    finally:
        server.shutdown()
        server.server_close()


def test_metrics_board_keeps_fresh_snapshots_and_excludes_the_caller():
    now = [0.0]
    board = MetricsBoard(stale_after_s=10.0, clock=lambda: now[0])
    board.publish("a", b"A1")
    board.publish("b", b"B1")
    board.publish("a", b"A2")
    assert board.snapshots() == [b"A2", b"B1"]
    assert board.snapshots(exclude="a") == [b"B1"]
    now[0] = 5.0
    board.publish("b", b"B2")
    now[0] = 12.0  # "a" last published at 0: gone
    assert board.snapshots() == [b"B2"]


@pytest.mark.e2e
@pytest.mark.shared_ray
def test_two_replicas_render_the_same_cluster_totals_through_a_ray_board():
    pytest.importorskip("ray")
    shared_ray()
    try:
        replicas = [RouterMetrics(replica_id="r0"), RouterMetrics(replica_id="r1")]
        run_workload(replicas[0])
        run_workload(replicas[1])
        replicas[1].observe_request_end("acme", None, Usage(prompt_tokens=5, completion_tokens=2), "stop")

        async def scenario():
            board = get_or_create_board("app-a")
            assert get_board("app-a") is not None
            tasks = [start_publishing(board, m, interval_s=0.05) for m in replicas]
            while len(await board.snapshots.remote()) < 2:
                await asyncio.sleep(0.05)
            bodies = [m.render(await board.snapshots.remote(exclude=m.replica_id)) for m in replicas]
            for task in tasks:
                task.cancel()
            # Another app on the same cluster has a board of its own: it sums nothing of app-a.
            assert await get_or_create_board("app-b").snapshots.remote() == []
            return bodies

        for body in asyncio.run(scenario()):
            s = scrape(body)
            assert value(s, "kvmesh_prompt_tokens_total", tenant="acme") == 305
            assert value(s, "kvmesh_requests_total", finish_reason="stop", tenant="acme") == 3
            assert value(s, "kvmesh_time_to_first_token_seconds_count") == 6
        # The app's board goes with it (stop_serving), so a new deployment starts from nothing.
        assert kill_board("app-a") and kill_board("app-b")
        with pytest.raises(ValueError):
            get_board("app-a")
        assert not kill_board("app-a")
    finally:
        kill_board("app-a")
        kill_board("app-b")


# ---- the worker's engine metrics from real engine steps (tiny random Llama) -------------

def test_engine_metrics_from_real_engine_steps(tiny_model_dir):
    """Two tenants' requests through a real engine with chunked prefill: the step reports feed
    per-phase time, the prefill/decode token mix, the fill rate, per-tenant compute seconds
    (which add up to the step time), the memory probes, model info, and an OOM counted from
    a forward that ran out of memory; the step log holds each prefill chunk for the spans."""
    from kvmesh.core.config import KvmeshConfig
    from kvmesh.core.seams import GenerateRequest, SamplingParams
    from kvmesh.worker.engine_loop.engine import Engine
    from kvmesh.core.telemetry import ModelInfoLabels, RequestStepLog
    from kvmesh.worker.kernels import cpu_native_step

    config = KvmeshConfig.from_dict({
        "model": {"path": tiny_model_dir, "dtype": "fp32", "max_model_len": 128},
        "cache": {"num_blocks": 32, "block_size": 8},
        "scheduler": {"max_num_batched_tokens": 16, "max_prefill_tokens_per_step": 16}})
    engine = Engine.from_config(config)
    plan = engine.parts.plan
    metrics = EngineMetrics("w0", ModelInfoLabels.of_engine(engine, config), device=engine.parts.device,
                            tensor_bytes=plan.weight_bytes + plan.kv_cache_bytes, kv_pool_bytes=plan.kv_cache_bytes)
    log = RequestStepLog()
    engine.phase_clock.observers += [metrics.observe_step_report, log.observe_step_report]
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request(GenerateRequest("a/1", prompt_token_ids=tuple(range(10, 50)), sampling=greedy,
                                       tenant_id="acme"))
    engine.add_request(GenerateRequest("b/1", prompt_token_ids=tuple(range(60, 66)), sampling=greedy,
                                       tenant_id="beta"))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1

    acme, beta = log.pop("a/1"), log.pop("b/1")
    assert len(log) == 0
    # 40 prompt tokens at <= 16 a step (arrived first, so served first): chunks 16, 16, 8.
    assert [c[2] for c in acme.prefill_chunks] == [16, 16, 8] and acme.num_prefill_chunks == 3
    assert [c[2] for c in beta.prefill_chunks] == [6]
    assert acme.num_decode_steps == 3 and beta.num_decode_steps == 3  # 4 tokens: 1 from prefill + 3 decodes
    assert all(start <= end for start, end, _ in acme.prefill_chunks) and acme.decode_step_s > 0

    s = scrape(metrics.snapshot())
    assert value(s, "kvmesh_step_time_seconds_count", worker="w0") == steps
    for phase in ("schedule", "prepare", "forward", "output"):
        assert value(s, "kvmesh_step_phase_seconds_count", worker="w0", phase=phase) == steps, phase
    # The two steps of acme's first 32 prompt tokens sample nothing: no sample phase.
    assert value(s, "kvmesh_step_phase_seconds_count", worker="w0", phase="sample") == steps - 2
    assert value(s, "kvmesh_step_tokens_sum", worker="w0", kind="prefill") == 46
    assert value(s, "kvmesh_step_tokens_sum", worker="w0", kind="decode") == 6
    assert value(s, "kvmesh_step_token_fill_ratio_count", worker="w0") == steps
    assert value(s, "kvmesh_step_token_fill_ratio_bucket", worker="w0", le="1.0") == steps
    assert value(s, "kvmesh_step_token_fill_ratio_sum", worker="w0") == pytest.approx((46 + 6) / 16)
    compute = {(t, p): value(s, "kvmesh_tenant_compute_seconds_total", tenant=t, phase=p)
               for t in ("acme", "beta") for p in ("prefill", "decode")}
    assert all(v > 0 for v in compute.values())
    assert sum(compute.values()) == pytest.approx(value(s, "kvmesh_step_time_seconds_sum", worker="w0"))
    mem = dict(worker="w0", rank="0", device="cpu")
    assert value(s, "kvmesh_memory_allocated_bytes", **mem) == plan.weight_bytes + plan.kv_cache_bytes
    assert value(s, "kvmesh_memory_reserved_bytes", **mem) > value(s, "kvmesh_memory_allocated_bytes", **mem)
    assert value(s, "kvmesh_memory_peak_bytes", **mem) >= value(s, "kvmesh_memory_reserved_bytes", **mem)
    assert value(s, "kvmesh_kv_pool_bytes", worker="w0") == plan.kv_cache_bytes > 0
    assert not any(name.startswith("kvmesh_gpu_") for name, _ in s)  # CPU: no NVML gauges
    info = [dict(labels) for name, labels in s if name == "kvmesh_model_info"]
    path, reason = info[0].pop("forward_path"), info[0].pop("forward_path_reason")
    assert info == [{"worker": "w0", "model": engine.model_name, "revision": "main", "dtype": "float32",
                     "weight_quant": "none", "kv_cache_dtype": engine.parts.kv_cache_dtype,
                     "version": info[0]["version"], "model_type": "llama"}] and info[0]["version"] != "unknown"
    # fp32 on CPU: the native step by default where this CPU builds it, and it says it is exact
    why_not = cpu_native_step.unavailable_reason()
    if why_not is None:
        assert path in ("native avx2", "native fma") and reason.endswith(", fp32, token-exact"), (path, reason)
    else:
        assert path == "eager" and why_not in reason, (path, reason)
    assert value(s, "kvmesh_oom_total", worker="w0") == 0

    def out_of_memory():
        raise MemoryError("injected: the step's activations do not fit")

    engine.runner.fault_hook = out_of_memory
    try:
        engine.add_request(GenerateRequest("a/2", prompt_token_ids=(5, 6, 7), sampling=greedy, tenant_id="acme"))
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.runner.fault_hook = None
    assert value(scrape(metrics.snapshot()), "kvmesh_oom_total", worker="w0") == 1
    window = engine.scheduler.stats()
    metrics.set_kv_window(window.peak_kv_tokens, window.mean_kv_tokens)
    s = scrape(metrics.snapshot())
    assert value(s, "kvmesh_kv_tokens_peak", worker="w0") == window.peak_kv_tokens >= 44
    assert 0 < value(s, "kvmesh_kv_tokens_mean", worker="w0") <= window.peak_kv_tokens

    # `kvmesh stats` shows the new layers from the router's merged view.
    router = RouterMetrics(replica_id="r0")
    router.update_engine_snapshots({"w0": metrics.snapshot()})
    summary = cmd_stats.summarize(scrape(router.render()))
    assert summary.workers["w0"]["memory_allocated_bytes"] == plan.weight_bytes + plan.kv_cache_bytes
    assert summary.workers["w0"]["oom_total"] == 1
    assert set(summary.step_phase_mean_s) == {"schedule", "prepare", "forward", "sample", "output"}
    # Prefill steps: 16, 16, 8 + 6, and the failed step's 3; decode steps: 3 of 2 tokens.
    assert summary.mean_step_tokens == pytest.approx({"prefill": (46 + 3) / 4, "decode": 2.0})
    assert set(summary.tenant_compute_s) == {"acme", "beta"}
    text = cmd_stats.format_summary(summary)
    for needle in ("step phases", "token fill", "tenant acme", "alloc MiB", "routing truth", "timeouts"):
        assert needle in text, needle


def test_ttft_from_router_arrival_timeouts_and_route_truth():
    """TTFT / e2e start at the router's arrival (the earlier clock wins when hosts drift), the
    router's own queue time is its own histogram, timeouts are not errors, and the routing
    truth histogram observes predicted minus hit blocks."""
    metrics = RouterMetrics(replica_id="r0")
    timings = RequestTimings(arrival_time=1000.5, first_scheduled_time=1000.6, first_token_time=1001.0,
                             finished_time=1002.0)
    usage = Usage(prompt_tokens=40, completion_tokens=3, cached_tokens=32)
    metrics.observe_request_end("acme", timings, usage, FinishReason.STOP, router_arrival_s=1000.0)
    metrics.observe_request_end("acme", timings, usage, FinishReason.STOP, router_arrival_s=1000.9)  # skewed
    metrics.observe_dispatch(1000.0, 1000.4)
    metrics.observe_timeout("acme", "admission")
    metrics.observe_timeout("acme", "stream")
    metrics.observe_request_end("acme", None, None, "timeout", router_arrival_s=1000.0)
    with pytest.raises(ValueError):
        metrics.observe_timeout("acme", "elsewhere")
    metrics.observe_route_truth(predicted_blocks=2, hit_blocks=2)
    metrics.observe_route_truth(predicted_blocks=3, hit_blocks=0)  # the router's view was stale
    s = scrape(metrics.render())
    assert value(s, "kvmesh_time_to_first_token_seconds_sum") == pytest.approx(1.0 + 0.5)
    assert value(s, "kvmesh_e2e_request_latency_seconds_sum") == pytest.approx(2.0 + 1.5)
    assert value(s, "kvmesh_request_queue_time_seconds_sum") == pytest.approx(2 * 0.1)  # the worker's own
    assert value(s, "kvmesh_router_queue_time_seconds_sum") == pytest.approx(0.4)
    assert value(s, "kvmesh_request_timeouts_total", stage="admission") == 1
    assert value(s, "kvmesh_request_timeouts_total", stage="stream") == 1
    assert value(s, "kvmesh_requests_total", finish_reason="timeout", tenant="acme") == 2
    assert ("kvmesh_requests_total", (("finish_reason", "error"), ("tenant", "acme"))) not in s
    assert value(s, "kvmesh_route_predicted_prefix_blocks_total") == 5
    assert value(s, "kvmesh_route_hit_prefix_blocks_total") == 2
    assert value(s, "kvmesh_route_prefix_blocks_error_bucket", le="0.0") == 1
    assert value(s, "kvmesh_route_prefix_blocks_error_bucket", le="4.0") == 2


def test_request_step_log_is_bounded():
    """An entry a step created after its request's stream ended (an abort racing the step) is
    never popped: the log drops the oldest beyond its bound instead of growing."""
    from kvmesh.core import telemetry
    from kvmesh.core.step_phases import StepReport, StepRow

    log = telemetry.RequestStepLog()
    n = telemetry.MAX_LOGGED_REQUESTS + 5
    for i in range(n):
        log.observe_step_report(StepReport(0.0, {"forward": 0.001}, (StepRow(f"r{i}", "t", 1, False),), 16))
    assert len(log) == telemetry.MAX_LOGGED_REQUESTS
    assert log.pop("r0") is None and log.pop(f"r{n - 1}").num_decode_steps == 1
