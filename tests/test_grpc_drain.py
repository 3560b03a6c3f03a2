"""A stopping router replica's edges over a real grpc.aio server (and the OpenAI route), without
Ray: every call it accepted ends retryably (UNAVAILABLE / 503 replica_stopping), never a wait for
the grace; and the one CANCELLED a stopping server cannot avoid (gRPC core's, for a call racing
its stop) is retried by the kvmesh client.

The servicer is the real ReplicaGrpcServicer over a stand-in RouterCore whose stages wait as
admission does when the workers are full, run through the real StartingRequests as
RouterCore.start runs them; the drain is router/replica_drain.py's."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvmesh.core.errors import RouterReplicaStoppingError
from kvmesh.core.seams import FinishReason, RequestDelta
from kvmesh.load_tests.grpc_target import free_port
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.router import convert, status_map
from kvmesh.router.client import KvmeshClient
from kvmesh.router.grpc_edge import add_kvmesh_service
from kvmesh.router.grpc_service import ReplicaGrpcServicer
from kvmesh.router.replica_drain import drain_replica
from kvmesh.router.retry import RetryPolicy
from kvmesh.router.starting_requests import StartingRequests

# Long enough that a call left to wait for the hand-off would outlive the client's deadline.
GRACE_S = 60.0
CLIENT_DEADLINE_S = 20.0


class _Channels:
    replica_id = "replica-under-test"

    def __init__(self):
        self.num_hand_offs = 0

    def hand_off_all(self) -> int:
        self.num_hand_offs += 1
        return 0


class _AdmissionWaitCore:
    """RouterCore as far as the servicer and the drain use it: its stages wait for capacity
    that never comes, and record how their wait ended."""

    def __init__(self):
        self.channels = _Channels()
        self.starting = StartingRequests()
        self.waiting = threading.Event()
        self.cancelled_waits = 0

    async def start(self, inbound):
        return await self.starting.run(self._run_stages(inbound))

    async def _run_stages(self, inbound):
        self.waiting.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled_waits += 1  # the stages' cleanup (quota, backlog) runs on this path
            raise


class ServerOnItsLoop:
    """A started grpc.aio server on an event loop of its own (as each replica has); `add`
    registers the servicer, `address` is where it listens."""

    def __init__(self, add, address: str = "127.0.0.1:0", options: tuple = ()):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.server, self.port = self.run(self._start(add, address, options))

    async def _start(self, add, address: str, options: tuple):
        server = grpc.aio.server(options=options)
        add(server)
        port = server.add_insecure_port(address)
        await server.start()
        return server, port

    def run(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.run(self.server.stop(None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


class ReplicaThread(ServerOnItsLoop):
    """One replica's gRPC edge: the real servicer over the admission-wait core."""

    def __init__(self):
        self.core = _AdmissionWaitCore()
        self.servicer = ReplicaGrpcServicer(self.core)
        super().__init__(lambda server: add_kvmesh_service(self.servicer, server))
        self.target = f"127.0.0.1:{self.port}"


@pytest.fixture
def replica():
    thread = ReplicaThread()
    yield thread
    thread.close()


def _generate(target: str, outcome: list) -> None:
    with grpc.insecure_channel(target) as channel:
        call = pb_grpc.KvmeshStub(channel).Generate(pb.GenerateRequest(prompt="hello"), timeout=CLIENT_DEADLINE_S)
        try:
            outcome.append(list(call))
        except grpc.RpcError as error:
            outcome.append(error)


def test_a_call_waiting_in_admission_ends_unavailable_replica_stopping_when_the_drain_begins(replica):
    outcome: list = []
    client = threading.Thread(target=_generate, args=(replica.target, outcome))
    client.start()
    assert replica.core.waiting.wait(10), "the call never reached admission"

    draining = asyncio.run_coroutine_threadsafe(
        drain_replica(replica.server, replica.servicer, None, GRACE_S), replica.loop)
    client.join(CLIENT_DEADLINE_S + 10)

    [error] = outcome
    assert isinstance(error, grpc.RpcError)
    assert error.code() == grpc.StatusCode.UNAVAILABLE, (error.code(), error.details())
    assert status_map.metadata_value(error.trailing_metadata(), status_map.ERROR_KIND_KEY) == "replica_stopping"
    assert draining.result(30) == 0  # nothing left for the hand-off: the drain did not wait out the grace
    assert replica.core.cancelled_waits == 1 and replica.core.channels.num_hand_offs == 1
    assert replica.servicer.num_active_streams == 0


def test_a_call_that_reaches_the_servicer_after_the_drain_began_is_refused_unavailable(replica):
    class Context:
        aborted: tuple | None = None

        def invocation_metadata(self):
            return ()

        async def abort(self, code, details, trailing_metadata=()):
            self.aborted = (code, dict(trailing_metadata))
            raise grpc.aio.AbortError()

    async def late_call():
        replica.core.starting.refuse_all()
        context = Context()
        with pytest.raises(grpc.aio.AbortError):
            async for _ in replica.servicer.Generate(pb.GenerateRequest(prompt="late"), context):
                pass
        return context.aborted

    code, trailers = replica.run(late_call())
    assert code == grpc.StatusCode.UNAVAILABLE
    assert trailers[status_map.ERROR_KIND_KEY] == status_map.status_for(RouterReplicaStoppingError("")).kind
    assert not replica.core.waiting.is_set()  # refused before admission


def _one_word(request) -> pb.GenerateResponse:
    return convert.delta_to_pb(RequestDelta(request.request_id, text="word", token_ids=(7,), finished=True,
                                            finish_reason=FinishReason.LENGTH))


class _StoppingKvmesh(pb_grpc.KvmeshServicer):
    """Generate: one finished word, except the prompt "hold", which waits until the server stops."""

    async def Generate(self, request, context):  # noqa: N802
        if request.prompt == "hold":
            await asyncio.Event().wait()
        yield _one_word(request)


class _StayingKvmesh(pb_grpc.KvmeshServicer):
    """Generate: one finished word (a blocking server: its threads are not the stopping loop's)."""

    def Generate(self, request, context):  # noqa: N802
        yield _one_word(request)


def _staying_server(port: int) -> grpc.Server:
    server = grpc.server(ThreadPoolExecutor(4), options=(("grpc.so_reuseport", 1),))
    pb_grpc.add_KvmeshServicer_to_server(_StayingKvmesh(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


def test_a_call_racing_a_replicas_stop_is_cancelled_by_grpc_core_and_the_client_retries_it_elsewhere():
    """gRPC core ends with CANCELLED a call it received but had not yet handed to the
    application when the server's stop begins (grpc/grpc#41785): the replica never sees it.
    Made certain here: while the stopping server's loop is busy, a first call takes the one
    request gRPC keeps open for the application and the client's call arrives behind it; the
    stop follows without a turn of the loop. The kvmesh client reads that CANCELLED (no
    x-kvmesh-error) as UNAVAILABLE and gets its answer from the replica that stays on the port."""
    port = free_port()
    stopping = ServerOnItsLoop(lambda server: pb_grpc.add_KvmeshServicer_to_server(_StoppingKvmesh(), server),
                               f"127.0.0.1:{port}", (("grpc.so_reuseport", 1),))
    staying = None
    held_channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    busy = threading.Event()
    try:
        with KvmeshClient(f"127.0.0.1:{port}", retry_policy=RetryPolicy(max_attempts=3, initial_backoff_s=0.01),
                          own_connection=True) as client:
            list(client.generate("warm-up"))  # the client's connection is to the stopping server
            grpc.channel_ready_future(held_channel).result(10)
            staying = _staying_server(port)  # binds beside it: the retry's new connection finds it

            async def busy_then_stop():
                busy.set()
                time.sleep(1.0)  # the loop takes no call meanwhile (a blocking sleep, on purpose)
                await stopping.server.stop(0.5)

            stop = asyncio.run_coroutine_threadsafe(busy_then_stop(), stopping.loop)
            assert busy.wait(10)
            held_call = pb_grpc.KvmeshStub(held_channel).Generate(pb.GenerateRequest(prompt="hold"), timeout=30)
            time.sleep(0.2)  # the held call first: it takes the open request
            deltas = list(client.generate("raced", timeout_s=20))
            stop.result(30)
        assert [d.text for d in deltas] == ["word"] and deltas[-1].finished
        with pytest.raises(grpc.RpcError):
            list(held_call)
    finally:
        held_channel.close()
        stopping.close()
        if staying is not None:
            staying.stop(None)


def test_an_http_request_waiting_in_admission_gets_503_replica_stopping_when_the_drain_begins():
    """The OpenAI edge's half of the same refusal: RouterCore.start raises, the route answers
    503 `replica_stopping` with Retry-After 0 before any byte of a stream is sent."""
    from starlette.requests import Request

    from kvmesh.router.openai_http import generate_response

    body = json.dumps({"model": "m", "prompt": "hello", "stream": True}).encode()

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    request = Request({"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
                       "headers": [(b"content-type", b"application/json")]}, receive)

    async def drained_while_waiting():
        core = _AdmissionWaitCore()
        answer = asyncio.ensure_future(generate_response(core, request, chat=False))
        while not core.waiting.is_set():
            await asyncio.sleep(0.01)
        core.starting.refuse_all()
        return await answer, core

    response, core = asyncio.run(drained_while_waiting())
    assert response.status_code == 503 and core.cancelled_waits == 1
    assert response.headers[status_map.ERROR_KIND_KEY] == "replica_stopping"
    assert response.headers["retry-after-ms"] == "0"
