"""Client retry policy: which failures to retry, how long to wait, and a retry budget.

Waiting (AWS "exponential backoff and jitter", full jitter, with the server's retry-after
as a floor):

    cap_n   = min(max_backoff_s, max(initial_backoff_s x multiplier^(n-1), retry_after_s))
    sleep_n = retry_after_s + uniform(0, cap_n)          n = retry number (1, 2, ...); retry_after_s = 0 if not sent

Full jitter spreads clients that failed together over the whole window instead of waking
them in lock-step; the server's retry-after is honoured as a minimum (it was computed from
the measured drain rate and the queue ahead), and the jitter goes on top. The window is at
least as long as the retry-after itself: a burst refused together is told about the same
wait (each refusal sees the same queue), and the room it was told about frees over the
following wait too, not in one instant; a fixed 0.1 s of jitter on a wait of seconds brought
them back together, to be refused again (tests/test_overload_e2e.py).

Budget (gRPC retry throttling, gRFC A6): a token bucket holding at most `max_tokens`
(starting full). Every failed attempt with a retryable code takes 1 token; every success
adds `token_ratio`. A retry is allowed only while the bucket holds more than half of
`max_tokens`. In a sustained outage retries therefore stop after a few failures, and in
steady state they are at most about `token_ratio` of the successful requests: a client
cannot multiply the load on a struggling server (the articles' retry storm).

Only RESOURCE_EXHAUSTED (overload, quota) and UNAVAILABLE (worker failed, connection
refused) are retried; never INVALID_ARGUMENT, UNAUTHENTICATED, DEADLINE_EXCEEDED or
CANCELLED (router/client.py first reads a CANCELLED that no kvmesh handler sent as
UNAVAILABLE: status_map.code_to_act_on). Streaming: a stream that already delivered tokens is
not retried unless the caller opted into restarting from scratch (see router/client.py).

Resumption is not throttled: a stream continued from the tokens it delivered (its router
replica or worker went away mid-stream) asks for the rest of work the server had accepted,
not for refused work again, and a replica that stops or dies breaks all its streams at once:
one client carrying 16 of them would otherwise spend the budget on the first 5 and fail the
rest. It takes no budget token and is not gated by it; max_attempts still bounds it.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

import grpc

from kvmesh.router import status_map


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 4  # first attempt included
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    multiplier: float = 2.0
    # Retry budget (gRPC retry throttling).
    budget_max_tokens: float = 10.0
    budget_token_ratio: float = 0.1
    # After UNAVAILABLE the next attempt first waits up to this long for the channel to connect:
    # a channel whose connection failed waits out gRPC's reconnect backoff (1 s +- 20 % at
    # first) and fails every call meanwhile at once, so retries sent then are spent without
    # reaching a server (a router replica killed: its clients' resumptions, sent within
    # milliseconds, would all fail though the other replica serves the port).
    reconnect_wait_s: float = 2.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if self.initial_backoff_s < 0 or self.max_backoff_s < self.initial_backoff_s or self.multiplier < 1:
            raise ValueError("need 0 <= initial_backoff_s <= max_backoff_s and multiplier >= 1")
        if self.budget_max_tokens <= 0 or not 0 < self.budget_token_ratio <= 1:
            raise ValueError("need budget_max_tokens > 0 and budget_token_ratio in (0, 1]")
        if self.reconnect_wait_s < 0:
            raise ValueError("need reconnect_wait_s >= 0")


def backoff_s(retry_number: int, policy: RetryPolicy, rng: random.Random, retry_after_s: float | None = None) -> float:
    """Seconds to sleep before retry `retry_number` (1 = the first retry)."""
    after_s = max(0.0, retry_after_s or 0.0)
    cap_s = min(policy.max_backoff_s, max(policy.initial_backoff_s * policy.multiplier ** (retry_number - 1), after_s))
    return after_s + rng.uniform(0.0, cap_s)


class RetryBudget:
    """gRPC-style retry throttling token bucket. Thread-safe: one per client, shared by calls."""

    def __init__(self, max_tokens: float = 10.0, token_ratio: float = 0.1):
        self.max_tokens = max_tokens
        self.token_ratio = token_ratio
        self._tokens = max_tokens
        self._lock = threading.Lock()

    @property
    def tokens(self) -> float:
        return self._tokens

    def record_success(self) -> None:
        with self._lock:
            self._tokens = min(self.max_tokens, self._tokens + self.token_ratio)

    def record_retryable_failure(self) -> None:
        with self._lock:
            self._tokens = max(0.0, self._tokens - 1.0)

    def allows_retry(self) -> bool:
        with self._lock:
            return self._tokens > self.max_tokens / 2


@dataclass(frozen=True)
class RetryDecision:
    retry: bool
    delay_s: float = 0.0
    reason: str = ""


def decide_retry(code: grpc.StatusCode, attempt: int, retry_after_s: float | None, policy: RetryPolicy,
                 budget: RetryBudget, rng: random.Random, *, tokens_received: int = 0,
                 restart_mid_stream: bool = False, resuming: bool = False,
                 time_left_s: float | None = None) -> RetryDecision:
    """Whether attempt `attempt` (which just failed with `code`) gets another try, and when.
    Records the failure in the budget when the code is retryable, unless the next attempt
    resumes the stream from the tokens it delivered (`resuming`: see the module docstring)."""
    if not status_map.is_retryable(code):
        return RetryDecision(False, reason=f"{code.name} is not retryable")
    resumption = resuming and tokens_received > 0
    if not resumption:
        budget.record_retryable_failure()
    if tokens_received and not (restart_mid_stream or resumption):
        return RetryDecision(False, reason="the stream already delivered tokens")
    if attempt >= policy.max_attempts:
        return RetryDecision(False, reason=f"{policy.max_attempts} attempts made")
    if not resumption and not budget.allows_retry():
        return RetryDecision(False, reason="retry budget exhausted")
    delay_s = backoff_s(attempt, policy, rng, retry_after_s)
    if time_left_s is not None and delay_s >= time_left_s:
        return RetryDecision(False, reason="the deadline would pass before the retry")
    return RetryDecision(True, delay_s=delay_s)
