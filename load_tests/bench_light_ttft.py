"""TTFT at light load: one request in flight at a time, through `kvmesh serve`'s config on this
machine, for configurations of the serving stack side by side and the engine in-process.

    python -m kvmesh.load_tests.bench_light_ttft --rounds 2 \\
        --side off=router.sched_idle=false \\
        --side throughout=router.sched_idle=true,router.sched_idle_min_streams=0 \\
        --side from-4=router.sched_idle=true,router.sched_idle_min_streams=4

Each round runs the in-process engine, then every side in order (a fresh Serve app each, one
local Ray), each with the same 23 sequential requests: the seed-shaped workload's first
prompts cut to 200 tokens, 32 output tokens, greedy. Its first three requests warm up; the
TTFT P50 (ms) of the other 20 is the figure, and the E2E P50 beside it. One request at a time
measures what the stack adds to a token's path, not what it shares out under load
(load_tests/bench_served.py). Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import GenerateRequest, SamplingParams
from kvmesh.load_tests.bench_served import seed_shaped_requests, serve_config
from kvmesh.load_tests.targets import TargetRequest
from kvmesh.router.launch import set_local_ray_env

PROMPT_TOKENS = 200
OUTPUT_TOKENS = 32
WARMUP = 3
MEASURED = 20


def _medians_ms(ttft_s: list[float], e2e_s: list[float]) -> tuple[float, float]:
    return statistics.median(ttft_s[WARMUP:]) * 1e3, statistics.median(e2e_s[WARMUP:]) * 1e3


def in_process(config: KvmeshConfig, prompts: list[list[int]]) -> tuple[float, float]:
    from kvmesh.worker.engine_api import Engine  # torch loads with it: only for this side

    engine = Engine.from_config(config)
    sampling = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    try:
        ttft, e2e = [], []
        for i, ids in enumerate(prompts):
            started, first = time.perf_counter(), None
            engine.add_request(GenerateRequest(f"light-{i}", prompt_token_ids=tuple(ids), sampling=sampling))
            while engine.has_unfinished():
                for delta in engine.step():
                    if first is None and delta.token_ids:
                        first = time.perf_counter() - started
            ttft.append(first)
            e2e.append(time.perf_counter() - started)
        return _medians_ms(ttft, e2e)
    finally:
        engine.close()
        del engine
        gc.collect()


async def served(config: KvmeshConfig, prompts: list[list[int]], app_name: str) -> tuple[float, float]:
    from kvmesh.load_tests.grpc_target import ClusterTarget  # Ray and Serve: only for this side

    target = ClusterTarget(config.to_dict(), app_name=app_name)
    await target.start()
    try:
        ttft, e2e = [], []
        for i, ids in enumerate(prompts):
            started, first = time.perf_counter(), None
            async for chunk in target.stream(TargetRequest(f"{app_name}-{i}", ids, "", OUTPUT_TOKENS)):
                if first is None and chunk.num_tokens:
                    first = time.perf_counter() - started
            ttft.append(first)
            e2e.append(time.perf_counter() - started)
        return _medians_ms(ttft, e2e)
    finally:
        await target.close()


def parse_side(text: str) -> tuple[str, tuple[str, ...]]:
    """NAME=SECTION.FIELD=VALUE[,SECTION.FIELD=VALUE...] (NAME= alone: the defaults)."""
    name, sep, overrides = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=SECTION.FIELD=VALUE[,...]")
    return name, tuple(o for o in overrides.split(",") if o)


def main(argv: list[str] | None = None) -> dict[str, list[tuple[float, float]]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--side", dest="sides", action="append", type=parse_side, default=[],
                   metavar="NAME=OVERRIDES", help="a served configuration (repeatable; none: the defaults)")
    args = p.parse_args(argv)
    sides = args.sides or [("defaults", ())]
    base = serve_config(None)
    prompts = [list(r.prompt_token_ids[:PROMPT_TOKENS]) for r in seed_shaped_requests(base, False)[:WARMUP + MEASURED]]
    import ray  # after the workload: Ray's start is the slow part

    set_local_ray_env()
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    figures: dict[str, list[tuple[float, float]]] = {}
    for round_ in range(args.rounds):
        runs = [("in-process", None)] + [(name, overrides) for name, overrides in sides]
        for name, overrides in runs:
            if overrides is None:
                ttft, e2e = in_process(base, prompts)
            else:
                ttft, e2e = asyncio.run(served(serve_config(None, overrides), prompts, f"light-{round_}-{name}"))
            figures.setdefault(name, []).append((ttft, e2e))
            print(f"round {round_} {name}: TTFT P50 {ttft:.1f} ms, E2E P50 {e2e:.1f} ms", flush=True)
    print("| side | TTFT P50 ms, per round | E2E P50 ms, per round |\n|---|---|---|")
    for name, rows in figures.items():
        print(f"| {name} | {' / '.join(f'{t:.1f}' for t, _ in rows)} | {' / '.join(f'{e:.1f}' for _, e in rows)} |")
    return figures


if __name__ == "__main__":
    main()
