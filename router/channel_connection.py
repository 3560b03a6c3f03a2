"""A router replica's socket to one worker incarnation (the frames: core/channel_frames.py).

    open(handle, replica id):  handle.channel_address()  (one Ray call)  -> host, port, token
                               connect, send token + HELLO, read ATTACHED (the incarnation)
                               handle.channel_watch(connection id)  (a Ray call left pending)
    send(ops)                  one OPS frame: this tick's submits and aborts for the worker
    messages()                 the DELTAS frames' payloads until the connection ends

Ray stays the control plane: it places and restarts the actor, hands out the address and the
token, and the pending `channel_watch` call fails when Ray declares the actor or its node
lost, which closes the socket even when no FIN ever reaches it. A connection that ends
without the worker's CLOSING frame means the worker process is gone (`lost`).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import uuid
from collections.abc import AsyncIterator

from kvmesh.core import channel_frames as frames

logger = logging.getLogger(__name__)

_READ_LIMIT_BYTES = 1 << 20  # the reader's buffer; past twice this it stops reading (TCP backpressure)


class ChannelConnection:
    """One open, authenticated connection; `incarnation` is the worker incarnation it reached."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, incarnation: str,
                 connection_id: str):
        self.incarnation = incarnation
        self.connection_id = connection_id
        self.closing = False  # the worker said it closes on purpose (shutdown)
        self._reader = reader
        self._writer = writer
        self._watch: asyncio.Task | None = None

    @classmethod
    async def open(cls, handle, replica_id: str) -> ChannelConnection:
        """Ask the actor for its address (waits while Ray restarts it), connect, and leave
        the watch call pending; raises Ray's error when the actor is gone, OSError /
        ConnectionError when the socket fails."""
        connection = await cls.connect(await handle.channel_address.remote(), replica_id)
        watch = handle.channel_watch.remote(connection.connection_id)
        connection._watch = asyncio.get_running_loop().create_task(connection._lost_when(watch))
        return connection

    @classmethod
    async def connect(cls, address: frames.ChannelAddress, replica_id: str,
                      read_limit_bytes: int = _READ_LIMIT_BYTES) -> ChannelConnection:
        """Connect to `address`, authenticate with its token and attach as `replica_id`."""
        connection_id = uuid.uuid4().hex
        reader, writer = await asyncio.open_connection(address.host, address.port, limit=read_limit_bytes)
        try:
            writer.write(address.token + frames.frame(frames.HELLO, f"{replica_id}\n{connection_id}".encode()))
            incarnation = (await frames.expect_frame(reader, frames.ATTACHED, frames.HELLO_MAX_BYTES)).decode()
        except asyncio.IncompleteReadError as exc:  # refused (a wrong token closes the socket unread)
            writer.transport.abort()
            raise ConnectionError("the worker closed the channel before attaching it") from exc
        except BaseException:
            writer.transport.abort()
            raise
        return cls(reader, writer, incarnation, connection_id)

    def send(self, ops: list[tuple[str, object]]) -> None:
        """Queue one OPS frame: ("s", GenerateRequest) / ("a", request id), in order."""
        self._writer.write(frames.frame(frames.OPS, pickle.dumps(ops, protocol=pickle.HIGHEST_PROTOCOL)))

    async def messages(self) -> AsyncIterator[bytes]:
        """Each DELTAS frame's payload (core/delta_wire.py), until the connection ends."""
        reader = self._reader
        while True:
            try:
                kind, payload = await frames.read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if kind == frames.DELTAS:
                yield payload
            elif kind == frames.CLOSING:
                self.closing = True
                return
            else:
                logger.warning("channel frame of unexpected kind %#x; closing the channel", kind)
                return

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        self._writer.transport.abort()

    async def _lost_when(self, watch) -> None:
        """Close the socket when Ray says the actor (or its node) is lost."""
        try:
            await watch
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # RayActorError and kin: the worker is gone
            logger.debug("channel watch ended: %r", exc)
            self._writer.transport.abort()
