"""router/affinity_wait.py and the admission queue's holds: a request whose prefix worker is
full waits for room there instead of spilling, only when budget is the one obstacle, never
past its bound, and without holding up the requests behind it."""

from __future__ import annotations

import asyncio
import random
import time

from kvmesh.core.config import RouterConfig
from kvmesh.router.admission import RouterAdmission
from kvmesh.router.affinity_wait import AffinityHold, AffinityWaitOutcome
from kvmesh.router.routing import preferred_workers
from kvmesh.core.seams import WorkerStats


def stats(worker_id, reserved=0, capacity=1000, to_compute=0):
    return WorkerStats(worker_id=worker_id, healthy=True, block_size=16, num_blocks_total=capacity // 16,
                       num_blocks_used=0, num_blocks_cached=0, num_blocks_free=capacity // 16,
                       kv_tokens_used=reserved, kv_tokens_capacity=capacity, kv_tokens_reserved=reserved,
                       num_running=0, num_waiting=0, queued_prompt_tokens=0, prefix_cache_hit_rate=0.0,
                       output_tokens_per_s=50.0, tokens_to_compute=to_compute)


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


# w0 holds 30 blocks of the prompt: there the request costs 100 tokens, elsewhere 580.
MATCHED = {"w0": 30}


def cost_for(worker_id):
    return 100 if worker_id == "w0" else 580


def test_preferred_workers_are_the_longest_matches_left_after_exclusion():
    assert preferred_workers({"w0": 30, "w1": 30, "w2": 4}) == {"w0", "w1"}
    assert preferred_workers({"w0": 30, "w1": 4}, exclude=frozenset({"w0"})) == {"w1"}
    assert preferred_workers({"w0": 0}) == set()


# The family's second home (its first 16 blocks on w1 too, as the spreading rule leaves it).
TWO_HOMES = {"w0": 30, "w1": 16}


def test_holds_only_when_budget_alone_would_spill_and_only_for_affinity_wait_s():
    """A spill to another of the family's homes: the hold lasts affinity_wait_s."""
    rng, clock, config = random.Random(0), FakeClock(), RouterConfig(policy="prefix_aware", affinity_wait_s=1.0)
    w0, w1 = stats("w0", reserved=950), stats("w1")
    hold = AffinityHold(TWO_HOMES, config, clock=clock)
    view = lambda: ([w0, w1], {}, 0.0)  # noqa: E731 - the cluster as the load guard sees it
    assert not hold.holds([w0, w1], view, rng)  # its worker is offered: no wait
    assert hold.holds([w1], view, rng)  # only the other one: wait
    assert hold.outcome("w1") is AffinityWaitOutcome.TIMED_OUT and hold.outcome("w0") is AffinityWaitOutcome.ROOM
    clock.now += 0.9
    assert hold.holds([w1], view, rng)
    clock.now += 0.2  # the wait ran out: it spills
    assert not hold.holds([w1], view, rng)
    # w1 holds only the first 15 blocks, less than the family's 16: not a home of the family
    assert not AffinityHold({"w0": 30, "w1": 15}, config, clock=clock)._spill_joins_a_home([w1])

    # the load guard would move it anyway (w0 has far more work to compute): no wait at all
    busy = stats("w0", reserved=950, to_compute=20_000)
    hold = AffinityHold(MATCHED, config, clock=clock)
    assert not hold.holds([w1], lambda: ([busy, w1], {}, 0.0), rng) and hold.outcome("w1") is None
    # switched off; nothing cached; the prefix's worker excluded (it refused this request)
    assert not AffinityHold(MATCHED, RouterConfig(policy="prefix_aware", affinity_wait_s=0.0), clock=clock).holds([w1], view, rng)
    assert not AffinityHold({}, config, clock=clock).holds([w1], view, rng)
    assert not AffinityHold(MATCHED, config, frozenset({"w0"}), clock=clock).holds([w1], view, rng)



def test_under_predicted_latency_the_wait_is_at_least_the_prefill_a_spill_would_add():
    """w0 holds 6,000 of the 6,010-token prompt, w1 (the family's second home) its first 256:
    a spill to w1 computes 5,744 again, 2.3 s at 0.4 ms a token, so the request waits up to
    that (not the 1 s floor) before spilling."""
    from kvmesh.router.routing import PredictedLatencyState, RouteRequest

    rng, clock = random.Random(0), FakeClock()
    config = RouterConfig(policy="predicted_latency", affinity_wait_s=1.0, prefill_s_per_token=0.0004)
    # w0 has 7,000 tokens to compute first (2.8 s): no sooner than a spill, once the wait is over
    w0, w1 = stats("w0", reserved=950, to_compute=7000), stats("w1")
    state = PredictedLatencyState(config, 512, clock)
    hold = AffinityHold({"w0": 375, "w1": 16}, config, clock=clock, request=RouteRequest(6010, 16, b"family"),
                        state=state)
    view = lambda: ([w0, w1], {}, 0.0)  # noqa: E731
    assert hold.holds([w1], view, rng)
    clock.now += 2.2
    assert hold.holds([w1], view, rng)
    clock.now += 0.2
    assert not hold.holds([w1], view, rng) and hold.outcome("w1") is AffinityWaitOutcome.TIMED_OUT
    # A short prefix keeps the floor: 30 blocks, 0.19 s of prefill, waits affinity_wait_s.
    short = AffinityHold(TWO_HOMES, config, clock=clock, request=RouteRequest(490, 16, b"other"), state=state)
    assert short.holds([w1], view, rng)
    clock.now += 1.1
    assert not short.holds([w1], view, rng)

def test_under_predicted_latency_the_wait_tracks_the_drain_of_the_prefix_worker():
    """Past the 2.4 s a spill would add, the request keeps waiting while its prefix's worker,
    full but predicted to drain sooner than the spill would serve it, is still the better bet;
    it spills once that changes, and at half the queue's wait bound whatever the prediction."""
    import dataclasses

    from kvmesh.router.routing import PredictedLatencyState, RouteRequest

    rng, clock = random.Random(0), FakeClock()
    config = RouterConfig(policy="predicted_latency", affinity_wait_s=1.0, prefill_s_per_token=0.0004,
                          max_queue_wait_s=10.0)
    state = PredictedLatencyState(config, 512, clock)

    def full(prompt_tokens=0):  # w0: no budget left, this much still to compute
        return dataclasses.replace(stats("w0", reserved=950, to_compute=prompt_tokens),
                                   queued_prompt_tokens=prompt_tokens)

    cluster = {"w0": full(prompt_tokens=3000), "w1": stats("w1")}
    view = lambda: (list(cluster.values()), {}, 0.0)  # noqa: E731

    def hold():  # w1: the family's second home (its first 16 blocks)
        return AffinityHold({"w0": 375, "w1": 16}, config, clock=clock, request=RouteRequest(6010, 16, b"family"),
                            state=state)

    waiting = hold()
    assert waiting.holds([cluster["w1"]], view, rng)
    clock.now += 3.0  # past the 2.3 s floor: w0 (1.2 s of work) still beats a spill (2.3 s)
    assert waiting.holds([cluster["w1"]], view, rng)
    cluster["w0"] = full(prompt_tokens=7000)  # now 2.8 s: the spill is sooner
    assert not waiting.holds([cluster["w1"]], view, rng)
    assert waiting.outcome("w1") is AffinityWaitOutcome.TIMED_OUT

    # never past half of max_queue_wait_s (a holder is refused as overloaded past it)
    cluster["w0"] = full()
    bounded = hold()
    assert bounded.holds([cluster["w1"]], view, rng)
    clock.now += 4.9
    assert bounded.holds([cluster["w1"]], view, rng)
    clock.now += 0.2
    assert not bounded.holds([cluster["w1"]], view, rng)


def _controller(workers, **router):
    clock = FakeClock()
    config = RouterConfig(**{"policy": "prefix_aware", "max_queue_wait_s": 5.0, "affinity_wait_s": 1.0, **router})
    admission = RouterAdmission(config, clock=clock)
    admission.update_stats(workers)
    return admission, clock, config


def _family(admission, clock, config, chosen, matched=MATCHED, **hold_args):
    """acquire() for a request of the family cached on w0, with its affinity hold."""
    affinity = AffinityHold(matched, config, clock=clock, **hold_args)
    rng = random.Random(0)

    def route(eligible, _):
        picked = "w0" if "w0" in {w.worker_id for w in eligible} else eligible[0].worker_id
        chosen.append(picked)
        return picked

    def hold(eligible):
        return affinity.holds(eligible, admission.cluster_load, rng)
    return affinity, route, hold


def test_a_held_request_waits_for_its_worker_without_holding_up_the_queue_behind_it():
    async def main():
        admission, clock, config = _controller([stats("w0", reserved=850), stats("w1")])
        filler = await admission.acquire(100, route=lambda eligible, _: "w0")  # w0 is now full for the family
        chosen = []
        _, route, hold = _family(admission, clock, config, chosen)
        family = asyncio.create_task(admission.acquire(580, cost_for=cost_for, route=route, hold=hold))
        await asyncio.sleep(0.01)
        assert not family.done() and chosen == []  # held, though w1 had room
        # a request behind it that w1 can take is not held up by it
        other = await asyncio.wait_for(admission.acquire(580, route=lambda eligible, _: "w1"), 1.0)
        assert other.worker_id == "w1"
        filler.release()  # room on w0: the held request takes it at once
        ticket = await asyncio.wait_for(family, 1.0)
        assert ticket.worker_id == "w0" and ticket.cost_tokens == 100 and chosen == ["w0"]

    asyncio.run(main())


def test_a_held_request_spills_once_its_wait_runs_out():
    """To another of the family's homes after affinity_wait_s; to a worker holding none of the
    family (a second home nobody chose) only after half of max_queue_wait_s (2.5 s here)."""
    async def main():
        full = [stats("w0", reserved=950), stats("w1")]
        for matched, waits_s in ((TWO_HOMES, 1.0), (MATCHED, 2.5)):
            admission, clock, config = _controller(full)
            chosen = []
            affinity, route, hold = _family(admission, clock, config, chosen, matched=matched)
            family = asyncio.create_task(admission.acquire(580, cost_for=cost_for, route=route, hold=hold))
            await asyncio.sleep(0.01)
            admission.update_stats(full)  # a report with w0 still full, within the wait: still held
            await asyncio.sleep(0.01)
            assert not family.done()
            clock.now += waits_s - 0.1
            admission.update_stats(full)  # just before the bound: still held
            await asyncio.sleep(0.01)
            assert not family.done() and chosen == []
            clock.now += 0.2
            admission.update_stats(full)  # the next report after the wait ran out: it spills to w1
            ticket = await asyncio.wait_for(family, 1.0)
            assert ticket.worker_id == "w1" and chosen == ["w1"]
            assert affinity.outcome("w1") is AffinityWaitOutcome.TIMED_OUT

    asyncio.run(main())


def test_a_spill_that_would_start_the_family_a_second_home_waits_as_long_as_a_hold_may():
    """predicted_latency, w0 full with its prefix, w1 holding none of the family: past the
    ski-rental bound and while a spill is predicted sooner, the request still waits for room
    on w0 (a spill would start a second home the spreading rule never chose), up to half of
    max_queue_wait_s; a deadline caps it at half the time left, as any hold."""
    from kvmesh.router.routing import PredictedLatencyState, RouteRequest

    rng, clock = random.Random(0), FakeClock()
    config = RouterConfig(policy="predicted_latency", affinity_wait_s=1.0, prefill_s_per_token=0.0004,
                          max_queue_wait_s=20.0)
    state = PredictedLatencyState(config, 512, clock)
    w0, w1 = stats("w0", reserved=950, to_compute=7000), stats("w1")  # w0: 2.8 s of work, a spill 2.4 s
    view = lambda: ([w0, w1], {}, 0.0)  # noqa: E731
    hold = AffinityHold({"w0": 375}, config, clock=clock, request=RouteRequest(6010, 16, b"family"), state=state)
    assert hold.holds([w1], view, rng)
    clock.now += 9.9
    assert hold.holds([w1], view, rng)
    assert not hold.holds([w0, w1], view, rng) and hold.outcome("w0") is AffinityWaitOutcome.ROOM
    late = AffinityHold({"w0": 375}, config, clock=clock, request=RouteRequest(6010, 16, b"family"), state=state)
    assert late.holds([w1], view, rng)
    clock.now += 10.1
    assert not late.holds([w1], view, rng) and late.outcome("w1") is AffinityWaitOutcome.TIMED_OUT
    near = AffinityHold({"w0": 375}, config, clock=clock, request=RouteRequest(6010, 16, b"family"), state=state,
                        deadline_s=1000.0, wall_clock=lambda: 996.0)
    assert near.holds([w1], view, rng)
    clock.now += 2.1
    assert not near.holds([w1], view, rng)


def test_no_hold_for_a_try_now_a_full_queue_or_a_near_deadline():
    async def main():
        full = [stats("w0", reserved=950), stats("w1")]
        admission, clock, config = _controller(full)
        chosen = []
        _, route, hold = _family(admission, clock, config, chosen)
        # a degradation ladder's try-now step takes what has room now
        ticket = await admission.acquire(580, cost_for=cost_for, route=route, hold=hold, max_wait_s=0)
        assert ticket.worker_id == "w1"
        ticket.release()
        # no queue slot to hold out in: it takes w1 instead of being refused
        no_slots, slots_clock, _ = _controller(full, max_queue_len=0)
        _, route, hold = _family(no_slots, slots_clock, config, [])
        assert (await no_slots.acquire(580, cost_for=cost_for, route=route, hold=hold)).worker_id == "w1"
        # a deadline 1 s away caps the hold at half of it; one already past never holds
        affinity = AffinityHold(MATCHED, config, clock=clock, deadline_s=1000.0, wall_clock=lambda: 999.0)
        assert affinity.holds([full[1]], lambda: (full, {}, 0.0), random.Random(0))
        clock.now += 0.6
        assert not affinity.holds([full[1]], lambda: (full, {}, 0.0), random.Random(0))
        late = AffinityHold(MATCHED, config, clock=clock, deadline_s=1000.0, wall_clock=lambda: 1001.0)
        assert not late.holds([full[1]], lambda: (full, {}, 0.0), random.Random(0)) and late.outcome("w1") is None

    asyncio.run(main())


def test_a_held_request_is_not_shed_for_the_queue_it_chose_to_wait_in():
    async def main():
        roomy = stats("w1", capacity=10_000)  # room for all four
        admission, clock, config = _controller([stats("w0", reserved=950), roomy],  # drain 2 x 50 tokens/s
                                               max_queue_wait_s=30.0)
        held = []
        for _ in range(3):  # 1,740 tokens queued ahead, all holding out for w0: 17 s at the drain rate
            _, route, hold = _family(admission, clock, config, [])
            held.append(asyncio.create_task(admission.acquire(580, cost_for=cost_for, route=route, hold=hold)))
            await asyncio.sleep(0.01)
        chosen = []
        _, route, hold = _family(admission, clock, config, chosen)
        # deadline-aware shedding would refuse a request that must queue 17 s with 5 s left;
        # this one could run on w1 now, so it holds out instead, and spills when the wait ends
        late = asyncio.create_task(admission.acquire(580, cost_for=cost_for, route=route, hold=hold,
                                                     deadline_s=time.time() + 5.0))
        await asyncio.sleep(0.01)
        assert not late.done()
        clock.now += 15.1  # past half of max_queue_wait_s (w1 holds none of the family)
        admission.update_stats([stats("w0", reserved=950), roomy])
        tickets = await asyncio.wait_for(asyncio.gather(*held, late), 1.0)
        assert [t.worker_id for t in tickets] == ["w1"] * 4

    asyncio.run(main())


def test_a_request_its_prefix_worker_refused_waits_for_that_workers_next_report():
    """w0 (the prefix's worker) refused the request: the router's view of it was behind. Its
    stale figures say it has far more to compute (the load guard would move the request), and
    it is left out until its next report; the request waits for that report instead of
    spilling at once to w1, and goes home when the report shows room. A report that still
    shows w0 full (yet the family's worker by the load guard) keeps it waiting past
    affinity_wait_s for room there; no report and no room: it waits as long as a hold may
    (half of max_queue_wait_s here), then spills. A refuser not holding the prefix is not
    waited for."""
    async def main():
        admission, clock, config = _controller([stats("w0", reserved=100, to_compute=20_000), stats("w1")])

        async def refused_by_w0():
            """The family's request, just refused by w0, re-admitted: held, though w1 has room."""
            admission.note_refusal("w0")
            chosen = []
            affinity, route, hold = _family(admission, clock, config, chosen, refused_by="w0",
                                            awaiting_report=admission.awaiting_report)
            retry = asyncio.create_task(admission.acquire(580, cost_for=cost_for, route=route, hold=hold))
            await asyncio.sleep(0.01)
            assert not retry.done() and chosen == []
            return affinity, retry, chosen

        affinity, retry, chosen = await refused_by_w0()
        clock.now += 0.5
        admission.update_stats([stats("w0", reserved=100), stats("w1")])  # the report: w0 drained
        ticket = await asyncio.wait_for(retry, 1.0)
        assert ticket.worker_id == "w0" and chosen == ["w0"] and affinity.outcome("w0") is AffinityWaitOutcome.ROOM
        ticket.release()

        affinity, retry, chosen = await refused_by_w0()
        clock.now += 0.5
        admission.update_stats([stats("w0", reserved=950), stats("w1")])  # the report: w0 still full
        await asyncio.sleep(0.01)
        clock.now += 1.1  # past affinity_wait_s: the refusal's home is still waited for
        admission.update_stats([stats("w0", reserved=950), stats("w1")])
        await asyncio.sleep(0.01)
        assert not retry.done() and chosen == []
        admission.update_stats([stats("w0", reserved=100), stats("w1")])  # room at home
        ticket = await asyncio.wait_for(retry, 1.0)
        assert ticket.worker_id == "w0" and affinity.outcome("w0") is AffinityWaitOutcome.ROOM
        ticket.release()

        affinity, retry, _ = await refused_by_w0()
        clock.now += 1.1
        # a report of w0 requested before its refusal (so no report since): still waiting
        admission.update_stats([stats("w0", reserved=100, to_compute=20_000), stats("w1")], taken_at=clock.now - 1.2)
        await asyncio.sleep(0.01)
        assert not retry.done()
        clock.now += 1.5  # past half of max_queue_wait_s: it spills
        admission.update_stats([stats("w0", reserved=100, to_compute=20_000), stats("w1")], taken_at=clock.now - 3.0)
        ticket = await asyncio.wait_for(retry, 1.0)
        assert ticket.worker_id == "w1" and affinity.outcome("w1") is AffinityWaitOutcome.TIMED_OUT
        ticket.release()

        admission.note_refusal("w1")  # a refuser that does not hold the prefix: nothing to wait for
        affinity = AffinityHold(MATCHED, config, clock=clock, refused_by="w1", awaiting_report=admission.awaiting_report)
        assert not affinity.holds([stats("w1")], lambda: ([stats("w0", to_compute=20_000), stats("w1")], {}, 0.0),
                                  random.Random(0))

    asyncio.run(main())


def test_with_several_replicas_a_new_family_waits_for_room_on_the_worker_its_placement_picks():
    """Two router replicas place a new family on the first worker of its rendezvous order; in
    one replica its own burst has filled that worker's budget, so only the other worker is
    offered: the request waits for room there (as a cached prefix's request does) instead of
    starting the family on the other worker while the other replica sends it home."""
    from kvmesh.router.hot_spread import preference_order
    from kvmesh.router.routing import PredictedLatencyState, RouteRequest

    clock = FakeClock()
    config = RouterConfig(policy="predicted_latency", affinity_wait_s=1.0, num_replicas=2)
    state = PredictedLatencyState(config, 512, clock)
    key = next(f"f{i}".encode() for i in range(100) if preference_order(f"f{i}".encode(), ["w0", "w1"])[0] == "w0")
    request = RouteRequest(560, 16, key)
    w0, w1 = stats("w0", reserved=950), stats("w1")
    view = lambda: ([w0, w1], {}, 0.0)  # noqa: E731
    hold = AffinityHold({}, config, clock=clock, request=request, state=state)
    assert hold.holds([w1], view, random.Random(0))  # w0 full here: it waits for room there
    assert not hold.holds([w0, w1], view, random.Random(0))  # room on w0: it goes
    assert hold.outcome("w0") is AffinityWaitOutcome.ROOM
    # one replica: no wait for a new prefix (it places among the workers with room)
    alone = AffinityHold({}, RouterConfig(policy="predicted_latency", affinity_wait_s=1.0), clock=clock,
                         request=request, state=state)
    assert not alone.holds([w1], view, random.Random(0))
