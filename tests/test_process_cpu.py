"""load_tests/process_cpu.py: the served benchmark's per-role CPU account, on real processes."""

import shutil
import subprocess

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


def test_account_divides_each_role_s_cpu_seconds_by_the_window():
    before = process_cpu.CpuSnapshot(10.0, {1: ("worker actors", 5.0), 2: ("client", 1.0), 3: ("raylet", 0.5)}, 100.0)
    after = process_cpu.CpuSnapshot(12.0, {1: ("worker actors", 8.0), 2: ("client", 1.5), 4: ("raylet", 9.0)}, 101.0)
    account = process_cpu.account(before, after)
    # pid 3 ended and pid 4 started inside the window: neither has a whole window to count
    assert account.cores_by_role == {"worker actors": 1.5, "client": 0.25}
    assert account.window_s == 2.0 and account.idle_cores == 0.5
    assert account.summary() == (f"CPU over the 2.0 s window, in cores of {account.cpus}: "
                                 "worker actors 1.50, client 0.25; idle 0.50")


@pytest.mark.skipif(shutil.which("yes") is None, reason="needs coreutils' yes")
def test_a_busy_process_is_counted_under_its_role():
    """A real CPU-bound process titled like Ray's worker actors (argv[0] is what Ray's title
    sets) and this process both show CPU under their roles. No rate is asserted: the window
    lasts until each has been charged CPU time (counts, not a clock; the box is shared)."""
    busy = subprocess.Popen(["ray::WorkerActor"], executable=shutil.which("yes"), stdout=subprocess.DEVNULL)
    try:
        before = process_cpu.snapshot()
        while busy.pid not in before.per_pid:  # until the child has exec'd under its title
            before = process_cpu.snapshot()
        for _ in range(100_000):  # a hang guard; each pass charges the client some CPU too
            sum(range(10_000))
            account = process_cpu.account(before, process_cpu.snapshot())
            if min(account.cores_by_role.get("worker actors", 0.0), account.cores_by_role.get("client", 0.0)) > 0:
                break
    finally:
        busy.kill()
        busy.wait()
    assert account.cores_by_role["worker actors"] > 0
    assert account.cores_by_role["client"] > 0
    assert account.window_s > 0 and 0.0 <= account.idle_cores <= account.cpus
