"""InProcessQuotaStore: token buckets, concurrency limits, settle/refund arithmetic.

Time is an injected clock (a list we advance), so refill arithmetic is exact and the
tests never sleep.
"""

import asyncio

import pytest

from kvmesh.router.quota import InProcessQuotaStore
from kvmesh.router.tenants import Tenant, TenantLimits
from kvmesh.core.errors import InvalidRequestError, QuotaExceededError


class ManualClock:
    def __init__(self):
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def tenant(**limits) -> Tenant:
    return Tenant(id="acme", limits=TenantLimits(**limits))


def run(coro):
    return asyncio.run(coro)


def test_prompt_bucket_drains_and_refills_at_rate_per_minute():
    clock = ManualClock()
    store = InProcessQuotaStore(clock=clock)
    t = tenant(prompt_tokens_per_minute=600)  # refills 10 tokens/s

    async def scenario():
        await store.reserve(t, prompt_tokens=500, max_tokens=1)
        with pytest.raises(QuotaExceededError) as exc:
            await store.reserve(t, prompt_tokens=150, max_tokens=1)
        # 100 left, 50 missing at 10 tokens/s -> 5 s
        assert exc.value.retry_after_s == pytest.approx(5.0)
        clock.now_s += 5.0
        await store.reserve(t, prompt_tokens=150, max_tokens=1)
        usage = await store.usage(t)
        assert usage.prompt_tokens_available == pytest.approx(0.0)
        clock.now_s += 3600  # refill caps at one minute's worth
        assert (await store.usage(t)).prompt_tokens_available == pytest.approx(600.0)

    run(scenario())


def test_settle_refunds_unused_output_and_charges_what_streamed():
    clock = ManualClock()
    store = InProcessQuotaStore(clock=clock)
    t = tenant(output_tokens_per_minute=1000, max_concurrent_requests=2)

    async def scenario():
        a = await store.reserve(t, prompt_tokens=10, max_tokens=300)
        b = await store.reserve(t, prompt_tokens=10, max_tokens=200)
        usage = await store.usage(t)
        assert usage.output_tokens_available == pytest.approx(500.0)
        assert usage.requests_in_flight == 2 and usage.kv_tokens_in_flight == 520
        await store.settle(a, completion_tokens=120)  # refund 180
        await store.settle(b, completion_tokens=7)  # cancelled after 7 tokens: refund 193
        usage = await store.usage(t)
        assert usage.output_tokens_available == pytest.approx(500.0 + 180 + 193)
        assert usage.requests_in_flight == 0 and usage.kv_tokens_in_flight == 0
        await store.settle(a, completion_tokens=0)  # idempotent: nothing more refunded
        assert (await store.usage(t)).output_tokens_available == pytest.approx(873.0)

    run(scenario())


def test_release_refunds_everything_and_frees_concurrency():
    store = InProcessQuotaStore(clock=ManualClock())
    t = tenant(prompt_tokens_per_minute=100, output_tokens_per_minute=100, max_concurrent_requests=1)

    async def scenario():
        r = await store.reserve(t, prompt_tokens=60, max_tokens=40)
        with pytest.raises(QuotaExceededError) as exc:
            await store.reserve(t, prompt_tokens=1, max_tokens=1)
        assert exc.value.retry_after_s > 0
        await store.release(r)
        usage = await store.usage(t)
        assert usage.prompt_tokens_available == pytest.approx(100.0)
        assert usage.output_tokens_available == pytest.approx(100.0)
        await store.reserve(t, prompt_tokens=60, max_tokens=40)

    run(scenario())


def test_concurrent_kv_tokens_limit():
    store = InProcessQuotaStore(clock=ManualClock())
    t = tenant(max_concurrent_kv_tokens=1000)

    async def scenario():
        a = await store.reserve(t, prompt_tokens=400, max_tokens=400)
        with pytest.raises(QuotaExceededError):
            await store.reserve(t, prompt_tokens=100, max_tokens=101)
        await store.reserve(t, prompt_tokens=100, max_tokens=100)
        await store.settle(a, completion_tokens=5)
        await store.reserve(t, prompt_tokens=400, max_tokens=400)

    run(scenario())


def test_requests_that_can_never_fit_are_invalid_not_retryable():
    store = InProcessQuotaStore(clock=ManualClock())
    t = tenant(prompt_tokens_per_minute=100, output_tokens_per_minute=1000, max_tokens_ceiling=256,
               max_concurrent_kv_tokens=300)

    async def scenario():
        for prompt, max_tokens in ((101, 1), (1, 257), (100, 250), (0, 0)):
            with pytest.raises(InvalidRequestError):
                await store.reserve(t, prompt_tokens=prompt, max_tokens=max_tokens)
        assert (await store.usage(t)).requests_in_flight == 0

    run(scenario())


def test_concurrent_asyncio_reservations_never_over_admit():
    store = InProcessQuotaStore(clock=ManualClock())
    t = tenant(prompt_tokens_per_minute=1000, max_concurrent_requests=50)

    async def one():
        try:
            return await store.reserve(t, prompt_tokens=30, max_tokens=1)
        except QuotaExceededError:
            return None

    async def scenario():
        results = await asyncio.gather(*(one() for _ in range(200)))
        admitted = [r for r in results if r is not None]
        assert len(admitted) == 1000 // 30  # 33: the bucket, not concurrency, is the bound

    run(scenario())


def test_local_share_divides_limits_by_replicas():
    store = InProcessQuotaStore(limit_fraction=1 / 4, clock=ManualClock())
    t = tenant(prompt_tokens_per_minute=1000, max_concurrent_requests=8, max_tokens_ceiling=64)

    async def scenario():
        admitted = 0
        for _ in range(10):
            try:
                await store.reserve(t, prompt_tokens=10, max_tokens=64)
                admitted += 1
            except QuotaExceededError:
                break
        assert admitted == 2  # 8 concurrent / 4 replicas
        assert (await store.usage(t)).prompt_tokens_available == pytest.approx(250 - 20)

    run(scenario())


def test_limit_change_is_followed():
    clock = ManualClock()
    store = InProcessQuotaStore(clock=clock)

    async def scenario():
        await store.reserve(tenant(prompt_tokens_per_minute=1000), prompt_tokens=100, max_tokens=1)
        smaller = tenant(prompt_tokens_per_minute=500)
        assert (await store.usage(smaller)).prompt_tokens_available == pytest.approx(500.0)
        unlimited = tenant()
        await store.reserve(unlimited, prompt_tokens=10**6, max_tokens=10**6)

    run(scenario())
