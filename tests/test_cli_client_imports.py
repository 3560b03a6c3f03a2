"""The client commands (`kvmesh generate --server`, `kvmesh chat`, `kvmesh stats`) load
neither torch nor the engine: a client of a running cluster starts in a fraction of a second.

Each command runs whole in a fresh interpreter (the `kvmesh` entry point's `main`) against a
real server on loopback: a gRPC server speaking the generated stubs for generate and chat, an
HTTP /metrics endpoint for stats. On exit the child prints the modules it loaded; none may be
torch, Ray, transformers or anything of kvmesh.worker. No timing is asserted (the box is shared);
the module list is what the start-up time follows from.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import subprocess
import sys
import threading

import grpc
import pytest

from kvmesh.core.seams import FinishReason, RequestDelta, Usage
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.router import convert

WORDS = ("Paris", " is", " big")
HEAVY_PREFIXES = ("torch", "ray", "transformers", "triton", "kvmesh.worker")
CHILD = """
import atexit, json, sys
atexit.register(lambda: print("MODULES " + json.dumps(sorted(sys.modules)), file=sys.stderr))
from kvmesh.deploy.cli import main
sys.exit(main(sys.argv[1:]))
"""


class _WordServer(pb_grpc.KvmeshServicer):
    """Streams WORDS for any request; remembers the prompts and chats it was sent."""

    def __init__(self):
        self.inputs = []

    async def Generate(self, request, context):
        inbound = convert.inbound_from_pb(request)
        self.inputs.append(inbound)
        for i, word in enumerate(WORDS):
            yield convert.delta_to_pb(RequestDelta(inbound.request_id, text=word, token_ids=(i,)))
        yield convert.delta_to_pb(RequestDelta(inbound.request_id, finished=True, finish_reason=FinishReason.LENGTH,
                                               usage=Usage(prompt_tokens=2, completion_tokens=len(WORDS))))


@pytest.fixture(scope="module")
def grpc_server():
    servicer = _WordServer()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        server = grpc.aio.server()
        pb_grpc.add_KvmeshServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    yield f"127.0.0.1:{port}", servicer
    asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


class _MetricsHandler(http.server.BaseHTTPRequestHandler):
    body = (b'# TYPE kvmesh_requests_total counter\n'
            b'kvmesh_requests_total{finish_reason="stop",replica="r0"} 5.0\n')

    def do_GET(self):
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def run_kvmesh(argv: list[str], stdin: str = "") -> tuple[subprocess.CompletedProcess, list[str]]:
    proc = subprocess.run([sys.executable, "-P", "-c", CHILD, *argv], input=stdin, capture_output=True,
                          text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("MODULES ")]
    assert lines, proc.stderr
    return proc, json.loads(lines[-1].removeprefix("MODULES "))


def heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in HEAVY_PREFIXES)]


def test_generate_with_server_loads_only_the_client(grpc_server):
    target, servicer = grpc_server
    proc, modules = run_kvmesh(["generate", "The capital of France", "--server", target, "--max-tokens", "3"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "".join(WORDS)
    assert servicer.inputs[-1].prompt == "The capital of France"
    assert "kvmesh.router.client" in modules  # the walk saw the real request path
    assert heavy(modules) == []


def test_chat_loads_only_the_client(grpc_server):
    target, servicer = grpc_server
    proc, modules = run_kvmesh(["chat", "--server", target, "--max-tokens", "3"], stdin="Hello there\n")
    assert proc.returncode == 0, proc.stderr
    assert "".join(WORDS) in proc.stdout
    assert [m.to_dict() for m in servicer.inputs[-1].messages] == [{"role": "user", "content": "Hello there"}]
    assert heavy(modules) == []


def test_stats_loads_neither_torch_nor_the_engine():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _MetricsHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        proc, modules = run_kvmesh(["stats", "--url", f"http://127.0.0.1:{server.server_address[1]}/metrics"])
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0, proc.stderr
    assert "stop" in proc.stdout
    assert heavy(modules) == []


def test_the_in_process_generate_does_load_the_engine():
    """The check can fail: the same walk over the in-process command sees the engine (its
    argument check fails before a model loads, after the imports)."""
    proc, modules = run_kvmesh(["generate", "hi", "--max-tokens", "0"])
    assert "kvmesh.worker.engine_loop.engine" in modules and "torch" in modules


def test_the_start_bench_runs_both_paths(capsys):
    """load_tests/bench_cli_start.py: one round prints both starts and the ratio (no timing is
    asserted; the figures go in notes and docs)."""
    from kvmesh.load_tests import bench_cli_start

    bench_cli_start.main(["--rounds", "1"])
    out = capsys.readouterr().out
    assert out.startswith("round 1: client ") and "in-process" in out and "median: the client path" in out
