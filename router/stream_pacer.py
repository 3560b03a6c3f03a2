"""One clock for the replica's paced streams (router.stream_messages_per_s).

A paced stream holds what arrives after a message until its share of the replica's message
budget has passed (router/router_core.py `stream_pace_s`), then sends it merged. Each stream
waiting on its own timer would put every stream's write on its own phase: a gRPC write alone
in its event-loop tick costs a socket write and a wake-up of grpc.aio's poller of its own,
while writes that leave in one tick share them (docs/deploy.md, the bare grpc.aio floor
aligned against staggered). So the holds end on a shared grid: a stream waits for the next
multiple of its pace (rounded up to a millisecond), and every stream with that pace wakes in
the same tick, from one timer, as a batched engine step's tokens arrive together.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

GRID_S = 0.001  # paces round up to whole milliseconds, so streams of nearly one pace share ticks


class PaceTick:
    """One instant of the grid: what to call then for each stream holding until it (a
    Subscription's hold ends there: it wakes its stream only when it holds something)."""

    __slots__ = ("callbacks",)

    def __init__(self):
        self.callbacks: list[Callable[[PaceTick], None]] = []

    def add(self, on_tick: Callable[[PaceTick], None]) -> None:
        self.callbacks.append(on_tick)

    def fire(self) -> None:
        callbacks, self.callbacks = self.callbacks, []
        for on_tick in callbacks:
            on_tick(self)


class StreamPacer:
    """The replica's grid of pace ticks; lives on the replica's event loop."""

    def __init__(self):
        self._ticks: dict[int, PaceTick] = {}  # grid index -> its tick, while one is pending

    def next_tick(self, pace_s: float) -> PaceTick | None:
        """The tick a stream paced at `pace_s` holds until; None when it is not paced."""
        if pace_s <= 0:
            return None
        loop = asyncio.get_running_loop()
        period = max(1, math.ceil(pace_s / GRID_S - 1e-9))  # in grid steps
        index = (math.floor(loop.time() / GRID_S) // period + 1) * period
        tick = self._ticks.get(index)
        if tick is None:
            tick = self._ticks[index] = PaceTick()
            loop.call_at(index * GRID_S, self._fire, index)
        return tick

    def _fire(self, index: int) -> None:
        self._ticks.pop(index).fire()
