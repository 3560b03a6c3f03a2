"""The router replica's end of the worker channels: one socket per worker, fanned out.

Each worker sends this replica one message per engine step holding the deltas of every
request of this replica on it (worker/runtime/delta_channel.py, packed as core/delta_wire.py
says); a request's stream here is a Subscription this module fills from that message:

    worker-0 ══ socket (router/channel_connection.py) ══> reader task ──┬─> subscription a ─> RequestStream a
                                                                         └─> subscription b ─> RequestStream b
    worker-1 ══ socket ══> reader task ──> ...

    RequestStream:  subscribe(worker, id) -> submit(worker, request) -> take() from the subscription
                    unsubscribe, and abort(worker, id) unless the request finished

Submits and aborts of one event-loop tick go to each worker as one OPS frame on the same
socket, in the order they were made (an abort after its submit); while the socket is being
(re)opened they wait in the worker's outbox and go once it is attached.

Failures travel the same path: when a worker's socket breaks (the actor died or restarts, or
Ray declared it lost), every request sent on it gets `ChannelFailure` (the RequestStream
re-routes or resumes, router/router_core.py) and the reader opens the channel again. A submit
the worker refused comes back as its error delta on the request's subscription.

Drain: a replica that is stopping hands its streams back to their clients (`hand_off_all`):
every subscribed request, and any that subscribes later, gets `ReplicaStopping` on its queue;
the RequestStream aborts it on its worker and ends it retryably (router/router_core.py).

Backpressure: TCP's. A replica that falls behind reads its socket late, the worker's writer
waits at `drain` while its channel merges the deltas that keep coming (one message for all
of them: worker/runtime/channel_server.py), instead of buffering ever more messages.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

from kvmesh.core import delta_wire
from kvmesh.core.delta_wire import TokenDelta
from kvmesh.core.errors import DeadlineExceededError
from kvmesh.core.seams import GenerateRequest, RequestDelta
from kvmesh.router.channel_connection import ChannelConnection
from kvmesh.router.stream_pacer import PaceTick
from kvmesh.router.worker_pool import WorkerPool

logger = logging.getLogger(__name__)

_REOPEN_WAIT_S = 0.1  # between a broken channel and the next open (Ray restarts the actor meanwhile)
_MAX_REOPEN_WAIT_S = 2.0


@dataclass(frozen=True)
class ChannelFailure:
    """Put on a request's subscription when its worker's channel broke or could not open."""

    reason: str
    actor_failed: bool  # the actor died (RayActorError), not a bug in a call
    # The worker incarnation that failed; None = unknown (a submit that never reached one).
    incarnation: str | None = None


@dataclass(frozen=True)
class ReplicaStopping:
    """Put on every request's queue when this replica hands its streams off (it is stopping)."""


REPLICA_STOPPING = ReplicaStopping()


class Subscription:
    """One request's end of its worker's channel: its items (TokenDelta, RequestDelta, a
    ChannelFailure; core/delta_wire.py) wait here until `take` hands over all of them at once,
    so a request that reads late gets one list, not a queue entry per step. `ended` is set once
    the last of them is here (a final, error or failure): a paced stream stops holding then.

    A `take` suspends its stream once: a pace tick that passes with nothing held ends the hold
    without waking it, and the next item wakes it at once (a stream slower than its pace, the
    usual case under a batched engine's steps, would otherwise wake twice a message).

    The request's deadline is one timer for the whole stream (`expire_at`), not one per wait:
    `take` runs once per message."""

    __slots__ = ("items", "ended", "incarnation", "_waiter", "_hold_tick", "_expired", "_deadline_timer")

    def __init__(self):
        self.items: list = []
        self.ended = asyncio.Event()
        # The incarnation that accepted the request (its submit's answer); None until then.
        self.incarnation: str | None = None
        self._waiter: asyncio.Future | None = None
        self._hold_tick: PaceTick | None = None  # holding until this tick: only the stream's end wakes it early
        self._expired = False
        self._deadline_timer: asyncio.TimerHandle | None = None

    def expire_at(self, deadline_s: float | None) -> None:
        """Arm the request's deadline (time.time()); None: no deadline."""
        if deadline_s is not None:
            self._deadline_timer = asyncio.get_running_loop().call_later(max(0.0, deadline_s - time.time()),
                                                                         self._expire)

    def close(self) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()

    def put(self, item) -> None:
        self.items.append(item)
        if type(item) is not TokenDelta and (not isinstance(item, RequestDelta) or item.finished or item.error_type):
            self.ended.set()
            self._hold_tick = None
        if self._hold_tick is None:
            self._wake()

    async def take(self, hold_until: PaceTick | None = None) -> list:
        """Every item that arrived since the last `take` (at least one), in order. With
        `hold_until` (the stream is paced: router/stream_pacer.py), what arrives is held until
        that tick unless the stream's end arrives first. DeadlineExceededError once the
        deadline has passed with nothing to hand over (a hold ends at the deadline, and what
        it held is handed over first)."""
        if hold_until is not None and not self.ended.is_set() and not self._expired:
            self._hold_tick = hold_until
            hold_until.add(self._tick_passed)
        try:
            while self._hold_tick is not None or not self.items:
                if self._expired:
                    if self.items:
                        break
                    raise DeadlineExceededError("the request's deadline passed")
                self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
        finally:
            self._hold_tick = None
        items, self.items = self.items, []
        return items

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _tick_passed(self, tick: PaceTick) -> None:
        """The hold's tick: hand over what was held; with nothing held, the next item goes at once."""
        if self._hold_tick is tick:
            self._hold_tick = None
            if self.items:
                self._wake()

    def _expire(self) -> None:
        self._expired = True
        self._wake()


class WorkerChannels:
    """This replica's channels to its pool's workers; lives on the replica's event loop."""

    def __init__(self, pool: WorkerPool, replica_id: str | None = None):
        self._pool = pool
        self.replica_id = replica_id or uuid.uuid4().hex
        self._subs: dict[str, dict[str, Subscription]] = {}  # worker id -> request id -> its subscription
        self._readers: dict[str, asyncio.Task] = {}
        self._connections: dict[str, ChannelConnection] = {}  # worker id -> its attached socket
        self.handing_off = False  # set by hand_off_all: this replica takes no stream any more
        # What this tick of the event loop submitted to / gave up on each worker, in order:
        # sent as one frame per worker when the tick ends (call_soon), or once the worker's
        # socket is attached.
        self._outbox: dict[str, list[tuple[str, object]]] = {}
        self._flush_due: set[str] = set()
        self._dispatch_seqs: dict[str, int] = {}  # worker id -> the last dispatch number given out

    def next_dispatch_seq(self, worker_id: str) -> int:
        """The number of this replica's next dispatch to the worker (1, 2, ...), in the order
        its submits go out: take it just before `submit` (GenerateRequest.dispatch)."""
        seq = self._dispatch_seqs[worker_id] = self._dispatch_seqs.get(worker_id, 0) + 1
        return seq

    def subscribe(self, worker_id: str, request_id: str) -> Subscription:
        """Where `request_id`'s deltas (and a ChannelFailure) arrive from now on."""
        if worker_id not in self._readers:
            self._subs[worker_id] = {}
            self._readers[worker_id] = asyncio.get_running_loop().create_task(self._read(worker_id))
        sub = Subscription()
        self._subs[worker_id][request_id] = sub
        if self.handing_off:  # admitted after the hand-off: it ends before it starts
            sub.put(REPLICA_STOPPING)
        return sub

    def hand_off_all(self) -> int:
        """End every request on this replica's channels, now and later, with ReplicaStopping;
        returns how many were live."""
        self.handing_off = True
        subs = [sub for by_request in self._subs.values() for sub in by_request.values()]
        for sub in subs:
            sub.put(REPLICA_STOPPING)
        return len(subs)

    def unsubscribe(self, worker_id: str, request_id: str) -> None:
        sub = self._subs.get(worker_id, {}).pop(request_id, None)
        if sub is not None:
            sub.close()

    def submit(self, worker_id: str, request: GenerateRequest) -> None:
        """Send the request to the worker (subscribe first), with the other ops of this tick
        to that worker in one frame; a refusal or failure lands on its subscription."""
        self._queue(worker_id, ("s", request))

    def abort(self, worker_id: str, request_id: str) -> None:
        """Stop the request on the worker (client gone, deadline, error), in the same ordered
        frame as submits: the worker sees the submit first. Scoped on the worker to this
        replica's channel: a client's resumption through another replica may hold the id."""
        try:
            self._queue(worker_id, ("a", request_id))
        except RuntimeError:  # a stream finalized outside the loop (shutdown): the socket's end aborts it
            logger.debug("abort of %s on %s outside the event loop", request_id, worker_id)

    async def close(self) -> None:
        tasks = list(self._readers.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._readers.clear()

    def _queue(self, worker_id: str, op: tuple[str, object]) -> None:
        self._outbox.setdefault(worker_id, []).append(op)
        if worker_id not in self._flush_due and worker_id in self._connections:
            asyncio.get_running_loop().call_soon(self._flush, worker_id)
            self._flush_due.add(worker_id)

    def _flush(self, worker_id: str) -> None:
        """Send the worker's outbox on its attached socket (else it waits for the attach)."""
        self._flush_due.discard(worker_id)
        connection = self._connections.get(worker_id)
        ops = self._outbox.pop(worker_id, None)
        if connection is None or not ops:
            if ops:
                self._outbox[worker_id] = ops
            return
        subs = self._subs.get(worker_id, {})
        for kind, arg in ops:
            if kind == "s" and (sub := subs.get(arg.request_id)) is not None:
                sub.incarnation = connection.incarnation  # its fate is this connection's from now on
        connection.send(ops)

    def _fail_outbox(self, worker_id: str, failure: ChannelFailure) -> None:
        """The socket could not open: the requests waiting to be sent fail (they re-route)."""
        subs = self._subs.get(worker_id, {})
        for kind, arg in self._outbox.pop(worker_id, ()):
            if kind == "s" and (sub := subs.get(arg.request_id)) is not None:
                sub.put(failure)

    async def _read(self, worker_id: str) -> None:
        """Keep the worker's socket open, fanning each message out to its requests' subscriptions.

        A socket is attached to one worker incarnation (its handshake names it), and every
        request sent on it shares its fate: when it breaks, they fail (none of their deltas
        can come). When a new one attaches, the requests of any other incarnation fail too
        (one that died while no socket was attached)."""
        import ray.exceptions

        wait_s = _REOPEN_WAIT_S
        while True:
            try:
                connection = await ChannelConnection.open(self._pool.handle(worker_id), self.replica_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the actor is gone or restarting (Ray's error), or the socket failed
                # Only a death Ray declared marks the worker failed: a restart in progress
                # (ActorUnavailableError) ends with a new incarnation the pool routes to again.
                actor_failed = isinstance(exc, ray.exceptions.ActorDiedError)
                logger.warning("channel of worker %s did not open: %r", worker_id, exc)
                self._fail_outbox(worker_id, ChannelFailure(type(exc).__name__, actor_failed))
                await asyncio.sleep(wait_s)
                wait_s = min(_MAX_REOPEN_WAIT_S, 2 * wait_s)  # a worker gone for good is not retried in a tight loop
                continue
            attached, wait_s = connection.incarnation, _REOPEN_WAIT_S
            for sub in self._subs[worker_id].values():  # sent to an incarnation that is gone
                if sub.incarnation is not None and sub.incarnation != attached:
                    sub.put(ChannelFailure("worker restarted", True, sub.incarnation))
            self._connections[worker_id] = connection
            self._flush(worker_id)
            try:
                subs = self._subs[worker_id]
                async for message in connection.messages():
                    for item in delta_wire.decode(message):
                        sub = subs.get(item[0] if type(item) is TokenDelta else item.request_id)
                        if sub is not None:
                            sub.put(item)
            finally:
                del self._connections[worker_id]
                connection.close()
            # Ended without the worker's word that it closes on purpose: its process is gone.
            actor_failed = not connection.closing
            reason = "worker process lost" if actor_failed else "channel closed by the worker"
            logger.warning("channel of worker %s (incarnation %s) ended: %s", worker_id, attached, reason)
            self._fail_where(worker_id, lambda inc: inc == attached, ChannelFailure(reason, actor_failed, attached))
            await asyncio.sleep(wait_s)

    def _fail_where(self, worker_id: str, incarnation_matches, failure: ChannelFailure) -> None:
        for sub in self._subs[worker_id].values():
            if incarnation_matches(sub.incarnation):
                sub.put(failure)
