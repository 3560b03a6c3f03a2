"""A Redis outage as one router replica sees it: the shared Redis (quotas, new-family claims)
stopped answering, the replica serves by its own fallback meanwhile, and a probe finds out
when Redis is back.

    a call fails (ConnectionError, a timeout)  -> enter(exc): active, one WARNING, on_change(True),
                                                  a probe task starts
    every probe_interval_s: ping               -> fails: still away
                                               -> answers: on_back() (e.g. the quota's settlements
                                                  made meanwhile, replayed; a failure there keeps
                                                  the outage), then inactive, one WARNING,
                                                  on_change(False)

The user of it (router/quota.py's FallbackQuotaStore, router/family_claims.py) decides what
its fallback is and asks `active` before each call: while Redis is away no request waits on
a call that would time out. Single-owner state on the replica's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)


class RedisOutage:
    def __init__(self, ping: Callable[[], Awaitable[object]], probe_interval_s: float, *, away: str, back: str,
                 on_change: Callable[[bool], None] | None = None,
                 on_back: Callable[[], Awaitable[None]] | None = None,
                 unavailable: tuple[type[BaseException], ...] = (Exception,)):
        """`away` / `back`: the WARNINGs (`away` gets the error as `{exc}`); `unavailable`:
        the errors of `ping` and `on_back` that mean Redis is still away."""
        self._ping = ping
        self._probe_interval_s = probe_interval_s
        self._away, self._back = away, back
        self._on_change = on_change
        self._on_back = on_back
        self._unavailable = unavailable
        self._active = False
        self._probe: asyncio.Task | None = None

    @property
    def active(self) -> bool:
        return self._active

    def enter(self, exc: BaseException) -> None:
        """A call to Redis failed: the outage starts (a no-op while one is on)."""
        if self._active:
            return
        self._active = True
        logger.warning(self._away.format(exc=exc))
        if self._on_change is not None:
            self._on_change(True)
        self._probe = asyncio.get_running_loop().create_task(self._probe_until_back())

    async def _probe_until_back(self) -> None:
        while True:
            await asyncio.sleep(self._probe_interval_s)
            try:
                await self._ping()
                if self._on_back is not None:
                    await self._on_back()
            except self._unavailable:
                continue
            self._active = False
            logger.warning(self._back)
            if self._on_change is not None:
                self._on_change(False)
            return

    def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
