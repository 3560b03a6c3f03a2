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

Refusals are explicit: a retryable OverloadedError carrying retry_after_s estimated from the
measured drain rate (reserved tokens returned per second), or a non-retryable
InvalidRequestError. A prompt is never truncated and max_tokens never lowered.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from kvmesh.core.config import SchedulerConfig
from kvmesh.kv.kv_cost import request_kv_tokens
from kvmesh.core.errors import InvalidRequestError, OverloadedError
from kvmesh.worker.engine_loop.request import Request

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


class AdmissionController:
    def __init__(self, config: SchedulerConfig, capacity_tokens: int, block_size: int, *,
                 clock: Callable[[], float], window_s: float = 30.0):
        self.config = config
        self.block_size = block_size
        self.capacity_tokens = capacity_tokens  # the pool: num_blocks * block_size
        self.budget_tokens = config.max_total_kv_tokens or capacity_tokens
        self.reserved_tokens = 0
        self.num_reservations = 0
        self.drain = RateMeter(window_s, clock)  # reserved tokens returned per second

    def reservation_for(self, request: Request) -> int:
        # One sample: the engine submits each of the n samples as its own Request.
        return request_kv_tokens(request.num_prompt_tokens, request.sampling.max_tokens, self.block_size)

    def check_valid(self, request: Request) -> None:
        """Refusals no retry can fix on this worker. The request itself (parameters, prompt,
        context length) was validated once on entering the process (Engine.validate)."""
        # Over-committing (max_total_kv_tokens > the pool) is allowed, but one request must
        # fit the pool on its own, or preemption could never make room for it.
        limit = min(self.budget_tokens, self.capacity_tokens)
        if self.reservation_for(request) > limit:
            raise InvalidRequestError(
                f"prompt ({request.num_prompt_tokens}) + max_tokens ({request.sampling.max_tokens}) needs "
                f"{self.reservation_for(request)} KV tokens; this worker can hold at most {limit}")

    def check_capacity(self, request: Request, num_waiting: int) -> None:
        """Refusals that go away as running requests finish."""
        needed = self.reservation_for(request)
        if num_waiting >= self.config.max_queue_len:
            raise OverloadedError(f"queue full ({num_waiting} waiting)", self.retry_after_s(needed))
        over = self.reserved_tokens + needed - self.budget_tokens
        if over > 0:
            raise OverloadedError(
                f"KV budget: {self.reserved_tokens} of {self.budget_tokens} tokens reserved, request needs {needed}",
                self.retry_after_s(over))

    def retry_after_s(self, tokens_to_drain: int | None = None) -> float:
        """Seconds until `tokens_to_drain` reserved KV tokens are likely returned, from the
        measured drain rate; by default about one outstanding request's worth."""
        if tokens_to_drain is None:
            tokens_to_drain = self.reserved_tokens // self.num_reservations if self.num_reservations else 0
        rate = self.drain.rate()
        estimate = tokens_to_drain / rate if rate > 0 else DEFAULT_RETRY_AFTER_S
        return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, estimate))

    def reserve(self, request: Request) -> None:
        request.reserved_kv_tokens = self.reservation_for(request)
        self.reserved_tokens += request.reserved_kv_tokens
        self.num_reservations += 1

    def release(self, request: Request) -> None:
        self.reserved_tokens -= request.reserved_kv_tokens
        self.num_reservations -= 1
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
