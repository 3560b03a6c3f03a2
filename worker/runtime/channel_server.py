"""The worker's end of the router replicas' channel sockets (core/channel_frames.py).

    WorkerActor.channel_address()  ──Ray──>  ChannelServer.start(): listen on the node's IP, port 0
    replica connects ── token ── HELLO ──>   _serve(connection):
                                                ATTACHED incarnation
                                                reader: OPS frames -> submit (in order) / abort (scoped to this replica)
                                                writer: DeltaChannel.batches() -> DELTAS frames, waiting at drain

One connection per router replica. Its requests' deltas gather in the replica's DeltaChannel
(worker/runtime/delta_channel.py) while the writer waits at `drain` (TCP flow control: the
replica reads slowly, the socket buffer fills), and leave merged as one message when it can
write again: a slow replica gets fewer, larger messages, never a growing queue.

A connection that ends (the replica closed it, stopped, or its process died) aborts its
requests, as the end of the Ray stream that carried them did. A second connection from the
same replica (it reopened after a break it saw first) replaces the first. Lives on the
actor's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import secrets
import socket
from kvmesh.core import channel_frames as frames
from kvmesh.worker.runtime.delta_channel import DeltaChannel

logger = logging.getLogger(__name__)

# Bytes the socket may hold unsent before the writer waits at drain (and the channel merges
# what keeps coming). Large enough that a replica keeping up never makes the worker wait.
WRITE_HIGH_WATER_BYTES = 1 << 20


class ChannelServer:
    """The listening socket of one worker incarnation and its replicas' connections.

    `owner` (the WorkerActor) is told of each connection's channel as it opens
    (`channel_opened(replica_id, channel)`), gets each OPS frame's ops to run in order
    (`channel_ops(replica_id, channel, ops)`: submits and aborts), and is told when it ends
    (`channel_closed(replica_id, channel)`)."""

    def __init__(self, incarnation: str, owner, write_high_water_bytes: int = WRITE_HIGH_WATER_BYTES,
                 send_buffer_bytes: int | None = None):
        self.incarnation = incarnation
        self._high_water_bytes = write_high_water_bytes
        self._send_buffer_bytes = send_buffer_bytes  # SO_SNDBUF; None = the kernel's (a test sets it small)
        self.token = secrets.token_bytes(frames.TOKEN_BYTES)
        self._owner = owner
        self._server: asyncio.Server | None = None
        self.address: frames.ChannelAddress | None = None
        self._live: dict[str, asyncio.StreamWriter] = {}  # replica id -> its connection's writer
        self._ended: dict[str, asyncio.Event] = {}  # connection id -> set when that connection ends

    async def start(self, host: str) -> frames.ChannelAddress:
        """Listen on `host` (the node's IP Ray uses for this actor), once; the address to hand out."""
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, host, 0, limit=1 << 20)
            port = self._server.sockets[0].getsockname()[1]
            self.address = frames.ChannelAddress(host, port, self.token)
        return self.address

    async def wait_closed(self, connection_id: str) -> None:
        """Return when connection `connection_id` has ended (or at once if it never opens and
        the caller cancels): what the replica's Ray call waits on, so that Ray tells the
        replica when this actor or its node is lost without a FIN reaching the socket."""
        await self._ended.setdefault(connection_id, asyncio.Event()).wait()
        self._ended.pop(connection_id, None)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._live.values()):
            _say_closing(writer)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not await frames.check_token(reader, self.token):
            logger.warning("channel connection from %s refused: wrong token", writer.get_extra_info("peername"))
            writer.transport.abort()
            return
        try:
            hello = (await frames.expect_frame(reader, frames.HELLO, frames.HELLO_MAX_BYTES)).decode()
            replica_id, connection_id = hello.split("\n", 1)
        except (ConnectionError, asyncio.IncompleteReadError, UnicodeDecodeError, ValueError) as exc:
            logger.warning("channel connection refused: bad hello (%s)", exc)
            writer.transport.abort()
            return
        previous = self._live.pop(replica_id, None)
        if previous is not None:  # the replica reopened: its old connection is dead to it
            previous.transport.abort()
        self._live[replica_id] = writer
        writer.transport.set_write_buffer_limits(high=self._high_water_bytes)
        if self._send_buffer_bytes is not None:
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._send_buffer_bytes)
        channel = DeltaChannel(asyncio.get_running_loop())
        self._owner.channel_opened(replica_id, channel)
        ended = self._ended.setdefault(connection_id, asyncio.Event())
        writer.write(frames.frame(frames.ATTACHED, self.incarnation.encode()))
        sending = asyncio.get_running_loop().create_task(self._send(channel, writer))
        try:
            await self._receive(replica_id, channel, reader)
        finally:
            channel.close()
            sending.cancel()
            if self._live.get(replica_id) is writer:
                del self._live[replica_id]
            self._owner.channel_closed(replica_id, channel)
            writer.close()
            ended.set()

    async def _receive(self, replica_id: str, channel: DeltaChannel, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                kind, payload = await frames.read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the replica closed the connection or is gone
            if kind != frames.OPS:
                logger.warning("channel of replica %s: unexpected frame kind %#x; closing", replica_id, kind)
                return
            self._owner.channel_ops(replica_id, channel, pickle.loads(payload))

    @staticmethod
    async def _send(channel: DeltaChannel, writer: asyncio.StreamWriter) -> None:
        try:
            async for message in channel.batches():
                writer.write(frames.frame(frames.DELTAS, message))
                await writer.drain()  # waits only over WRITE_HIGH_WATER_BYTES: TCP backpressure
        except ConnectionError:
            writer.transport.abort()  # the reader sees the end and cleans up


def _say_closing(writer: asyncio.StreamWriter) -> None:
    """A deliberate end (shutdown): the replica does not take it for a dead worker."""
    try:
        writer.write(frames.frame(frames.CLOSING, b""))
        writer.close()
    except (ConnectionError, RuntimeError):
        pass
