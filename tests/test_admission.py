"""router/admission.py: budgets from stats, in-flight accounting, lanes, measured retry-after."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import pytest

from kvmesh.core.config import RouterConfig
from kvmesh.router.admission import RouterAdmission, cost_with_cached_prefix, request_cost_tokens
from kvmesh.router.routing import choose_worker, is_spill
from kvmesh.core.seams import DispatchReport, SamplingParams, WorkerStats
from kvmesh.core.errors import (DeadlineExceededError, DeadlineUnmeetableError, InvalidRequestError,
                               OverloadedError, QueueSlotTakenError, WorkerFailedError)


def stats(worker_id, reserved=0, capacity=1000, rate=50.0, healthy=True):
    return WorkerStats(worker_id=worker_id, healthy=healthy, block_size=16, num_blocks_total=capacity // 16,
                       num_blocks_used=0, num_blocks_cached=0, num_blocks_free=capacity // 16,
                       kv_tokens_used=reserved, kv_tokens_capacity=capacity, kv_tokens_reserved=reserved,
                       num_running=0, num_waiting=0, queued_prompt_tokens=0, prefix_cache_hit_rate=0.0,
                       output_tokens_per_s=rate)


class FakeClock:
    """Monotonic time the test moves by hand, so 'sent before the stats were taken' is exact."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def controller(workers, clock=None, wall_clock=time.time, **router):
    config = RouterConfig(**{"max_queue_len": 10, "retry_lane_fraction": 0.2, "max_queue_wait_s": 5.0, **router})
    admission = RouterAdmission(config, clock=clock or FakeClock(), wall_clock=wall_clock)
    admission.update_stats(workers)
    return admission


async def settle():
    for _ in range(3):
        await asyncio.sleep(0)


def test_request_cost_matches_the_workers_block_granular_reservation():
    # the worker reserves K x ceil((prompt + max_tokens) / K) for each of the n samples
    assert request_cost_tokens(40, SamplingParams(max_tokens=30), block_size=16) == 80
    assert request_cost_tokens(100, SamplingParams(max_tokens=20, n=3), block_size=16) == 3 * 128
    assert request_cost_tokens(100, SamplingParams(max_tokens=20), block_size=1) == 120


def test_admits_where_it_fits_and_routes_only_among_workers_with_room():
    async def main():
        admission = controller([stats("w0", reserved=950), stats("w1", reserved=100), stats("w2", healthy=False)])
        seen = []

        def route(eligible, in_flight):
            seen.append([w.worker_id for w in eligible])
            return eligible[0].worker_id

        ticket = await admission.acquire(200, route=route)
        assert seen == [["w1"]] and ticket.worker_id == "w1"
        assert admission.in_flight_tokens() == {"w1": 200}
        with pytest.raises(ValueError):
            await admission.acquire(10, route=lambda eligible, in_flight: "w2")
    asyncio.run(main())


def test_a_burst_between_refreshes_cannot_over_admit():
    async def main():
        clock = FakeClock()
        admission = controller([stats("w0", capacity=1000)], clock=clock)
        tickets = [await admission.acquire(300) for _ in range(3)]
        fourth = asyncio.ensure_future(admission.acquire(300))
        await settle()
        assert not fourth.done()  # 900 in flight + 300 > 1000, though the stats still say 0
        # The worker now reports the three (stats requested after they were sent): same total.
        clock.now += 1
        admission.update_stats([stats("w0", reserved=900)], taken_at=clock.now)
        assert admission.in_flight_tokens() == {}
        await settle()
        assert not fourth.done()
        tickets[0].release()  # one the report counts ended: its room is free at once
        ticket = await asyncio.wait_for(fourth, 1)
        assert ticket.worker_id == "w0"
        assert admission.snapshot().num_in_flight == 3
        clock.now += 1
        admission.update_stats([stats("w0", reserved=900)], taken_at=clock.now)
        assert admission.snapshot().committed_tokens == 900  # the next report has the fourth, not the first
    asyncio.run(main())


def test_releasing_before_the_next_refresh_returns_the_in_flight_tokens():
    async def main():
        admission = controller([stats("w0", capacity=1000)])
        with await admission.acquire(800) as ticket:
            assert admission.in_flight_tokens() == {"w0": 800}
        assert ticket.released and admission.in_flight_tokens() == {}
        ticket.release()  # idempotent
        async with await admission.acquire(1000):
            assert admission.snapshot().num_in_flight == 1
        assert admission.snapshot().num_in_flight == 0
    asyncio.run(main())


def test_a_request_ending_after_its_worker_reported_it_frees_its_room_at_once_not_at_the_next_report():
    """The report that counts a running request stays the router's view until the next poll;
    the request ending in between gives its reservation back at once (credited against that
    report), so a family's next request is not turned away from its worker (a spill) for the
    rest of the refresh period. A report requested after the end carries it, credit gone."""
    async def main():
        clock = FakeClock()
        admission = controller([stats("w0", reserved=900, capacity=1000)], clock=clock)
        ticket = await admission.acquire(100)
        clock.now += 1.0  # a report requested well after the send surely counts it
        admission.update_stats([stats("w0", reserved=1000, capacity=1000)], taken_at=clock.now)
        assert admission.in_flight_tokens() == {} and admission.snapshot().committed_tokens == 1000
        with pytest.raises(OverloadedError):
            await admission.acquire(100, max_wait_s=0)
        clock.now += 0.1
        ticket.release()  # ended on the worker: its 100 tokens are free there now
        assert admission.snapshot().committed_tokens == 900
        follower = await admission.acquire(100, max_wait_s=0)
        assert admission.snapshot().committed_tokens == 1000
        # The next report (requested after the release) already lacks the ended request: no credit.
        clock.now += 0.1
        admission.update_stats([stats("w0", reserved=1000, capacity=1000)], taken_at=clock.now)
        assert admission.snapshot().committed_tokens == 1000 + 100  # the follower, kept a refresh longer
        follower.release()
        assert admission.snapshot().committed_tokens == 1000
    asyncio.run(main())


def test_a_report_that_names_a_dispatch_stops_its_double_count_at_once_whatever_the_timing():
    """A report answered within one refresh of the send (a quick poll) used to keep the ticket
    beside the figures that already held it: the worker looked full and the family's next
    request spilled. The worker's report now says which of this replica's dispatches it holds
    (DispatchReport): a held one is dropped at once, a later one stays counted however old."""
    async def main():
        clock = FakeClock()
        admission = controller([stats("w0", capacity=1000)], clock=clock, stats_refresh_s=0.5)
        first = await admission.acquire(600)
        first.dispatch_seq = 1
        second = await admission.acquire(300)
        second.dispatch_seq = 2
        clock.now += 0.05  # requested right after the sends: the time rule keeps both
        admission.update_stats([stats("w0", reserved=600, capacity=1000)], taken_at=clock.now,
                               dispatches={"w0": DispatchReport(1, frozenset({1}))})
        assert admission.in_flight_tokens() == {"w0": 300}  # the first is in the figures; the second not yet
        assert admission.snapshot().committed_tokens == 900
        clock.now += 5.0  # however long that poll took, a dispatch the report lacks stays counted
        admission.update_stats([stats("w0", reserved=600, capacity=1000)], taken_at=clock.now,
                               dispatches={"w0": DispatchReport(1, frozenset({1}))})
        assert admission.snapshot().committed_tokens == 900
        # The first ends, then a report held it no longer (answered before its end reached us):
        # nothing is credited twice, and the second is in that report.
        admission.update_stats([stats("w0", reserved=300, capacity=1000)], taken_at=clock.now,
                               dispatches={"w0": DispatchReport(2, frozenset({2}))})
        first.release()
        assert admission.snapshot().committed_tokens == 300
        second.release()  # held by the report: credited against it until one lacks it
        assert admission.snapshot().committed_tokens == 0
        admission.update_stats([stats("w0", reserved=0, capacity=1000)], taken_at=clock.now,
                               dispatches={"w0": DispatchReport(2, frozenset())})
        assert admission.snapshot().committed_tokens == 0
    asyncio.run(main())


def test_a_dispatch_the_worker_never_took_in_or_an_unnumbered_one_keeps_the_time_rule():
    async def main():
        clock = FakeClock()
        admission = controller([stats("w0", capacity=1000)], clock=clock, stats_refresh_s=0.5)
        unnumbered = await admission.acquire(200)  # a retry, a resumption, a prefix pull
        numbered = await admission.acquire(300)
        numbered.dispatch_seq = 1
        clock.now += 0.05
        report = {"w0": DispatchReport(0, frozenset())}  # the poll read the figures before either arrived
        admission.update_stats([stats("w0", reserved=0, capacity=1000)], taken_at=clock.now, dispatches=report)
        assert admission.in_flight_tokens() == {"w0": 500}
        clock.now += 1.0  # a refresh later the unnumbered one is presumed counted; the numbered one is not
        admission.update_stats([stats("w0", reserved=0, capacity=1000)], taken_at=clock.now, dispatches=report)
        assert admission.in_flight_tokens() == {"w0": 300}
        # A worker that does not say (None) counts the numbered one by time too.
        admission.update_stats([stats("w0", reserved=0, capacity=1000)], taken_at=clock.now + 1.0,
                               dispatches={"w0": None})
        assert admission.in_flight_tokens() == {}
        numbered.release()
        unnumbered.release()
    asyncio.run(main())


def test_a_first_request_ending_while_its_follower_runs_is_credited_only_what_the_worker_frees():
    """The family's first request computed the 33-block prefix (charged 560); its follower on
    the same worker shares it (charged its tail). When the first one ends the worker keeps the
    prefix pinned for the follower, so the router credits only the first one's own tail; when
    the follower ends too, the worker frees its tail and the prefix (pinned, counted once, by
    nobody now), and so does the credit: the router's wiring (router_core)."""
    from kvmesh.kv.hashing import hash_full_blocks
    from kvmesh.router.prefix_index import PrefixIndex

    async def main():
        clock, sampling = FakeClock(), SamplingParams(max_tokens=8)
        prefix = list(range(1000, 1528))  # 33 blocks
        first, follower = prefix + list(range(2000, 2024)), prefix + list(range(3000, 3024))
        index = PrefixIndex(linger_s=1.0, clock=clock)
        admission = controller([stats("w0", capacity=2048)], clock=clock)
        tickets = []
        for prompt in (first, follower):
            hashes = hash_full_blocks(prompt, 16, ())
            matched = index.longest_prefix(hashes)
            ticket = await admission.acquire(request_cost_tokens(552, sampling, block_size=16), cost_for=lambda w: (
                cost_with_cached_prefix(552, sampling, 16, matched.get(w, 0))))
            token = index.add_in_flight("w0", hashes)
            ticket.freed_on_release = lambda token=token: cost_with_cached_prefix(
                552, sampling, 16, index.shared_with_live_requests(token))
            ticket.on_release(lambda token=token: index.end_in_flight(token))
            tickets.append(ticket)
        assert [t.cost_tokens for t in tickets] == [560, 560 - 33 * 16]
        clock.now += 1.0  # the worker's report counts both: the prefix once, two tails
        admission.update_stats([stats("w0", reserved=560 + 32, capacity=2048)], taken_at=clock.now)
        assert admission.snapshot().committed_tokens == 592
        tickets[0].release()  # the follower still pins the prefix: only the first one's tail is free
        assert admission.snapshot().committed_tokens == 592 - 32
        tickets[1].release()
        assert admission.snapshot().committed_tokens == 0
    asyncio.run(main())


def test_full_queue_rejects_at_once_with_retry_after_from_the_measured_drain_rate():
    async def main():
        # 2 first-attempt slots; two workers draining 40 + 60 = 100 output tokens/s.
        admission = controller([stats("w0", reserved=900, rate=40.0), stats("w1", reserved=950, rate=60.0)],
                               max_queue_len=2, retry_lane_fraction=0.0)
        waiting = [asyncio.ensure_future(admission.acquire(300)) for _ in range(2)]
        await settle()
        with pytest.raises(OverloadedError) as info:
            await admission.acquire(300)
        # overflow on the best worker: 900 + 300 - 1000 = 200; queued ahead: 600 -> 800 / 100
        assert info.value.retry_after_s == pytest.approx(8.0)
        # twice the drain rate, half the wait: the answer follows measurements, not a constant
        admission.update_stats([stats("w0", reserved=900, rate=80.0), stats("w1", reserved=950, rate=120.0)])
        with pytest.raises(OverloadedError) as info:
            await admission.acquire(300)
        assert info.value.retry_after_s == pytest.approx(4.0)
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        assert admission.snapshot().num_queued_first == 0
    asyncio.run(main())


def test_without_a_measured_rate_retry_after_is_one_refresh_interval():
    admission = controller([stats("w0", rate=0.0)], stats_refresh_s=0.4)
    assert admission.retry_after_s(5000, 1000) == 0.4


def test_a_retry_storm_fills_only_its_own_lane():
    async def main():
        # max_queue_len 10, retry_lane_fraction 0.2 -> 2 retry slots, 8 first-attempt slots
        admission = controller([stats("w0", reserved=1000)])
        assert (admission.first_slots, admission.retry_slots) == (8, 2)
        retries = [asyncio.ensure_future(admission.acquire(100, attempt=2)) for _ in range(2)]
        await settle()
        with pytest.raises(OverloadedError, match="retry lane"):
            await admission.acquire(100, attempt=3)
        firsts = [asyncio.ensure_future(admission.acquire(100)) for _ in range(8)]
        await settle()
        assert admission.snapshot().num_queued_first == 8  # first attempts still had their queue
        # Room for two requests: the first attempts go first even though the retries queued earlier.
        admission.update_stats([stats("w0", reserved=800)])
        await settle()
        assert [t.done() for t in firsts] == [True, True] + [False] * 6
        assert not any(t.done() for t in retries)
        for task in retries + firsts:
            task.cancel()
        await asyncio.gather(*retries, *firsts, return_exceptions=True)
    asyncio.run(main())


def test_running_retries_hold_at_most_their_fraction_of_capacity():
    async def main():
        admission = controller([stats("w0", capacity=1000)], retry_lane_fraction=0.2)
        first = await admission.acquire(150, attempt=2)  # one retry may always run
        blocked = asyncio.ensure_future(admission.acquire(100, attempt=2))  # 250 > 0.2 x 1000
        await settle()
        assert not blocked.done()
        assert (await admission.acquire(500)).worker_id == "w0"  # first attempts are not held back
        first.release()
        assert (await asyncio.wait_for(blocked, 1)).attempt == 2
    asyncio.run(main())


def test_a_retry_refused_by_its_lane_is_told_when_the_running_retries_leave_room():
    async def main():
        # Capacity 2,000 tokens draining 100 output tokens/s; retries may hold 0.2 x 2,000 = 400.
        # max_queue_len 5 -> 1 retry slot.
        admission = controller([stats("w0", capacity=2000, rate=100.0)], max_queue_len=5, retry_lane_fraction=0.2)
        running = [await admission.acquire(200, attempt=2) for _ in range(2)]  # the lane's budget is full
        firsts = [await admission.acquire(200) for _ in range(6)]  # 1,600 tokens committed in all
        queued = asyncio.ensure_future(admission.acquire(200, attempt=2))  # the lane's one slot
        await settle()
        with pytest.raises(OverloadedError, match="retry lane") as refused:
            await admission.acquire(200, attempt=2)
        # Room for it: 400 running + 200 queued + 200 - 400 = 400 tokens of the running retries
        # must end, and they end at their share of the drain, 400 / 1,600 of 100 tokens/s:
        # 400 / 25 = 16 s. The queues alone say 2 s (it fits the KV; 200 tokens queued ahead).
        assert refused.value.retry_after_s == pytest.approx(16.0)
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)
        for ticket in running + firsts:
            ticket.release()
    asyncio.run(main())


def test_waiting_too_long_is_overloaded_and_a_sooner_deadline_is_deadline_exceeded():
    async def main():
        # No drain rate measured yet: nothing says the deadline is unmeetable, so it waits.
        admission = controller([stats("w0", reserved=1000, rate=0.0)], max_queue_wait_s=0.05)
        with pytest.raises(OverloadedError):
            await admission.acquire(100)
        with pytest.raises(DeadlineExceededError):
            await admission.acquire(100, deadline_s=time.time() + 0.01)
        assert admission.snapshot().num_queued_first == 0
    asyncio.run(main())


def test_a_deadline_the_queue_cannot_meet_is_refused_at_once_with_retry_after():
    async def main():
        wall = FakeClock()
        wall.now = 1_000.0  # time.time() as the controller sees it
        admission = controller([stats("w0", reserved=900, capacity=1000, rate=50.0)], wall_clock=wall)
        # 200 tokens overflow the worker by 100; at 50 tok/s the expected wait is 2 s: a
        # deadline exactly 2 s away can be met, so the request queues.
        first = asyncio.ensure_future(admission.acquire(200, deadline_s=wall.now + 2.0))
        await settle()
        assert not first.done() and admission.snapshot().num_queued_first == 1
        # Behind it: its 200 queued tokens + the 100 overflow = 300 / 50 = 6 s > 5 s left.
        with pytest.raises(DeadlineUnmeetableError) as refused:
            await admission.acquire(200, deadline_s=wall.now + 5.0)
        assert isinstance(refused.value, OverloadedError) and refused.value.retryable
        assert refused.value.retry_after_s == pytest.approx(6.0)
        snap = admission.snapshot()
        assert (snap.num_queued_first, snap.num_deadline_shed) == (1, 1)  # refused without queueing
        # Without a deadline, or with one the queue can meet, the same request still queues.
        no_deadline = asyncio.ensure_future(admission.acquire(200))
        await settle()
        assert not no_deadline.done() and admission.snapshot().num_queued_first == 2
        # Room frees up: the queued ones are admitted in order; the shed one left no trace.
        admission.update_stats([stats("w0", reserved=0, capacity=1000, rate=50.0)])
        tickets = [await asyncio.wait_for(f, 1) for f in (first, no_deadline)]
        assert [t.cost_tokens for t in tickets] == [200, 200] and admission.snapshot().num_in_flight == 2
        for t in tickets:
            t.release()
        assert admission.snapshot().num_in_flight == 0
    asyncio.run(main())


def test_deadline_shedding_off_queues_until_the_deadline():
    async def main():
        wall = FakeClock()
        wall.now = 1_000.0
        admission = controller([stats("w0", reserved=1000, rate=50.0)], wall_clock=wall, deadline_shedding=False)
        waiting = asyncio.ensure_future(admission.acquire(100, deadline_s=wall.now + 0.05))  # expects 2 s
        await settle()
        assert not waiting.done() and admission.snapshot().num_deadline_shed == 0
        with pytest.raises(DeadlineExceededError):  # the wait runs to the deadline, then fails
            await waiting
    asyncio.run(main())


def test_a_more_important_class_waits_only_behind_its_own_class_or_better():
    async def main():
        wall = FakeClock()
        wall.now = 1_000.0
        admission = controller([stats("w0", reserved=1000, capacity=1000, rate=50.0)], wall_clock=wall)
        lows = [asyncio.ensure_future(admission.acquire(100, priority_class=1)) for _ in range(3)]
        await settle()
        # Behind three low waiters (300 tokens) a low request's wait is (300 + 100) / 50 = 8 s ...
        with pytest.raises(DeadlineUnmeetableError):
            await admission.acquire(100, priority_class=1, deadline_s=wall.now + 2.5)
        # ... an important one waits only for its own overflow: 100 / 50 = 2 s, so it queues,
        # at the head of the lane.
        vip = asyncio.ensure_future(admission.acquire(100, priority_class=0, deadline_s=wall.now + 2.5))
        await settle()
        assert not vip.done() and admission.snapshot().num_queued_first == 4
        admission.update_stats([stats("w0", reserved=900, capacity=1000, rate=50.0)])  # room for one
        ticket = await asyncio.wait_for(vip, 1)
        assert not any(f.done() for f in lows)  # it went first; the low ones keep their order
        ticket.release()
        admission.update_stats([stats("w0", reserved=0, capacity=1000, rate=50.0)])
        for ticket in [await asyncio.wait_for(f, 1) for f in lows]:
            ticket.release()
        assert admission.snapshot().num_in_flight == 0
    asyncio.run(main())


def test_a_full_lane_gives_the_newest_less_important_waiter_s_slot_to_a_more_important_request():
    async def main():
        # max_queue_len 5, retry fraction 0.2: 4 first-attempt slots.
        admission = controller([stats("w0", reserved=1000, capacity=1000, rate=50.0)], max_queue_len=5)
        old = [asyncio.ensure_future(admission.acquire(100, priority_class=1)) for _ in range(3)]
        newest = asyncio.ensure_future(admission.acquire(100, priority_class=1))
        await settle()
        with pytest.raises(OverloadedError):  # same class: no eviction, the newcomer is refused
            await admission.acquire(100, priority_class=1)
        vip = asyncio.ensure_future(admission.acquire(100, priority_class=0))
        await settle()
        with pytest.raises(OverloadedError) as evicted:  # the newest low waiter gave up its slot
            await newest
        assert evicted.value.retry_after_s > 0 and isinstance(evicted.value, QueueSlotTakenError)
        snap = admission.snapshot()
        assert (snap.num_queued_first, snap.num_evicted) == (4, 1) and not vip.done()
        admission.update_stats([stats("w0", reserved=0, capacity=1000, rate=50.0)])
        tickets = [await asyncio.wait_for(f, 1) for f in (vip, *old)]
        for ticket in tickets:
            ticket.release()
        assert admission.snapshot().num_in_flight == 0
    asyncio.run(main())


def test_impossible_requests_and_no_healthy_worker_fail_fast():
    async def main():
        admission = controller([stats("w0", capacity=1000), stats("w1", capacity=4000, healthy=False)])
        with pytest.raises(InvalidRequestError):
            await admission.acquire(1001)
        empty = controller([stats("w0", healthy=False)])
        with pytest.raises(WorkerFailedError):
            await empty.acquire(10)
        # queued, then the last healthy worker goes away: the waiter fails instead of hanging
        full = controller([stats("w0", reserved=1000)])
        waiting = asyncio.ensure_future(full.acquire(10))
        await settle()
        full.update_stats([stats("w0", reserved=1000, healthy=False)])
        with pytest.raises(WorkerFailedError):
            await waiting
    asyncio.run(main())


def test_a_cancelled_waiter_leaves_the_queue_and_unblocks_those_behind_it():
    async def main():
        admission = controller([stats("w0", reserved=500)])
        big = asyncio.ensure_future(admission.acquire(900))  # head: does not fit
        small = asyncio.ensure_future(admission.acquire(100))  # FIFO: waits behind it
        await settle()
        assert not small.done()
        big.cancel()
        ticket = await asyncio.wait_for(small, 1)
        assert ticket.queue_wait_s >= 0 and admission.snapshot().num_queued_first == 0
    asyncio.run(main())


def test_a_worker_holding_the_prefix_is_charged_only_its_uncached_blocks():
    async def main():
        # w0 holds 33 of the prompt's blocks (a 528-token prefix); 1680 of 2048 committed.
        admission = controller([stats("w0", reserved=1680, capacity=2048), stats("w1", reserved=1900, capacity=2048)])
        sampling = SamplingParams(max_tokens=8)
        whole = request_cost_tokens(552, sampling, block_size=16)
        assert whole == 560 and 1680 + whole > 2048  # counting the whole prompt, nobody has room
        cached = {"w0": 33}
        ticket = await admission.acquire(
            whole, cost_for=lambda w: cost_with_cached_prefix(552, sampling, 16, cached.get(w, 0)))
        assert ticket.worker_id == "w0" and ticket.cost_tokens == 560 - 33 * 16
        assert admission.in_flight_tokens() == {"w0": 32}
    asyncio.run(main())


def test_a_follower_of_a_family_in_flight_is_charged_only_its_tail_where_the_first_one_went():
    """The family's first request was just dispatched to w0 (no STORED event yet, only the
    prefix index's in-flight claim). The router charges the follower on w0 what the worker's
    own admission will (the claimed prefix counted once), so it follows the first request
    there instead of spilling to w1 for want of a whole prompt's budget."""
    from kvmesh.kv.hashing import hash_full_blocks
    from kvmesh.router.prefix_index import PrefixIndex

    async def main():
        sampling = SamplingParams(max_tokens=8)
        prompt = list(range(1000, 1552))  # 552 tokens: 34 full blocks of 16
        hashes = hash_full_blocks(prompt, 16, ())
        index = PrefixIndex(linger_s=1.0)
        index.add_in_flight("w0", hashes)
        matched = index.longest_prefix(hashes)  # what the admit stage charges against
        assert matched == {"w0": 34} and index.longest_prefix(hashes, include_in_flight=False) == {}
        admission = controller([stats("w0", reserved=1600, capacity=2048), stats("w1", reserved=0, capacity=2048)])
        ticket = await admission.acquire(
            request_cost_tokens(552, sampling, block_size=16),
            cost_for=lambda w: cost_with_cached_prefix(552, sampling, 16, matched.get(w, 0)),
            route=lambda eligible, in_flight: choose_worker(matched, eligible, RouterConfig(policy="prefix_aware"), random.Random(0),
                                                            None, in_flight).worker_id)
        assert ticket.worker_id == "w0" and ticket.cost_tokens == 560 - 34 * 16  # the tail block: 8 prompt + 8 output
    asyncio.run(main())


def test_the_router_charges_a_cached_prefix_as_the_worker_commits_it_held_or_let_go():
    """The worker (its real scheduler) counts a cached prefix block once while a live request
    holds it, and adds it again for a newcomer that pins it after everyone let it go. The
    router's cost on the worker must be that same increment, from its report's held blocks,
    its own requests in flight there, and what it has seen end since: charged as free, a
    family's request after a pause cost 32 tokens here and 560 on the worker, which then
    refused requests the router had admitted (the 2-worker campaign at 16 in flight)."""
    from fake_paged_model import run_until_idle, FakePagedModel

    from kvmesh.core.config import SchedulerConfig
    from kvmesh.kv.hashing import hash_full_blocks
    from kvmesh.kv.kv_cache_manager import KVCacheManager
    from kvmesh.router.admission_budget import WorkerBudgets, cost_on_worker
    from kvmesh.router.prefix_index import PrefixIndex
    from kvmesh.worker.engine_loop.engine import worker_stats
    from kvmesh.worker.engine_loop.request import Request
    from kvmesh.worker.engine_loop.scheduler import Scheduler

    block, clock = 16, FakeClock()
    scheduler = Scheduler(SchedulerConfig(), KVCacheManager(128, block), clock=clock)
    model = FakePagedModel(128, block)
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    prefix = list(range(1000, 1528))  # 33 full blocks, the family's system prompt
    budgets, index = WorkerBudgets(RouterConfig(), clock), PrefixIndex(clock=clock)
    sent = 0

    def send(question: int) -> tuple[int, int, Request]:
        """(the router's cost on w0, what the worker's committed grew by, the request)."""
        nonlocal sent
        sent += 1
        prompt = prefix + [question] * 16
        hashes = hash_full_blocks(prompt, block, ())
        cached = min(33, len(hashes))  # the prefix index has the family's blocks there
        held = max(index.held_by_live_requests("w0", hashes[:cached]), budgets.held_blocks("w0", hashes[:cached]))
        cost = cost_on_worker(len(prompt), sampling, block, cached, held)
        before = worker_stats(scheduler, "w0").kv_tokens_reserved
        request = Request(f"r{sent}", prompt, sampling, arrival_time=clock())
        scheduler.add_request(request)
        index.add_in_flight("w0", hashes)
        return cost, worker_stats(scheduler, "w0").kv_tokens_reserved - before, request

    scheduler.add_request(Request("leader", prefix + [7] * 16, sampling, arrival_time=clock()))
    run_until_idle(scheduler, model)  # the prefix is cached on w0, and nobody holds it
    budgets.update_stats([worker_stats(scheduler, "w0")], taken_at=clock())
    cost, grew, _ = send(1)  # after a pause: it pins the whole prefix, paid by nobody else
    assert grew == 33 * block + 32 and cost == grew
    cost, grew, _ = send(2)  # the first one is live here (this router's in-flight claim)
    assert grew == 32 and cost == grew
    index = PrefixIndex(clock=clock)  # another replica's view: its requests are not in it
    budgets = WorkerBudgets(RouterConfig(), clock)
    budgets.update_stats([worker_stats(scheduler, "w0")], taken_at=clock())
    cost, grew, _ = send(3)  # held per the worker's report
    assert grew == 32 and cost == grew


def test_a_prefix_the_report_holds_stops_counting_as_held_once_its_request_ends_here_until_a_new_report():
    """The report said w0's live requests hold the family's blocks; this router then saw the
    request holding them end (credited against that report: the worker may have let them go).
    Until a report requested after that, the blocks are charged again to the next request."""
    async def main():
        clock = FakeClock()
        hashes = tuple(f"h{i}".encode() for i in range(4))
        report = dataclasses.replace(stats("w0", reserved=200), held_block_hashes=frozenset(hashes))
        admission = controller([report], clock=clock)
        assert admission.held_blocks("w0", hashes) == 4 and admission.held_blocks("w0", (b"x",) + hashes) == 0
        ticket = await admission.acquire(100)
        ticket.block_hashes = hashes
        clock.now += 1.0
        admission.update_stats([dataclasses.replace(report)], taken_at=clock.now)  # its report holds it
        ticket.release()  # credited against that report
        assert admission.held_blocks("w0", hashes) == 0
        clock.now += 0.1
        admission.update_stats([dataclasses.replace(report)], taken_at=clock.now)  # requested after the end
        assert admission.held_blocks("w0", hashes) == 4
    asyncio.run(main())


def test_a_cached_prefix_nobody_holds_counts_against_the_budget_but_not_the_load():
    """Its request pins it: the worker's committed KV grows by it, its work does not (the
    prefix is not computed). Counted as load, a family's request after a pause made its own
    home look busy with a prefix's worth of work (16 workers simulated: computed max/min 3.76)."""
    async def main():
        admission = controller([stats("w0", reserved=0, capacity=2048)])
        ticket = await admission.acquire(560, cost_for=lambda w: 560, load_for=lambda w: 32)
        assert ticket.cost_tokens == 560 and ticket.load_tokens == 32
        assert admission.in_flight_tokens() == {"w0": 32} and admission.mean_admitted_tokens() == 32
        assert admission.snapshot().committed_tokens == 560
    asyncio.run(main())


def test_the_load_guard_s_mean_request_is_what_admissions_cost_their_workers_as_the_load_counts_it():
    """The 16-worker table's shape: a 6,000-token prefix cached on w0 + a 1,200-token question,
    32 output tokens. A cache hit adds 1,232 tokens to w0's load (its tail), a miss 7,232. The
    margin of the load guard is 2 mean requests; measured in the load's unit (the tickets'
    costs) w0 may run two hits ahead and the fourth hit in a row spills. Measured in whole
    KV sizes (7,232 each: the unit mix-up) the margin would be 14,464 tokens and all four
    would stay on w0."""
    from kvmesh.router.routing import RoutingPath

    async def main():
        sampling = SamplingParams(max_tokens=32)
        whole = request_cost_tokens(7200, sampling, block_size=16)
        hit = cost_with_cached_prefix(7200, sampling, 16, cached_blocks=375)
        assert (whole, hit) == (7232, 1232)
        admission = controller([stats("w0", capacity=10**6), stats("w1", capacity=10**6)])
        assert admission.mean_admitted_tokens() == 0.0
        matched, config, rng = {"w0": 375}, RouterConfig(policy="prefix_aware"), random.Random(0)
        paths = []

        def route(eligible, in_flight):
            decision = choose_worker(matched, eligible, config, rng, None, in_flight,
                                     admission.mean_admitted_tokens())
            paths.append((decision.worker_id, decision.path))
            return decision.worker_id

        tickets = [await admission.acquire(whole, route=route, cost_for=lambda w: cost_with_cached_prefix(
            7200, sampling, 16, matched.get(w, 0))) for _ in range(4)]
        assert paths == [("w0", RoutingPath.PREFIX_MATCH)] * 3 + [("w1", RoutingPath.PREFIX_IMBALANCED)]
        assert [t.cost_tokens for t in tickets] == [hit, hit, hit, whole]
        # The unit is the load's own: the mean ticket is the in-flight tokens per ticket.
        assert admission.mean_admitted_tokens() == sum(admission.in_flight_tokens().values()) / 4 == (3 * hit + whole) / 4
    asyncio.run(main())


def test_a_full_preferred_worker_spills_to_one_with_room_and_only_none_means_overloaded():
    async def main():
        admission = controller([stats("w0", reserved=990), stats("w1", reserved=100)], max_queue_wait_s=0.01)
        matched = {"w0": 4}  # the prefix lives on w0, which has no room for 100 more
        chosen = []

        def route(eligible, in_flight):
            decision = choose_worker(matched, eligible, RouterConfig(policy="prefix_aware"), random.Random(0), None, in_flight)
            chosen.append((decision.worker_id, is_spill(matched, eligible, decision.worker_id)))
            return decision.worker_id

        ticket = await admission.acquire(100, route=route)
        assert ticket.worker_id == "w1" and chosen == [("w1", True)]
        # A worker that refused this request is never chosen again; with nobody else: overloaded.
        with pytest.raises(OverloadedError):
            await admission.acquire(100, route=route, exclude=frozenset({"w1"}))
        ticket.release()
        again = await admission.acquire(100, route=route, exclude=frozenset({"w0"}))
        assert again.worker_id == "w1"
    asyncio.run(main())


def test_max_wait_zero_admits_now_or_refuses_without_queueing_and_a_short_wait_bounds_the_queue():
    """The degradation ladder's probes: a step that does not fit now is refused at once and
    takes no queue slot; the ladder's queue step waits its own bound, not max_queue_wait_s."""
    async def main():
        clock = FakeClock()
        admission = controller([stats("w0", reserved=900, capacity=1000)], clock=clock, max_queue_wait_s=30.0)
        with pytest.raises(OverloadedError) as refused:
            await admission.acquire(200, max_wait_s=0.0)
        assert refused.value.retry_after_s > 0
        assert admission.snapshot().num_queued_first == 0
        ticket = await admission.acquire(100, max_wait_s=0.0)  # fits: admitted as usual
        assert ticket.worker_id == "w0"
        ticket.release()
        with pytest.raises(OverloadedError):  # after the step's 0.05 s (a 30 s wait would hit the guard)
            await asyncio.wait_for(admission.acquire(200, max_wait_s=0.05), timeout=20)
        assert admission.snapshot().num_queued_first == 0

    asyncio.run(main())


def test_in_front_of_expected_output_workers_the_router_costs_a_request_as_the_worker_reserves_it():
    """Same history, same estimate: the router's cost (output_tokens = its estimate) is the
    worker's reservation, where max_tokens would overstate it 4x."""
    from kvmesh.core.config import SchedulerConfig
    from kvmesh.kv.output_estimate import OutputLengthEstimator
    from kvmesh.worker.engine_loop.admission import EngineAdmission
    from kvmesh.worker.engine_loop.request import Request

    scheduler = SchedulerConfig(admission_reserve="expected", expected_output_floor_tokens=16)
    worker = EngineAdmission(scheduler, capacity_tokens=4096, block_size=16, clock=time.monotonic)
    router = OutputLengthEstimator(scheduler.expected_output_floor_tokens, scheduler.expected_output_quantile)
    for length in (20, 30, 25, 40, 35, 28, 22, 33, 27, 31):  # requests of tenant t that ended by themselves
        worker.estimator.observe("t", length)
        router.observe("t", length)
    sampling = SamplingParams(max_tokens=200)
    request = Request("r", list(range(40)), sampling, arrival_time=0.0, tenant_id="t")
    cost = request_cost_tokens(40, sampling, block_size=16, output_tokens=router.estimate("t", 200))
    assert cost == worker.reservation_for(request) == 16 * -(-(40 + 40) // 16)  # 40 = the 0.9 quantile
    assert request_cost_tokens(40, sampling, block_size=16) == 240
    assert cost_with_cached_prefix(40, sampling, 16, 2, output_tokens=40) == cost - 32


def test_with_a_kept_kv_share_less_important_classes_fit_only_within_the_rest():
    """Capacity 1000, a quarter kept for class 0: classes >= 1 are admitted only while
    everything committed stays within 750."""
    async def main():
        admission = RouterAdmission(RouterConfig(max_queue_len=10, max_queue_wait_s=5.0), clock=FakeClock(),
                                        kv_reserved_fraction=0.25, kv_reserved_below_class=1)
        admission.update_stats([shared_stats("w0", reserved=600, shared=600)])
        low = await admission.acquire(150, priority_class=1)  # 600 + 150 <= 750
        with pytest.raises(OverloadedError):  # 750 + 100 > 750: the rest is kept for class 0
            await admission.acquire(100, priority_class=2, max_wait_s=0.0)
        high = await admission.acquire(200, priority_class=0)  # 750 + 200 <= 1000
        assert (low.worker_id, high.worker_id) == ("w0", "w0")

        # 500 reserved, of which class 0 holds 200: the worker would take a class-1 request of
        # 400 (300 + 400 <= 750), the router does not (500 + 400 > 750): a quarter stays free
        # for the next class-0 arrival while class-0 requests run.
        admission = RouterAdmission(RouterConfig(max_queue_len=10, max_queue_wait_s=5.0), clock=FakeClock(),
                                        kv_reserved_fraction=0.25, kv_reserved_below_class=1)
        admission.update_stats([shared_stats("w0", reserved=500, shared=300)])
        with pytest.raises(OverloadedError):
            await admission.acquire(400, priority_class=1, max_wait_s=0.0)
        assert (await admission.acquire(250, priority_class=1, max_wait_s=0.0)).worker_id == "w0"
        assert (await admission.acquire(250, priority_class=0, max_wait_s=0.0)).worker_id == "w0"

    asyncio.run(main())


def shared_stats(worker_id, reserved, shared, capacity=1000):
    return dataclasses.replace(stats(worker_id, reserved=reserved, capacity=capacity), kv_tokens_reserved_shared=shared)


def test_the_kept_share_admits_an_important_request_at_once_despite_the_flood_s_double_counted_tickets():
    """A flood's admission, in the worker's report and still in flight (counted twice for a
    refresh), cannot push the flood past its limit at the worker: a class-0 request that fits
    in the kept quarter is admitted on arrival, not after the next refresh."""
    async def main():
        clock = FakeClock()
        admission = RouterAdmission(RouterConfig(max_queue_len=10, max_queue_wait_s=5.0, stats_refresh_s=0.25),
                                        clock=clock, kv_reserved_fraction=0.25, kv_reserved_below_class=1)
        admission.update_stats([shared_stats("w0", reserved=600, shared=600)], taken_at=100.0)
        await admission.acquire(150, priority_class=1)  # sent at 100.0: the flood now at 750
        clock.now = 100.05
        admission.update_stats([shared_stats("w0", reserved=750, shared=750)], taken_at=100.05)
        assert admission.snapshot().committed_tokens == 900  # the ticket counted twice
        high = await asyncio.wait_for(admission.acquire(250, priority_class=0), timeout=1)
        assert high.worker_id == "w0" and admission.snapshot().num_queued_first == 0
        with pytest.raises(OverloadedError):  # the flood itself stays held back
            await admission.acquire(16, priority_class=1, max_wait_s=0.0)

    asyncio.run(main())


@pytest.mark.parametrize("kept_share", [0.0, 0.25])
def test_an_important_request_is_let_past_what_less_important_classes_hold_when_workers_take_reservations(
        kept_share):
    """Workers that take less important classes' KV reservations for an important request
    (scheduler.priority_preempts_kv_reservations) can make room for it, so the router sends
    it at once instead of queueing it until the flood drains; the flood stays held back."""
    async def main():
        def admission_for(preempting):
            admission = RouterAdmission(RouterConfig(max_queue_len=10, max_queue_wait_s=5.0), clock=FakeClock(),
                                            kv_reserved_fraction=kept_share, kv_reserved_below_class=1,
                                            workers_preempt_kv_reservations=preempting)
            # Full: class 1 holds 700 (and owes any reservation taken: still counted), class 0 300.
            admission.update_stats([shared_stats("w0", reserved=1000, shared=700)])
            return admission

        admission = admission_for(preempting=True)
        assert (await admission.acquire(400, priority_class=0, max_wait_s=0.0)).worker_id == "w0"
        assert (await admission.acquire(300, priority_class=0, max_wait_s=0.0)).worker_id == "w0"
        with pytest.raises(OverloadedError):  # class 0 now holds 1000 itself: nothing to take
            await admission.acquire(16, priority_class=0, max_wait_s=0.0)
        with pytest.raises(OverloadedError):  # the flood is not let past anything
            await admission.acquire(16, priority_class=1, max_wait_s=0.0)
        with pytest.raises(OverloadedError):  # workers that do not take reservations: no room
            await admission_for(preempting=False).acquire(400, priority_class=0, max_wait_s=0.0)

    asyncio.run(main())


async def _ladder(admission, cost, capped_cost, queue_wait_s, priority_class=0):
    """The degradation ladder's admission calls (router/stages/degrade.admit_degrading): queue up to the
    rule's wait, then try the capped cost at once, keeping the request's place."""
    place = admission.now()
    try:
        return "as sent", await admission.acquire(cost, max_wait_s=queue_wait_s, queued_since=place,
                                                  priority_class=priority_class)
    except OverloadedError:
        return "cap", await admission.acquire(capped_cost, max_wait_s=0.0, queued_since=place,
                                              priority_class=priority_class)


def test_requests_stepping_down_together_are_not_held_back_by_each_other_in_the_lane():
    """Four requests of one class queue together, then step down to the cap at their own
    moments: each capped request fits, and none is refused because another of its class,
    which came after it and is about to step down too, still waits in the lane."""
    async def main():
        admission = controller([stats("w0", reserved=800, capacity=1000)])
        outcomes = await asyncio.gather(*(_ladder(admission, 300, 48, queue_wait_s=0.05) for _ in range(4)))
        assert [step for step, _ in outcomes] == ["cap"] * 4
        assert all(ticket.worker_id == "w0" for _, ticket in outcomes)
        assert admission.snapshot().num_queued_first == 0
        # A fifth no longer fits at the cap (800 + 4 x 48 + 48 > 1000): refused at once.
        with pytest.raises(OverloadedError):
            await _ladder(admission, 300, 48, queue_wait_s=0.01)

    asyncio.run(main())


def test_a_step_down_still_waits_behind_more_important_and_earlier_waiters_of_the_same_workers():
    async def main():
        admission = controller([stats("w0", reserved=900, capacity=1000), stats("f0", reserved=0)])
        important = asyncio.ensure_future(admission.acquire(200, priority_class=-1, exclude=frozenset({"f0"})))
        await settle()
        place = admission.now()
        with pytest.raises(OverloadedError):  # a more important waiter for w0 is ahead
            await admission.acquire(48, max_wait_s=0.0, queued_since=place, exclude=frozenset({"f0"}))
        # The fallback pool's worker: that waiter cannot go there, so it holds nothing back.
        ticket = await admission.acquire(100, max_wait_s=0.0, queued_since=place, exclude=frozenset({"w0"}))
        assert ticket.worker_id == "f0"
        important.cancel()

    asyncio.run(main())


def test_a_try_now_that_fits_but_for_a_double_counted_admission_waits_for_the_next_report():
    """The budget keeps counting an admission for one refresh after a report may already hold
    it. A ladder step refused on that double count would be a refusal with room: it waits
    for the next report instead, and is refused only once it truly does not fit."""
    async def main():
        clock = FakeClock()
        admission = controller([stats("w0", reserved=0, capacity=1000)], clock=clock, stats_refresh_s=0.25)
        long_request = await admission.acquire(700)  # sent at 100.0
        clock.now = 100.05
        admission.update_stats([stats("w0", reserved=704)], taken_at=100.05)  # it is in the report...
        assert admission.snapshot().committed_tokens == 1404  # ...and still in flight: counted twice
        capped = asyncio.ensure_future(admission.acquire(48, max_wait_s=0.0))
        await settle()
        assert not capped.done()  # 704 + 48 fits on what the workers reported: not refused
        with pytest.raises(OverloadedError):  # 704 + 400 > 1000 even so: refused at once, no wait
            await admission.acquire(400, max_wait_s=0.0)
        clock.now = 100.4
        admission.update_stats([stats("w0", reserved=704)], taken_at=100.3)
        assert (await capped).worker_id == "w0"
        assert admission.snapshot().committed_tokens == 704 + 48
        long_request.release()

        # The other way round: the report did not hold the admission yet (the worker had not
        # queued it), so the next one shows there is no room: then the refusal comes.
        admission = controller([stats("w0", reserved=0, capacity=1000)], clock=clock, stats_refresh_s=0.25)
        await admission.acquire(700)  # sent at 100.4
        clock.now = 100.45
        admission.update_stats([stats("w0", reserved=0)], taken_at=100.45)
        waiting = asyncio.ensure_future(admission.acquire(400, max_wait_s=0.0))
        await settle()
        assert not waiting.done()
        clock.now = 100.8
        admission.update_stats([stats("w0", reserved=704)], taken_at=100.7)
        with pytest.raises(OverloadedError, match="no room now"):
            await waiting
        assert admission.snapshot().num_queued_first == 0

    asyncio.run(main())


def test_a_report_from_one_worker_does_not_forget_admissions_sent_to_another():
    """Each worker's in-flight admissions are forgotten against its own report's time: a
    newer poll of another worker says nothing about what this one has counted."""
    clock = FakeClock()
    w0, w1 = stats("w0", capacity=1000), stats("w1", capacity=1000)
    admission = controller([w0, w1], clock=clock, stats_refresh_s=0.25)  # both reported at 100.0

    async def main():
        return await admission.acquire(600, route=lambda eligible, _: "w0")

    ticket = asyncio.run(main())
    clock.now = 101.0
    admission.update_stats([w0, stats("w1", capacity=1000)], taken_at=101.0)  # only w1 polled again
    assert admission.in_flight_tokens() == {"w0": ticket.cost_tokens}


def test_a_step_behind_another_waiting_only_for_the_next_report_waits_with_it_in_order():
    """Two capped requests sent together while an admission is counted twice: the first
    waits for the next report; the second, behind it, is not refused for that (it would be
    behind a real queue), it waits too, and both are admitted, first first."""
    async def main():
        clock = FakeClock()
        admission = controller([stats("w0", reserved=0, capacity=1000)], clock=clock, stats_refresh_s=0.25)
        await admission.acquire(700)  # sent at 100.0
        clock.now = 100.05
        admission.update_stats([stats("w0", reserved=704)], taken_at=100.05)  # counted twice now
        first = asyncio.ensure_future(admission.acquire(48, max_wait_s=0.0))
        await settle()
        second = asyncio.ensure_future(admission.acquire(48, max_wait_s=0.0))
        await settle()
        assert not first.done() and not second.done()
        blocker = asyncio.ensure_future(admission.acquire(16, priority_class=-1))  # a real waiter ahead
        await settle()
        with pytest.raises(OverloadedError):  # behind a real queue: refused at once
            await admission.acquire(48, max_wait_s=0.0)
        blocker.cancel()
        await settle()
        clock.now = 100.4
        admission.update_stats([stats("w0", reserved=704)], taken_at=100.3)
        a, b = await first, await second
        assert a.sent_at <= b.sent_at and admission.snapshot().committed_tokens == 704 + 96

    asyncio.run(main())


def test_two_replicas_sending_one_worker_requests_each_fill_only_their_share_of_its_room():
    """Between two reports each replica counts only its own dispatches: both filled the room
    the worker's report left and the worker refused what the second sent. Told the other
    replica sends that worker requests too, each takes half of the room (the worker's total
    stays within its capacity); alone there it takes all of it, as before."""
    async def main():
        report = [stats("w0", reserved=400, capacity=1000)]  # 600 tokens of room
        replicas = [controller(report) for _ in range(2)]
        for admission in replicas:
            admission.update_stats(report, replicas_sharing={"w0": 1})
        tickets = [await asyncio.wait_for(admission.acquire(300, max_wait_s=0), 1.0) for admission in replicas]
        assert sum(t.cost_tokens for t in tickets) + 400 <= 1000  # the worker admits both
        with pytest.raises(OverloadedError):  # this replica's half is spent
            await replicas[0].acquire(100, max_wait_s=0)
        tickets[0].release()  # its own request ended: its own credit, at once
        assert (await asyncio.wait_for(replicas[0].acquire(300, max_wait_s=0), 1.0)).worker_id == "w0"
        # the other replica quiet there (its dispatches neither live nor new): the whole room
        alone = controller(report)
        alone.update_stats(report, replicas_sharing={"w0": 0})
        assert (await asyncio.wait_for(alone.acquire(600, max_wait_s=0), 1.0)).worker_id == "w0"
    asyncio.run(main())
