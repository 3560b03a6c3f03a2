"""A stopping router replica's gRPC edge over a real grpc.aio server, without Ray: every call it
accepted ends retryably (UNAVAILABLE replica_stopping), never CANCELLED or a wait for the grace.

The servicer is the real ReplicaGrpcServicer over a stand-in RouterCore whose stages wait as
admission does when the workers are full, run through the real StartingRequests as
RouterCore.start runs them; the drain is router/replica_drain.py's."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from kvmesh.core.errors import RouterReplicaStoppingError
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc
from kvmesh.router import status_map
from kvmesh.router.grpc_edge import add_kvmesh_service
from kvmesh.router.grpc_service import ReplicaGrpcServicer
from kvmesh.router.replica_drain import drain_replica
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


class ReplicaThread:
    """One replica's gRPC server on an event loop of its own (as each replica has)."""

    def __init__(self):
        self.core = _AdmissionWaitCore()
        self.servicer = ReplicaGrpcServicer(self.core)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.server, port = self.run(self._start())
        self.target = f"127.0.0.1:{port}"

    def run(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _start(self):
        server = grpc.aio.server()
        add_kvmesh_service(self.servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    def close(self) -> None:
        self.run(self.server.stop(None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


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
