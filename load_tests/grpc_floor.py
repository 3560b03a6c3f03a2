"""The floor under the router replica's per-message CPU: a bare grpc.aio server, nothing else.

A child process serves kvmesh.v1 Generate with no router, no worker and no Ray: on uvloop, as
a Serve replica runs, every stream gets one GenerateResponse of one token per step, all of a
step's writes in one event-loop tick (as a batched engine step's tokens reach the router
together). Its CPU per message is what any grpc.aio ingress pays per streamed message on this
machine; load_tests/bench_stack.py prints the router replica's CPU per message against it in
the same run. What the floor says (docs/deploy.md): below saturation a message carries about
one token, so CPU per token there cannot fall below this floor however lean the router is.

    python -m kvmesh.load_tests.grpc_floor --streams 64 --tokens 300 --step-ms 20
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time
from dataclasses import dataclass

import grpc
import psutil

from kvmesh.load_tests.grpc_target import free_port
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc


@dataclass(frozen=True)
class FloorRun:
    streams: int
    messages: int
    wall_s: float
    server_cpu_s: float

    @property
    def us_per_message(self) -> float:
        return 1e6 * self.server_cpu_s / max(1, self.messages)


class _StepServicer(kvmesh_pb2_grpc.KvmeshServicer):
    """Generate: request.sampling.max_tokens messages of one token, one a step."""

    def __init__(self, step_s: float):
        self._step_s = step_s
        self._waiting: list[asyncio.Future] = []
        self._clock: asyncio.Task | None = None

    async def Generate(self, request, context):  # noqa: N802
        if self._clock is None:
            self._clock = asyncio.get_running_loop().create_task(self._steps())
        for i in range(request.sampling.max_tokens):
            step = asyncio.get_running_loop().create_future()
            self._waiting.append(step)
            await step
            yield pb.GenerateResponse(request_id=request.request_id, text="x", token_ids=[i],
                                      finished=i == request.sampling.max_tokens - 1)

    async def _steps(self) -> None:
        while True:
            await asyncio.sleep(self._step_s)
            waiting, self._waiting = self._waiting, []
            for step in waiting:
                step.set_result(None)


def _serve(port: int, step_s: float, ready) -> None:
    import uvloop  # why: the child runs the event loop a Serve replica runs (a Ray Serve dependency)

    async def main() -> None:
        server = grpc.aio.server()
        kvmesh_pb2_grpc.add_KvmeshServicer_to_server(_StepServicer(step_s), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    uvloop.run(main())


async def _stream_all(port: int, streams: int, tokens: int) -> int:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_concurrent_streams", 4096)])
    stub = kvmesh_pb2_grpc.KvmeshStub(channel)

    async def one(i: int, max_tokens: int) -> int:
        request = pb.GenerateRequest(request_id=f"floor-{i}", sampling=pb.SamplingParams(max_tokens=max_tokens))
        return sum([1 async for _ in stub.Generate(request)])

    try:
        warm = await one(-1, 1)  # the connection is up before the streams start
        return warm + sum(await asyncio.gather(*(one(i, tokens) for i in range(streams))))
    finally:
        await channel.close()


def measure(streams: int, tokens: int, step_s: float) -> FloorRun:
    """The bare server's CPU over `streams` concurrent streams of `tokens` one-token messages."""
    context = multiprocessing.get_context("spawn")  # no copy of the caller's Ray or gRPC state
    ready = context.Event()
    port = free_port()
    child = context.Process(target=_serve, args=(port, step_s, ready), daemon=True)
    child.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the bare gRPC server did not start")
        server = psutil.Process(child.pid)
        before, t0 = server.cpu_times(), time.perf_counter()
        messages = asyncio.run(_stream_all(port, streams, tokens))
        after, wall_s = server.cpu_times(), time.perf_counter() - t0
    finally:
        child.kill()
        child.join()
    cpu_s = (after.user - before.user) + (after.system - before.system)
    return FloorRun(streams, messages, wall_s, cpu_s)


def main(argv: list[str] | None = None) -> FloorRun:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--step-ms", type=float, default=20.0)
    args = p.parse_args(argv)
    run = measure(args.streams, args.tokens, args.step_ms / 1000)
    print(f"bare grpc.aio, {run.streams} streams: {run.messages} messages in {run.wall_s:.2f} s, "
          f"{run.us_per_message:.1f} us of server CPU a message")
    return run


if __name__ == "__main__":
    main()
