"""Admission: who may enter the engine (bounded queue, KV token budget, queue timeout) and
when a waiting request may join the running batch (the batching policy).

The articles' rule: T_current + sum(P_new) + reserved output <= T_KV_max. Every unfinished
request (waiting or running) reserves its prompt plus its full max_tokens at block
granularity, K * ceil(S / K) with S = prompt + max_tokens, so an admitted request can always
run to completion within the budget (unless the operator over-commits with
max_total_kv_tokens above the pool, which is what preemption is for).

    budget 1,024 tokens, block_size 16, reserved 960
    new request: 40 prompt + 30 max_tokens = 70 -> 80 reserved   960 + 80 > 1024 -> Overloaded
    new request: 900 prompt + 200 max_tokens -> 1,104 > 1,024 ever  -> InvalidRequest

Blocks already resident count once. A request whose leading prompt blocks are in the
prefix cache (or in another running request's block table) reserves only what will be newly
allocated: `request_kv_tokens(..., cached_prompt_tokens=...)`, its uncached prompt blocks
plus its output. The scheduler pins those cached blocks from admission to the request's end
(kv_cache_manager.pin_prefix), so they cannot be evicted while it waits; pinned blocks no
request's own reservation covers (a reused cached prefix, or one whose first owner has
finished) are added once to the committed total, however many requests share them:

    committed = sum(reservations) + K x (pinned blocks no reservation owns)

    budget 2,048, K = 16, a 528-token prefix resident, each request 560 prompt + 8 output
    whole prompt counted:   2 x 576 = 1,152 reserved; the fourth request is refused
    blocks counted once:    33 x 16 shared + 2 x 48 = 624 committed for two, room for 30

With `admission_reserve: expected` the output part is an estimate learned per tenant
(kv/output_estimate.py) instead of max_tokens; a request that outgrows it has its
reservation topped up a block at a time (`grow_for_output`), and preemption covers the pool
running short meanwhile. "Can this ever fit" still counts the whole max_tokens.

Class-aware (`kv_reserved_fraction` f, `kv_reserved_below_class` c): requests of class >= c
(the less important ones; lower class = more important) may together commit at most
(1 - f) x budget; the remaining f x budget only requests of a class below c can take. A
flood of low-priority work is refused there (retryable), and an important request arriving
behind it still finds room, without waiting for the flood to drain:

    budget 1,024, f = 0.25, c = 1: class >= 1 requests commit at most 768 between them;
    a class-0 request may use the whole 1,024 (the total rule above still holds)

Priority preemption of reservations (`priority_preemption` with
`priority_preempts_kv_reservations`, on by default with it): a request the budget refuses may
take the reservations of requests of strictly less important classes, the least important
and most recently started first (vLLM's priority order for preemption victims), as many as
make it fit and each at most max_priority_preemptions times. Without it an important request
waits for a flood's reservations to drain (the KV-bound priority campaign: its TTFT P99 8.8x
idle). A request whose reservation was taken owes it (`owed_kv_tokens`): the scheduler
preempts it if it runs (recompute or swap; its tokens are kept, its stream continues) and it
reserves the same amount again before it resumes. What is owed counts against newcomers of
its class or a less important one, so they cannot take its place:

    budget 384, four low requests of 96 reserved; a class-0 request of 96 arrives:
    the newest low request's 96 is taken (it goes back to waiting, owing 96)
    a low newcomer now sees 384 committed + 96 owed: refused; a class-0 one takes the next

Refusals are explicit: a retryable OverloadedError carrying retry_after_s estimated from the
measured drain rate (reserved tokens returned per second), or a non-retryable
InvalidRequestError. A prompt is never truncated and max_tokens never lowered.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence

from kvmesh.core.config import SchedulerConfig
from kvmesh.kv.kv_cost import request_kv_tokens
from kvmesh.core.errors import InvalidRequestError, OverloadedError
from kvmesh.core.seams import RequestBudget
from kvmesh.worker.engine_loop.request import Request
from kvmesh.kv.output_estimate import OutputLengthEstimator

logger = logging.getLogger(__name__)

# retry_after_s when nothing has drained yet (no measurement), and its clamp range.
DEFAULT_RETRY_AFTER_S = 1.0
MIN_RETRY_AFTER_S = 0.05
MAX_RETRY_AFTER_S = 60.0


class RateMeter:
    """Amounts recorded over a sliding window of `window_s` seconds -> amount per second."""

    def __init__(self, window_s: float, clock: Callable[[], float]):
        self.window_s = window_s
        self._clock = clock
        self._start = clock()
        self._events: deque[tuple[float, float]] = deque()  # (time, amount)
        self._sum = 0.0

    def add(self, amount: float) -> None:
        self._events.append((self._clock(), amount))
        self._sum += amount

    def rate(self) -> float:
        now = self._clock()
        while self._events and self._events[0][0] < now - self.window_s:
            self._sum -= self._events.popleft()[1]
        # Young meters average over their lifetime, not a window they have not lived yet.
        span_s = min(self.window_s, now - self._start)
        return self._sum / span_s if span_s > 0 and self._events else 0.0


class EngineAdmission:
    def __init__(self, config: SchedulerConfig, capacity_tokens: int, block_size: int, *,
                 clock: Callable[[], float], window_s: float = 30.0):
        self.config = config
        self.block_size = block_size
        self.capacity_tokens = capacity_tokens  # the pool: num_blocks * block_size
        self.budget_tokens = config.max_total_kv_tokens or capacity_tokens
        self.reserved_tokens = 0
        self.num_reservations = 0
        self.drain = RateMeter(window_s, clock)  # reserved tokens returned per second
        self.estimator = (OutputLengthEstimator(config.expected_output_floor_tokens, config.expected_output_quantile)
                          if config.admission_reserve == "expected" else None)
        self.num_outgrown_estimates = 0  # requests that produced more than their estimate
        # Class-aware KV admission: what the less important classes may commit together.
        self.shared_class_budget_tokens = int(self.budget_tokens * (1.0 - config.kv_reserved_fraction))
        self.shared_class_reserved_tokens = 0  # reservations of requests of class >= kv_reserved_below_class
        self._owing: dict[str, Request] = {}  # requests whose reservation was taken (owed_kv_tokens), by id

    def output_tokens_to_reserve(self, request: Request) -> int:
        if self.estimator is None:
            return request.sampling.max_tokens
        return self.estimator.estimate(request.tenant_id, request.sampling.max_tokens)

    def reservation_for(self, request: Request, cached_prompt_tokens: int = 0,
                        output_tokens: int | None = None) -> int:
        # One sample: the engine submits each of the n samples as its own Request.
        output_tokens = self.output_tokens_to_reserve(request) if output_tokens is None else output_tokens
        return request_kv_tokens(request.num_prompt_tokens, output_tokens, self.block_size,
                                 cached_prompt_tokens=cached_prompt_tokens)

    def committed_tokens(self, shared_tokens: int = 0) -> int:
        """Reservations plus the pinned shared blocks nobody's reservation covers."""
        return self.reserved_tokens + shared_tokens

    def check_valid(self, request: Request) -> None:
        """Refusals no retry can fix on this worker. The request itself (parameters, prompt,
        context length) was validated once on entering the process (Engine.validate)."""
        # Over-committing (max_total_kv_tokens > the pool) is allowed, but one request must
        # fit the pool on its own, or preemption could never make room for it.
        limit = min(self.budget_tokens, self.capacity_tokens)
        whole = self.reservation_for(request, output_tokens=request.sampling.max_tokens)
        if whole > limit:
            raise InvalidRequestError(
                f"prompt ({request.num_prompt_tokens}) + max_tokens ({request.sampling.max_tokens}) needs "
                f"{whole} KV tokens; this worker can hold at most {limit}")

    def check_request_fits(self, budget: RequestBudget) -> None:
        """All n samples of one request together must fit the budget (each reserves its own
        blocks), or the request could wait forever: no retry can fix that. `budget.kv_tokens`
        is the request's carried figure (Engine.request_budget checked it)."""
        limit = min(self.budget_tokens, self.capacity_tokens)
        if budget.kv_tokens > limit:
            raise InvalidRequestError(
                f"prompt ({budget.prompt_tokens}) + max_tokens ({budget.max_tokens}) x n ({budget.n}) needs "
                f"{budget.kv_tokens} KV tokens in whole blocks of {budget.block_size}; this worker can hold at most "
                f"{limit}")

    def check_capacity(self, request: Request, num_waiting: int, cached_prompt_tokens: int = 0,
                       shared_tokens: int = 0, preemptible: Sequence[Request] = (),
                       shared_tokens_without: Callable[[Sequence[Request]], int] | None = None) -> list[Request]:
        """Refusals that go away as running requests finish. `cached_prompt_tokens`: the
        request's resident prefix (pinned); `shared_tokens`: pinned blocks no reservation
        covers, this request's pins included. `preemptible`: requests whose reservations it
        may take (strictly less important classes, the first to take first; empty with
        priority preemption of reservations off); `shared_tokens_without(victims)`: the
        shared tokens once those let their pins and blocks go. Returns those it must take
        to fit ([] = it fits as it is); the caller takes them (`take`) and reserves."""
        needed = self.reservation_for(request, cached_prompt_tokens)
        if num_waiting >= self.config.max_queue_len:
            raise OverloadedError(f"queue full ({num_waiting} waiting)", self.retry_after_s(needed))
        over, over_shared = self._shortfall(request, needed, shared_tokens)
        if over <= 0 and over_shared <= 0:
            return []
        victims = self._victims(request, needed, preemptible, shared_tokens_without or (lambda _: shared_tokens))
        if victims is not None:
            return victims
        if over > 0:
            raise OverloadedError(
                f"KV budget: {self.committed_tokens(shared_tokens)} of {self.budget_tokens} tokens committed"
                f"{self._owed_note(request)}, request needs {needed} ({cached_prompt_tokens} of its prompt cached)",
                self.retry_after_s(over))
        raise OverloadedError(
            f"KV budget of priority class {request.importance_class} and below: "
            f"{self.shared_class_reserved_tokens} of {self.shared_class_budget_tokens} tokens committed"
            f"{self._owed_note(request)} (the rest is kept for more important classes), request needs {needed}",
            self.retry_after_s(over_shared))

    def fits_again(self, request: Request, needed: int, shared_tokens: int = 0) -> bool:
        """Whether a request that owes its reservation can reserve `needed` again now."""
        over, over_shared = self._shortfall(request, needed, shared_tokens)
        return over <= 0 and over_shared <= 0

    def _shortfall(self, request: Request, needed: int, shared_tokens: int,
                   taken: Sequence[Request] = ()) -> tuple[int, int]:
        """Tokens past the budget and past the sharing classes' budget (0 or less = room)
        if `request` reserved `needed` now, counting what is owed ahead of it, and with the
        reservations of `taken` given up (`shared_tokens` then as without them)."""
        owed, owed_shared = self._owed_ahead(request)
        freed = sum(r.reserved_kv_tokens for r in taken)
        freed_shared = sum(r.reserved_kv_tokens for r in taken if self.in_shared_class(r))
        over = self.committed_tokens(shared_tokens) - freed + owed + needed - self.budget_tokens
        if not self.in_shared_class(request):
            return over, 0
        shared = self.shared_class_reserved_tokens - freed_shared + owed_shared
        return over, shared + needed - self.shared_class_budget_tokens

    def _owed_ahead(self, request: Request) -> tuple[int, int]:
        """Reservations owed by requests ahead of `request` (a more important class, or its
        own that arrived no later): they come back before it. (Total, of the sharing classes.)"""
        owed = owed_shared = 0
        for other in self._owing.values():
            if other is not request and (other.importance_class, other.arrival_time) <= (
                    request.importance_class, request.arrival_time):
                owed += other.owed_kv_tokens
                owed_shared += other.owed_kv_tokens if self.in_shared_class(other) else 0
        return owed, owed_shared

    def _owed_note(self, request: Request) -> str:
        owed = self._owed_ahead(request)[0]
        return f" and {owed} owed to preempted requests" if owed else ""

    def _victims(self, request: Request, needed: int, preemptible: Sequence[Request],
                 shared_tokens_without: Callable[[Sequence[Request]], int]) -> list[Request] | None:
        """The first of `preemptible` whose reservations (and pinned blocks nobody else pays
        for) together make room for `needed`; None if all of them do not."""
        victims: list[Request] = []
        for victim in preemptible:
            victims.append(victim)
            over, over_shared = self._shortfall(request, needed, shared_tokens_without(victims), victims)
            if over <= 0 and over_shared <= 0:
                return victims
        return None

    def in_shared_class(self, request: Request) -> bool:
        """Counted against the share the less important classes have (class-aware admission;
        with no kept share that is the whole budget, and the split is still reported: the
        router lets a more important request past what those classes hold)."""
        return request.importance_class >= self.config.kv_reserved_below_class

    @property
    def owed_tokens(self) -> int:
        """Reservations taken by more important requests, to be reserved again."""
        return sum(r.owed_kv_tokens for r in self._owing.values())

    @property
    def shared_class_owed_tokens(self) -> int:
        return sum(r.owed_kv_tokens for r in self._owing.values() if self.in_shared_class(r))

    def retry_after_s(self, tokens_to_drain: int | None = None) -> float:
        """Seconds until `tokens_to_drain` reserved KV tokens are likely returned, from the
        measured drain rate; by default about one outstanding request's worth."""
        if tokens_to_drain is None:
            tokens_to_drain = self.reserved_tokens // self.num_reservations if self.num_reservations else 0
        rate = self.drain.rate()
        estimate = tokens_to_drain / rate if rate > 0 else DEFAULT_RETRY_AFTER_S
        return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, estimate))

    def reserve(self, request: Request, cached_prompt_tokens: int = 0) -> None:
        request.reserved_output_tokens = self.output_tokens_to_reserve(request)
        self._hold(request, self.reservation_for(request, cached_prompt_tokens, request.reserved_output_tokens))

    def grow_for_output(self, request: Request) -> None:
        """A request past its reserved output: reserve one more block's worth of output
        (never past max_tokens), so the committed total stays true."""
        if request.num_output_tokens <= request.reserved_output_tokens:
            return
        if request.reserved_output_tokens < request.sampling.max_tokens and not request.outgrew_estimate:
            request.outgrew_estimate = True
            self.num_outgrown_estimates += 1
        grown = min(request.sampling.max_tokens, request.num_output_tokens + self.block_size - 1)
        cached = request.num_reserved_cached_tokens
        extra = (self.reservation_for(request, cached, grown)
                 - self.reservation_for(request, cached, request.reserved_output_tokens))
        request.reserved_output_tokens = grown
        self.top_up(request, extra)

    def observe_finished(self, request: Request) -> None:
        """A request that ended by itself: its output length teaches the estimate."""
        if self.estimator is not None:
            self.estimator.observe(request.tenant_id, request.num_output_tokens)

    def top_up(self, request: Request, num_tokens: int) -> None:
        """Grow an admitted request's reservation (blocks it was expected to share are not there)."""
        if request.owed_kv_tokens:  # taken, not yet preempted: it owes the grown amount
            request.owed_kv_tokens += num_tokens
            return
        request.reserved_kv_tokens += num_tokens
        self.reserved_tokens += num_tokens
        if self.in_shared_class(request):
            self.shared_class_reserved_tokens += num_tokens

    def take(self, request: Request) -> None:
        """A more important request takes this one's reservation: it owes it from now on,
        counted whole (the scheduler unpins its cached prefix, which may be evicted before
        it comes back)."""
        self._unreserve(request)
        request.reserved_kv_tokens = 0
        request.owed_kv_tokens = self.reservation_for(request, 0, request.reserved_output_tokens)
        self._owing[request.request_id] = request

    def reserve_again(self, request: Request, num_tokens: int) -> None:
        """An owing request (see `fits_again`) holds a reservation of `num_tokens` again."""
        del self._owing[request.request_id]
        request.owed_kv_tokens = 0
        self._hold(request, num_tokens)

    def _hold(self, request: Request, num_tokens: int) -> None:
        """`request` holds a reservation of `num_tokens` (the twin of `_unreserve`)."""
        request.reserved_kv_tokens = num_tokens
        self.reserved_tokens += num_tokens
        self.num_reservations += 1
        if self.in_shared_class(request):
            self.shared_class_reserved_tokens += num_tokens

    def _unreserve(self, request: Request) -> None:
        self.reserved_tokens -= request.reserved_kv_tokens
        self.num_reservations -= 1
        if self.in_shared_class(request):
            self.shared_class_reserved_tokens -= request.reserved_kv_tokens

    def release(self, request: Request) -> None:
        if request.owed_kv_tokens:  # ended while owing: nothing reserved to return
            del self._owing[request.request_id]
            request.owed_kv_tokens = 0
            return
        self._unreserve(request)
        self.drain.add(request.reserved_kv_tokens)
        request.reserved_kv_tokens = 0

    def is_expired(self, request: Request, now: float) -> bool:
        """Waited past max_queue_time_s without ever being scheduled. A preempted request
        has been served and keeps its place (rejecting it would waste its progress)."""
        return request.first_scheduled_time is None and now - request.arrival_time > self.config.max_queue_time_s


# ---- batching policies: which waiting requests may join the running batch, and when ------


class BatchingPolicy:
    """Continuous (iteration-level) batching: every waiting request is a candidate every
    step; the scheduler's budgets and free blocks decide how many get in."""

    def admission_candidates(self, waiting: list[Request], now: float) -> list[Request]:
        return waiting

    def on_finished(self, request: Request) -> None:
        pass


class StaticBatching(BatchingPolicy):
    """Form a batch of up to `batch_size` from the queue head and run it until every member
    has finished; nothing else is admitted meanwhile (members preempted mid-batch come back
    as members). With `window_s` > 0 this is dynamic batching: a batch starts once it is full
    or its oldest request has waited `window_s`, whichever comes first."""

    def __init__(self, batch_size: int, window_s: float = 0.0):
        self.batch_size = batch_size
        self.window_s = window_s
        self._members: set[str] = set()  # request ids of the current batch still unfinished

    def admission_candidates(self, waiting: list[Request], now: float) -> list[Request]:
        if self._members:
            return [r for r in waiting if r.request_id in self._members]
        if not waiting:
            return []
        oldest_wait_s = now - min(r.arrival_time for r in waiting)
        if len(waiting) < self.batch_size and oldest_wait_s < self.window_s:
            return []  # keep the window open: the batch may still fill
        batch = waiting[:self.batch_size]
        self._members = {r.request_id for r in batch}
        return batch

    def on_finished(self, request: Request) -> None:
        self._members.discard(request.request_id)


def make_batching_policy(config: SchedulerConfig) -> BatchingPolicy:
    if config.policy == "static":
        return StaticBatching(config.static_batch_size)
    if config.policy == "dynamic":
        return StaticBatching(config.static_batch_size, config.dynamic_batch_window_s)
    return BatchingPolicy()
