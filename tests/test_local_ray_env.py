"""The environment `kvmesh serve` gives the local Ray it starts (router/launch.py): Ray's
periodic jobs whose output nothing of kvmesh reads are off or slowed; a value the caller set
stays."""

import os

from kvmesh.router.launch import LOCAL_RAY_ENV, set_local_ray_env


def test_a_local_ray_runs_without_the_periodic_jobs_nothing_of_kvmesh_reads(monkeypatch):
    for name in LOCAL_RAY_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_event_stats", "1")  # the caller's choice
    set_local_ray_env()
    assert os.environ["RAY_enable_metrics_collection"] == "0"
    assert os.environ["RAY_task_events_report_interval_ms"] == "0"
    assert os.environ["RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"] == "1000"
    assert os.environ["RAY_worker_niceness"] == "0" and os.environ["RAY_AUTH_MODE"] == "disabled"
    assert os.environ["RAY_event_stats"] == "1"
