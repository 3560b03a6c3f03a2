"""The routing campaign: prefix_aware against round_robin on a real 2-worker cluster, at
several numbers of requests in flight, with a skewed family mix under cache pressure.

    python -m kvmesh.load_tests.routing_campaign load_tests/campaigns/routing-under-load.yaml --out DIR

One private local Ray cluster (`cluster_cpus` CPUs; worker CPUs left to their derived
default), Serve's gRPC proxy on loopback. Each (concurrency, policy) run redeploys the router
with its policy (the workers and their caches stay up) and uses its own fresh families, so
no run profits from blocks an earlier one left cached. Prompts are token ids, so block
boundaries are exact. Per request: the serving worker (the router's `x-kvmesh-worker`
trailing metadata), cached tokens (final usage), TTFT (client clock, send to first token).

Figures per run: prefix hit rate (cached / prompt tokens), TTFT P50/P90, tokens computed per
worker (prompt - cached + completion) and their max/min, families per worker, families on
more than one worker, requests per family and worker, router refusals seen by the client
after its retries, and what the router saw (its /metrics over the run: spills by reason,
routing decisions by path), which tells a family split by the load guard from one split by
a full KV budget.
Results: DIR/routing_campaign.json and a markdown table on stdout.
"""

from __future__ import annotations

# Function-level imports: Ray, Serve, gRPC and the router app load only for a live campaign,
# so the simulator (load_tests/routing_sim.py) can reuse this module's workload without them.

import argparse
import collections
import concurrent.futures
import contextlib
import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

WORKER_KEY = "x-kvmesh-worker"
REPLICA_KEY = "x-kvmesh-router-replica"
APP_NAME = "kvmesh-routing-campaign"


@dataclass(frozen=True)
class Served:
    family: int
    worker_id: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    router_replica: str = ""  # the router replica that served it (x-kvmesh-router-replica)


@dataclass(frozen=True)
class RoutingRunFigures:
    policy: str
    concurrency: int
    num_served: int
    num_failed: int
    hit_rate: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    computed_tokens_per_worker: dict[str, int]
    computed_max_over_min: float
    families_per_worker: dict[str, int]
    families_on_both: int
    wall_s: float
    oracle_hit_rate: float = 0.0  # the best any router could reach on this run's requests
    requests_per_family_worker: dict[str, int] = field(default_factory=dict)  # "f0@worker-1" -> requests
    router_counters: dict[str, float] = field(default_factory=dict)  # "spills:preferred_full", "paths:no_prefix", ...
    requests_per_router_replica: dict[str, int] = field(default_factory=dict)
    seed: int = 0  # the run's workload seed (run_cells)


def family_workload(spec: dict, seed: int) -> list[tuple[int, list[int]]]:
    """(family, prompt ids): fresh family prefixes per seed, families drawn by weight."""
    rng = random.Random(seed)
    weights = spec["family_weights"]
    prefixes = [[rng.randrange(1000, 40000) for _ in range(spec["prefix_tokens"])] for _ in weights]
    low, high = spec["question_tokens"]
    picks = rng.choices(range(len(weights)), weights=weights, k=spec["num_requests"])
    return [(f, prefixes[f] + [rng.randrange(1000, 40000) for _ in range(rng.randint(low, high))]) for f in picks]


def oracle_hit_rate(prompts, block_size: int) -> float:
    """The best prefix hit rate any router could reach on these prompts, sent in this order:
    one cache that never evicts, shared by all workers, so a request hits every full block of
    its longest common prefix with any earlier request (the last prompt token always computed,
    as the workers cap a match). No policy, cache size or number of workers does better; a
    family's first request always misses. `prompts`: token id sequences."""
    from kvmesh.kv.hashing import hash_full_blocks

    seen: set = set()
    cached = total = 0
    for prompt in prompts:
        hashes = hash_full_blocks(list(prompt), block_size, ())  # chain hashes: block i covers 0..i
        cacheable = (len(prompt) - 1) // block_size
        blocks = 0
        while blocks < cacheable and hashes[blocks] in seen:
            blocks += 1
        cached += blocks * block_size
        total += len(prompt)
        seen.update(hashes)
    return cached / max(1, total)


def computed_tokens_per_worker(served) -> dict[str, int]:
    """Tokens each worker had to compute: prompt tokens its prefix cache did not serve, plus the
    output. This is the load the router balances (a cache hit costs the worker nothing). Takes
    any records with worker_id, prompt_tokens, cached_tokens and completion_tokens."""
    computed = collections.Counter()
    for s in served:
        computed[s.worker_id] += s.prompt_tokens - s.cached_tokens + s.completion_tokens
    return dict(computed)


def figures(policy: str, concurrency: int, served: list[Served], num_failed: int, wall_s: float,
            oracle: float = 0.0, router_counters: dict[str, float] | None = None, seed: int = 0) -> RoutingRunFigures:
    computed = computed_tokens_per_worker(served)
    families = collections.defaultdict(set)
    for s in served:
        families[s.family].add(s.worker_id)
    per_worker = collections.Counter(w for ws in families.values() for w in ws)
    ttfts = sorted(s.ttft_s for s in served)
    values = list(computed.values())
    return RoutingRunFigures(
        policy=policy, concurrency=concurrency, num_served=len(served), num_failed=num_failed,
        hit_rate=sum(s.cached_tokens for s in served) / max(1, sum(s.prompt_tokens for s in served)),
        ttft_p50_ms=1000 * statistics.median(ttfts) if ttfts else float("nan"),
        ttft_p90_ms=1000 * ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))] if ttfts else float("nan"),
        computed_tokens_per_worker=computed,
        computed_max_over_min=max(values) / min(values) if len(values) > 1 and min(values) > 0 else float("inf"),
        families_per_worker=dict(per_worker), families_on_both=sum(len(ws) > 1 for ws in families.values()),
        wall_s=wall_s, oracle_hit_rate=oracle,
        requests_per_family_worker=dict(sorted(collections.Counter(f"f{s.family}@{s.worker_id}" for s in served).items())),
        router_counters=router_counters or {},
        requests_per_router_replica=dict(collections.Counter(s.router_replica for s in served if s.router_replica)),
        seed=seed)


# The router's counters a run reports: metric name -> (key prefix, its one label).
ROUTER_COUNTERS = {"kvmesh_routing_spills_total": ("spills", "reason"),
                   "kvmesh_routing_decisions_total": ("paths", "path"),
                   "kvmesh_routing_affinity_waits_total": ("affinity_waits", "outcome"),
                   "kvmesh_family_claims_total": ("family_claims", "outcome")}


def router_counters(http_base: str, settle_timeout_s: float = 90.0, num_replicas: int = 1) -> dict[str, float]:
    """What the router saw over a run: its spill and routing-path counters from /metrics, as
    {"spills:preferred_full": n, "paths:no_prefix": n, "affinity_waits:room": n, ...}. Each run deploys fresh router
    replicas (counters from 0), but /metrics also sums the previous replicas' last snapshots
    until they go stale (60 s, router/metrics.py MetricsBoard), so this waits until the view
    holds `num_replicas` replicas (each replica's `kvmesh_quota_store_fallback_active` carries
    its id); "replicas_in_view" says how many it held when it gave up waiting."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + settle_timeout_s
    while True:
        counters: dict[str, float] = {}
        replicas = set()
        for family in text_string_to_metric_families(httpx.get(f"{http_base}/metrics", timeout=10).text):
            for sample in family.samples:
                if sample.name == "kvmesh_quota_store_fallback_active":
                    replicas.add(sample.labels.get("replica"))
                counted = ROUTER_COUNTERS.get(sample.name)
                if counted is not None and sample.value:
                    key = f"{counted[0]}:{sample.labels[counted[1]]}"
                    counters[key] = counters.get(key, 0.0) + sample.value
        if len(replicas) <= num_replicas or time.monotonic() > deadline:
            counters["replicas_in_view"] = len(replicas)
            return counters
        time.sleep(2.0)


class _CallRecorder:
    """A client interceptor keeping each Generate call, to read its trailing metadata (the
    worker that served it) once the stream has ended."""

    def __init__(self) -> None:
        import grpc

        class Interceptor(grpc.UnaryStreamClientInterceptor):
            def intercept_unary_stream(inner, continuation, details, request):
                call = continuation(details, request)
                self.calls[request.request_id] = call
                return call

        self.calls: dict[str, object] = {}
        self.interceptor = Interceptor()

    def worker_of(self, request_id: str) -> str:
        return dict(self.calls[request_id].trailing_metadata() or ())[WORKER_KEY]

    def replica_of(self, request_id: str) -> str:
        return dict(self.calls[request_id].trailing_metadata() or ()).get(REPLICA_KEY, "")


def _send(client, recorder: _CallRecorder, spec: dict, request_id: str, family: int, prompt: list[int]) -> Served:
    from kvmesh.core.seams import SamplingParams

    sampling = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    ttft_s, last = None, None
    for delta in client.generate(prompt_token_ids=prompt, sampling=sampling, request_id=request_id, timeout_s=300):
        if ttft_s is None and delta.token_ids:
            ttft_s = time.perf_counter() - started  # retries (after RESOURCE_EXHAUSTED) included
        last = delta
    usage = last.usage
    return Served(family, recorder.worker_of(request_id), usage.prompt_tokens, usage.cached_tokens,
                  usage.completion_tokens, ttft_s if ttft_s is not None else float("nan"),
                  recorder.replica_of(request_id))


def run_cells(spec: dict) -> list[tuple[int, str, int]]:
    """(concurrency, policy, seed) of every run in order. Seeds count up from 1 over the runs
    (the first run draws seed `first_seed`, 1 by default: one run of an earlier campaign is
    drawn again with `--first-seed`); `seeds: N` repeats each (concurrency,
    policy) cell N times, each with its own seed: runs of one code differ by a family or two,
    so one run a cell cannot call a line met."""
    cells, seed = [], spec.get("first_seed", 1) - 1
    for concurrency in spec["concurrency"]:
        for _ in range(spec.get("seeds", 1)):
            for policy in spec["policies"]:
                seed += 1
                cells.append((concurrency, policy, seed))
    return cells


def run_campaign(spec: dict, out_dir: Path) -> list[RoutingRunFigures]:
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import grpc
    import ray

    from kvmesh.core.config import KvmeshConfig
    from kvmesh.router.client import KvmeshClient, open_channel
    from kvmesh.router.launch import redeploy_router, start_serving, stop_serving
    from kvmesh.router.retry import RetryPolicy
    from kvmesh.load_tests.grpc_target import free_port

    config = KvmeshConfig.from_dict({
        "model": spec.get("model", {}),
        "cache": {"block_size": spec["block_size"], "num_blocks": spec["num_blocks_per_worker"]},
        "scheduler": {"max_num_seqs": spec["max_num_seqs"], "max_queue_time_s": 300},
        "parallel": {"num_workers": spec["num_workers"], "device": "cpu"},
        "router": {"host": "127.0.0.1", "grpc_port": free_port(), "http_port": free_port(),
                   "stats_refresh_s": spec["stats_refresh_s"], "max_queue_wait_s": 60.0,
                   **spec.get("router", {})},  # e.g. {affinity_wait_s: 0} for an A/B
    })
    target = f"127.0.0.1:{config.router.grpc_port}"
    redis_dir = redis = None
    if spec.get("redis"):  # the Redis the router replicas share (quotas, new-family claims)
        import tempfile

        from kvmesh.load_tests.redis_server import RedisServer

        redis_dir = tempfile.TemporaryDirectory(prefix="kvmesh-routing-redis-")
        redis = RedisServer.start(redis_dir.name)
        config = config.replace(tenants={"redis_url": redis.url})
    ray.init(address="local", num_cpus=spec["cluster_cpus"], include_dashboard=False, log_to_driver=False)
    results: list[RoutingRunFigures] = []
    try:
        start_serving(config, APP_NAME)
        # One run per (concurrency, policy, seed): the seed draws the run's fresh family
        # prefixes, its questions and the order of families (family_workload).
        for concurrency, policy, seed in run_cells(spec):
            redeploy_router(config.replace(router={"policy": policy}), APP_NAME)
            workload = family_workload(spec, seed)
            served, failed = [], 0
            recorder = _CallRecorder()
            # client_connections > 1: each its own connection (a subchannel pool of its own),
            # which the kernel spreads over the router replicas sharing the port.
            clients = [KvmeshClient("", channel=grpc.intercept_channel(open_channel(target, own_connection=True),
                                                                      recorder.interceptor),
                retry_policy=RetryPolicy(max_attempts=20)) for _ in range(spec.get("client_connections", 1))]
            started = time.perf_counter()
            with contextlib.ExitStack() as stack, concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
                for client in clients:
                    stack.enter_context(client)
                futures = [pool.submit(_send, clients[i % len(clients)], recorder, spec,
                                       f"c{concurrency}-{policy}-{i}", f, p)
                           for i, (f, p) in enumerate(workload)]
                for future in futures:
                    try:
                        served.append(future.result())
                    except Exception as exc:  # counted, and the run goes on
                        print(f"request failed: {exc}", flush=True)
                        failed += 1
            result = figures(policy, concurrency, served, failed, time.perf_counter() - started,
                             oracle_hit_rate([p for _, p in workload], spec["block_size"]),
                             router_counters(f"http://127.0.0.1:{config.router.http_port}",
                                             num_replicas=config.router.num_replicas), seed=seed)
            results.append(result)
            print(json.dumps(asdict(result)), flush=True)
    finally:
        stop_serving(config, APP_NAME)
        ray.shutdown()
        if redis is not None:
            redis.stop()
            redis_dir.cleanup()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "routing_campaign.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    return results


def markdown_table(results: list[RoutingRunFigures], num_families: int) -> str:
    by_key = {(r.concurrency, r.policy): r for r in results}
    lines = ["| in flight | hit rate PA / RR (oracle) | ratio (oracle / RR) | PA / oracle | TTFT P50 PA / RR (ms) "
             "| ratio | computed max/min PA (RR) | families on both workers PA (RR) | families per worker PA "
             "| PA spills full / refused | PA affinity waits room / timed out | PA requests per router replica |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for concurrency in sorted({r.concurrency for r in results}):
        pa, rr = by_key.get((concurrency, "prefix_aware")), by_key.get((concurrency, "round_robin"))
        if pa is None or rr is None or not pa.num_served or not rr.num_served:
            continue
        lines.append(
            f"| {concurrency} | {pa.hit_rate:.3f} / {rr.hit_rate:.3f} ({pa.oracle_hit_rate:.3f}) "
            f"| {pa.hit_rate / rr.hit_rate:.2f}x ({pa.oracle_hit_rate / rr.hit_rate:.2f}x) "
            f"| {pa.hit_rate / pa.oracle_hit_rate:.3f}x "
            f"| {pa.ttft_p50_ms:.0f} / {rr.ttft_p50_ms:.0f} | {pa.ttft_p50_ms / rr.ttft_p50_ms:.2f} "
            f"| {pa.computed_max_over_min:.2f} ({rr.computed_max_over_min:.2f}) "
            f"| {pa.families_on_both} ({rr.families_on_both}) of {num_families} "
            f"| {dict(sorted(pa.families_per_worker.items()))} "
            f"| {pa.router_counters.get('spills:preferred_full', 0):.0f} / "
            f"{pa.router_counters.get('spills:worker_refused', 0):.0f} "
            f"| {pa.router_counters.get('affinity_waits:room', 0):.0f} / "
            f"{pa.router_counters.get('affinity_waits:timed_out', 0):.0f} "
            f"| {sorted(pa.requests_per_router_replica.values())} |")
    return "\n".join(lines)


def runs_table(results: list[RoutingRunFigures], num_families: int) -> str:
    """One line per run, any policy: hit rate against the oracle, families split, failures."""
    lines = ["| in flight | policy | seed | hit rate (oracle) | hit / oracle | families on both workers | failed "
             "| computed max/min | spills full / refused | affinity waits room / timed out | requests per replica "
             "| family claims won / joined / unavailable |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        c = r.router_counters
        lines.append(
            f"| {r.concurrency} | {r.policy} | {r.seed} | {r.hit_rate:.3f} ({r.oracle_hit_rate:.3f}) "
            f"| {r.hit_rate / r.oracle_hit_rate if r.oracle_hit_rate else float('nan'):.3f}x "
            f"| {r.families_on_both} of {num_families} | {r.num_failed} | {r.computed_max_over_min:.2f} "
            f"| {c.get('spills:preferred_full', 0):.0f} / {c.get('spills:worker_refused', 0):.0f} "
            f"| {c.get('affinity_waits:room', 0):.0f} / {c.get('affinity_waits:timed_out', 0):.0f} "
            f"| {sorted(r.requests_per_router_replica.values())} "
            f"| {c.get('family_claims:won', 0):.0f} / {c.get('family_claims:joined', 0):.0f} / "
            f"{c.get('family_claims:unavailable', 0):.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", type=Path)
    parser.add_argument("--out", type=Path, default=Path("routing-campaign-results"))
    parser.add_argument("--num-requests", type=int, help="override the spec's num_requests")
    parser.add_argument("--concurrency", type=int, nargs="+", help="override the spec's concurrency list")
    parser.add_argument("--policies", nargs="+", help="override the spec's policies")
    parser.add_argument("--seeds", type=int, help="runs per (concurrency, policy) cell, each its own seed")
    parser.add_argument("--first-seed", type=int, help="the first run's seed (1 by default): rerun one cell's workload")
    args = parser.parse_args(argv)
    spec = yaml.safe_load(args.spec.read_text())
    if args.num_requests:
        spec["num_requests"] = args.num_requests
    if args.concurrency:
        spec["concurrency"] = args.concurrency
    if args.policies:
        spec["policies"] = args.policies
    if args.seeds:
        spec["seeds"] = args.seeds
    if args.first_seed:
        spec["first_seed"] = args.first_seed
    results = run_campaign(spec, args.out)
    print(runs_table(results, len(spec["family_weights"])))
    print(markdown_table(results, len(spec["family_weights"])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
