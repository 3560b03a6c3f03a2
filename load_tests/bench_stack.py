"""The serving stack alone: a null engine (load_tests/null_engine.py) behind the real router,
gRPC ingress and worker channels, so what is measured is what carries tokens, not what makes them.

    python -m kvmesh.load_tests.bench_stack                      # 1 and 2 router replicas
    python -m kvmesh.load_tests.bench_stack --replicas 1 --streams 1,64,1024 --tokens 64
    python -m kvmesh.load_tests.bench_stack --replicas 1 --protocols http --http-streams 64,256

For each number of router replicas (a fresh Serve app each, on one private local Ray):

* streams: C concurrent gRPC streams, each one request of --tokens tokens (one every
  --step-ms); streamed tokens/s, and tokens/s per core of stack CPU (every Ray process of the
  cluster: router replicas, worker actors with their Ray transport, Serve's proxy and
  controller, GCS, raylet; the bench's client is not counted; load_tests/process_cpu.py);
* short requests: --short requests of 1 token, 64 in flight: requests/s per stack core;
* TTFT at 1 in flight: served P50 against the same null engine driven in this process
  (AsyncEngine(NullEngine)): the added TTFT; beside it a unary Health call's round trip, the
  ingress's share of it (the rest: routing, the submit frame, the channel frame, the write);
* http streams (`--protocols http`): C concurrent OpenAI completions streamed as SSE over
  router.http_port (one HTTP/1.1 connection each, aiohttp), the same figures per token as
  the gRPC streams, and the TTFT P50 at 1 in flight over HTTP.

Targets (docs/deploy.md): >= 20,000 streamed tokens/s per stack core (<= 50 us of stack CPU a
token), >= 300 short requests/s per stack core, added TTFT P50 <= 5 ms. On a shared or
2-core machine the client competes with the stack for cores: the per-core figures hold, the
absolute tokens/s do not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass

import grpc
import ray

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import GenerateRequest, SamplingParams
from kvmesh.router.launch import set_local_ray_env, start_serving, stop_serving
from kvmesh.load_tests import process_cpu
from kvmesh.load_tests.grpc_target import free_port
from kvmesh.load_tests.null_engine import NullEngine, start_null_workers
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc
from kvmesh.worker.engine_api import AsyncEngine

APP_NAME = "kvmesh-stack-bench"
PROMPT_TOKEN_IDS = tuple(range(1, 33))


@dataclass(frozen=True)
class StreamRun:
    streams: int
    tokens: int
    messages: int
    wall_s: float
    stack_cores: float  # mean cores of stack CPU over the window
    ttft_p50_s: float
    account: process_cpu.CpuAccount

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def tokens_per_stack_core_s(self) -> float:
        return self.tokens / max(1e-9, self.stack_cores * self.wall_s)

    @property
    def router_us_per_message(self) -> float:
        """The router replicas' CPU per streamed message (what the bare grpc.aio floor bounds)."""
        return 1e6 * self.account.cores_by_role.get("router replica", 0.0) * self.wall_s / max(1, self.messages)


def stack_cores(account: process_cpu.CpuAccount) -> float:
    return sum(cores for role, cores in account.cores_by_role.items() if role != "client")


def bench_config(replicas: int, workers: int, max_num_seqs: int) -> KvmeshConfig:
    return KvmeshConfig.from_dict({
        "router": {"host": "127.0.0.1", "grpc_port": free_port(), "http_port": free_port(),
                   "num_replicas": replicas, "max_queue_len": 4096, "policy": "least_loaded"},
        "scheduler": {"max_num_seqs": max_num_seqs, "max_new_tokens": 100_000},
        "parallel": {"num_workers": workers, "worker_num_cpus": 0.1},
        "tenants": {},
    })


class HttpClient:
    """OpenAI completions streamed as SSE over plain HTTP/1.1 (aiohttp: the bench's own CPU is
    not the stack's); a connection per stream in flight, kept alive between requests."""

    def __init__(self, base_url: str, max_connections: int):
        import aiohttp  # a Ray Serve dependency; only the HTTP runs need it

        self._url = f"{base_url}/v1/completions"
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max_connections),
                                              timeout=aiohttp.ClientTimeout(total=600))

    async def generate(self, max_tokens: int) -> tuple[int, int, float]:
        """(tokens, SSE chunks with text, TTFT s) of one streamed completion; the tokens are
        the final usage's completion_tokens."""
        body = {"model": "", "prompt": list(PROMPT_TOKEN_IDS), "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        ttft_s, tokens, messages = None, 0, 0
        async with self._session.post(self._url, json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                if chunk["choices"]:
                    messages += 1
                    if ttft_s is None:
                        ttft_s = time.perf_counter() - t0
                elif chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        return tokens, messages, ttft_s or 0.0

    async def close(self) -> None:
        await self._session.close()


class Client:
    """A plain grpc.aio client (the bench's own CPU is not the stack's)."""

    def __init__(self, address: str):
        self._channel = grpc.aio.insecure_channel(address, options=[("grpc.max_concurrent_streams", 4096)])
        self._stub = kvmesh_pb2_grpc.KvmeshStub(self._channel)

    async def generate(self, max_tokens: int) -> tuple[int, int, float]:
        """(tokens, messages, TTFT s) of one request."""
        request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=PROMPT_TOKEN_IDS),
                                     sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        t0 = time.perf_counter()
        ttft_s, tokens, messages = None, 0, 0
        async for response in self._stub.Generate(request):
            messages += 1
            tokens += len(response.token_ids)
            if ttft_s is None:
                ttft_s = time.perf_counter() - t0
        return tokens, messages, ttft_s or 0.0

    async def ttft_split(self, max_tokens: int = 4) -> tuple[float, float, float]:
        """(TTFT, out, back) seconds of one request: out = the client's send to the engine's
        arrival stamp (ingress, the router's stages, the submit frame, the worker's loop), back
        = that stamp to the first response here (the step, the channel frame, the fan-out, the
        gRPC write). Wall clocks of one machine; the null engine's first token comes at the
        step right after its arrival."""
        request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=PROMPT_TOKEN_IDS),
                                     sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        sent, first, arrival = time.time(), None, None
        async for response in self._stub.Generate(request):
            first = first or time.time()
            if response.HasField("timings"):
                arrival = response.timings.arrival_time
        return first - sent, arrival - sent, first - arrival

    async def health_round_trip(self) -> float:
        """Seconds of one unary Health call: the ingress's share of a request (gRPC both ways,
        the replica's loop), without routing, the worker or its channel."""
        t0 = time.perf_counter()
        await self._stub.Health(pb.HealthRequest())
        return time.perf_counter() - t0

    async def close(self) -> None:
        await self._channel.close()


async def run_streams(client: Client | HttpClient, streams: int, tokens: int) -> StreamRun:
    before = process_cpu.snapshot()
    t0 = time.perf_counter()
    results = await asyncio.gather(*(client.generate(tokens) for _ in range(streams)))
    wall_s = time.perf_counter() - t0
    account = process_cpu.account(before, process_cpu.snapshot())
    return StreamRun(streams, sum(r[0] for r in results), sum(r[1] for r in results), wall_s,
                     stack_cores(account), statistics.median(r[2] for r in results), account)


async def run_short(client: Client, num_requests: int, in_flight: int = 64) -> tuple[float, float]:
    """(requests/s, requests/s per stack core) of 1-token requests, `in_flight` at a time."""
    left = num_requests

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await client.generate(1)

    before = process_cpu.snapshot()
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    wall_s = time.perf_counter() - t0
    cores = stack_cores(process_cpu.account(before, process_cpu.snapshot()))
    return num_requests / wall_s, num_requests / max(1e-9, cores * wall_s)


async def ttft_in_process(step_s: float, num_requests: int) -> float:
    """TTFT P50 of the null engine driven in this process (the baseline of the added TTFT)."""
    engine = AsyncEngine(NullEngine(bench_config(1, 1, 64), step_s))
    ttfts = []
    try:
        for i in range(num_requests):
            t0 = time.perf_counter()
            async for _ in engine.generate(GenerateRequest(f"ttft-{i}", prompt_token_ids=PROMPT_TOKEN_IDS,
                                                           sampling=SamplingParams(max_tokens=4, ignore_eos=True))):
                ttfts.append(time.perf_counter() - t0)
                break
    finally:
        await engine.shutdown()
    return statistics.median(ttfts)


def _stream_line(label: str, run: StreamRun, floor=None) -> str:
    """One stream run's figures; `floor` (grpc_floor.FloorRun) adds the router's CPU a message over it."""
    line = (f"{label} {run.streams:5d}: {run.tokens_per_s:9.0f} tok/s, "
            f"{run.tokens_per_stack_core_s:9.0f} tok/s per stack core "
            f"({1e6 / run.tokens_per_stack_core_s:6.1f} us a token), stack {run.stack_cores:.2f} cores, "
            f"{run.tokens / max(1, run.messages):.2f} tokens a message, TTFT P50 {run.ttft_p50_s * 1e3:.1f} ms, "
            f"router replicas {run.router_us_per_message:.1f} us a message")
    if floor is not None:
        line += (f" (bare grpc.aio {floor.us_per_message:.1f}: "
                 f"{run.router_us_per_message / max(1e-9, floor.us_per_message):.2f}x)")
    return line


async def run_grpc(args, config: KvmeshConfig, replicas: int) -> list[str]:
    client = Client(f"127.0.0.1:{config.router.grpc_port}")
    lines = []
    try:
        await client.generate(4)  # warm: channels open, connections up
        for streams in args.streams_list:
            run = await run_streams(client, streams, args.tokens)
            lines.append(_stream_line(f"replicas {replicas}  streams", run, args.floors.get(streams)))
            print(lines[-1] + "\n    " + run.account.summary(), flush=True)
        rps, rps_core = await run_short(client, args.short)
        lines.append(f"replicas {replicas}  short requests: {rps:.0f} req/s, {rps_core:.0f} req/s per stack core")
        print(lines[-1], flush=True)
        splits = [await client.ttft_split() for _ in range(args.ttft_requests)]
        served = statistics.median(s[0] for s in splits)
        out_s, back_s = statistics.median(s[1] for s in splits), statistics.median(s[2] for s in splits)
        ingress = statistics.median([await client.health_round_trip() for _ in range(args.ttft_requests)])
        local = await ttft_in_process(args.step_ms / 1000, args.ttft_requests)
        lines.append(f"replicas {replicas}  TTFT P50 at 1 in flight: served {served * 1e3:.2f} ms, in-process "
                     f"{local * 1e3:.2f} ms, added {(served - local) * 1e3:.2f} ms (of which a unary gRPC "
                     f"round trip to the replica: {ingress * 1e3:.2f} ms); client to engine arrival "
                     f"{out_s * 1e3:.2f} ms, engine arrival to first response {back_s * 1e3:.2f} ms")
        print(lines[-1], flush=True)
    finally:
        await client.close()
    return lines


async def run_http(args, config: KvmeshConfig, replicas: int) -> list[str]:
    """The same stream figures over the OpenAI API's SSE on router.http_port (whatever serves
    that port: the router replicas themselves, or Serve's HTTP proxy in front of them)."""
    client = HttpClient(f"http://127.0.0.1:{config.router.http_port}", max(args.http_streams_list))
    lines = []
    try:
        await client.generate(4)  # warm
        for streams in args.http_streams_list:
            run = await run_streams(client, streams, args.tokens)
            lines.append(_stream_line(f"replicas {replicas}  http streams", run))
            print(lines[-1] + "\n    " + run.account.summary(), flush=True)
        ttfts = [(await client.generate(4))[2] for _ in range(args.ttft_requests)]
        lines.append(f"replicas {replicas}  http TTFT P50 at 1 in flight: {statistics.median(ttfts) * 1e3:.2f} ms")
        print(lines[-1], flush=True)
    finally:
        await client.close()
    return lines


async def run_one_cluster(args, replicas: int) -> list[str]:
    config = bench_config(replicas, args.workers,
                          max_num_seqs=max(args.streams_list + getattr(args, "http_streams_list", [])) + 64)
    start_null_workers(config, APP_NAME, args.step_ms / 1000)
    await asyncio.to_thread(start_serving, config, APP_NAME)
    lines = []
    try:
        protocols = getattr(args, "protocols", ("grpc",))
        if "grpc" in protocols:
            lines += await run_grpc(args, config, replicas)
        if "http" in protocols:
            lines += await run_http(args, config, replicas)
    finally:
        await asyncio.to_thread(stop_serving, config, APP_NAME)
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", default="1,2", help="router replica counts to run, comma-separated")
    p.add_argument("--streams", default="1,16,64,256,1024", help="concurrent streams, comma-separated")
    p.add_argument("--tokens", type=int, default=64, help="tokens per streamed request")
    p.add_argument("--step-ms", type=float, default=20.0, help="the null engine's step: one token a stream each")
    p.add_argument("--workers", type=int, default=1, help="null workers")
    p.add_argument("--short", type=int, default=600, help="1-token requests for the requests/s figure")
    p.add_argument("--ttft-requests", type=int, default=30)
    p.add_argument("--protocols", default="grpc", help="grpc, http or both (comma-separated)")
    p.add_argument("--http-streams", default="64,256", help="concurrent SSE streams over HTTP, comma-separated")
    p.add_argument("--no-floor", action="store_true",
                   help="skip the bare grpc.aio server's CPU a message at each stream count (load_tests/grpc_floor.py)")
    args = p.parse_args(argv)
    args.streams_list = [int(s) for s in args.streams.split(",")]
    args.http_streams_list = [int(s) for s in args.http_streams.split(",")]
    args.protocols = tuple(args.protocols.split(","))
    # Here, not at the top: bench_stack_ab runs this file against older checkouts too.
    from kvmesh.load_tests import grpc_floor

    # Before the cluster starts: the floor's child has the machine to itself, as the stack will.
    args.floors = {} if args.no_floor or "grpc" not in args.protocols else {
        streams: grpc_floor.measure(streams, args.tokens, args.step_ms / 1000) for streams in args.streams_list}
    for streams, floor in args.floors.items():
        print(f"bare grpc.aio {streams:5d} streams: {floor.us_per_message:.1f} us of server CPU a message", flush=True)
    set_local_ray_env()  # as `kvmesh serve` starts one
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    lines = []
    try:
        for replicas in (int(r) for r in args.replicas.split(",")):
            lines += asyncio.run(run_one_cluster(args, replicas))
    finally:
        ray.shutdown()
    print("\n".join(["", "summary (stack = every Ray process of the cluster; the client excluded):"] + lines))
    return lines


if __name__ == "__main__":
    main()
