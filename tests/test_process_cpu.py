"""load_tests/process_cpu.py: the served benchmark's per-role CPU account, on real processes."""

import shutil
import subprocess
import time

import pytest

from kvmesh.load_tests import process_cpu


def test_roles_follow_ray_process_titles_and_executables():
    assert process_cpu.role_of(["ray::WorkerActor"]) == "worker actors"
    assert process_cpu.role_of(["ray::ServeReplica:kvmesh:KvmeshRouter.initialize_and_get_metadata"]) == "router replica"
    assert process_cpu.role_of(["ray::ProxyActor"]) == "Serve proxy"
    assert process_cpu.role_of(["ray::DashboardAgent"]) == "other Ray processes"
    assert process_cpu.role_of(["/x/ray/core/src/ray/raylet/raylet", "--gcs-address=127.0.0.1:1"]) == "raylet"
    assert process_cpu.role_of(["/x/ray/core/src/ray/gcs/gcs_server", "--raylet_config_list=1"]) == "Ray GCS"
    assert process_cpu.role_of(["/usr/bin/python3", "/x/ray/_private/log_monitor.py", "--x"]) == "Ray log monitor"
    assert process_cpu.role_of(["/usr/bin/python3", "-m", "pytest"]) is None
    assert process_cpu.role_of([]) is None


@pytest.mark.skipif(shutil.which("yes") is None, reason="needs coreutils' yes")
def test_a_busy_process_is_counted_under_its_role():
    # a real CPU-bound process titled like Ray's worker actors (argv[0] is what Ray's title sets)
    busy = subprocess.Popen(["ray::WorkerActor"], executable=shutil.which("yes"), stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.1)
        before = process_cpu.snapshot()
        deadline = time.monotonic() + 0.6
        while time.monotonic() < deadline:  # the client (this process) works too
            sum(range(10_000))
        account = process_cpu.account(before, process_cpu.snapshot())
    finally:
        busy.kill()
        busy.wait()
    assert account.window_s >= 0.6
    assert account.cores_by_role["worker actors"] > 0.1
    assert account.cores_by_role["client"] > 0.1
    assert 0.0 <= account.idle_cores <= account.cpus
    line = account.summary()
    assert "worker actors" in line and "client" in line and f"in cores of {account.cpus}" in line
