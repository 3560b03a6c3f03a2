"""The router replica's end of the worker channels: one Ray stream per worker, fanned out.

Each worker sends this replica one message per engine step holding the deltas of every
request of this replica on it (worker/runtime/delta_channel.py); a request's stream here is
a queue this module fills from that message:

    worker-0 ══ open_channel(replica) ══> reader task ──┬─> queue of request a ─> RequestStream a
                                                        └─> queue of request b ─> RequestStream b
    worker-1 ══ open_channel(replica) ══> reader task ──> ...

    RequestStream:  subscribe(worker, id) -> submit(replica, request) on the worker -> read the queue
                    unsubscribe, and abort(id) on the worker unless the request finished

Failures travel the same path: when a worker's channel breaks (the actor died or restarts),
every request subscribed on it gets `ChannelFailure` (the RequestStream re-routes or resumes,
router/router_core.py) and the reader opens the channel again. A submit the worker refused
comes back as its error delta on the request's queue.

Drain: a replica that is stopping hands its streams back to their clients (`hand_off_all`):
every subscribed request, and any that subscribes later, gets `ReplicaStopping` on its queue;
the RequestStream aborts it on its worker and ends it retryably (router/router_core.py).

Backpressure: the stream is opened with Ray's generator backpressure
(`CHANNEL_BACKPRESSURE_MESSAGES`), so a replica that falls behind makes the worker's channel
wait at its `yield` while it merges the deltas that keep coming (bounded: one pending delta
per live sample), instead of Ray buffering ever more messages for it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass

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
    """Put on a request's queue when its worker's channel or submit call failed."""

    reason: str
    actor_failed: bool  # the actor died (RayActorError), not a bug in a call
    # The worker incarnation that failed; None = unknown (a submit that never reached one).
    incarnation: str | None = None


@dataclass(frozen=True)
class ReplicaStopping:
    """Put on every request's queue when this replica hands its streams off (it is stopping)."""


REPLICA_STOPPING = ReplicaStopping()


@dataclass
class Subscription:
    """One request's end of its worker's channel: its deltas (and a ChannelFailure) on `queue`;
    `ended` is set once the last of them is queued (a final, error or failure): a paced
    stream stops waiting then (router/router_core.py)."""

    queue: asyncio.Queue
    ended: asyncio.Event
    # The incarnation that accepted the request (its submit's answer); None until then.
    incarnation: str | None = None

    def put(self, item) -> None:
        self.queue.put_nowait(item)
        if not isinstance(item, RequestDelta) or item.finished or item.error_type:
            self.ended.set()


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

    def subscribe(self, worker_id: str, request_id: str) -> Subscription:
        """Where `request_id`'s deltas (and a ChannelFailure) arrive from now on."""
        if worker_id not in self._readers:
            self._subs[worker_id] = {}
            self._readers[worker_id] = asyncio.get_running_loop().create_task(self._read(worker_id))
        sub = Subscription(asyncio.Queue(), asyncio.Event())
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

    def submit(self, worker_id: str, request: GenerateRequest) -> asyncio.Task:
        """Send the request to the worker (subscribe first); a refusal or failure lands on its queue."""
        ref = self._pool.handle(worker_id).submit.remote(self.replica_id, request)
        sub = self._subs[worker_id][request.request_id]
        task = asyncio.get_running_loop().create_task(self._await_submit(worker_id, ref, sub))
        self._pending_submits.add(task)
        task.add_done_callback(self._pending_submits.discard)
        return task

    async def close(self) -> None:
        tasks = list(self._readers.values()) + list(self._pending_submits)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._readers.clear()

    async def _await_submit(self, worker_id: str, ref, sub: Subscription) -> None:
        import ray.exceptions

        try:
            answer: str | RequestDelta = await ref
        except ray.exceptions.RayActorError as exc:
            sub.put(ChannelFailure(type(exc).__name__, actor_failed=True))
        except ray.exceptions.RayError as exc:
            logger.error("submit to worker %s raised: %s", worker_id, exc)
            sub.put(ChannelFailure(type(exc).__name__, actor_failed=False))
        else:
            if isinstance(answer, str):  # accepted by this incarnation
                sub.incarnation = answer
                if answer in self._dead.get(worker_id, ()):  # whose channel broke before this answer was read
                    sub.put(ChannelFailure("worker failed", True, answer))
            else:
                sub.put(answer)

    async def _read(self, worker_id: str) -> None:
        """Keep the worker's channel open, fanning each message out to its requests' queues.

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
                    for delta in batch:
                        sub = subs.get(delta.request_id)
                        if sub is not None:
                            sub.put(delta)
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
