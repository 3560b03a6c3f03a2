"""RedisQuotaStore and FallbackQuotaStore against a real redis-server (tests/redis_server.py).

Two store instances stand for two router replicas: they share one tenant's limit through
Redis. In service buckets refill from Redis TIME; the bucket arithmetic tests inject a clock
(the scripts' last argument), so their figures are exact and need no allowance for how long
the test took.
"""

import asyncio
import logging
import uuid

import pytest
from redis_server import RedisServer

from kvmesh.core.config import TenantsConfig
from kvmesh.load_tests.grpc_target import free_port
from kvmesh.router.quota import FallbackQuotaStore, RedisQuotaStore, make_quota_store, tenant_keys
from kvmesh.router.tenants import Tenant, TenantLimits
from kvmesh.core.errors import QuotaExceededError


class ManualClock:
    """Microseconds for the quota scripts; moves only when the test moves it."""

    def __init__(self):
        self.now_us = 1_700_000_000_000_000

    def advance(self, seconds: float) -> None:
        self.now_us += int(seconds * 1_000_000)

    def __call__(self) -> int:
        return self.now_us


def fresh_tenant(**limits) -> Tenant:
    return Tenant(id=f"t-{uuid.uuid4().hex[:8]}", limits=TenantLimits(**limits))


async def until(predicate, what: str, limit_s: float = 30.0) -> None:
    """Wait for a state change; the limit only turns a hang into a readable failure."""
    async def poll():
        while not predicate():
            await asyncio.sleep(0.01)
    try:
        await asyncio.wait_for(poll(), limit_s)
    except asyncio.TimeoutError:
        raise AssertionError(f"never happened: {what}") from None


async def try_reserve(store, tenant, prompt_tokens, max_tokens):
    try:
        return await store.reserve(tenant, prompt_tokens, max_tokens)
    except QuotaExceededError:
        return None


def test_keys_are_namespaced_with_a_cluster_hash_tag():
    assert tenant_keys("acme") == ["kvmesh:{acme}:prompt_bucket", "kvmesh:{acme}:output_bucket",
                                   "kvmesh:{acme}:inflight", "kvmesh:{acme}:inflight_kv"]


def test_two_replicas_share_one_concurrency_limit_exactly(redis_server):
    tenant = fresh_tenant(max_concurrent_requests=7)

    async def scenario():
        replicas = [RedisQuotaStore(redis_server.url), RedisQuotaStore(redis_server.url)]
        results = await asyncio.gather(*(try_reserve(replicas[i % 2], tenant, 5, 5) for i in range(80)))
        admitted = [r for r in results if r is not None]
        assert len(admitted) == 7
        assert {r.issued_by for r in admitted} == {"redis"}
        usage = await replicas[0].usage(tenant)
        assert usage.requests_in_flight == 7 and usage.kv_tokens_in_flight == 70
        # Settled on the other replica than the one that reserved: the limit is one limit.
        for i, r in enumerate(admitted):
            await replicas[(i + 1) % 2].settle(r, completion_tokens=5)
        assert (await replicas[1].usage(tenant)).requests_in_flight == 0
        for store in replicas:
            await store.aclose()

    asyncio.run(scenario())


def test_two_replicas_share_one_token_bucket_without_over_admission(redis_server):
    tenant = fresh_tenant(prompt_tokens_per_minute=60)  # 60-token bucket, refills 1 token/s

    async def scenario():
        clock = ManualClock()
        replicas = [RedisQuotaStore(redis_server.url, clock_us=clock), RedisQuotaStore(redis_server.url, clock_us=clock)]
        results = await asyncio.gather(*(try_reserve(replicas[i % 2], tenant, 10, 1) for i in range(60)))
        assert sum(r is not None for r in results) == 6  # the full bucket, not one token more
        clock.advance(10.0)  # 10 tokens of refill: exactly one more request
        results = await asyncio.gather(*(try_reserve(replicas[i % 2], tenant, 10, 1) for i in range(10)))
        assert sum(r is not None for r in results) == 1
        for store in replicas:
            await store.aclose()

    asyncio.run(scenario())


def test_redis_settle_and_release_arithmetic(redis_server):
    tenant = fresh_tenant(prompt_tokens_per_minute=60, output_tokens_per_minute=60)  # 1 token/s

    async def scenario():
        clock = ManualClock()
        store = RedisQuotaStore(redis_server.url, clock_us=clock)
        r = await store.reserve(tenant, prompt_tokens=20, max_tokens=50)
        usage = await store.usage(tenant)
        assert usage.requests_in_flight == 1 and usage.kv_tokens_in_flight == 70
        with pytest.raises(QuotaExceededError) as exc:
            await store.reserve(tenant, prompt_tokens=1, max_tokens=30)
        # 10 output tokens left, 20 missing at 1 token/s: 20 s.
        assert exc.value.retry_after_s == pytest.approx(20.0, abs=0.001)
        await store.settle(r, completion_tokens=20)  # refund 30 output tokens
        await store.settle(r, completion_tokens=0)  # idempotent
        usage = await store.usage(tenant)
        assert usage.requests_in_flight == 0 and usage.kv_tokens_in_flight == 0
        assert usage.output_tokens_available == pytest.approx(40)
        assert usage.prompt_tokens_available == pytest.approx(40)  # prompt tokens are not refunded
        # Buckets expire once they would be full again (here: 20 of 60 missing -> ~20 s).
        ttl_ms = await store._redis.pttl(tenant_keys(tenant.id)[1])
        assert 0 < ttl_ms <= 21_000
        r2 = await store.reserve(tenant, prompt_tokens=30, max_tokens=30)
        await store.release(r2)  # failed before any token: everything back
        usage = await store.usage(tenant)
        assert usage.prompt_tokens_available == pytest.approx(40)
        clock.advance(5.0)  # refill at 1 token/s
        assert (await store.usage(tenant)).prompt_tokens_available == pytest.approx(45)
        await store.aclose()

    asyncio.run(scenario())


def test_expired_lease_frees_a_dead_replicas_reservation(redis_server):
    tenant = fresh_tenant(max_concurrent_requests=1)

    async def scenario():
        store = RedisQuotaStore(redis_server.url, lease_s=0.2)
        await store.reserve(tenant, 1, 1)  # never settled: its router "died"
        with pytest.raises(QuotaExceededError):
            await store.reserve(tenant, 1, 1)
        await asyncio.sleep(0.3)
        await store.reserve(tenant, 1, 1)
        await store.aclose()

    asyncio.run(scenario())


def test_redis_killed_and_restarted_mid_load(redis_server, caplog):
    tenant = fresh_tenant(max_concurrent_requests=8, output_tokens_per_minute=100_000)
    fallback_changes = []
    errors = []
    settled = []

    async def one_request(store, hold_s):
        r = await try_reserve(store, tenant, 10, 20)
        if r is None:
            return None
        await asyncio.sleep(hold_s)
        await store.settle(r, completion_tokens=5)
        settled.append(r)
        return r

    async def load(store, stop):
        while not stop.is_set():
            try:
                await one_request(store, 0.01)
            except Exception as exc:  # anything but QuotaExceededError is a lost request
                errors.append(exc)

    async def scenario():
        store = FallbackQuotaStore(RedisQuotaStore(redis_server.url, socket_timeout_s=0.5), num_replicas=2,
                                   probe_interval_s=0.05, on_fallback_change=fallback_changes.append)
        stop = asyncio.Event()
        loaders = [asyncio.create_task(load(store, stop)) for _ in range(3)]
        await asyncio.sleep(0.2)
        # Reservations issued by Redis that are still open when it dies: settled later.
        open_on_redis = [await store.reserve(tenant, 10, 20) for _ in range(2)]
        assert {r.issued_by for r in open_on_redis} == {"redis"}

        redis_server.kill()
        await until(lambda: store.fallback_active, "fallback after Redis died")
        for r in open_on_redis:
            await store.settle(r, completion_tokens=3)  # queued: Redis is down
        assert store.num_pending_settlements >= 2
        stop.set()
        await asyncio.gather(*loaders)
        # Local limits held meanwhile: 8 concurrent / 2 replicas = 4.
        held = await asyncio.gather(*(try_reserve(store, tenant, 10, 20) for _ in range(10)))
        held = [r for r in held if r is not None]
        assert len(held) == 4 and {r.issued_by for r in held} == {"local"}

        redis_server.restart()
        await until(lambda: not store.fallback_active, "Redis resumed after restart")
        assert store.num_pending_settlements == 0
        back = await store.reserve(tenant, 10, 20)
        assert back.issued_by == "redis"
        for r in held + [back]:
            await store.settle(r, completion_tokens=1)  # local ones settle locally, after the switch
        assert (await store.primary.usage(tenant)).requests_in_flight == 0
        assert (await store.local.usage(tenant)).requests_in_flight == 0
        await store.aclose()

    with caplog.at_level(logging.WARNING, logger="kvmesh.router.quota"):
        asyncio.run(scenario())
    assert errors == []
    assert fallback_changes == [True, False]
    assert settled, "the load ran"
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("Redis unreachable" in m for m in messages) and any("Redis is back" in m for m in messages)


def test_two_replicas_share_one_kv_tokens_limit(redis_server):
    tenant = fresh_tenant(max_concurrent_kv_tokens=1000)

    async def scenario():
        replicas = [RedisQuotaStore(redis_server.url), RedisQuotaStore(redis_server.url)]
        results = await asyncio.gather(*(try_reserve(replicas[i % 2], tenant, 60, 40) for i in range(40)))
        admitted = [r for r in results if r is not None]
        assert len(admitted) == 10  # 10 x (60 + 40) = 1000
        await replicas[1].release(admitted[0])
        assert await try_reserve(replicas[0], tenant, 60, 40) is not None
        assert await try_reserve(replicas[1], tenant, 1, 1) is None
        for store in replicas:
            await store.aclose()

    asyncio.run(scenario())


def test_starts_without_redis_then_joins_it(tmp_path):
    port = free_port()
    store = make_quota_store(TenantsConfig(redis_url=f"redis://127.0.0.1:{port}/0", quota_probe_interval_s=0.05),
                             num_replicas=3)
    tenant = fresh_tenant(max_concurrent_requests=6)

    async def scenario():
        first = await store.reserve(tenant, 1, 1)  # Redis absent: local share of 6 / 3 = 2
        assert first.issued_by == "local" and store.fallback_active
        await store.reserve(tenant, 1, 1)
        assert await try_reserve(store, tenant, 1, 1) is None
        server = RedisServer.start(tmp_path / "late-redis", port=port)
        try:
            await until(lambda: not store.fallback_active, "joined Redis once it started")
            assert (await store.reserve(tenant, 1, 1)).issued_by == "redis"
            await store.settle(first, completion_tokens=1)
            assert (await store.local.usage(tenant)).requests_in_flight == 1
            await store.aclose()
        finally:
            server.stop()

    asyncio.run(scenario())


class ReplyDroppingProxy:
    """TCP proxy to Redis that can drop ONE reply and cut the client off: Redis has run the
    command, the client never hears of it (a fault a healthy Redis cannot be made to show)."""

    def __init__(self, redis_port: int):
        self.redis_port = redis_port
        self.drop_next_reply = False
        self.num_dropped = 0
        self._server = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _serve(self, client_r, client_w):
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.redis_port)

        async def upstream():
            while data := await client_r.read(65536):
                server_w.write(data)
                await server_w.drain()
            server_w.close()

        async def downstream():
            while data := await server_r.read(65536):
                if self.drop_next_reply:
                    self.drop_next_reply = False
                    self.num_dropped += 1
                    break
                client_w.write(data)
                await client_w.drain()
            client_w.close()
            server_w.close()

        await asyncio.gather(upstream(), downstream(), return_exceptions=True)

    async def stop(self):
        self._server.close()


def test_reserve_whose_reply_is_lost_is_released_on_reconnect(redis_server):
    tenant = fresh_tenant(max_concurrent_requests=4, prompt_tokens_per_minute=6000)

    async def scenario():
        proxy = ReplyDroppingProxy(redis_server.port)
        port = await proxy.start()
        store = FallbackQuotaStore(RedisQuotaStore(f"redis://127.0.0.1:{port}/0"), num_replicas=2,
                                   probe_interval_s=0.05)
        await store.release(await store.reserve(tenant, 10, 10))  # scripts loaded, connection warm
        proxy.drop_next_reply = True
        local = await store.reserve(tenant, 100, 10)  # ran in Redis; the reply never came back
        assert proxy.num_dropped == 1 and local.issued_by == "local"
        await until(lambda: not store.fallback_active, "reconnected through the proxy")
        usage = await store.primary.usage(tenant)
        assert usage.requests_in_flight == 0  # the phantom reservation was released
        assert usage.prompt_tokens_available == pytest.approx(6000, abs=1)  # its prompt tokens refunded
        await store.settle(local, completion_tokens=10)
        await store.aclose()
        await proxy.stop()

    asyncio.run(scenario())


def test_outage_of_30_s_under_load_admits_at_most_quota_plus_local_shares(redis_server):
    """Two replicas, saturating clients, a tenant's 1,200 output tokens/min; Redis killed for
    30 s (of a clock the test moves) and restarted with its data. Before and after, the two
    replicas share one bucket; during the outage each holds 1/2 of the limit. Output tokens
    admitted while Redis is down <= the replicas' local shares (full at the start) plus what
    they refill in 30 s; nothing but QuotaExceededError is refused, and the local shares are
    actually served (the quota allowed them)."""
    quota, num_replicas, max_tokens, step_s = 1200, 2, 20, 0.5
    tenant = fresh_tenant(output_tokens_per_minute=quota)
    redis_clock = ManualClock()
    local_now_s = [0.0]

    def advance(seconds: float) -> None:
        redis_clock.advance(seconds)
        local_now_s[0] += seconds

    async def saturate(replicas, seconds: float) -> int:
        """Each step every replica reserves until refused; every reservation uses it all."""
        admitted = 0
        for _ in range(int(seconds / step_s)):
            for store in replicas:
                while (r := await try_reserve(store, tenant, 1, max_tokens)) is not None:
                    await store.settle(r, completion_tokens=max_tokens)
                    admitted += max_tokens
            advance(step_s)
        return admitted

    async def scenario():
        replicas = [FallbackQuotaStore(RedisQuotaStore(redis_server.url, socket_timeout_s=0.5, clock_us=redis_clock),
                                       num_replicas=num_replicas, probe_interval_s=0.05,
                                       local_clock=lambda: local_now_s[0]) for _ in range(num_replicas)]
        before = await saturate(replicas, 10)
        redis_server.kill()
        during = await saturate(replicas, 30)
        assert all(store.fallback_active for store in replicas)
        redis_server.restart()
        await until(lambda: not any(store.fallback_active for store in replicas), "both back on Redis")
        after = await saturate(replicas, 10)
        assert not any(store.fallback_active for store in replicas)
        for store in replicas:
            await store.aclose()
        return before, during, after

    before, during, after = asyncio.run(scenario())
    local_shares = num_replicas * (quota // num_replicas)  # every local bucket full at the outage
    refill_30_s = quota * 30 / 60
    assert during <= local_shares + refill_30_s
    assert during >= local_shares  # served what the quota allowed, not refused for the outage
    # One shared bucket outside the outage: full once, then its refill (Redis's clock ran on
    # through the outage, so the bucket left near empty has refilled 30 s worth by the restart).
    assert before <= quota + quota * 10 / 60
    assert after <= quota * (30 + 10) / 60 + max_tokens
