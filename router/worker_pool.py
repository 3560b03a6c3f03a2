"""The router replica's view of the worker actors: handles, latest stats, health.

Every router replica keeps its own `WorkerPool`; replicas agree because each one learns
the same facts from the same workers (stats and prefix-cache events), not from a shared
in-memory global. One watcher task per worker keeps exactly one `poll` call in flight:

    watcher(worker-i):  poll(since_seq) ──ok──> stats, prefix events -> PrefixIndex, healthy
                              │
                              ├─ RayActorError ─> unhealthy; sleep; poll again
                              ├─ no answer within the slow-poll timeout -> late; keep
                              │  waiting on the same call (a restarting actor answers late;
                              │  piling up calls on it would only delay it)
                              └─ no answer within _SLOW_POLL_CAP_S -> unhealthy

Slow is not gone: a dead actor's call fails (RayActorError) and a restarting one's raises
ActorUnavailableError, both at once; an unanswered poll only means the worker is slower than
expected. The timeout is therefore relative to how slowly polls are answered right now
(`slow_poll_timeout_s`): on a loaded machine every poll takes seconds, and a fixed 2 s timeout
took workers out of routing while they were serving (131 such warnings in one afternoon of
this project's test runs on a shared 2-core machine), sending all traffic to the others:
prefix families split, one worker computed 1.68x the other's tokens.

A worker is routable when its last poll succeeded, it reported `healthy`, and no request
stream has failed on that same incarnation since. A late worker (its poll unanswered past the
slow-poll timeout, not yet past the cap) is routed to only while no on-time worker of its pool
(main or fallback) is routable: Envoy's panic threshold in small. A slow worker beats none: when
a node dies, the survivor suddenly holds the whole load and on a loaded machine answers its
polls late; taking it out too refused every request ("no healthy worker") until it caught up. A failed stream (`mark_failed`) takes
the worker out at once, without waiting for the next poll. Ray restarts the actor
(`max_restarts=-1`); the first poll answered by the new incarnation brings it back and
drops what the prefix index knew of the old one (its cache died with it).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.core.config import KvmeshConfig
from kvmesh.router.degradation import FALLBACK_WORKER_PREFIX, fallback_app_name, fallback_pool_config
from kvmesh.router.prefix_index import PrefixIndex
from kvmesh.worker.public_api import WorkerInfo, WorkerPoll, start_workers
from kvmesh.core.seams import DispatchReport, WorkerStats

logger = logging.getLogger(__name__)

_MAX_POLL_WAIT_S = 300.0  # longer than any model load; then the call is presumed lost
# An unanswered poll marks a worker down after this many times the slowest recent answer
# (any worker's), at least the configured floor and at most _SLOW_POLL_CAP_S.
SLOW_POLL_FACTOR = 4.0
_SLOW_POLL_CAP_S = 60.0
_POLL_HISTORY = 32  # recent answered polls' round trips, all workers together
# A replica waiting for its first routable worker logs why the workers are not, this often.
WAIT_REPORT_EVERY_S = 30.0
_NO_DISPATCHES = DispatchReport()  # a worker that took none of a replica's dispatches (yet)


def slow_poll_timeout_s(floor_s: float, recent_round_trips_s) -> float:
    """How long a poll may go unanswered before its worker is taken out of routing: the floor,
    or SLOW_POLL_FACTOR x the slowest recent round trip when the machine is that slow (capped:
    a worker that stopped answering altogether is still taken out within a minute)."""
    slowest = max(recent_round_trips_s, default=0.0)
    return min(max(floor_s, SLOW_POLL_FACTOR * slowest), max(floor_s, _SLOW_POLL_CAP_S))


@dataclass
class _WorkerState:
    """Mutable, owned by the pool (the replica's event loop): no locks."""

    worker_id: str
    handle: object  # ray.actor.ActorHandle
    info: WorkerInfo | None = None
    stats: WorkerStats | None = None
    polled_ok: bool = False
    failed_incarnation: str | None = None  # a stream failed on this incarnation
    last_error: str = ""
    last_ok_time: float = 0.0
    metrics_snapshot: bytes = b""  # the worker's EngineMetrics, as of its last poll
    late: bool = False  # its current poll is past the slow-poll timeout (not yet the cap)
    # Per router replica, which of its dispatches `stats` holds (WorkerPoll.dispatches, read
    # with the stats); None: the worker keeps no such log.
    dispatches: dict[str, DispatchReport] | None = None
    previous_dispatches: dict[str, DispatchReport] | None = None  # the poll's before (replica_sharing)

    @property
    def routable(self) -> bool:
        return (self.polled_ok and self.stats is not None and self.stats.healthy
                and self.info is not None and self.info.incarnation != self.failed_incarnation)


def routable_now(states: dict[str, _WorkerState]) -> set[str]:
    """The workers to route to: the routable ones that are on time, plus, in a pool (main or
    fallback) where none is on time, its routable late ones (a slow worker beats none)."""
    result: set[str] = set()
    for in_fallback in (False, True):
        pool = [s for s in states.values()
                if s.routable and s.worker_id.startswith(FALLBACK_WORKER_PREFIX) == in_fallback]
        on_time = [s for s in pool if not s.late]
        result.update(s.worker_id for s in (on_time or pool))
    return result


class WorkerPool:
    def __init__(self, config: KvmeshConfig, app_name: str, prefix_index: PrefixIndex | None = None):
        self._config = config
        self._app_name = app_name
        # A dispatched prefix is claimed until its STORED events have surely been polled.
        self._base_linger_s = 4 * config.router.stats_refresh_s
        self.prefix_index = prefix_index or PrefixIndex(linger_s=self._base_linger_s)
        self._workers: dict[str, _WorkerState] = {}
        self._watchers: list[asyncio.Task] = []
        self._refresh_s = config.router.stats_refresh_s
        # A poll is a few dict reads on the worker; several refresh periods without an answer
        # means the actor is gone or restarting, not slow.
        self._poll_timeout_s = max(2.0, 8 * self._refresh_s)
        self._poll_round_trips_s: collections.deque[float] = collections.deque(maxlen=_POLL_HISTORY)
        self._changed = asyncio.Event()
        # Called with (stats_for_routing(), taken_at) after every change: admission and
        # metrics follow the pool. taken_at is time.monotonic() when the poll was sent.
        self.on_stats: Callable[[list[WorkerStats], float | None], None] | None = None
        # Workers of the fallback pool (degradation.fallback_pool): only degraded requests go there.
        self.fallback_ids: frozenset[str] = frozenset()

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Find or create the workers and start watching them (call on the event loop)."""
        groups = [(self._config, self._app_name, "worker")]
        fallback = fallback_pool_config(self._config)
        if fallback is not None:  # the degradation ladder's second worker group
            groups.append((fallback, fallback_app_name(self._app_name), FALLBACK_WORKER_PREFIX))
        for config, app_name, prefix in groups:
            for index, handle in enumerate(start_workers(config, app_name, prefix)):
                worker_id = f"{prefix}-{index}"
                self._workers[worker_id] = _WorkerState(worker_id, handle)
                self._watchers.append(asyncio.get_running_loop().create_task(self._watch(worker_id)))
        self.fallback_ids = frozenset(w for w in self._workers if w.startswith(FALLBACK_WORKER_PREFIX + "-"))

    async def wait_routable(self, timeout_s: float, min_workers: int = 1,
                            report_every_s: float = WAIT_REPORT_EVERY_S) -> bool:
        """Wait until at least `min_workers` workers are routable (model loads take a while).
        Every `report_every_s` of waiting it logs why each worker is not routable yet
        (`not_routable_reasons`): a replica waiting on its workers says what for."""
        deadline = time.monotonic() + timeout_s
        next_report = time.monotonic() + report_every_s
        while len(self.routable_ids()) < min_workers:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                logger.error("no routable worker after %.0fs: %s", timeout_s, self.not_routable_reasons())
                return False
            if time.monotonic() >= next_report:
                logger.warning("waiting for a routable worker (%.0fs left): %s", remaining, self.not_routable_reasons())
                next_report = time.monotonic() + report_every_s
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=min(remaining, 1.0))
            except asyncio.TimeoutError:
                pass
        return True

    async def close(self) -> None:
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        self._watchers.clear()

    # ---- queries -------------------------------------------------------------------------

    def not_routable_reasons(self) -> dict[str, str]:
        """worker id -> why it is not routable (routable ones left out)."""
        reasons = {}
        for worker_id, state in sorted(self._workers.items()):
            if state.routable:
                continue
            if not state.polled_ok:
                why = f"no poll answered yet ({state.last_error or 'waiting'})"
            elif state.stats is None or not state.stats.healthy:
                why = "reports unhealthy (draining or failed)"
            elif state.info is not None and state.info.incarnation == state.failed_incarnation:
                why = f"a stream failed on this incarnation ({state.last_error})"
            else:
                why = "unknown"
            reasons[worker_id] = why + (", late" if state.late else "")
        return reasons

    @property
    def worker_ids(self) -> list[str]:
        return sorted(self._workers)

    def routable_ids(self) -> list[str]:
        routable = routable_now(self._workers)
        return [w for w in self.worker_ids if w in routable]

    def handle(self, worker_id: str):
        return self._workers[worker_id].handle

    def info(self, worker_id: str) -> WorkerInfo | None:
        return self._workers[worker_id].info

    def any_info(self) -> WorkerInfo | None:
        return next((s.info for s in self._workers.values() if s.info is not None), None)

    def engine_snapshots(self) -> dict[str, bytes]:
        """worker id -> its latest EngineMetrics snapshot (step time), for /metrics."""
        return {w: s.metrics_snapshot for w, s in sorted(self._workers.items()) if s.metrics_snapshot}

    def dispatches_seen_by(self, replica_id: str) -> dict[str, DispatchReport | None]:
        """worker id -> which of `replica_id`'s dispatches its current stats hold (an empty
        report: none; None: the worker does not say, the router counts by time)."""
        return {w: (s.dispatches.get(replica_id, _NO_DISPATCHES) if s.dispatches is not None else None)
                for w, s in self._workers.items() if s.stats is not None}

    def replicas_sharing(self, replica_id: str) -> dict[str, int]:
        """worker id -> how many other router replicas are sending it requests: those whose
        dispatches it still runs or queues, or took in since its previous poll (each worker's
        own DispatchLog says; a worker that keeps none counts none). Between two reports each
        replica counts only its own dispatches, so these share the room the report leaves
        (router/admission_budget.py, "Several replicas")."""
        sharing = {}
        for worker_id, state in self._workers.items():
            if state.stats is None or not state.dispatches:
                continue
            # On a first poll (no earlier one to compare) only live dispatches count: the log
            # remembers every replica that ever sent the worker anything, earlier deployments'
            # gone ones included, and counted as new they took this replica's room for a whole
            # refresh period.
            before = state.previous_dispatches
            sharing[worker_id] = sum(
                1 for replica, report in state.dispatches.items()
                if replica != replica_id and (report.live_seqs or (
                    before is not None and report.seen_seq > before.get(replica, _NO_DISPATCHES).seen_seq)))
        return sharing

    def stats_for_routing(self) -> list[WorkerStats]:
        """Latest stats of every worker that has reported, `healthy` as the router sees it
        (a worker whose stream just failed is unhealthy even if its last stats said not)."""
        result = []
        routable = routable_now(self._workers)
        for worker_id in self.worker_ids:
            state = self._workers[worker_id]
            if state.stats is None:
                continue
            if state.stats.healthy != (worker_id in routable):
                result.append(_with_health(state.stats, worker_id in routable))
            else:
                result.append(state.stats)
        return result

    async def read_stats_now(self, timeout_s: float) -> list[tuple[WorkerStats, float]]:
        """(stats, age in seconds) of every worker that has reported: each routable worker's
        read from its engine now (age 0); one that is not routable or does not answer within
        `timeout_s`, as of its last poll. For GetStats; routing keeps using the polled view."""
        calls = {w: asyncio.ensure_future(_await_ref(self._workers[w].handle.stats.remote()))
                 for w in self.routable_ids()}
        if calls:
            await asyncio.wait(calls.values(), timeout=timeout_s)
        now = time.time()
        result = []
        for stats in self.stats_for_routing():
            call = calls.get(stats.worker_id)
            if call is not None and call.done() and not call.cancelled() and call.exception() is None:
                result.append((_with_health(call.result(), stats.healthy), 0.0))
            else:
                if call is not None:
                    call.cancel()
                result.append((stats, max(0.0, now - self._workers[stats.worker_id].last_ok_time)))
        return result

    # ---- failures ------------------------------------------------------------------------

    def mark_failed(self, worker_id: str, reason: str, incarnation: str | None = None) -> None:
        """A request stream on this worker failed: stop routing to it until it comes back.
        `incarnation`: the one that failed, when known; a failure of an older one than the
        pool now knows (the worker already restarted) changes nothing."""
        state = self._workers[worker_id]
        if incarnation is not None and state.info is not None and incarnation != state.info.incarnation:
            return
        if state.info is not None and state.failed_incarnation != state.info.incarnation:
            state.failed_incarnation = state.info.incarnation
            state.last_error = reason
            logger.warning("worker %s marked unavailable: %s", worker_id, reason)
            self._changed.set()
            self._notify(None)

    # ---- polling -------------------------------------------------------------------------

    async def _watch(self, worker_id: str) -> None:
        import ray.exceptions

        state = self._workers[worker_id]
        while True:
            taken_at = time.monotonic()
            ref = state.handle.poll.remote(self.prefix_index.next_seq(worker_id))
            future = asyncio.ensure_future(_await_ref(ref))
            timeout_s = slow_poll_timeout_s(self._poll_timeout_s, self._poll_round_trips_s)
            try:
                done, _ = await asyncio.wait({future}, timeout=timeout_s)
                if not done:
                    self._set_late(state, f"no answer to poll within {timeout_s:.1f}s")
                    done, _ = await asyncio.wait({future}, timeout=max(0.0, _SLOW_POLL_CAP_S - timeout_s))
                    if not done:
                        self._set_down(state, f"no answer to poll within {max(timeout_s, _SLOW_POLL_CAP_S):.0f}s")
                    # A restart (process start + model load) answers late; a call that never
                    # answers is dropped after a generous bound and the poll sent again.
                    poll = await asyncio.wait_for(future, timeout=_MAX_POLL_WAIT_S)
                    if state.info is not None and poll.info.incarnation == state.info.incarnation:
                        # Late, not restarted: this is how slow polls are now.
                        self._poll_round_trips_s.append(time.monotonic() - taken_at)
                else:
                    poll = future.result()
                    self._poll_round_trips_s.append(time.monotonic() - taken_at)
                # The claim must outlive the next poll that reports the request's blocks: on a
                # loaded machine a poll round trip alone can exceed the base linger.
                self.prefix_index.linger_s = max(self._base_linger_s,
                                                 self._refresh_s + 2 * max(self._poll_round_trips_s, default=0.0))
                self._apply(state, poll)
                self._notify(taken_at)
            except asyncio.CancelledError:
                future.cancel()
                raise
            except asyncio.TimeoutError:
                logger.warning("worker %s: poll unanswered for %.0fs; polling again", worker_id, _MAX_POLL_WAIT_S)
            except ray.exceptions.RayError as exc:
                self._set_down(state, f"{type(exc).__name__}")
            except Exception:  # a bug in applying a poll must not kill the watcher
                logger.exception("applying the poll of %s failed", worker_id)
                self._set_down(state, "poll could not be applied")
            await asyncio.sleep(self._refresh_s)

    def _apply(self, state: _WorkerState, poll: WorkerPoll) -> None:
        was_routable = state.routable
        was_late, state.late = state.late, False  # it answered
        if state.info is not None and state.info.incarnation != poll.info.incarnation:
            # A restart: the old cache died with the old process, and these events were
            # asked for from the old incarnation's sequence numbers. Forget both and let
            # the next poll (since_seq=0) rebuild the worker's prefix view.
            logger.warning("worker %s restarted (incarnation %s -> %s)", state.worker_id,
                           state.info.incarnation, poll.info.incarnation)
            self.prefix_index.remove_worker(state.worker_id)
            state.info, state.stats, state.polled_ok = poll.info, poll.stats, False
            state.dispatches = getattr(poll, "dispatches", None)
            self._changed.set()
            return
        state.info, state.stats = poll.info, poll.stats
        state.previous_dispatches = state.dispatches
        state.dispatches = getattr(poll, "dispatches", None)  # a worker of an older version has none
        state.metrics_snapshot = poll.metrics_snapshot
        self.prefix_index.apply(poll.prefix_events)
        state.polled_ok = True
        state.last_ok_time = time.time()
        if state.routable != was_routable:
            logger.info("worker %s is %s", state.worker_id, "routable" if state.routable else "not routable")
        if state.routable != was_routable or was_late:
            self._changed.set()

    def _set_late(self, state: _WorkerState, reason: str) -> None:
        if state.polled_ok and not state.late:
            logger.warning("worker %s late: %s (routed to only while no on-time worker is routable)",
                           state.worker_id, reason)
        state.late = True
        state.last_error = reason
        self._changed.set()
        self._notify(None)

    def _set_down(self, state: _WorkerState, reason: str) -> None:
        if state.polled_ok:
            logger.warning("worker %s not answering: %s", state.worker_id, reason)
        state.polled_ok = False
        state.late = False
        state.last_error = reason
        self._changed.set()
        self._notify(None)

    def _notify(self, taken_at: float | None) -> None:
        if self.on_stats is not None:
            self.on_stats(self.stats_for_routing(), taken_at)


async def _await_ref(ref):
    return await ref


def _with_health(stats: WorkerStats, healthy: bool) -> WorkerStats:
    return dataclasses.replace(stats, healthy=healthy)

