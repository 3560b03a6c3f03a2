"""router/worker_pool.py without a cluster: when an unanswered poll takes a worker out."""

from __future__ import annotations

from kvmesh.router.worker_pool import SLOW_POLL_FACTOR, slow_poll_timeout_s


def test_a_slow_poll_is_judged_against_how_slowly_polls_are_answered_now():
    # A quiet machine: polls answer in milliseconds, the floor applies.
    assert slow_poll_timeout_s(2.0, [0.004, 0.01, 0.02]) == 2.0
    assert slow_poll_timeout_s(2.0, []) == 2.0
    # A loaded one: polls take up to 1.5 s, so 2.5 s unanswered is slow, not gone.
    assert slow_poll_timeout_s(2.0, [0.2, 1.5, 0.9]) == SLOW_POLL_FACTOR * 1.5 > 2.5
    # A worker that stopped answering altogether is still taken out within a minute.
    assert slow_poll_timeout_s(2.0, [40.0]) == 60.0
    # A configured floor above the cap stays the floor.
    assert slow_poll_timeout_s(120.0, [40.0]) == 120.0
