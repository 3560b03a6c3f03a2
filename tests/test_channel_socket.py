"""The worker channel's socket, no Ray: the worker actor's ChannelServer
(worker/runtime/channel_server.py) and the router replica's ChannelConnection
(router/channel_connection.py) over real loopback sockets, with the null engine: the frames and
ordered ops, authentication before anything is read, and TCP backpressure merging what waits."""

import asyncio
import pickle
import socket

from kvmesh.core import channel_frames as frames
from kvmesh.core import delta_wire
from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import FinishReason, GenerateRequest, RequestDelta, SamplingParams
from kvmesh.load_tests.null_engine import NullWorkerActor
from kvmesh.router.channel_connection import ChannelConnection
from kvmesh.worker.runtime.channel_server import ChannelServer

CONFIG = KvmeshConfig.from_dict({"scheduler": {"max_num_seqs": 64}}).to_dict()


def _request(rid: str, max_tokens: int, n: int = 1) -> GenerateRequest:
    return GenerateRequest(rid, prompt_token_ids=(1, 2, 3), sampling=SamplingParams(max_tokens=max_tokens, n=n,
                                                                                     ignore_eos=True))


def _deltas_of(message: bytes) -> list[RequestDelta]:
    """A message's deltas, each request's run joined as the router's fan-out does (per request)."""
    by_request: dict[str, list] = {}
    for item in delta_wire.decode(message):
        by_request.setdefault(delta_wire.request_id_of(item), []).append(item)
    return [d for items in by_request.values() for d in delta_wire.to_request_deltas(items)]


async def _read_until(connection: ChannelConnection, done, timeout_s: float = 30.0) -> list[RequestDelta]:
    """Every delta read until `done(deltas)` holds."""
    read: list[RequestDelta] = []
    messages = connection.messages()
    async with asyncio.timeout(timeout_s):
        while not done(read):
            read += _deltas_of(await anext(messages))
    return read


def _endings(deltas: list[RequestDelta]) -> dict[str, list]:
    out: dict[str, list] = {}
    for delta in deltas:
        if delta.finished:
            out.setdefault(delta.request_id, []).append(delta.finish_reason)
    return out


def test_ops_reach_the_engine_in_order_and_refusals_and_aborts_come_back_on_the_channel():
    """One OPS frame holds submits and aborts in order: the attach names the incarnation, a
    duplicate id is refused as its error delta, the aborts after the submits end them with
    ABORT, a request left alone runs to LENGTH; a closed connection aborts what it left."""
    async def scenario():
        actor = NullWorkerActor(CONFIG, "worker-0", step_s=0.01)
        try:
            connection = await ChannelConnection.connect(await actor.channel_address(), "replica-a")
            assert connection.incarnation == actor._info.incarnation
            connection.send([("s", _request("a", 1000)), ("s", _request("a", 5)), ("s", _request("b", 1000, n=2)),
                             ("s", _request("c", 3)), ("a", "a"), ("a", "b"), ("a", "unknown")])
            read = await _read_until(connection, lambda d: len(_endings(d).get("a", [])) == 2
                                     and len(_endings(d).get("b", [])) == 2 and "c" in _endings(d))
            endings = _endings(read)
            refusals = [d for d in read if d.error_type]
            c_tokens = sum(len(d.token_ids) for d in read if d.request_id == "c")
            # A second connection of the same replica; closing it aborts its long request.
            again = await ChannelConnection.connect(await actor.channel_address(), "replica-a")
            again.send([("s", _request("d", 100_000))])
            await _read_until(again, lambda d: any(x.request_id == "d" for x in d))
            again.close()
            async with asyncio.timeout(30):
                while actor._streaming:
                    await asyncio.sleep(0.01)
            connection.close()
            return endings, refusals, c_tokens
        finally:
            actor._channel_server.close()
            await actor._engine.shutdown()

    endings, refusals, c_tokens = asyncio.run(scenario())
    assert sorted(endings["a"], key=str) == sorted([FinishReason.ABORT, FinishReason.ERROR], key=str)
    assert [r.error_type for r in refusals] == ["InvalidRequestError"] and refusals[0].request_id == "a"
    assert endings["b"] == [FinishReason.ABORT, FinishReason.ABORT]
    assert endings["c"] == [FinishReason.LENGTH] and c_tokens == 3


def test_a_connection_without_the_token_is_closed_before_anything_is_read():
    """A wrong, missing or partial token: the worker closes the socket without attaching and
    never reads what follows (an OPS frame whose unpickling would record itself, and a submit)."""
    async def scenario():
        actor = NullWorkerActor(CONFIG, "worker-0", step_s=0.01)
        address = await actor.channel_address()
        hostile = frames.frame(frames.HELLO, b"replica-x\nc1") + frames.frame(
            frames.OPS, pickle.dumps([("s", _request("injected", 5))]))
        answers = []
        try:
            for first in (bytes(frames.TOKEN_BYTES), address.token[:-1] + bytes([address.token[-1] ^ 1]), b""):
                reader, writer = await asyncio.open_connection(address.host, address.port)
                writer.write(first + hostile)
                async with asyncio.timeout(30):
                    answers.append(await reader.read())  # b"" = closed by the worker, nothing sent
                writer.close()
            good = await ChannelConnection.connect(address, "replica-a")  # the server still serves
            good.close()
            return answers, set(actor._streaming), dict(actor._channels), address
        finally:
            actor._channel_server.close()
            await actor._engine.shutdown()

    answers, streaming, channels, address = asyncio.run(scenario())
    assert answers == [b"", b"", b""]
    assert not streaming and "replica-x" not in channels
    assert address.host == "127.0.0.1"  # outside Ray: loopback, never every interface


def test_a_replica_that_stops_reading_makes_the_worker_wait_and_merge_then_gets_every_token():
    """Backpressure through TCP: with small socket buffers, a replica that reads nothing fills
    the socket, the worker's writer waits at drain and the deltas that keep coming wait in the
    channel (several steps per request); once the replica reads again, every token arrives once,
    in order, in fewer messages than steps, the waiting runs merged."""
    max_tokens = 400

    async def scenario():
        actor = NullWorkerActor(CONFIG, "worker-0", step_s=0.002)
        actor._channel_server = ChannelServer(actor._info.incarnation, actor, write_high_water_bytes=1024,
                                              send_buffer_bytes=4096)
        try:
            connection = await ChannelConnection.connect(await actor.channel_address(), "replica-a",
                                                         read_limit_bytes=1024)
            connection._writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            connection.send([("s", _request(f"r{i}", max_tokens)) for i in range(32)])
            async with asyncio.timeout(60):  # the condition itself, however fast the machine
                while not any(len(run) > 2 for run in actor._channels["replica-a"]._pending.values()):
                    await asyncio.sleep(0.01)
            messages, read = 0, []
            stream = connection.messages()
            async with asyncio.timeout(60):
                while len(_endings(read)) < 32:
                    read += _deltas_of(await anext(stream))
                    messages += 1
            connection.close()
            return messages, read
        finally:
            actor._channel_server.close()
            await actor._engine.shutdown()

    messages, read = asyncio.run(scenario())
    assert messages < max_tokens
    assert max(len(d.token_ids) for d in read) > 2  # a run that waited came as one delta
    for i in range(32):
        mine = [d for d in read if d.request_id == f"r{i}"]
        assert sum(len(d.token_ids) for d in mine) == max_tokens
        assert mine[-1].finish_reason is FinishReason.LENGTH and [d.finished for d in mine].count(True) == 1
