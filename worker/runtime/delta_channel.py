"""One channel per (worker, router replica): every engine step's deltas for all of that
replica's requests in one message, as vLLM v1's engine core sends one EngineCoreOutputs per step.

    router replica R                          worker actor W
      connect (socket: worker/runtime/channel_server.py)  ──>  DeltaChannel(R).batches()   (one per connection)
      OPS [submit request, ...] ──────────────────────────>  AsyncEngine.submit(request, channel R)
                          <── DELTAS [deltas of step k for every request of R on W] ──
                          <── DELTAS [deltas of step k+1 ...] ──
      OPS [abort request_id] ─────────────────────────────>  engine abort -> its ABORT delta on the channel

A message per request per step made the stack's CPU grow with the batch (at batch 64, 64
messages a step crossing Ray, the router and the ingress: docs/deploy.md); on the channel it
is one message a step whatever the batch, and the router fans the deltas out to its streams.

Backpressure, bounded: when a slow replica leaves the socket's buffer full, the server's writer
waits at `drain` (TCP flow control) between two messages of `batches`. Meanwhile
the step thread keeps calling `put`, and what arrives waits per request, to leave as one
merged item per sample run (core/delta_wire.py's `pack`) in the next message: the replica
gets one message however long it stalled, never a growing list of messages.

Lives on the actor's event loop: `put` is called there (AsyncEngine's dispatch hands it the
step's deltas with one call_soon_threadsafe per step), and so is `batches` (the connection's writer).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from kvmesh.core import delta_wire
from kvmesh.core.seams import RequestDelta


class DeltaChannel:
    """The deltas bound for one router replica, buffered between two messages."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._pending: dict[str, list[RequestDelta]] = {}  # request id -> deltas not yet sent, in order
        self._samples_left: dict[str, int] = {}  # live request id -> samples not yet finished
        self._on_end: dict[str, Callable[[RequestDelta], None]] = {}
        self._ready = asyncio.Event()
        self._closed = False

    def open_request(self, request_id: str, num_samples: int, on_end: Callable[[RequestDelta], None]) -> None:
        """Route `request_id`'s deltas here until its last sample's final (or an error) delta;
        `on_end(last_delta)` is called then, on this loop."""
        self._samples_left[request_id] = num_samples
        self._on_end[request_id] = on_end

    def forget(self, request_id: str) -> None:
        """Stop routing the request (it was refused before it started)."""
        self._samples_left.pop(request_id, None)
        self._on_end.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        """True while `request_id` is live on this channel."""
        return request_id in self._samples_left

    def refuse(self, refusal: RequestDelta) -> None:
        """A request the worker refused (never opened here, or forgotten): its error delta
        goes out in the next message, as the last word on it."""
        self._pending.setdefault(refusal.request_id, []).append(refusal)
        self._ready.set()

    def request_ids(self) -> list[str]:
        """The live requests on this channel."""
        return list(self._samples_left)

    def put(self, delta: RequestDelta) -> None:
        """One delta from the engine (or an error report for a request of this channel)."""
        left = self._samples_left.get(delta.request_id)
        if left is None:  # already ended (an abort's delta after an error, say)
            return
        self._pending.setdefault(delta.request_id, []).append(delta)
        left = 0 if delta.error_type else left - int(delta.finished)
        if left > 0:
            self._samples_left[delta.request_id] = left
        else:
            del self._samples_left[delta.request_id]
            self._on_end.pop(delta.request_id)(delta)
        self._ready.set()

    def put_all(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            self.put(delta)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True
        self._ready.set()

    async def batches(self) -> AsyncIterator[bytes]:
        """Everything that arrived since the previous message, as one message (at least one
        delta each, packed and encoded: core/delta_wire.py); ends after `close`."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            if self._closed:
                return
            pending, self._pending = self._pending, {}
            if pending:
                items: list = []
                for deltas in pending.values():
                    items += delta_wire.pack(deltas)
                yield delta_wire.encode(items)
