"""The router replicas' shared new-family claims (router/family_claims.py) against a real
redis-server, and the routing rule that follows a claim (router/routing.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import random

from kvmesh.core.config import KvmeshConfig, RouterConfig
from kvmesh.core.seams import WorkerStats
from kvmesh.router.family_claims import ClaimOutcome, FamilyClaims, make_family_claims
from kvmesh.router.routing import PredictedLatencyState, RouteRequest, RoutingPath, choose_worker

BLOCK = 16
CONFIG = RouterConfig(num_replicas=2)


def stats(worker_id: str, tokens_to_compute: int = 0) -> WorkerStats:
    return WorkerStats(worker_id=worker_id, healthy=True, block_size=BLOCK, num_blocks_total=1000, num_blocks_used=0,
                       num_blocks_cached=0, num_blocks_free=1000, kv_tokens_used=0, kv_tokens_capacity=16_000,
                       kv_tokens_reserved=0, num_running=0, num_waiting=0, queued_prompt_tokens=0,
                       prefix_cache_hit_rate=0.0, output_tokens_per_s=10.0, tokens_to_compute=tokens_to_compute)


def test_two_replicas_claiming_one_new_family_both_get_the_first_proposal(redis_server):
    async def main():
        outcomes = []
        first, second = (FamilyClaims(redis_server.url, ttl_s=5.0, namespace="claims-test", on_outcome=outcomes.append)
                         for _ in range(2))
        # Each replica's own rule picked a different worker (its own tickets, its own view).
        assert await first.claim(b"family-a", [("worker-1", 3), ("worker-0", 3)]) == "worker-1"
        assert await second.claim(b"family-a", [("worker-0", 3), ("worker-1", 3)]) == "worker-1"
        assert await second.claim(b"family-b", [("worker-0", 3), ("worker-1", 3)]) == "worker-0"
        assert outcomes == [ClaimOutcome.WON, ClaimOutcome.JOINED, ClaimOutcome.WON]
        # At once, many families from both replicas: every family ends on one worker.
        owners = await asyncio.gather(*[replica.claim(f"burst-{i}".encode(), [(f"worker-{r}", 100), ("worker-9", 100)])
                                        for i in range(20) for r, replica in enumerate((first, second))])
        assert all(owners[2 * i] == owners[2 * i + 1] for i in range(20))
        await first.aclose()
        await second.aclose()
    asyncio.run(main())


def test_a_new_family_is_claimed_where_the_live_families_leave_room_whoever_placed_them(redis_server):
    """Room for three families a worker (the routing campaign's caches): two replicas place
    three on worker-1 between them; the fourth goes to worker-0 whichever replica proposes
    worker-1 first, as neither replica alone has seen all three."""
    async def main():
        first, second = (FamilyClaims(redis_server.url, ttl_s=5.0, namespace="claims-room") for _ in range(2))
        order = [("worker-1", 3), ("worker-0", 3)]
        assert [await first.claim(b"f0", order), await second.claim(b"f1", order),
                await first.claim(b"f2", order)] == ["worker-1"] * 3
        assert await second.claim(b"f3", order) == "worker-0"
        full = [("worker-1", 1), ("worker-0", 0)]  # room nowhere: the proposal stands
        assert await first.claim(b"f4", full) == "worker-1"
        await first.aclose()
        await second.aclose()
    asyncio.run(main())


def test_a_claim_expires_unless_its_family_keeps_coming(redis_server):
    async def main():
        now = [0.0]
        replica = FamilyClaims(redis_server.url, ttl_s=0.3, namespace="claims-expiry", clock=lambda: now[0])
        other = FamilyClaims(redis_server.url, ttl_s=0.3, namespace="claims-expiry")
        assert await replica.claim(b"live", [("worker-1", 9)]) == "worker-1"
        assert await replica.claim(b"quiet", [("worker-1", 9)]) == "worker-1"
        for _ in range(4):  # the live family's requests keep coming: its claim is renewed
            await asyncio.sleep(0.15)
            now[0] += 0.15
            replica.keep_alive(b"live")
        await asyncio.sleep(0.05)
        assert await other.claim(b"live", [("worker-0", 9)]) == "worker-1"
        assert await other.claim(b"quiet", [("worker-0", 9)]) == "worker-0"  # expired: placed anew
        await replica.aclose()
        await other.aclose()
    asyncio.run(main())


def test_with_redis_down_a_replica_places_by_its_own_rule_says_so_and_resumes(redis_server):
    async def main():
        fallback = []
        replica = FamilyClaims(redis_server.url, ttl_s=5.0, namespace="claims-down", probe_interval_s=0.1,
                               on_fallback_change=fallback.append)
        redis_server.kill()
        try:
            assert await replica.claim(b"family", [("worker-0", 3)]) is None
            assert replica.fallback_active and fallback == [True]
            assert await replica.claim(b"family", [("worker-1", 3)]) is None  # no wait on a dead Redis meanwhile
        finally:
            redis_server.restart()
        for _ in range(200):
            if not replica.fallback_active:
                break
            await asyncio.sleep(0.05)
        assert fallback == [True, False]
        assert await replica.claim(b"family", [("worker-1", 3)]) == "worker-1"
        await replica.aclose()
    asyncio.run(main())


def test_a_new_family_goes_to_its_claimed_worker_whatever_the_replica_s_own_view():
    state = PredictedLatencyState(CONFIG, 512)
    workers = [stats("w0"), stats("w1", tokens_to_compute=800), stats("w2")]
    request = RouteRequest(600, BLOCK, b"family")
    own = choose_worker({}, workers, CONFIG, random.Random(0), request=request, state=state)
    claimed = next(w.worker_id for w in workers if w.worker_id != own.worker_id)
    decision = choose_worker({}, workers, CONFIG, random.Random(0), state=state,
                             request=dataclasses.replace(request, claimed_worker=claimed))
    assert (decision.worker_id, decision.path) == (claimed, RoutingPath.NO_PREFIX)
    # A family already cached somewhere routes by its prefix: the claim is for new ones only.
    decision = choose_worker({"w2": 30}, workers, CONFIG, random.Random(0), state=state,
                             request=dataclasses.replace(request, claimed_worker="w0"))
    assert decision.worker_id == "w2"
    prefix_aware = dataclasses.replace(CONFIG, policy="prefix_aware")
    assert choose_worker({}, workers, prefix_aware, random.Random(0),
                         request=dataclasses.replace(request, claimed_worker="w1")).worker_id == "w1"


def test_claims_apply_only_with_several_replicas_a_redis_and_a_ttl():
    def config(**router):
        return KvmeshConfig.from_dict({"router": router, "tenants": {"redis_url": "redis://127.0.0.1:1/0"}})
    assert make_family_claims(config(num_replicas=1), "app") is None
    assert make_family_claims(config(num_replicas=2, family_claim_ttl_s=0), "app") is None
    assert make_family_claims(KvmeshConfig.from_dict({"router": {"num_replicas": 2}}), "app") is None
    assert isinstance(make_family_claims(config(num_replicas=2), "app"), FamilyClaims)


def test_a_family_sent_somewhere_lately_is_proposed_there_again():
    """Its prefix evicted and its claim expired, a family still in use is proposed where this
    replica sent it last (within the live window), not placed anew by the rule."""
    from kvmesh.core.seams import WorkerStats
    from kvmesh.router.family_claims import claim_proposal
    from kvmesh.router.live_families import LiveFamilies

    now = [100.0]
    live = LiveFamilies(30.0, clock=lambda: now[0])
    live.note("w0", b"f", 33)
    now[0] += 1.0
    live.note("w1", b"f", 33)  # spread, or moved: the latest request went to w1
    live.note("w0", b"g", 33)
    workers = [WorkerStats(w, True, 16, *([0] * 10), 0.0, 0.0) for w in ("w0", "w1")]
    rule = lambda: "w0"  # noqa: E731 - the one-replica rule's pick
    assert live.latest_worker(b"f") == "w1" and claim_proposal(live.latest_worker(b"f"), workers, rule) == "w1"
    assert claim_proposal("w1", workers[:1], rule) == "w0"  # w1 not a candidate (excluded, unhealthy)
    assert live.latest_worker(b"new") is None and claim_proposal(None, workers, rule) == "w0"
    now[0] += 31.0  # past the window: placed by the rule again
    assert live.latest_worker(b"f") is None
