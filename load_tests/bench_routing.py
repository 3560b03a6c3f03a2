"""Router decision time at scale: what one router replica does per request to route it (the
prefix index lookup, the footprint count for a prompt nothing matched, the policy, its state
update, the in-flight claim), on 64 workers and 1,000 tenants at 1,000 requests per second.

    python -m kvmesh.load_tests.bench_routing --workers 64 --tenants 1000 --qps 1000 --requests 6000

The cluster around the router is a fluid model, so only the router's own code is timed:
each worker drains the tokens it was sent at `--worker-tokens-per-s` and reports them as
`tokens_to_compute` every `--stats-refresh-s`; a request's blocks reach the prefix index as
STORED events one refresh after dispatch, each worker's cache is an LRU of `--num-blocks`
blocks whose evictions are reported the same way, and a request ends `--request-s` after
dispatch (its in-flight claim then lingers, as router_core's does). Time is simulated (the
arrivals are `--qps` apart on an injected clock); the timed part is the thread's CPU time
(`time.thread_time`: on a shared machine wall time also counts waiting for a core; the
wall-time mean is printed beside it). Prompt
hashing (kv/hashing.py, the same for every prefix policy) is timed apart. Policies run
alternately, in rounds, on the same requests; the last line prints the predicted-latency
policy's mean and P99 decision time against the 1 ms budget and against prefix_aware.
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import time
from dataclasses import dataclass

from kvmesh.core.config import RouterConfig
from kvmesh.core.seams import PrefixEvent, PrefixEventBatch, PrefixEventKind, SamplingParams, WorkerStats
from kvmesh.kv.hashing import hash_full_blocks
from kvmesh.load_tests.routing_sim import SimClock
from kvmesh.router.admission import cost_with_cached_prefix
from kvmesh.router.prefix_index import PrefixIndex
from kvmesh.router.routing import (PredictedLatencyState, RequestSizeMeter, RoundRobinCursor, RouteRequest,
                                   choose_worker, family_key)

EXTRA_KEYS = ("model=bench",)


@dataclass(frozen=True)
class BenchShape:
    num_workers: int = 64
    num_tenants: int = 1000
    zipf_s: float = 1.2
    prefix_tokens: int = 3000
    question_tokens: tuple[int, int] = (400, 600)
    max_tokens: int = 8
    block_size: int = 16
    num_blocks: int = 2048
    qps: float = 1000.0
    stats_refresh_s: float = 0.25
    request_s: float = 1.5
    worker_tokens_per_s: float = 40_000.0
    seed: int = 0


def make_prompts(shape: BenchShape, num_requests: int) -> list[list[int]]:
    rng = random.Random(shape.seed)
    prefixes: dict[int, list[int]] = {}
    weights = [1.0 / (rank ** shape.zipf_s) for rank in range(1, shape.num_tenants + 1)]
    prompts = []
    for tenant in rng.choices(range(shape.num_tenants), weights=weights, k=num_requests):
        if tenant not in prefixes:
            prefixes[tenant] = [rng.randrange(1000, 40000) for _ in range(shape.prefix_tokens)]
        question = [rng.randrange(1000, 40000) for _ in range(rng.randint(*shape.question_tokens))]
        prompts.append(prefixes[tenant] + question)
    return prompts


def run(policy: str, shape: BenchShape, prompts: list[list[int]], hashes: list[list[bytes]]
        ) -> tuple[list[float], list[float]]:
    """Seconds of router work per request: CPU time of the timed calls, and their wall time."""
    clock = SimClock()
    config = RouterConfig(policy=policy, stats_refresh_s=shape.stats_refresh_s)
    index = PrefixIndex(linger_s=4 * shape.stats_refresh_s, clock=clock)
    state = PredictedLatencyState(config, 2048, clock)
    rng, cursor, sizes = random.Random(shape.seed + 1), RoundRobinCursor(), RequestSizeMeter()
    ids = [f"worker-{i}" for i in range(shape.num_workers)]
    backlog = dict.fromkeys(ids, 0.0)  # tokens each worker still has to compute (the fluid model)
    caches = {w: collections.OrderedDict() for w in ids}  # block hash -> None, LRU order
    seqs = dict.fromkeys(ids, 0)
    pending_events: list[tuple[float, str, PrefixEventKind, tuple[bytes, ...]]] = []
    endings: collections.deque[tuple[float, int]] = collections.deque()
    stats: dict[str, WorkerStats] = {}
    next_refresh = 0.0
    sampling = SamplingParams(max_tokens=shape.max_tokens, ignore_eos=True)
    timings, walls = [], []

    def refresh() -> None:
        for w in ids:
            stats[w] = WorkerStats(worker_id=w, healthy=True, block_size=shape.block_size,
                                   num_blocks_total=shape.num_blocks, num_blocks_used=0,
                                   num_blocks_cached=len(caches[w]), num_blocks_free=0, kv_tokens_used=0,
                                   kv_tokens_capacity=shape.num_blocks * shape.block_size, kv_tokens_reserved=0,
                                   num_running=min(8, round(backlog[w] / 500)), num_waiting=0,
                                   queued_prompt_tokens=0, prefix_cache_hit_rate=0.0, output_tokens_per_s=0.0,
                                   tokens_to_compute=round(backlog[w]))
        due = [e for e in pending_events if e[0] <= clock.now]
        pending_events[:] = [e for e in pending_events if e[0] > clock.now]
        for _, w, kind, block_hashes in due:
            index.apply(PrefixEventBatch(w, seqs[w] + 1, (PrefixEvent(seqs[w], kind, block_hashes),)))
            seqs[w] += 1

    def store(worker_id: str, block_hashes: list[bytes]) -> None:
        cache, evicted = caches[worker_id], []
        for h in block_hashes:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > shape.num_blocks:
            evicted.append(cache.popitem(last=False)[0])
        at = clock.now + shape.stats_refresh_s
        pending_events.append((at, worker_id, PrefixEventKind.STORED, tuple(block_hashes)))
        if evicted:
            pending_events.append((at, worker_id, PrefixEventKind.EVICTED, tuple(evicted)))

    for i, (prompt, prompt_hashes) in enumerate(zip(prompts, hashes)):
        previous, clock.now = clock.now, i / shape.qps
        for w in ids:
            backlog[w] = max(0.0, backlog[w] - shape.worker_tokens_per_s * (clock.now - previous))
        while endings and endings[0][0] <= clock.now:
            index.end_in_flight(endings.popleft()[1])
        if clock.now >= next_refresh:
            refresh()
            next_refresh = clock.now + shape.stats_refresh_s
        started, started_wall = time.thread_time(), time.perf_counter()
        matched = index.longest_prefix(prompt_hashes)
        known = index.num_blocks_known() if not matched else None
        request = RouteRequest(len(prompt), shape.block_size, family_key(prompt_hashes, config.spread_family_blocks))
        decision = choose_worker(matched, list(stats.values()), config, rng, cursor, None, sizes.mean_tokens(),
                                 known, request=request, state=state)
        cost = cost_with_cached_prefix(len(prompt), sampling, shape.block_size, matched.get(decision.worker_id, 0))
        state.commit(decision, cost, len(prompt) // shape.block_size)
        sizes.observe(cost)
        token = index.add_in_flight(decision.worker_id, prompt_hashes)
        timings.append(time.thread_time() - started)
        walls.append(time.perf_counter() - started_wall)
        backlog[decision.worker_id] += cost
        endings.append((clock.now + shape.request_s, token))
        store(decision.worker_id, prompt_hashes)
    return timings, walls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=BenchShape.num_workers)
    parser.add_argument("--tenants", type=int, default=BenchShape.num_tenants)
    parser.add_argument("--qps", type=float, default=BenchShape.qps)
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the policies")
    parser.add_argument("--worker-tokens-per-s", type=float, default=BenchShape.worker_tokens_per_s)
    parser.add_argument("--policies", nargs="+", default=["prefix_aware", "predicted_latency"])
    args = parser.parse_args(argv)
    shape = BenchShape(num_workers=args.workers, num_tenants=args.tenants, qps=args.qps,
                       worker_tokens_per_s=args.worker_tokens_per_s)
    prompts = make_prompts(shape, args.requests)
    started = time.thread_time()
    hashes = [hash_full_blocks(p, shape.block_size, EXTRA_KEYS) for p in prompts]
    hashing_ms = 1000 * (time.thread_time() - started) / len(prompts)
    print(f"{shape.num_workers} workers, {shape.num_tenants} tenants, {args.requests} requests at {shape.qps:g} qps "
          f"(simulated), prompts {shape.prefix_tokens}+{shape.question_tokens} tokens; "
          f"prompt hashing {hashing_ms:.3f} ms/request (every prefix policy)")
    timings: dict[str, list[float]] = collections.defaultdict(list)
    walls: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(args.rounds):
        for policy in args.policies:
            cpu, wall = run(policy, shape, prompts, hashes)
            timings[policy].extend(cpu)
            walls[policy].extend(wall)
    summary = {}
    for policy, values in timings.items():
        values.sort()
        summary[policy] = (statistics.mean(values), values[len(values) // 2], values[int(0.99 * len(values))])
        mean, p50, p99 = (1000 * v for v in summary[policy])
        print(f"{policy:>18}: decision CPU mean {mean:.3f} ms, P50 {p50:.3f} ms, P99 {p99:.3f} ms "
              f"(wall mean {1000 * statistics.mean(walls[policy]):.3f} ms)")
    if "predicted_latency" in summary:
        mean, _, p99 = summary["predicted_latency"]
        line = f"predicted_latency decision: mean {1000 * mean:.3f} ms ({mean / 0.001:.2f}x the 1 ms budget), " \
               f"P99 {1000 * p99:.3f} ms ({p99 / 0.001:.2f}x); with prompt hashing mean " \
               f"{1000 * mean + hashing_ms:.3f} ms ({(1000 * mean + hashing_ms):.2f}x)"
        if "prefix_aware" in summary:
            line += f"; vs prefix_aware mean {mean / summary['prefix_aware'][0]:.2f}x"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
