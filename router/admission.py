"""Admission control at the router: token budgets from measured capacity, a bounded wait
queue, a separate smaller lane for retries, and fast rejection with a measured retry-after.

The per-worker KV budget (what a request costs, what each worker has committed, whether it
fits, and how the router counts admissions its workers have not reported yet) is
router/admission_budget.py's; this module decides order and answers: the queue, its lanes,
the degradation ladder's steps, deadline shedding and retry-after.

Queue: requests that do not fit wait (per lane: by priority class, lower = more important,
then FIFO) until a refresh or a release makes room, up to `max_queue_wait_s` or their
deadline. A more important request therefore waits only behind requests of its own class or
better, as in the engine's queue (worker/engine_loop/scheduler.py), instead of behind a flood of less
important work; and when its lane is full, the lane's least important, newest waiter is
refused (OverloadedError with retry-after) to give it the slot. Two lanes:

    first attempts   max_queue_len - retry_slots slots; served first (a retry is admitted
                     only while no first attempt is waiting)
    retries          retry_slots = floor(max_queue_len x retry_lane_fraction) slots, and the
                     retries admitted and still running may hold at most retry_lane_fraction
                     of the cluster's KV capacity (one retry may always run, so retries
                     cannot starve forever)

so a retry storm fills its own small lane and is rejected there, while first attempts keep
their queue and their share of the budget.

The degradation ladder (router/degradation.py) asks in steps: queue up to the rule's wait
(`max_wait_s`), then a capped or fallback request "now" (`max_wait_s=0`). Two things keep a
step from being refused while it has room:
- its place: every step passes the time it first asked (`queued_since`), so only waiters
  ahead of that place (more important, or its own class asked earlier) that could use the
  same workers hold it back. Requests of one class that queued together step down together;
  a later one of its class, still waiting and about to step down itself, is behind it.
- the double count (router/admission_budget.py, "In-flight accounting"): a step that fits
  on the workers' reports plus only the
  admissions sent after them waits for the next reports (at its place) instead of being
  refused on the extra refresh period; it is refused as soon as it would not fit even so.
  Another step arriving behind such waiters (and only such) waits with them, in order.
Measured on the cluster: right after a long request's first token, a capped request that
fit was refused in 3 of 24 tries (the long one counted twice); with the wait, 0 of 20.

Deadline-aware shedding (`deadline_shedding`, on by default): a request that must queue and
carries a deadline is refused at once (`DeadlineUnmeetableError`, an `OverloadedError` with
retry-after) when its expected wait, the same drain estimate as retry-after below without
its one-refresh floor, already ends after the deadline: waiting would only end in
DeadlineExceededError while holding a queue slot. Judged once, on arrival; with no measured
drain rate nothing is known, and the request queues as before.

Over the limit (lane full, or the wait ran out) the answer is immediate: `OverloadedError`
with `retry_after_s = tokens that must drain / measured drain rate`, where the tokens are
the request's overflow on its best worker plus the cost of everything queued ahead of it,
and the drain rate is the sum of the healthy workers' `output_tokens_per_s` (reservations are
freed as output is produced, so this errs long, never short). A retry refused by its lane
is told no sooner than the running retries should leave room in the lane's budget: they end
at their share of the drain (their tokens over all committed tokens). So is a refused first
attempt: it comes back as a retry. Before any rate has been measured the answer is one stats
refresh interval: nothing better is known until then.

`acquire` returns an `AdmissionTicket`; releasing it (a `with` block, or `release()`,
idempotent) on every terminal path returns the in-flight reservation. Single-owner state on
the replica's event loop: no locks.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvmesh.core.config import RouterConfig
from kvmesh.core.seams import DispatchReport, WorkerStats
from kvmesh.router.admission_budget import (AdmissionTicket, CostFn, WorkerBudgets, cost_on_worker,
                                            cost_with_cached_prefix, request_cost_tokens)
from kvmesh.router.admission_queue import HELD, Held, HoldFn, RouteFn, Waiter, enqueue, excluding
from kvmesh.core.errors import (
    DeadlineExceededError,
    DeadlineUnmeetableError,
    InvalidRequestError,
    OverloadedError,
    QueueSlotTakenError,
    WorkerFailedError,
)

logger = logging.getLogger(__name__)

# The request costs and the ticket live with the budget; importable from here as before.
__all__ = ["AdmissionSnapshot", "AdmissionTicket", "RouterAdmission", "cost_on_worker", "cost_with_cached_prefix",
           "request_cost_tokens"]


@dataclass(frozen=True)
class AdmissionSnapshot:
    """Figures for GetStats and metrics."""

    num_queued_first: int
    num_queued_retry: int
    num_in_flight: int  # tickets not yet released
    retry_tokens_in_flight: int
    committed_tokens: int  # cluster: reserved (stats) + in flight since refresh
    capacity_tokens: int
    drain_tokens_per_s: float
    num_deadline_shed: int = 0  # requests refused on arrival because their deadline could not be met
    num_evicted: int = 0  # waiters refused to free a full lane's slot for a more important request


class RouterAdmission:
    def __init__(self, config: RouterConfig, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, kv_reserved_fraction: float = 0.0,
                 kv_reserved_below_class: int = 1, workers_preempt_kv_reservations: bool = False):
        self._config = config
        # Each worker's KV budget as this router sees it (router/admission_budget.py).
        self.budgets = WorkerBudgets(config, clock, kv_reserved_fraction=kv_reserved_fraction,
                                     kv_reserved_below_class=kv_reserved_below_class,
                                     workers_preempt_kv_reservations=workers_preempt_kv_reservations)
        self._clock = clock
        self._wall_clock = wall_clock  # deadlines are absolute time.time() values
        self._num_deadline_shed = 0
        self._num_evicted = 0  # waiters refused to give their slot to a more important request
        self._last_place = -math.inf  # see now()
        self._live: set[AdmissionTicket] = set()
        self._retry_tokens_live = 0
        self._first_lane: collections.deque[Waiter] = collections.deque()
        self._retry_lane: collections.deque[Waiter] = collections.deque()
        self.retry_slots = math.floor(config.max_queue_len * config.retry_lane_fraction)
        self.first_slots = config.max_queue_len - self.retry_slots

    # ---- inputs ---------------------------------------------------------------------------

    def update_stats(self, workers: Sequence[WorkerStats], taken_at: float | None = None,
                     dispatches: Mapping[str, DispatchReport | None] | None = None,
                     replicas_sharing: Mapping[str, int] | None = None) -> None:
        """Replace the workers' figures. `taken_at` (this controller's clock) is when the
        stats were requested: admissions sent before it are assumed counted by the workers,
        except where `dispatches` says which are (WorkerBudgets.update_stats).
        `replicas_sharing`: worker id -> the other router replicas sending it requests."""
        taken_at = self._clock() if taken_at is None else taken_at
        self.budgets.update_stats(workers, taken_at, dispatches, replicas_sharing)
        self._pump()

    def now(self) -> float:
        """A place in line for acquire's `queued_since`: this controller's clock, strictly
        increasing from call to call, so two requests never share a place (first asked, first)."""
        self._last_place = max(self._clock(), math.nextafter(self._last_place, math.inf))
        return self._last_place

    async def acquire(self, cost_tokens: int, *, attempt: int = 1, route: RouteFn | None = None,
                      deadline_s: float | None = None, cost_for: CostFn | None = None,
                      exclude: frozenset[str] = frozenset(), priority_class: int = 0,
                      max_wait_s: float | None = None, queued_since: float | None = None,
                      hold: HoldFn | None = None, load_for: CostFn | None = None) -> AdmissionTicket:
        """Admit now, wait for room, or raise (OverloadedError, WorkerFailedError,
        InvalidRequestError, DeadlineExceededError). `deadline_s` is absolute time.time().
        `cost_tokens` is the whole cost (nothing cached); `cost_for(worker_id)`, when given,
        the cost on one worker with its cached prefix taken off (never more than the whole).
        Workers in `exclude` (one that already refused this request) are never chosen.
        `load_for(worker_id)`: the tokens it adds to that worker's load (what it computes
        there) when not its KV cost: a cached prefix no live request holds costs KV, not work.
        `priority_class` (lower = more important) orders the wait queue. `max_wait_s` bounds
        the wait below router.max_queue_wait_s (the degradation ladder's queue step); 0 admits
        now or raises OverloadedError without queueing (see below for the one exception).

        `queued_since` (this controller's clock, `now()`): when the request first asked. The
        degradation ladder passes it to every step after its queue step, so a request stepping
        down keeps its place: only waiters ahead of that place (a more important class, or its
        own class asked earlier) and able to use the same workers can hold it back, never one
        of its class that came after it (which will itself step down a moment later).

        A try-now (max_wait_s 0) that fits only if the admissions this router sent just before
        the workers' latest reports are already in them (the budget keeps counting them for a
        refresh, see "In-flight accounting") does not get a refusal that is only an artefact of
        that double count: it waits at its place for the next reports and is admitted, or
        refused once it would not fit even without them. So does one that finds only such
        waiters ahead of it; any other waiter ahead means a real queue: refused.

        `hold(eligible)`: True while the request would rather wait than take any of the
        workers with room (the affinity wait); it then queues at its place, stepped over by
        the waiters behind it. A try-now never holds, nor does a request the queue has no slot
        for (it takes what there is instead of being refused)."""
        healthy = self.budgets.healthy()
        if not healthy:
            raise WorkerFailedError("no healthy worker to admit the request to")
        if exclude:
            cost_for = excluding(cost_for or (lambda _: cost_tokens), exclude)
        largest = max(w.kv_tokens_capacity for w in healthy)
        if cost_tokens > largest:
            raise InvalidRequestError(
                f"prompt plus max_tokens needs {cost_tokens} KV tokens; the largest worker holds {largest}")
        lane = self._retry_lane if attempt > 1 else self._first_lane
        place = self.now() if queued_since is None else queued_since
        slots = self.retry_slots if attempt > 1 else self.first_slots
        ahead = self._waiters_ahead(lane, priority_class, place, exclude)
        retry_held = attempt > 1 and any(not w.holding for w in self._first_lane)
        if max_wait_s == 0:
            hold = None
        held = False
        if not ahead and not retry_held:  # admit at once if it fits
            ticket = self._try_admit(cost_tokens, attempt, route, queued_since=queued_since, cost_for=cost_for,
                                     priority_class=priority_class,
                                     hold=hold if len(lane) < slots else None,  # no slot to hold out in
                                     load_for=load_for)
            if isinstance(ticket, AdmissionTicket):
                return ticket
            held = ticket is HELD
        if max_wait_s == 0:
            # Behind other try-nows waiting for the same reports (requests stepping down
            # together) it waits with them, in order; behind a real queue it is refused.
            if not (all(w.until_settled for w in ahead) and not retry_held and len(lane) < slots
                    and self.budgets.eligible(cost_tokens, cost_for, priority_class, as_reported=True)[0]):
                raise self._overloaded(cost_tokens, attempt, "no room now")
            return await self._wait(lane, cost_tokens, attempt, route, deadline_s, cost_for, priority_class,
                                    None, place, exclude, until_settled=True, load_for=load_for)
        if len(lane) >= slots and not self._evict_less_important(lane, priority_class):
            raise self._overloaded(cost_tokens, attempt, "admission queue full")
        # A request holding out could run now elsewhere: its wait is its own choice, never shed.
        if deadline_s is not None and self._config.deadline_shedding and not held:
            self._shed_if_deadline_unmeetable(cost_tokens, lane, deadline_s, priority_class)
        return await self._wait(lane, cost_tokens, attempt, route, deadline_s, cost_for, priority_class, max_wait_s,
                                place, exclude, hold=hold, holding=held, load_for=load_for)

    # ---- queries --------------------------------------------------------------------------

    def in_flight_tokens(self) -> dict[str, int]:
        """Tokens admitted per worker since its stats were taken (add them to its load)."""
        return self.budgets.in_flight_tokens()

    def note_refusal(self, worker_id: str) -> None:
        """The worker's own admission refused a request this router sent it: nothing goes
        there until its next report (WorkerBudgets.note_refusal)."""
        self.budgets.note_refusal(worker_id)

    def held_blocks(self, worker_id: str, block_hashes) -> int:
        """Leading blocks of `block_hashes` the worker's live requests hold per its latest
        report, less those of requests ended since (WorkerBudgets.held_blocks)."""
        return self.budgets.held_blocks(worker_id, block_hashes)

    def awaiting_report(self, worker_id: str) -> bool:
        """The worker refused a request and nothing goes there until its next report."""
        return self.budgets.awaiting_report(worker_id)

    def cluster_load(self) -> tuple[list[WorkerStats], dict[str, int], float]:
        """The healthy workers' latest reports, the tokens admitted to each since, and the
        mean admitted request: what the load guard weighs (router/affinity_wait.py)."""
        return self.budgets.healthy(), self.in_flight_tokens(), self.mean_admitted_tokens()

    def mean_admitted_tokens(self) -> float:
        """Mean cost of the recent tickets: the imbalance margin's unit (WorkerBudgets)."""
        return self.budgets.mean_admitted_tokens()

    def snapshot(self) -> AdmissionSnapshot:
        healthy = self.budgets.healthy()
        return AdmissionSnapshot(
            num_queued_first=len(self._first_lane), num_queued_retry=len(self._retry_lane),
            num_in_flight=len(self._live), retry_tokens_in_flight=self._retry_tokens_live,
            committed_tokens=sum(self.budgets.committed(w.worker_id) for w in healthy),
            capacity_tokens=sum(w.kv_tokens_capacity for w in healthy),
            drain_tokens_per_s=self._drain_tokens_per_s(),
            num_deadline_shed=self._num_deadline_shed, num_evicted=self._num_evicted)

    # ---- internals ------------------------------------------------------------------------

    def _waiters_ahead(self, lane: collections.deque, priority_class: int, place: float,
                       exclude: frozenset[str]) -> list[Waiter]:
        """The waiters ahead of `place` in `lane` that could take a worker this request could."""
        usable = {w.worker_id for w in self.budgets.healthy()} - exclude
        return [w for w in lane if (w.priority_class, w.enqueued_at) <= (priority_class, place) and usable - w.exclude
                and not w.holding]

    def _retry_budget_tokens(self) -> float:
        """What admitted retries may hold together: router.retry_lane_fraction of the healthy
        workers' KV capacity."""
        return self._config.retry_lane_fraction * sum(w.kv_tokens_capacity for w in self.budgets.healthy())

    def _retry_budget_allows(self, cost_tokens: int) -> bool:
        if self._retry_tokens_live == 0:
            return True  # one retry may always run
        return self._retry_tokens_live + cost_tokens <= self._retry_budget_tokens()

    def _try_admit(self, cost_tokens: int, attempt: int, route: RouteFn | None,
                   queued_since: float | None, cost_for: CostFn | None = None,
                   priority_class: int = 0, hold: HoldFn | None = None,
                   load_for: CostFn | None = None) -> AdmissionTicket | Held | None:
        """A ticket, None (it fits nowhere now), or HELD (`hold` said to wait)."""
        if attempt > 1 and not self._retry_budget_allows(cost_tokens):
            return None
        eligible, costs = self.budgets.eligible(cost_tokens, cost_for, priority_class)
        if not eligible:
            return None
        eligible.sort(key=lambda w: w.worker_id)
        if hold is not None and hold(eligible):
            return HELD
        if route is None:
            worker_id = self.budgets.with_most_room(eligible)
        else:
            worker_id = route(eligible, self.in_flight_tokens())
            if worker_id not in {w.worker_id for w in eligible}:
                raise ValueError(f"route chose {worker_id!r}, not one of the workers with room")
        now = self._clock()
        ticket = AdmissionTicket(self._release, worker_id, costs[worker_id], attempt, sent_at=now,
                                 queue_wait_s=0.0 if queued_since is None else max(0.0, now - queued_since))
        ticket.shared_class = self.budgets.in_shared_class(priority_class)
        if load_for is not None:
            ticket.load_tokens = load_for(worker_id)
        self.budgets.record(ticket)
        self._live.add(ticket)
        if attempt > 1:
            self._retry_tokens_live += ticket.cost_tokens
        return ticket

    def _release(self, ticket: AdmissionTicket) -> None:
        self._live.discard(ticket)
        if ticket.attempt > 1:
            self._retry_tokens_live -= ticket.cost_tokens
        self.budgets.forget(ticket)
        self._pump()

    async def _wait(self, lane: collections.deque, cost_tokens: int, attempt: int, route: RouteFn | None,
                    deadline_s: float | None, cost_for: CostFn | None = None,
                    priority_class: int = 0, max_wait_s: float | None = None, place: float | None = None,
                    exclude: frozenset[str] = frozenset(), until_settled: bool = False,
                    hold: HoldFn | None = None, holding: bool = False,
                    load_for: CostFn | None = None) -> AdmissionTicket:
        waiter = Waiter(cost_tokens, attempt, route, self._clock() if place is None else place,
                         asyncio.get_running_loop().create_future(), cost_for, priority_class, exclude, until_settled,
                         hold, holding, load_for)
        enqueue(lane, waiter)
        if lane[0] is waiter:
            self._pump()  # ahead of everyone waiting: it may fit where the old head did not
        wait_s = self._config.max_queue_wait_s if max_wait_s is None else min(max_wait_s, self._config.max_queue_wait_s)
        deadline_first = deadline_s is not None and deadline_s - self._wall_clock() < wait_s
        if deadline_first:
            wait_s = max(0.0, deadline_s - self._wall_clock())
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), timeout=wait_s)
        except asyncio.TimeoutError:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                return waiter.future.result()  # admitted in the same instant the wait ran out
            ahead = self._ahead_of(lane, waiter)
            self._discard(lane, waiter)
            if deadline_first:
                raise DeadlineExceededError("deadline passed while waiting for admission") from None
            raise self._overloaded(cost_tokens, attempt, f"no capacity within {wait_s:g} s", ahead=ahead) from None
        except asyncio.CancelledError:  # the caller went away: give back whatever it got
            self._discard(lane, waiter)
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                waiter.future.result().release()
            raise

    def _evict_less_important(self, lane: collections.deque, priority_class: int) -> bool:
        """A full lane makes room for a more important newcomer: its last waiter (the least
        important class, newest) is refused now, as it would have been had it come later."""
        if not lane or lane[-1].priority_class <= priority_class:
            return False
        victim = lane.pop()
        if not victim.future.done():
            refusal = self._overloaded(victim.cost_tokens, victim.attempt, "queue slot taken by a more important request")
            victim.future.set_exception(QueueSlotTakenError(refusal.message, retry_after_s=refusal.retry_after_s))
        self._num_evicted += 1
        return True

    def _discard(self, lane: collections.deque, waiter: Waiter) -> None:
        if not waiter.future.done():
            waiter.future.cancel()
        if waiter in lane:
            lane.remove(waiter)
            self._pump()  # a large head leaving may unblock smaller requests behind it

    def _pump(self) -> None:
        """Admit waiting heads that fit now (FIFO within a lane). Retries go only when no
        first attempt is waiting: under overload the retry lane is the one that times out."""
        healthy = bool(self.budgets.healthy())
        for lane in (self._first_lane, self._retry_lane):
            if lane is self._retry_lane and any(not w.holding for w in self._first_lane):
                continue
            # In order; a waiter that holds out is stepped over (it waits for its own workers,
            # which the ones behind it need not), the first that fits nowhere stops it.
            index = 0
            while index < len(lane):
                head = lane[index]
                if head.future.done():
                    del lane[index]
                    continue
                if not healthy:
                    del lane[index]
                    head.future.set_exception(WorkerFailedError("no healthy worker left while queued"))
                    continue
                try:
                    ticket = self._try_admit(head.cost_tokens, head.attempt, head.route, head.enqueued_at,
                                             head.cost_for, head.priority_class, head.hold, head.load_for)
                except Exception as exc:  # a failing route callback fails its own request only
                    del lane[index]
                    head.future.set_exception(exc)
                    continue
                head.holding = ticket is HELD
                if head.holding:
                    index += 1
                    continue
                if ticket is None:
                    break
                del lane[index]
                head.future.set_result(ticket)
        self._settle_try_now_waiters()

    def _settle_try_now_waiters(self) -> None:
        """Refuse each waiting try-now (see acquire) that no longer fits even without the
        admissions the reports may already count: its "no room now" is now certain."""
        for lane in (self._first_lane, self._retry_lane):
            for waiter in [w for w in lane if w.until_settled]:
                if waiter.future.done():
                    continue
                if not self.budgets.eligible(waiter.cost_tokens, waiter.cost_for, waiter.priority_class, as_reported=True)[0]:
                    lane.remove(waiter)
                    waiter.future.set_exception(self._overloaded(waiter.cost_tokens, waiter.attempt, "no room now"))

    def _ahead_of(self, lane: collections.deque, waiter: Waiter | None, priority_class: int | None = None) -> int:
        """Tokens queued ahead of `waiter` (None: of a newcomer of `priority_class`, or of
        the whole lane when that is None too): the whole first lane counts for a retry (it
        is served first)."""
        ahead = 0
        if lane is self._retry_lane:
            ahead += sum(w.cost_tokens for w in self._first_lane)
        for w in lane:
            if w is waiter or (priority_class is not None and w.priority_class > priority_class):
                break
            ahead += w.cost_tokens
        return ahead

    def _overloaded(self, cost_tokens: int, attempt: int, reason: str, ahead: int | None = None) -> OverloadedError:
        lane = self._retry_lane if attempt > 1 else self._first_lane
        ahead = self._ahead_of(lane, None) if ahead is None else ahead
        # It comes back as a retry, through the retry lane: no sooner than that has room.
        retry_after_s = max(self.retry_after_s(cost_tokens, ahead), self._retry_budget_wait_s(cost_tokens))
        logger.debug("admission rejected (%s): cost=%d ahead=%d retry_after=%.3fs", reason, cost_tokens, ahead,
                     retry_after_s)
        lane_name = "retry" if attempt > 1 else "first-attempt"
        return OverloadedError(f"server overloaded: {reason} ({lane_name} lane)", retry_after_s=retry_after_s)

    def _shed_if_deadline_unmeetable(self, cost_tokens: int, lane: collections.deque, deadline_s: float,
                                     priority_class: int) -> None:
        expected_wait_s = self.expected_wait_s(cost_tokens, self._ahead_of(lane, None, priority_class))
        remaining_s = deadline_s - self._wall_clock()
        if expected_wait_s is None or expected_wait_s <= remaining_s:
            return
        self._num_deadline_shed += 1
        retry_after_s = max(self._config.stats_refresh_s, expected_wait_s)
        logger.debug("admission shed: expected wait %.3fs > %.3fs to the deadline", expected_wait_s, remaining_s)
        raise DeadlineUnmeetableError(
            f"server overloaded: expected queue wait {expected_wait_s:.2f} s exceeds the {max(0.0, remaining_s):.2f} s "
            "left before the request's deadline", retry_after_s=retry_after_s)

    def _retry_budget_wait_s(self, cost_tokens: int) -> float:
        """Seconds until the retries running now (and those queued for the lane) leave room in
        the retry budget for `cost_tokens` more: what a refused retry waits for besides the
        queues. The running retries end at their share of the drain (their tokens over all
        committed tokens), not at the whole drain rate: a retry lane refusal told the whole
        rate came back while the lane was still full, to be refused again."""
        live = self._retry_tokens_live
        drain = self._drain_tokens_per_s()
        if live == 0 or drain <= 0:
            return 0.0
        excess = live + sum(w.cost_tokens for w in self._retry_lane) + cost_tokens - self._retry_budget_tokens()
        committed = sum(self.budgets.committed(w.worker_id) for w in self.budgets.healthy())
        return max(0.0, excess) * max(committed, live) / (drain * live)

    def _drain_tokens_per_s(self) -> float:
        """The healthy workers' measured output tokens a second (0 before any is measured)."""
        return sum(w.output_tokens_per_s for w in self.budgets.healthy())

    def expected_wait_s(self, cost_tokens: int, tokens_ahead: int) -> float | None:
        """Seconds until `tokens_ahead` plus this request's overflow should have drained at the
        measured rate; None before any rate is measured (or with no healthy worker)."""
        healthy = self.budgets.healthy()
        drain = self._drain_tokens_per_s()
        if drain <= 0 or not healthy:
            return None
        overflow = min(max(0, self.budgets.committed(w.worker_id) + cost_tokens - w.kv_tokens_capacity) for w in healthy)
        return (overflow + tokens_ahead) / drain

    def retry_after_s(self, cost_tokens: int, tokens_ahead: int) -> float:
        """The expected wait, never less than one stats refresh (nothing is known sooner)."""
        expected = self.expected_wait_s(cost_tokens, tokens_ahead)
        return self._config.stats_refresh_s if expected is None else max(self._config.stats_refresh_s, expected)
