"""The router replica's threads against the engines' (Linux keeps niceness and scheduling
policy per thread, and a thread started later takes its starter's).

The replica runs nicer than the engines (`lower_process_priority`), and with router.sched_idle
at SCHED_IDLE: it then gets a core only when no engine thread wants one, instead of
preempting one of an engine's lockstep threads mid-phase while the others wait for it at the
next barrier (docs/deploy.md). That is worth it under load, where the replica wakes for every
step's tokens; a lightly loaded replica's first token then waits for a core the engine leaves
idle while it decodes the next (TTFT P50 at 1 in flight 35.9 -> 41-42 ms, docs/deploy.md). So
`SchedIdleUnderLoad` runs the replica at SCHED_IDLE only while it carries
router.sched_idle_min_streams streams or more, and back at its nice once half of that or fewer
are left. Leaving SCHED_IDLE needs CAP_SYS_NICE or an RLIMIT_NICE that allows the thread's
nice value (sched(7)); where the OS refuses it, the replica stays at SCHED_IDLE throughout, as
with router.sched_idle_min_streams 0.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def _thread_ids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def lower_process_priority(increment: int) -> None:
    """Add `increment` to the niceness of every thread of this process (at most 19). Raising
    niceness needs no privilege; where it fails, the thread runs as it was."""
    for tid in _thread_ids():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
        except OSError as exc:
            logger.debug("lowering the priority of thread %d: %s", tid, exc)


def set_process_policy(policy: int) -> bool:
    """Move every thread of this process to `policy` (os.SCHED_IDLE, os.SCHED_OTHER); False
    where the OS refused it for any."""
    moved = True
    for tid in _thread_ids():
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except OSError as exc:
            moved = False
            logger.debug("scheduling policy %d for thread %d: %s", policy, tid, exc)
    return moved


def can_leave_sched_idle() -> bool:
    """Whether this process may move a thread from SCHED_IDLE back to SCHED_OTHER: tried on a
    thread of its own (a thread that can only enter SCHED_IDLE stays there)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except OSError:
        return False
    return True


class SchedIdleUnderLoad:
    """SCHED_IDLE for the whole replica while it carries `min_streams` streams or more; back
    to SCHED_OTHER at `min_streams // 2` or fewer (the gap keeps a replica near the line from
    switching at every stream). `min_streams` 0, or a process that may not leave SCHED_IDLE:
    SCHED_IDLE from the start, for good."""

    def __init__(self, min_streams: int):
        self._enter = min_streams
        self._leave = min_streams // 2
        self.adaptive = min_streams > 0 and can_leave_sched_idle()
        self.idle = False
        if not self.adaptive:
            set_process_policy(os.SCHED_IDLE)
            self.idle = True

    def streams_changed(self, streams: int) -> None:
        """Called with the replica's stream count each time it changes."""
        if not self.adaptive:
            return
        if not self.idle and streams >= self._enter:
            set_process_policy(os.SCHED_IDLE)
            self.idle = True
        elif self.idle and streams <= self._leave:
            self.idle = not set_process_policy(os.SCHED_OTHER)
