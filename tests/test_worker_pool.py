"""router/worker_pool.py without a cluster: when an unanswered poll takes a worker out."""

from __future__ import annotations

from kvmesh.core.seams import WorkerStats
from kvmesh.router.degradation import FALLBACK_WORKER_PREFIX
from kvmesh.router.worker_pool import SLOW_POLL_FACTOR, _WorkerState, routable_now, slow_poll_timeout_s
from kvmesh.worker.public_api import WorkerInfo


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


def _state(worker_id: str, late: bool = False, polled_ok: bool = True):
    info = WorkerInfo(worker_id=worker_id, incarnation="i1", model_name="m", block_size=16)
    return _WorkerState(worker_id, handle=None, info=info, stats=WorkerStats(worker_id, True, 16, *([0] * 10), 0.0, 0.0),
                        polled_ok=polled_ok, late=late)


def test_a_late_worker_is_routed_to_only_while_no_on_time_worker_of_its_pool_is_routable():
    fallback = f"{FALLBACK_WORKER_PREFIX}-0"
    # Both on time: both routable. One late: only the on-time one.
    assert routable_now({w: _state(w) for w in ("worker-0", "worker-1")}) == {"worker-0", "worker-1"}
    assert routable_now({"worker-0": _state("worker-0", late=True), "worker-1": _state("worker-1")}) == {"worker-1"}
    # The other one died (its poll failed): the late survivor is routed to, not dropped with it
    # (the CI failure: a node loss left the loaded survivor late, and every request was refused).
    states = {"worker-0": _state("worker-0", polled_ok=False), "worker-1": _state("worker-1", late=True)}
    assert routable_now(states) == {"worker-1"}
    # Every worker late: all of them (a slow worker beats none).
    assert routable_now({w: _state(w, late=True) for w in ("worker-0", "worker-1")}) == {"worker-0", "worker-1"}
    # Pools are judged apart: an on-time fallback worker does not take out the late main one.
    assert routable_now({"worker-0": _state("worker-0", late=True), fallback: _state(fallback)}) == {"worker-0", fallback}
    # Nothing routable at all stays nothing.
    assert routable_now({"worker-0": _state("worker-0", polled_ok=False)}) == set()


def test_a_replica_waiting_for_its_workers_says_why_each_is_not_routable(caplog):
    import asyncio
    import dataclasses
    import logging

    from kvmesh.core.config import KvmeshConfig
    from kvmesh.router.worker_pool import WorkerPool

    pool = WorkerPool(KvmeshConfig(), "app")
    silent, unhealthy, late = _state("worker-0", polled_ok=False), _state("worker-1"), _state("worker-2", polled_ok=False)
    silent.last_error = "no answer to poll within 4.0s"
    unhealthy.stats = dataclasses.replace(unhealthy.stats, healthy=False)
    late.late, late.last_error = True, "no answer to poll within 4.0s"
    pool._workers = {"worker-0": silent, "worker-1": unhealthy, "worker-2": late, "worker-3": _state("worker-3")}
    assert pool.not_routable_reasons() == {
        "worker-0": "no poll answered yet (no answer to poll within 4.0s)",
        "worker-1": "reports unhealthy (draining or failed)",
        "worker-2": "no poll answered yet (no answer to poll within 4.0s), late"}
    del pool._workers["worker-3"]
    with caplog.at_level(logging.WARNING, logger="kvmesh.router.worker_pool"):
        assert not asyncio.run(pool.wait_routable(0.2, report_every_s=0.0))
    assert "waiting for a routable worker" in caplog.text and "no routable worker after 0s" in caplog.text
    assert "reports unhealthy" in caplog.text


def test_the_replicas_sharing_a_worker_are_those_whose_dispatches_run_there_or_arrived_since_its_last_poll():
    from kvmesh.core.config import KvmeshConfig
    from kvmesh.core.seams import DispatchReport
    from kvmesh.router.worker_pool import WorkerPool

    pool = WorkerPool(KvmeshConfig(), "app")
    busy, quiet, silent = _state("worker-0"), _state("worker-1"), _state("worker-2")
    busy.dispatches = {"me": DispatchReport(5, frozenset({5})), "other": DispatchReport(3, frozenset({3})),
                       "third": DispatchReport(9, frozenset())}
    busy.previous_dispatches = {"third": DispatchReport(7, frozenset())}  # two more came and went since
    quiet.dispatches = {"me": DispatchReport(5, frozenset({5})), "other": DispatchReport(3, frozenset())}
    quiet.previous_dispatches = {"other": DispatchReport(3, frozenset())}  # nothing running, nothing new
    silent.dispatches = None  # a worker that keeps no dispatch log
    pool._workers = {"worker-0": busy, "worker-1": quiet, "worker-2": silent}
    assert pool.replicas_sharing("me") == {"worker-0": 2, "worker-1": 0}
    assert pool.replicas_sharing("other")["worker-1"] == 1  # "me" still runs there
    # a first poll: a replica the worker heard from once (an earlier deployment's) is not sharing
    quiet.previous_dispatches = None
    assert pool.replicas_sharing("me")["worker-1"] == 0
