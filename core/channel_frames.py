"""The bytes on a worker channel's socket: one TCP connection per (worker, router replica).

    router replica                                              worker actor
      ask the actor (one Ray call): ChannelAddress(host, port, token)
      connect ─── token (TOKEN_BYTES raw) ─────────────────────>  checked before anything else is read
              ─── HELLO  "replica id\\nconnection id" ─────────>
              <── ATTACHED  the worker incarnation's id ───────
              ─── OPS  [("s", GenerateRequest) | ("a", id)] ──>   one frame per event-loop tick
              <── DELTAS  core/delta_wire.py message ──────────   one frame per engine step (merged under backpressure)
              <── CLOSING  (the worker is closing the channel on purpose)

A frame is a 4-byte big-endian payload length, one kind byte, then the payload. The token is
a per-incarnation random secret handed out only through the actor call, so a peer that did
not get it from Ray is refused before a byte of it is unpickled; after it, payloads are
pickles between processes of one cluster (the same trust as Ray's own).

Why a socket and not Ray: a Ray actor call per submit and a Ray streaming item per step
message cost the replica and the worker far more than the bytes (thread-pool hops, object
store bookkeeping: docs/deploy.md); Ray keeps placement, restarts, failure detection and
the address hand-out. vLLM v1's engine core and frontend talk over ZMQ sockets the same way.
"""

from __future__ import annotations

import asyncio
import hmac
import struct
from dataclasses import dataclass

TOKEN_BYTES = 32
HEADER = struct.Struct(">IB")  # payload length, kind
# A frame larger than this is a broken or hostile peer, not a message (a GenerateRequest with
# a long prompt is well under a megabyte).
MAX_FRAME_BYTES = 256 << 20
HELLO_MAX_BYTES = 1024
AUTH_TIMEOUT_S = 10.0  # a peer that connects and says nothing is dropped

HELLO = 0x48  # "H"
ATTACHED = 0x41  # "A"
OPS = 0x4F  # "O"
DELTAS = 0x44  # "D"
CLOSING = 0x43  # "C"


@dataclass(frozen=True)
class ChannelAddress:
    """Where a worker incarnation takes router replicas' channel connections, and the secret
    they must send first (WorkerActor.channel_address)."""

    host: str
    port: int
    token: bytes


def frame(kind: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), kind) + payload


async def read_frame(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES) -> tuple[int, bytes]:
    """The next frame's (kind, payload); ConnectionError on a frame over `max_bytes`,
    asyncio.IncompleteReadError at the end of the stream."""
    size, kind = HEADER.unpack(await reader.readexactly(HEADER.size))
    if size > max_bytes:
        raise ConnectionError(f"channel frame of {size} bytes (limit {max_bytes})")
    return kind, await reader.readexactly(size)


async def expect_frame(reader: asyncio.StreamReader, kind: int, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """The next frame's payload, which must be of `kind` (else ConnectionError)."""
    got, payload = await read_frame(reader, max_bytes)
    if got != kind:
        raise ConnectionError(f"channel frame of kind {got:#x} where {kind:#x} was due")
    return payload


async def check_token(reader: asyncio.StreamReader, token: bytes) -> bool:
    """Read the peer's first TOKEN_BYTES (within AUTH_TIMEOUT_S) and compare them with
    `token` in constant time; False for a wrong, short or late token."""
    try:
        async with asyncio.timeout(AUTH_TIMEOUT_S):
            sent = await reader.readexactly(TOKEN_BYTES)
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
        return False
    return hmac.compare_digest(sent, token)
