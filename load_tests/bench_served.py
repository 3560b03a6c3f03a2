"""What the serving stack costs: `kvmesh serve` against the same engine in-process, as ratios
of one run, the two sides alternating.

    python -m kvmesh.load_tests.bench_served --rounds 3          # the seed-shaped run
    python -m kvmesh.load_tests.bench_served --quick --model DIR  # seconds, tiny model (tests)

Both sides run the seed-shaped workload (64 requests, the articles' length shape x0.25, all at
t=0, exact output lengths, greedy; load_tests/workloads.py synthetic kind, seed 0) on ONE
config: the one `kvmesh serve` deploys on this machine with its defaults (deploy/cmd_serve.py:
workers x engine threads from the cores, every other field its default). In-process: an
Engine built from that config in this process, stepped in a loop. Served: the same requests
through a fresh local deployment of that config over gRPC (the client library, one stream a
request). Each round builds both sides fresh (a new engine, a new Serve app on the same Ray),
warms each with the same two requests, and the order alternates round by round (A B, B A, ...),
so the machine's drift hits both sides alike and neither finds the other round's prefixes.

Per side and round: output tok/s, E2E P50 / P99, the engine's steps and tokens a step, and the
cores used (in-process: this process; served: per process role, load_tests/process_cpu.py).
Then the median of the per-round ratios served / in-process. Run it with nothing else on the
machine: the served side's engine shares the cores with the router, Ray and this client.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from kvmesh.core.config import KvmeshConfig, apply_overrides
from kvmesh.load_tests import process_cpu
from kvmesh.load_tests.workloads import WorkloadRequest
from kvmesh.router.launch import machine_defaults, set_local_ray_env

if TYPE_CHECKING:  # bench_engine loads torch: the run imports it only after main() applied --env
    from kvmesh.load_tests.bench_engine import EngineRunFigures

# OpenMP's wait settings: read once when torch loads its runtime; --env sets them for both sides
OPENMP_WAIT_ENV = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "KMP_BLOCKTIME")

WARMUP_REQUESTS = 2


@dataclass(frozen=True)
class SideFigures:
    side: str  # "in-process" | "served"
    round: int
    run: EngineRunFigures  # output tok/s, E2E P50 / P99, wall
    cpu: str  # the CPU account's summary line


def serve_config(model: str | None, overrides: tuple[str, ...] = ()) -> KvmeshConfig:
    """The config `kvmesh serve [--model M] [--set ...]` deploys on this machine, on loopback."""
    data = KvmeshConfig().to_dict()
    for section, fields in machine_defaults(os.cpu_count() or 1).items():
        data[section].update(fields)
    data["router"]["host"] = "127.0.0.1"
    if model:
        data["model"]["path"] = model
    return apply_overrides(KvmeshConfig.from_dict(data), overrides)


def run_in_process(config: KvmeshConfig, requests: list[WorkloadRequest], round_: int) -> SideFigures:
    """A fresh engine from `config` in this process; warm-up, then every request at t=0."""
    from kvmesh.load_tests.bench_engine import run_engine_workload  # torch: loaded after main() applied --env
    from kvmesh.worker.engine_api import Engine  # torch: loaded after main() applied --env

    engine = Engine.from_config(config)
    try:
        run_engine_workload(engine, requests[:WARMUP_REQUESTS])
        before, steps_before = process_cpu.snapshot(), engine.scheduler.stats().num_steps
        figures = run_engine_workload(engine, requests)
        steps = engine.scheduler.stats().num_steps - steps_before
        cpu = process_cpu.account(before, process_cpu.snapshot()).summary().replace("client", "this process")
        return SideFigures("in-process", round_, figures, f"{steps} steps; {cpu}")
    finally:
        engine.close()
        del engine
        gc.collect()


def run_served(config: KvmeshConfig, requests: list[WorkloadRequest], round_: int) -> SideFigures:
    """A fresh Serve app of `config` on this process's Ray; warm-up, then every request at t=0
    over gRPC; E2E = when a request's final delta arrives."""
    from kvmesh.load_tests.bench_engine import run_figures  # torch: loaded after main() applied --env
    from kvmesh.load_tests.grpc_target import ClusterTarget  # Ray Serve: only for the served side
    from kvmesh.load_tests.targets import TargetRequest  # with ClusterTarget

    async def go() -> SideFigures:
        target = ClusterTarget(config.to_dict(), app_name=f"kvmesh-bench-{round_}")
        await target.start()
        try:
            messages = 0

            async def one(r: WorkloadRequest, tag: str, t0: float, finish: list[float]) -> None:
                nonlocal messages
                async for chunk in target.stream(TargetRequest(f"{tag}{r.index}", r.prompt_token_ids, "",
                                                               r.output_tokens)):
                    messages += 1
                    if chunk.finished:
                        finish.append(time.perf_counter() - t0)

            await asyncio.gather(*(one(r, "warm", 0.0, []) for r in requests[:WARMUP_REQUESTS]))
            finish: list[float] = []
            messages = 0
            steps_before = await asyncio.to_thread(engine_steps, target.app_name)
            before, t0 = process_cpu.snapshot(), time.perf_counter()
            await asyncio.gather(*(one(r, "w", t0, finish) for r in requests))
            wall_s = time.perf_counter() - t0
            cpu = process_cpu.account(before, process_cpu.snapshot()).summary()
            steps, step_s = (a - b for a, b in zip(await asyncio.to_thread(engine_steps, target.app_name), steps_before))
            tokens = sum(r.output_tokens for r in requests)
            return SideFigures("served", round_, run_figures(finish, tokens, wall_s),
                               f"{steps:.0f} steps, {step_s:.1f} s of the window inside them; "
                               f"{tokens / max(1, messages):.2f} tokens a message; {cpu}")
        finally:
            await target.close()

    return asyncio.run(go())


def engine_steps(app_name: str) -> tuple[float, float]:
    """(steps, seconds inside steps) the app's workers have run so far, from their own metrics:
    the served engine's steps against the in-process one's, and how much of the window its
    step thread spent outside them (handing deltas over, waiting for the GIL or a command)."""
    from kvmesh.load_tests.worker_metrics import read_worker_metrics  # Ray: only for the served side
    from kvmesh.worker.public_api import find_workers  # Ray: as above

    metrics = [read_worker_metrics(h) for h in find_workers((app_name,)).values()]
    return (sum(m.total("kvmesh_step_time_seconds_count") for m in metrics),
            sum(m.total("kvmesh_step_time_seconds_sum") for m in metrics))


def seed_shaped_requests(config: KvmeshConfig, quick: bool) -> list[WorkloadRequest]:
    from kvmesh.load_tests import bench_engine  # torch: loaded after main() applied --env
    from kvmesh.worker.engine_api import load_tokenizer  # torch: loaded after main() applied --env

    return bench_engine.seed_shaped_requests(load_tokenizer(config.model), 6 if quick else 64, 0.05 if quick else 0.25)


def run(config: KvmeshConfig, requests: list[WorkloadRequest], rounds: int,
        only: str | None = None) -> list[SideFigures]:
    import ray  # loaded after main() applied --env

    if not ray.is_initialized():  # a Ray of its own, as `kvmesh serve` starts one
        set_local_ray_env()
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    out: list[SideFigures] = []
    for round_ in range(rounds):
        sides = (run_in_process, run_served) if round_ % 2 == 0 else (run_served, run_in_process)
        for side in sides:
            if only and side is not {"in-process": run_in_process, "served": run_served}[only]:
                continue
            out.append(side(config, requests, round_))
            print(f"[round {round_}] {json.dumps(asdict(out[-1]))}", file=sys.stderr, flush=True)
    return out


def format_report(config: KvmeshConfig, figures: list[SideFigures]) -> str:
    p = config.parallel
    waits = ", ".join(f"{name}={os.environ[name]}" for name in OPENMP_WAIT_ENV if name in os.environ) or "OpenMP defaults"
    lines = [f"config: kvmesh serve defaults, {p.num_workers} worker(s) x {p.engine_threads()} engine threads, "
             f"model {config.model.path or 'embedded'}; {waits}",
             "| round | side | output tok/s | E2E P50 s | E2E P99 s | CPU |", "|---|---|---|---|---|---|"]
    for f in figures:
        lines.append(f"| {f.round} | {f.side} | {f.run.output_tok_s:.1f} | {f.run.e2e_p50_s:.1f} | "
                     f"{f.run.e2e_p99_s:.1f} | {f.cpu} |")
    by_round: dict[int, dict[str, SideFigures]] = {}
    for f in figures:
        by_round.setdefault(f.round, {})[f.side] = f
    paired = [r for r in by_round.values() if len(r) == 2]
    if not paired:  # --only: one side, no ratio
        return "\n".join(lines)
    lines.append("")
    lines.append(paired_ratio_line("served / in-process", [(r["served"].run, r["in-process"].run) for r in paired]))
    return "\n".join(lines)


def paired_ratio_line(label: str, pairs: list[tuple[EngineRunFigures, EngineRunFigures]]) -> str:
    """A / B of each round's pair (A, B): throughput and E2E P99, their medians and the rounds."""
    tput = [a.output_tok_s / b.output_tok_s for a, b in pairs]
    p99 = [a.e2e_p99_s / b.e2e_p99_s for a, b in pairs]
    return (f"{label}: throughput {statistics.median(tput):.2f}x (rounds: {', '.join(f'{x:.2f}' for x in tput)}), "
            f"E2E P99 {statistics.median(p99):.2f}x (rounds: {', '.join(f'{x:.2f}' for x in p99)})")


def main(argv: list[str] | None = None) -> list[SideFigures]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF folder or GGUF (default: the embedded SmolLM2)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of (in-process, served), order alternating")
    p.add_argument("--quick", action="store_true", help="6 tiny requests: a smoke run")
    p.add_argument("--only", choices=("in-process", "served"), help="run one side only (no ratio): for profiling")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="a config override for both sides, as `kvmesh serve --set` (repeatable)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for both sides, set before torch and Ray start (e.g. "
                        "GOMP_SPINCOUNT=0: the engine threads sleep at once at a barrier; repeatable)")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = p.parse_args(argv)
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            p.error(f"--env {item!r}: expected NAME=VALUE")
        os.environ[name] = value
    config = serve_config(args.model, tuple(args.overrides))
    figures = run(config, seed_shaped_requests(config, args.quick), args.rounds, args.only)
    print(format_report(config, figures))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(x) for x in figures], f, indent=1)
    return figures


if __name__ == "__main__":
    main()
