"""Paced streams on the router replica: holds end together on one grid (router/stream_pacer.py),
and a Subscription's hold, end and deadline (router/worker_channels.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvmesh.core.delta_wire import TokenDelta
from kvmesh.core.errors import DeadlineExceededError
from kvmesh.core.seams import FinishReason, RequestDelta
from kvmesh.router.stream_pacer import StreamPacer
from kvmesh.router.worker_channels import Subscription


def _token(i: int) -> TokenDelta:
    return TokenDelta("t/r", 0, f"<{i}>", (i,))


def _final() -> RequestDelta:
    return RequestDelta("t/r", finished=True, finish_reason=FinishReason.LENGTH)


async def _just_past_a_boundary(pacer: StreamPacer, pace_s: float) -> None:
    """Wait for a tick of `pace_s`: the next one is then a whole period away, not a moment."""
    aligned = asyncio.get_running_loop().create_future()
    pacer.next_tick(pace_s).add(lambda tick: aligned.set_result(None))
    await aligned


def test_streams_holding_from_different_instants_wake_in_one_tick():
    async def main():
        pacer, loop = StreamPacer(), asyncio.get_running_loop()
        woke: list[float] = []
        await _just_past_a_boundary(pacer, 0.05)  # the streams below all hold within one period

        async def stream(start_after_s: float) -> None:
            await asyncio.sleep(start_after_s)
            sub = Subscription()
            sub.put(_token(1))
            await sub.take(pacer.next_tick(0.05))
            woke.append(loop.time())

        await asyncio.gather(*(stream(s) for s in (0.0, 0.004, 0.011)))
        return woke

    woke = asyncio.run(main())
    assert len(woke) == 3
    assert max(woke) - min(woke) < 0.003  # one timer, one tick: not each stream's own phase


def test_no_pace_means_no_hold():
    async def main():
        assert StreamPacer().next_tick(0.0) is None
        sub = Subscription()
        sub.put(_token(1))
        return await asyncio.wait_for(sub.take(None), 1.0)

    assert asyncio.run(main()) == [_token(1)]


def test_a_hold_keeps_increments_back_until_its_tick_then_hands_them_over_together():
    async def main():
        pacer, loop = StreamPacer(), asyncio.get_running_loop()
        sub = Subscription()
        await _just_past_a_boundary(pacer, 0.2)  # the tick comes after the increments below
        tick = pacer.next_tick(0.2)
        started = loop.time()
        taken = asyncio.ensure_future(sub.take(tick))
        for i in range(3):
            await asyncio.sleep(0.005)
            sub.put(_token(i))
            assert not taken.done()  # an increment does not end the hold
        items = await taken
        return items, loop.time() - started

    items, waited_s = asyncio.run(main())
    assert items == [_token(0), _token(1), _token(2)]
    assert waited_s >= 0.015


def test_the_stream_end_ends_a_hold_at_once():
    async def main():
        pacer, sub = StreamPacer(), Subscription()
        await _just_past_a_boundary(pacer, 1.0)  # the tick is not what ends the hold
        taken = asyncio.ensure_future(sub.take(pacer.next_tick(1.0)))
        await asyncio.sleep(0)
        sub.put(_token(1))
        sub.put(_final())
        return await asyncio.wait_for(taken, 0.5)  # not the 1 s tick

    items = asyncio.run(main())
    assert items[-1].finished and items[0] == _token(1)


def test_a_hold_after_the_end_arrived_does_not_wait():
    async def main():
        sub = Subscription()
        sub.put(_final())
        return await asyncio.wait_for(sub.take(StreamPacer().next_tick(1.0)), 0.5)

    assert asyncio.run(main())[0].finished


def test_deadline_ends_a_hold_hands_over_what_it_held_then_fails():
    async def main():
        sub = Subscription()
        sub.expire_at(time.time() + 0.03)  # wall-clock, as GenerateRequest.deadline_s
        taken = asyncio.ensure_future(sub.take(StreamPacer().next_tick(1.0)))
        await asyncio.sleep(0.005)
        sub.put(_token(7))
        held = await asyncio.wait_for(taken, 0.5)
        with pytest.raises(DeadlineExceededError):
            await asyncio.wait_for(sub.take(None), 0.5)
        return held

    assert asyncio.run(main()) == [_token(7)]


def test_deadline_with_nothing_to_hand_over_raises():
    async def main():
        sub = Subscription()
        sub.expire_at(time.time() + 0.02)
        with pytest.raises(DeadlineExceededError):
            await asyncio.wait_for(sub.take(None), 0.5)
        sub.close()

    asyncio.run(main())


def test_a_cancelled_stream_does_not_cancel_the_others_on_its_tick():
    async def main():
        pacer = StreamPacer()
        subs = [Subscription() for _ in range(3)]
        for sub in subs:
            sub.put(_token(1))
        tick = pacer.next_tick(0.03)
        tasks = [asyncio.ensure_future(sub.take(tick)) for sub in subs]
        await asyncio.sleep(0.005)
        tasks[0].cancel()
        return await asyncio.wait_for(asyncio.gather(*tasks[1:]), 0.5)

    assert asyncio.run(main()) == [[_token(1)], [_token(1)]]


class _Suspensions:
    """Awaits a coroutine and counts how often it suspended (each suspension is one wake-up of
    its task by the event loop)."""

    def __init__(self, coro):
        self.coro, self.count = coro, 0

    def __await__(self):
        inner = self.coro.__await__()
        try:
            awaited = inner.send(None)
            while True:
                self.count += 1
                awaited = inner.send((yield awaited))
        except StopIteration as stop:
            return stop.value


def test_a_tick_that_passes_with_nothing_held_does_not_wake_the_stream():
    async def main():
        pacer, sub = StreamPacer(), Subscription()
        take = _Suspensions(sub.take(pacer.next_tick(0.01)))
        taken = asyncio.ensure_future(take)
        await asyncio.sleep(0.05)  # the tick passes: nothing arrived meanwhile
        assert not taken.done()
        sub.put(_token(1))  # after the tick: handed over at once
        return await asyncio.wait_for(taken, 0.5), take.count

    items, suspensions = asyncio.run(main())
    assert items == [_token(1)]
    assert suspensions == 1  # woken by the item, not also by the empty tick


def test_a_hold_cancelled_before_its_tick_leaves_the_next_take_unheld():
    async def main():
        pacer, sub = StreamPacer(), Subscription()
        taken = asyncio.ensure_future(sub.take(pacer.next_tick(0.02)))
        await asyncio.sleep(0)
        taken.cancel()
        await asyncio.sleep(0.04)  # the cancelled hold's tick fires
        sub.put(_token(2))
        return await asyncio.wait_for(sub.take(None), 0.5)

    assert asyncio.run(main()) == [_token(2)]
