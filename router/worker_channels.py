"""The router replica's end of the worker channels: one Ray stream per worker, fanned out.

Each worker sends this replica one message per engine step holding the deltas of every
request of this replica on it (worker/runtime/delta_channel.py, packed as core/delta_wire.py
says); a request's stream here is a Subscription this module fills from that message:

    worker-0 ══ open_channel(replica) ══> reader task ──┬─> subscription a ─> RequestStream a
                                                        └─> subscription b ─> RequestStream b
    worker-1 ══ open_channel(replica) ══> reader task ──> ...

    RequestStream:  subscribe(worker, id) -> submit(worker, request) -> take() from the subscription
                    unsubscribe, and abort(worker, id) unless the request finished

Submits and aborts of one event-loop tick go to each worker as one actor call
(`submit_many`, `abort_many`): under load a tick starts many requests, and an actor call
costs the replica and the worker far more than the request's bytes.

Failures travel the same path: when a worker's channel breaks (the actor died or restarts),
every request subscribed on it gets `ChannelFailure` (the RequestStream re-routes or resumes,
router/router_core.py) and the reader opens the channel again. A submit the worker refused
comes back as its error delta on the request's subscription.

Drain: a replica that is stopping hands its streams back to their clients (`hand_off_all`):
every subscribed request, and any that subscribes later, gets `ReplicaStopping` on its queue;
the RequestStream aborts it on its worker and ends it retryably (router/router_core.py).

Backpressure: the stream is opened with Ray's generator backpressure
(`CHANNEL_BACKPRESSURE_MESSAGES`), so a replica that falls behind makes the worker's channel
wait at its `yield` while it merges the deltas that keep coming (one message for all of
them), instead of Ray buffering ever more messages for it.
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
from kvmesh.router.worker_pool import WorkerPool

logger = logging.getLogger(__name__)

# Messages a worker may have sent this replica that it has not read yet; past that the
# worker's channel waits (and merges) until the replica catches up.
CHANNEL_BACKPRESSURE_MESSAGES = 16
_REOPEN_WAIT_S = 0.1  # between a broken channel and the next open (Ray restarts the actor meanwhile)
_MAX_REOPEN_WAIT_S = 2.0


@dataclass(frozen=True)
class ChannelFailure:
    """Put on a request's subscription when its worker's channel or submit call failed."""

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
    the last of them is here (a final, error or failure): a paced stream stops waiting then
    (router/router_core.py)."""

    __slots__ = ("items", "ended", "incarnation", "_waiter")

    def __init__(self):
        self.items: list = []
        self.ended = asyncio.Event()
        # The incarnation that accepted the request (its submit's answer); None until then.
        self.incarnation: str | None = None
        self._waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        self.items.append(item)
        if type(item) is not TokenDelta and (not isinstance(item, RequestDelta) or item.finished or item.error_type):
            self.ended.set()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self, deadline_s: float | None) -> list:
        """Every item that arrived since the last `take` (at least one), in order;
        DeadlineExceededError at `deadline_s` (time.time()). One timer per wait, not
        asyncio.wait_for's task: this runs once per message."""
        if not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                if deadline_s is None:
                    await self._waiter
                else:
                    async with asyncio.timeout(max(0.0, deadline_s - time.time())):
                        await self._waiter
            except TimeoutError:
                raise DeadlineExceededError("the request's deadline passed") from None
            finally:
                self._waiter = None
        items, self.items = self.items, []
        return items


class WorkerChannels:
    """This replica's channels to its pool's workers; lives on the replica's event loop."""

    def __init__(self, pool: WorkerPool, replica_id: str | None = None):
        self._pool = pool
        self.replica_id = replica_id or uuid.uuid4().hex
        self._subs: dict[str, dict[str, Subscription]] = {}  # worker id -> request id -> its subscription
        self._readers: dict[str, asyncio.Task] = {}
        self._pending_submits: set[asyncio.Task] = set()
        self._dead: dict[str, set[str]] = {}  # worker id -> incarnations whose channel broke
        self.handing_off = False  # set by hand_off_all: this replica takes no stream any more
        # What this tick of the event loop submitted to / gave up on each worker: sent as one
        # actor call per worker when the tick ends (call_soon), not one call per request.
        self._submits: dict[str, list[tuple[GenerateRequest, Subscription]]] = {}
        self._aborts: dict[str, list[str]] = {}

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
        self._subs.get(worker_id, {}).pop(request_id, None)

    def submit(self, worker_id: str, request: GenerateRequest) -> None:
        """Send the request to the worker (subscribe first), with the other submits of this
        tick to that worker in one `submit_many` call; a refusal or failure lands on its
        subscription."""
        batch = self._submits.get(worker_id)
        if batch is None:
            batch = self._submits[worker_id] = []
            asyncio.get_running_loop().call_soon(self._send_submits, worker_id)
        batch.append((request, self._subs[worker_id][request.request_id]))

    def abort(self, worker_id: str, request_id: str) -> None:
        """Stop the request on the worker (client gone, deadline, error), batched per tick as
        submits are and sent after them: the worker sees the submit first."""
        batch = self._aborts.get(worker_id)
        if batch is None:
            batch = self._aborts[worker_id] = []
            try:
                asyncio.get_running_loop().call_soon(self._send_aborts, worker_id)
            except RuntimeError:  # a stream finalized outside the loop (shutdown): send it now
                batch.append(request_id)
                self._send_aborts(worker_id)
                return
        batch.append(request_id)

    async def close(self) -> None:
        tasks = list(self._readers.values()) + list(self._pending_submits)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._readers.clear()

    def _send_submits(self, worker_id: str) -> None:
        batch = self._submits.pop(worker_id)
        try:
            ref = self._pool.handle(worker_id).submit_many.remote(self.replica_id, [r for r, _ in batch])
        except Exception as exc:  # the handle is gone: nothing reached the worker
            for _, sub in batch:
                sub.put(ChannelFailure(type(exc).__name__, actor_failed=False))
            return
        task = asyncio.get_running_loop().create_task(self._await_submits(worker_id, ref, [s for _, s in batch]))
        self._pending_submits.add(task)
        task.add_done_callback(self._pending_submits.discard)

    def _send_aborts(self, worker_id: str) -> None:
        request_ids = self._aborts.pop(worker_id)
        try:
            # Scoped to this replica's channel: a client's resumption through another replica
            # may hold the id there by now (WorkerActor.abort_many).
            self._pool.handle(worker_id).abort_many.remote(request_ids, self.replica_id)
        except Exception as exc:  # the actor is gone: nothing left to stop
            logger.debug("abort of %d requests on %s: %s", len(request_ids), worker_id, exc)

    async def _await_submits(self, worker_id: str, ref, subs: list[Subscription]) -> None:
        import ray.exceptions

        try:
            answers: list[str | RequestDelta] = await ref
        except ray.exceptions.RayActorError as exc:
            for sub in subs:
                sub.put(ChannelFailure(type(exc).__name__, actor_failed=True))
            return
        except ray.exceptions.RayError as exc:
            logger.error("submit to worker %s raised: %s", worker_id, exc)
            for sub in subs:
                sub.put(ChannelFailure(type(exc).__name__, actor_failed=False))
            return
        dead = self._dead.get(worker_id, ())
        for sub, answer in zip(subs, answers):
            if isinstance(answer, str):  # accepted by this incarnation
                sub.incarnation = answer
                if answer in dead:  # whose channel broke before this answer was read
                    sub.put(ChannelFailure("worker failed", True, answer))
            else:
                sub.put(answer)

    async def _read(self, worker_id: str) -> None:
        """Keep the worker's channel open, fanning each message out to its requests' subscriptions.

        A stream's first message names the worker incarnation it is attached to. When a stream
        breaks, the requests accepted by that incarnation fail (none of their deltas can come);
        when a new one attaches, so do the requests accepted by any other (an incarnation that
        died while no stream was attached). A stream that breaks before attaching (the actor
        was restarting) fails nobody: requests sent meanwhile reached the new incarnation."""
        import ray.exceptions

        wait_s = _REOPEN_WAIT_S
        while True:
            attached: str | None = None
            reason, actor_failed = "channel ended", False
            stream = self._pool.handle(worker_id).open_channel.options(
                num_returns="streaming",
                _generator_backpressure_num_objects=CHANNEL_BACKPRESSURE_MESSAGES).remote(self.replica_id)
            try:
                async for ref in stream:
                    batch = await ref
                    if attached is None:  # the handshake: the incarnation this stream talks to
                        attached, wait_s = batch, _REOPEN_WAIT_S
                        self._fail_where(worker_id, lambda inc: inc is not None and inc != attached,
                                         ChannelFailure("worker restarted", True, None))
                        continue
                    subs = self._subs[worker_id]
                    for item in delta_wire.decode(batch):
                        sub = subs.get(item[0] if type(item) is TokenDelta else item.request_id)
                        if sub is not None:
                            sub.put(item)
            except asyncio.CancelledError:
                _cancel_quietly(stream)
                raise
            except ray.exceptions.RayActorError as exc:
                reason, actor_failed = type(exc).__name__, True
            except ray.exceptions.RayError as exc:
                reason = type(exc).__name__
                logger.warning("channel of worker %s broke: %s", worker_id, exc)
            if attached is not None:
                if actor_failed:
                    self._dead.setdefault(worker_id, set()).add(attached)
                self._fail_where(worker_id, lambda inc: inc == attached, ChannelFailure(reason, actor_failed, attached))
            await asyncio.sleep(wait_s)
            wait_s = min(_MAX_REOPEN_WAIT_S, 2 * wait_s)  # a worker gone for good is not retried in a tight loop

    def _fail_where(self, worker_id: str, incarnation_matches, failure: ChannelFailure) -> None:
        for sub in self._subs[worker_id].values():
            if incarnation_matches(sub.incarnation):
                sub.put(failure)


def _cancel_quietly(stream) -> None:
    import ray

    try:
        ray.cancel(stream)
    except Exception as exc:  # finished, or the actor is gone
        logger.debug("cancel of a channel: %s", exc)
