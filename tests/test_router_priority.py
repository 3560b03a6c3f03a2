"""router/app.py `lower_process_priority`: the router replica's threads run nicer than the
engines, and with router.sched_idle at SCHED_IDLE, each thread (Linux keeps both per thread),
those started before the call and after it. In a child process: the call lowers the whole
process it runs in."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")

_CHILD = """
import json, os, threading
from kvmesh.router.app import lower_process_priority

started = threading.Event()
stop = threading.Event()
early = threading.Thread(target=lambda: (started.set(), stop.wait()))
early.start()
started.wait()
lower_process_priority(3, sched_idle={sched_idle})
late = {{}}
def read_late():
    late["policy"] = os.sched_getscheduler(0)
    late["nice"] = os.getpriority(os.PRIO_PROCESS, 0)
t = threading.Thread(target=read_late)
t.start()
t.join()
threads = [(os.sched_getscheduler(int(tid)), os.getpriority(os.PRIO_PROCESS, int(tid)))
           for tid in os.listdir("/proc/self/task")]
stop.set()
early.join()
print(json.dumps({{"threads": threads, "late": [late["policy"], late["nice"]]}}))
"""


def _lowered(sched_idle: bool) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD.format(sched_idle=sched_idle)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("sched_idle", [True, False])
def test_every_thread_of_the_replica_is_lowered(sched_idle):
    out = _lowered(sched_idle)
    nice = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 3)
    policy = os.SCHED_IDLE if sched_idle else os.SCHED_OTHER
    assert len(out["threads"]) >= 2  # the main thread and one started before the call
    assert all(p == policy and n == nice for p, n in out["threads"]), out
    assert out["late"] == [policy, nice]  # a thread started afterwards inherits both
