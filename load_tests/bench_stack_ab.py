"""bench_stack on two checkouts, alternating rounds in one run: the stack's before/after as ratios.

    python -m kvmesh.load_tests.bench_stack_ab --a /path/to/baseline-checkout --b . --rounds 3
    python -m kvmesh.load_tests.bench_stack_ab --a /path/to/baseline-checkout --b . --protocol http

Each checkout runs in its own Python (`<checkout>/.venv/bin/python`, where `import kvmesh`
resolves to that checkout) with one private Ray cluster kept up for the whole run, so a round
costs a Serve deploy, not a Ray start (on a loaded machine Ray's 30 s node-start limit fails
often). Both run the benchmark code of this file's checkout (its bench_stack.py, loaded by
path) against their own stack, so a baseline older than a benchmark mode still runs it.
Rounds alternate A, B, A, B, ...: on a shared machine the load drifts, and a ratio of medians
over interleaved rounds is what survives it. One round is bench_stack's run for one router
replica (run_one_cluster): gRPC streams, short requests and TTFT, or with `--protocol http`
OpenAI SSE streams over router.http_port (what serves that port is the checkout's: Serve's
HTTP proxy before the replicas served HTTP themselves).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvmesh.load_tests import grpc_floor

_FIGURES = (  # (name, pattern over a round's summary lines, group)
    ("tok/s 64 streams", r"\d  streams\s+64: +(\d+) tok/s", 1),
    ("us/token 64 streams", r"\d  streams\s+64: .*?\(\s*([\d.]+) us a token\)", 1),
    ("tokens/message 64", r"\d  streams\s+64: .*? ([\d.]+) tokens a message", 1),
    ("router us/message 64", r"\d  streams\s+64: .*?router replicas ([\d.]+) us a message", 1),
    ("tok/s 1024 streams", r"\d  streams\s+1024: +(\d+) tok/s", 1),
    ("us/token 1024 streams", r"\d  streams\s+1024: .*?\(\s*([\d.]+) us a token\)", 1),
    ("tokens/message 1024", r"\d  streams\s+1024: .*? ([\d.]+) tokens a message", 1),
    ("router us/message 1024", r"\d  streams\s+1024: .*?router replicas ([\d.]+) us a message", 1),
    ("short req/s per core", r"short requests: \d+ req/s, (\d+) req/s per stack core", 1),
    ("TTFT added ms", r"added ([-\d.]+) ms", 1),
    ("unary gRPC round trip ms", r"round trip to the replica: ([-\d.]+) ms", 1),
    ("TTFT client->engine ms", r"client to engine arrival ([-\d.]+) ms", 1),
    ("TTFT engine->client ms", r"engine arrival to first response ([-\d.]+) ms", 1),
    ("http tok/s 64 streams", r"http streams\s+64: +(\d+) tok/s", 1),
    ("http us/token 64", r"http streams\s+64: .*?\(\s*([\d.]+) us a token\)", 1),
    ("http tokens/message 64", r"http streams\s+64: .*? ([\d.]+) tokens a message", 1),
    ("http tok/s 256 streams", r"http streams\s+256: +(\d+) tok/s", 1),
    ("http us/token 256", r"http streams\s+256: .*?\(\s*([\d.]+) us a token\)", 1),
    ("http tokens/message 256", r"http streams\s+256: .*? ([\d.]+) tokens a message", 1),
    ("http TTFT P50 ms", r"http TTFT P50 at 1 in flight: ([-\d.]+) ms", 1),
)
HTTP_STREAMS = [64, 256]
# One round's gRPC streams (the figures above read 64 and 1,024), tokens each and the null step;
# the parent's bare grpc.aio floor is measured at the first stream count with the same tokens and step.
ROUND_STREAMS, ROUND_TOKENS, ROUND_STEP_MS = [64, 1024], 64, 20.0


def _bench_stack():
    """This checkout's bench_stack.py, whichever checkout's kvmesh the running Python imports."""
    spec = importlib.util.spec_from_file_location("kvmesh_bench_stack_ab_round", Path(__file__).with_name("bench_stack.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def serve_rounds(args) -> None:
    """The child: one Ray cluster, a round per 'run' line on stdin, its lines then 'END'."""
    # Here, not at the top: the parent only starts the children, each of which imports the
    # stack (and Ray) of its own checkout.
    import ray
    from kvmesh.router.launch import set_local_ray_env  # the running checkout's, as above

    bench_stack = _bench_stack()
    bench_args = argparse.Namespace(streams_list=ROUND_STREAMS, tokens=ROUND_TOKENS, step_ms=ROUND_STEP_MS,
                                    workers=1, short=args.short, ttft_requests=30, protocols=(args.protocol,),
                                    http_streams_list=HTTP_STREAMS, floors={})  # the parent measures the floor between rounds
    set_local_ray_env()
    for attempt in range(5):  # a loaded machine misses Ray's node-start limit now and then
        try:
            ray.init(address="local", include_dashboard=False, log_to_driver=False)
            break
        except Exception as exc:
            print(f"ray.init failed ({exc}); again", file=sys.stderr, flush=True)
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        try:
            lines = asyncio.run(bench_stack.run_one_cluster(bench_args, 1))
        except Exception as exc:
            lines = [f"round failed: {exc!r}"]
        print("\n".join(lines) + "\nEND", flush=True)
    ray.shutdown()


def figures(text: str) -> dict[str, float]:
    out = {}
    for name, pattern, group in _FIGURES:
        match = re.search(pattern, text)
        if match:
            out[name] = float(match.group(group))
    return out


def _read_round(child: subprocess.Popen) -> str:
    lines = []
    for line in child.stdout:  # ends at EOF too: a child that died gives an empty round
        if line == "END\n":
            break
        lines.append(line)
    return "".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", help="baseline checkout (with its .venv)")
    p.add_argument("--b", help="checkout to compare (with its .venv)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--short", type=int, default=1500, help="1-token requests per round")
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc",
                   help="what a round measures: gRPC streams, short requests and TTFT, or OpenAI SSE streams")
    p.add_argument("--serve-rounds", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_rounds:
        return serve_rounds(args)
    children = {name: subprocess.Popen([f"{tree}/.venv/bin/python", "-P", str(Path(__file__).resolve()),
                                        "--serve-rounds", "--short", str(args.short), "--protocol", args.protocol],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
                for name, tree in (("A", args.a), ("B", args.b))}
    for child in children.values():
        for line in child.stdout:
            if line.startswith("READY"):
                break
    results: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    floors: list[float] = []  # the bare grpc.aio server's CPU a message at 64 streams, one a round
    for index in range(args.rounds):
        for name, child in children.items():
            t0 = time.perf_counter()
            child.stdin.write("run\n")
            child.stdin.flush()
            text = _read_round(child)
            print(f"round {index} {name} ({time.perf_counter() - t0:.0f} s):\n{text}", flush=True)
            if figures(text):
                results[name].append(figures(text))
        if args.protocol == "grpc":
            floors.append(grpc_floor.measure(ROUND_STREAMS[0], ROUND_TOKENS, ROUND_STEP_MS / 1000).us_per_message)
            print(f"round {index} bare grpc.aio, 64 streams: {floors[-1]:.1f} us a message", flush=True)
    for child in children.values():
        child.stdin.write("stop\n")
        child.stdin.close()
        child.wait(120)
    print(f"\n{'figure':24s} {'A median':>10s} {'B median':>10s} {'B/A':>6s}   rounds A {len(results['A'])}, "
          f"B {len(results['B'])}")
    for name, _, _ in _FIGURES:
        a = [r[name] for r in results["A"] if name in r]
        b = [r[name] for r in results["B"] if name in r]
        if a and b:
            ma, mb = statistics.median(a), statistics.median(b)
            print(f"{name:24s} {ma:10.1f} {mb:10.1f} {mb / ma if ma else float('nan'):6.2f}")
    if floors:
        floor = statistics.median(floors)
        print(f"bare grpc.aio us/message 64 streams: {floor:.1f} (rounds {', '.join(f'{f:.1f}' for f in floors)}); "
              "router us/message 64 over it: " + ", ".join(
                  f"{name} {statistics.median(r['router us/message 64'] for r in results[name]) / floor:.2f}x"
                  for name in ("A", "B") if any("router us/message 64" in r for r in results[name])))


if __name__ == "__main__":
    main()
