"""Tenant quotas: reserve before a request runs, settle when it ends.

Four limits per tenant (router/tenants.py `TenantLimits`), checked atomically together:
a prompt-token bucket and an output-token bucket (each holds one minute of its rate and
refills continuously at rate / 60 per second), concurrent requests, and concurrent KV tokens
(prompt + max_tokens of the requests in flight). A reservation takes the prompt tokens and
the whole `max_tokens` up front; settle refunds what was not generated.

    store = make_quota_store(config.tenants, num_replicas=config.router.num_replicas,
                             on_fallback_change=metrics.set_quota_fallback)
    try:
        r = await store.reserve(tenant, prompt_tokens=120, max_tokens=256)
    except QuotaExceededError as exc:        # exc.retry_after_s: until the bucket refills
        ...
    try:
        ... stream ...
    except BaseException:
        if no_token_streamed: await store.release(r)   # failed before any token: refund all
        else: await store.settle(r, completion_tokens=streamed)   # cancel: pay what streamed
        raise
    await store.settle(r, completion_tokens=usage.completion_tokens)   # refund 256 - used

Settle and release are idempotent (a second call is a no-op). Implementations:

- `InProcessQuotaStore`: one router process (the embedded default). Asyncio-safe because no
  method awaits inside its critical section; a threading lock covers callers on threads.
- `RedisQuotaStore`: several router replicas enforce ONE limit; each operation is one Lua
  script (router/quota_lua.py) over keys `kvmesh:{tenant}:...`, refilled from Redis TIME.
- `FallbackQuotaStore`: Redis with a safety net. When Redis is unreachable it serves from a
  local store holding limits / num_replicas (so the replicas together stay near the global
  limit), logs a WARNING, flips `kvmesh_quota_store_fallback_active`, queues settlements of
  Redis-issued reservations, probes Redis every `probe_interval_s`, replays the queue and
  resumes Redis when it answers.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Protocol

from kvmesh.core.config import TenantsConfig
from kvmesh.router import quota_lua
from kvmesh.router.redis_outage import RedisOutage
from kvmesh.router.tenants import Tenant, TenantLimits
from kvmesh.core.errors import InvalidRequestError, QuotaExceededError

logger = logging.getLogger(__name__)

# Concurrency limits free up when some request ends, which no clock predicts; this is the
# retry-after hint then (token buckets give an exact refill time instead).
CONCURRENCY_RETRY_AFTER_S = 1.0
DEFAULT_LEASE_S = 900.0  # a reservation not settled by then is dropped (its router died)


@dataclass(frozen=True)
class Reservation:
    reservation_id: str
    tenant_id: str
    prompt_tokens: int
    max_tokens: int
    limits: TenantLimits  # the limits it was taken under: refunds are capped by the same
    issued_by: str = "local"  # "local" | "redis": which store must settle it

    @property
    def kv_tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens


@dataclass(frozen=True)
class QuotaUsage:
    """A tenant's quota state now (for tests, `kvmesh stats` and debugging)."""

    requests_in_flight: int
    kv_tokens_in_flight: int
    prompt_tokens_available: float | None  # None = unlimited
    output_tokens_available: float | None


class QuotaStoreUnavailableError(Exception):
    """The shared store cannot be reached; FallbackQuotaStore turns this into local limits.

    `attempted` is the reservation a failed reserve call may or may not have taken (Redis can
    run the script and die before replying); releasing it later is safe either way."""

    def __init__(self, message: str, attempted: "Reservation | None" = None):
        super().__init__(message)
        self.attempted = attempted


class QuotaStore(Protocol):
    async def reserve(self, tenant: Tenant, prompt_tokens: int, max_tokens: int) -> Reservation: ...
    async def settle(self, reservation: Reservation, completion_tokens: int) -> None: ...
    async def release(self, reservation: Reservation) -> None: ...
    async def usage(self, tenant: Tenant) -> QuotaUsage: ...
    async def aclose(self) -> None: ...


def check_request_fits(limits: TenantLimits, tenant_id: str, prompt_tokens: int, max_tokens: int) -> None:
    """Reject what no amount of waiting could admit (else the client retries forever)."""
    if prompt_tokens < 0 or max_tokens < 1:
        raise InvalidRequestError(f"prompt_tokens must be >= 0 and max_tokens >= 1, got {prompt_tokens}, {max_tokens}")
    too_big = [
        ("max_tokens", max_tokens, limits.max_tokens_ceiling),
        ("prompt tokens", prompt_tokens, limits.prompt_tokens_per_minute),
        ("max_tokens", max_tokens, limits.output_tokens_per_minute),
        ("prompt + max_tokens", prompt_tokens + max_tokens, limits.max_concurrent_kv_tokens),
    ]
    for what, value, limit in too_big:
        if limit is not None and value > limit:
            raise InvalidRequestError(f"{what} = {value} exceeds tenant {tenant_id!r}'s limit of {limit}")


def _output_refund(reservation: Reservation, completion_tokens: int) -> int:
    """Tokens to give back to the output bucket; negative charges an overrun."""
    return reservation.max_tokens - max(0, completion_tokens)


# ---- in-process --------------------------------------------------------------------------

@dataclass
class _Bucket:
    capacity: float
    tokens: float
    updated_s: float

    def refill(self, now_s: float) -> float:
        self.tokens = min(self.capacity, self.tokens + max(0.0, now_s - self.updated_s) * self.capacity / 60.0)
        self.updated_s = now_s
        return self.tokens


@dataclass
class _TenantState:
    prompt: _Bucket | None
    output: _Bucket | None
    inflight_kv: dict[str, int] = field(default_factory=dict)  # reservation id -> KV tokens


class InProcessQuotaStore:
    def __init__(self, limit_fraction: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 issued_by: str = "local"):
        self._fraction = limit_fraction  # FallbackQuotaStore: 1 / num_replicas
        self._clock = clock
        self._issued_by = issued_by
        self._lock = threading.Lock()
        self._states: dict[str, _TenantState] = {}

    def _limits(self, tenant: Tenant) -> TenantLimits:
        return tenant.limits if self._fraction == 1.0 else tenant.limits.scaled(self._fraction)

    def _state(self, tenant_id: str, limits: TenantLimits, now_s: float) -> _TenantState:
        state = self._states.get(tenant_id)
        if state is None:
            state = self._states[tenant_id] = _TenantState(prompt=None, output=None)
        # Follow limit changes (kvmesh tenants set): keep the fill level, cap to the new size.
        for attr, cap in (("prompt", limits.prompt_tokens_per_minute), ("output", limits.output_tokens_per_minute)):
            bucket = getattr(state, attr)
            if cap is None:
                setattr(state, attr, None)
            elif bucket is None:
                setattr(state, attr, _Bucket(capacity=cap, tokens=cap, updated_s=now_s))
            else:
                bucket.refill(now_s)
                bucket.capacity = cap
                bucket.tokens = min(bucket.tokens, cap)
        return state

    async def reserve(self, tenant: Tenant, prompt_tokens: int, max_tokens: int) -> Reservation:
        limits = self._limits(tenant)
        check_request_fits(limits, tenant.id, prompt_tokens, max_tokens)
        with self._lock:
            now_s = self._clock()
            state = self._state(tenant.id, limits, now_s)
            if limits.max_concurrent_requests is not None and len(state.inflight_kv) >= limits.max_concurrent_requests:
                raise QuotaExceededError(f"tenant {tenant.id!r}: {limits.max_concurrent_requests} requests "
                                         "already in flight", CONCURRENCY_RETRY_AFTER_S)
            kv_tokens = prompt_tokens + max_tokens
            if limits.max_concurrent_kv_tokens is not None and \
                    sum(state.inflight_kv.values()) + kv_tokens > limits.max_concurrent_kv_tokens:
                raise QuotaExceededError(f"tenant {tenant.id!r}: concurrent KV tokens limit "
                                         f"{limits.max_concurrent_kv_tokens} reached", CONCURRENCY_RETRY_AFTER_S)
            wait_s = 0.0
            for bucket, need in ((state.prompt, prompt_tokens), (state.output, max_tokens)):
                if bucket is not None and bucket.tokens < need:
                    wait_s = max(wait_s, (need - bucket.tokens) * 60.0 / bucket.capacity)
            if wait_s > 0:
                raise QuotaExceededError(f"tenant {tenant.id!r}: tokens-per-minute limit reached", wait_s)
            if state.prompt is not None:
                state.prompt.tokens -= prompt_tokens
            if state.output is not None:
                state.output.tokens -= max_tokens
            reservation_id = uuid.uuid4().hex
            state.inflight_kv[reservation_id] = kv_tokens
        return Reservation(reservation_id, tenant.id, prompt_tokens, max_tokens, limits, self._issued_by)

    def _finish(self, reservation: Reservation, refund_prompt: int, refund_output: int) -> None:
        with self._lock:
            state = self._states.get(reservation.tenant_id)
            if state is None or state.inflight_kv.pop(reservation.reservation_id, None) is None:
                return  # already settled
            now_s = self._clock()
            for bucket, refund in ((state.prompt, refund_prompt), (state.output, refund_output)):
                if bucket is not None and refund:
                    bucket.tokens = min(bucket.capacity, bucket.refill(now_s) + refund)

    async def settle(self, reservation: Reservation, completion_tokens: int) -> None:
        self._finish(reservation, 0, _output_refund(reservation, completion_tokens))

    async def release(self, reservation: Reservation) -> None:
        self._finish(reservation, reservation.prompt_tokens, reservation.max_tokens)

    async def usage(self, tenant: Tenant) -> QuotaUsage:
        limits = self._limits(tenant)
        with self._lock:
            state = self._state(tenant.id, limits, self._clock())
            return QuotaUsage(len(state.inflight_kv), sum(state.inflight_kv.values()),
                              None if state.prompt is None else state.prompt.tokens,
                              None if state.output is None else state.output.tokens)

    async def aclose(self) -> None:
        return None


# ---- Redis -------------------------------------------------------------------------------

def tenant_keys(tenant_id: str) -> list[str]:
    """KEYS of the Lua scripts; `{tenant}` is a Redis Cluster hash tag (one slot per tenant)."""
    base = f"kvmesh:{{{tenant_id}}}"
    return [f"{base}:prompt_bucket", f"{base}:output_bucket", f"{base}:inflight", f"{base}:inflight_kv"]


def _cap(limit: int | None) -> int:
    return -1 if limit is None else limit


class RedisQuotaStore:
    def __init__(self, redis_url: str, lease_s: float = DEFAULT_LEASE_S, socket_timeout_s: float = 1.0,
                 clock_us: Callable[[], int] | None = None):
        """clock_us: tests only; None (service) means the scripts read Redis TIME, one clock for
        every replica."""
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        # No client-side retries: FallbackQuotaStore decides what an outage means, and a
        # request must not wait through a retry ladder before it does.
        self._redis = aioredis.Redis.from_url(
            redis_url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0), decode_responses=True)
        self._lease_ms = int(lease_s * 1000)
        self._clock_us = clock_us
        self._reserve = self._redis.register_script(quota_lua.RESERVE)
        self._settle = self._redis.register_script(quota_lua.SETTLE)
        self._usage = self._redis.register_script(quota_lua.USAGE)

    async def _call(self, script, keys: list[str], args: list):
        import redis.exceptions as rexc
        try:
            return await script(keys=keys, args=[*args, self._clock_us() if self._clock_us else 0])
        except (rexc.ConnectionError, rexc.TimeoutError, OSError, asyncio.TimeoutError) as exc:
            raise QuotaStoreUnavailableError(f"redis unreachable: {type(exc).__name__}") from exc

    async def ping(self) -> None:
        await self._call(self._usage, tenant_keys("__probe__"), [-1, -1])

    async def reserve(self, tenant: Tenant, prompt_tokens: int, max_tokens: int) -> Reservation:
        limits = tenant.limits
        check_request_fits(limits, tenant.id, prompt_tokens, max_tokens)
        reservation = Reservation(uuid.uuid4().hex, tenant.id, prompt_tokens, max_tokens, limits, "redis")
        try:
            admitted, reason, retry_after_ms = await self._call(self._reserve, tenant_keys(tenant.id), [
                reservation.reservation_id, prompt_tokens, max_tokens,
                _cap(limits.prompt_tokens_per_minute), _cap(limits.output_tokens_per_minute),
                _cap(limits.max_concurrent_requests), _cap(limits.max_concurrent_kv_tokens), self._lease_ms])
        except QuotaStoreUnavailableError as exc:
            exc.attempted = reservation
            raise
        if not admitted:
            retry_after_s = CONCURRENCY_RETRY_AFTER_S if retry_after_ms < 0 else retry_after_ms / 1000.0
            raise QuotaExceededError(f"tenant {tenant.id!r}: {reason} limit reached", retry_after_s)
        return reservation

    async def _finish(self, reservation: Reservation, refund_prompt: int, refund_output: int) -> None:
        limits = reservation.limits
        await self._call(self._settle, tenant_keys(reservation.tenant_id), [
            reservation.reservation_id, refund_prompt, refund_output,
            _cap(limits.prompt_tokens_per_minute), _cap(limits.output_tokens_per_minute)])

    async def settle(self, reservation: Reservation, completion_tokens: int) -> None:
        await self._finish(reservation, 0, _output_refund(reservation, completion_tokens))

    async def release(self, reservation: Reservation) -> None:
        await self._finish(reservation, reservation.prompt_tokens, reservation.max_tokens)

    async def usage(self, tenant: Tenant) -> QuotaUsage:
        limits = tenant.limits
        n, kv, p, o = await self._call(self._usage, tenant_keys(tenant.id), [
            _cap(limits.prompt_tokens_per_minute), _cap(limits.output_tokens_per_minute)])
        return QuotaUsage(int(n), int(kv), None if p == "none" else float(p), None if o == "none" else float(o))

    async def aclose(self) -> None:
        await self._redis.aclose()


# ---- Redis with a local safety net ---------------------------------------------------------

class FallbackQuotaStore:
    """RedisQuotaStore while Redis answers; per-replica local limits while it does not."""

    def __init__(self, primary: RedisQuotaStore, num_replicas: int = 1, probe_interval_s: float = 1.0,
                 on_fallback_change: Callable[[bool], None] | None = None,
                 local_clock: Callable[[], float] = time.monotonic):
        """local_clock: the local buckets' clock (tests inject one, as RedisQuotaStore's clock_us)."""
        self.primary = primary
        self.local = InProcessQuotaStore(limit_fraction=1.0 / max(1, num_replicas), clock=local_clock)
        self._outage = RedisOutage(
            primary.ping, probe_interval_s, on_change=on_fallback_change, on_back=self._replay_pending,
            unavailable=(QuotaStoreUnavailableError,),
            away="quota store: Redis unreachable ({exc}); serving with local limits divided by the replica count "
                 "until it answers again",
            back="quota store: Redis is back; shared limits resumed")
        # Settlements of Redis-issued reservations made while Redis was away, and releases of
        # reserve calls whose reply was lost, replayed on reconnect (the settle script acts only
        # on a reservation still in flight, so a replay, or a release of one never taken, is safe).
        self._pending: list[tuple[Reservation, int | None]] = []  # (reservation, completion or None=release)

    @property
    def fallback_active(self) -> bool:
        return self._outage.active

    @property
    def num_pending_settlements(self) -> int:
        return len(self._pending)

    def _enter_fallback(self, exc: Exception) -> None:
        self._outage.enter(exc)

    async def _replay_pending(self) -> None:
        """Redis answers again: the settlements made while it was away, in order, before the
        shared limits resume (a failure keeps the outage on, the rest for the next probe)."""
        while self._pending:
            reservation, completion = self._pending[0]
            await self._finish_on_primary(reservation, completion)
            self._pending.pop(0)

    async def _finish_on_primary(self, reservation: Reservation, completion_tokens: int | None) -> None:
        if completion_tokens is None:
            await self.primary.release(reservation)
        else:
            await self.primary.settle(reservation, completion_tokens)

    async def reserve(self, tenant: Tenant, prompt_tokens: int, max_tokens: int) -> Reservation:
        if not self._outage.active:
            try:
                return await self.primary.reserve(tenant, prompt_tokens, max_tokens)
            except QuotaStoreUnavailableError as exc:
                self._enter_fallback(exc)
                if exc.attempted is not None:  # it may have landed: undo it on reconnect
                    self._pending.append((exc.attempted, None))
        return await self.local.reserve(tenant, prompt_tokens, max_tokens)

    async def _finish(self, reservation: Reservation, completion_tokens: int | None) -> None:
        if reservation.issued_by != "redis":
            if completion_tokens is None:
                await self.local.release(reservation)
            else:
                await self.local.settle(reservation, completion_tokens)
            return
        if not self._outage.active:
            try:
                await self._finish_on_primary(reservation, completion_tokens)
                return
            except QuotaStoreUnavailableError as exc:
                self._enter_fallback(exc)
        self._pending.append((reservation, completion_tokens))

    async def settle(self, reservation: Reservation, completion_tokens: int) -> None:
        await self._finish(reservation, completion_tokens)

    async def release(self, reservation: Reservation) -> None:
        await self._finish(reservation, None)

    async def usage(self, tenant: Tenant) -> QuotaUsage:
        return await (self.local.usage(tenant) if self._outage.active else self.primary.usage(tenant))

    async def aclose(self) -> None:
        self._outage.close()
        await self.primary.aclose()


def make_quota_store(tenants_config: TenantsConfig, num_replicas: int = 1,
                     on_fallback_change: Callable[[bool], None] | None = None) -> QuotaStore:
    """Redis (with the local fallback) when `tenants.redis_url` is set, else in-process."""
    if tenants_config.redis_url:
        return FallbackQuotaStore(RedisQuotaStore(tenants_config.redis_url), num_replicas=num_replicas,
                                  probe_interval_s=tenants_config.quota_probe_interval_s,
                                  on_fallback_change=on_fallback_change)
    return InProcessQuotaStore()
