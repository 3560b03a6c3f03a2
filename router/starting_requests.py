"""The requests of one router replica that are still starting (auth, quota, the admission wait),
so that a replica that stops can refuse them at once.

A request waiting in admission holds no worker, no KV block and no token yet; when Serve stops
the replica it could only be admitted to be handed off again at the end of the drain grace. So
the drain (router/replica_drain.py) refuses it, and every request that still reaches the
replica, with RouterReplicaStoppingError (UNAVAILABLE / 503 `replica_stopping`, retried at
once): the client's next connection reaches another replica. Both edges get this through
RouterCore.start, and the error reaches the client through the call's own context or response,
as any other refusal does.

    replica stops ──> refuse_all(): each starting task is cancelled with REFUSAL;
                      run() turns that cancel (and only that one) into RouterReplicaStoppingError
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvmesh.core.errors import RouterReplicaStoppingError

T = TypeVar("T")

STOPPING_MESSAGE = "the router replica is stopping; retry on another replica"
# The cancel message that marks a start cut by the replica's stop, not by its client leaving.
REFUSAL = "kvmesh: router replica stopping"


class StartingRequests:
    """Tasks inside RouterCore.start; lives on the replica's event loop."""

    def __init__(self):
        self.refusing = False  # the replica is stopping: no request starts any more
        self._tasks: set[asyncio.Task] = set()

    async def run(self, start: Coroutine[Any, Any, T]) -> T:
        """Await `start` (the stages) in the current task, unless the replica stops first."""
        if self.refusing:
            start.close()
            raise RouterReplicaStoppingError(STOPPING_MESSAGE)
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            return await start
        except asyncio.CancelledError as exc:
            if exc.args[:1] != (REFUSAL,):
                raise  # the client went away (or the loop is closing): nothing to answer
            task.uncancel()
            raise RouterReplicaStoppingError(STOPPING_MESSAGE) from None
        finally:
            self._tasks.discard(task)

    def refuse_all(self) -> int:
        """Refuse the requests starting now and every later one; returns how many were starting."""
        self.refusing = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel(REFUSAL)
        return len(tasks)
