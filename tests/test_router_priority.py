"""router/thread_priority.py: the router replica's threads run nicer than the engines, and with
router.sched_idle at SCHED_IDLE while the replica carries enough streams. Linux keeps both per
thread: each is checked on every thread, those started before the call and after it. In a
child process: the calls change the whole process they run in."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")

# Runs STEPS in a process with a thread started before them, then reads every thread's
# policy and nice, and those of a thread started afterwards.
_CHILD = """
import json, os, threading
from kvmesh.router.thread_priority import SchedIdleUnderLoad, lower_process_priority, set_process_policy

started = threading.Event()
stop = threading.Event()
early = threading.Thread(target=lambda: (started.set(), stop.wait()))
early.start()
started.wait()

def policies():
    late = {{}}
    def read_late():
        late["thread"] = [os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)]
    t = threading.Thread(target=read_late)
    t.start()
    t.join()
    threads = [[os.sched_getscheduler(int(tid)), os.getpriority(os.PRIO_PROCESS, int(tid))]
               for tid in os.listdir("/proc/self/task")]
    return {{"threads": threads, "late": late["thread"]}}

out = {{}}
{steps}
# Out at once: a process left at SCHED_IDLE gets a core only when nothing else wants one, and
# the interpreter's own teardown on a busy box could outlast the test's patience.
os.write(1, (json.dumps(out) + "\\n").encode())
os._exit(0)
"""


def _run(steps: str, **kwargs) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD.format(steps=steps)], capture_output=True, text=True,
                          timeout=120, check=False, **kwargs)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _all(seen: dict, policy: int, nice: int | None = None) -> bool:
    rows = seen["threads"] + [seen["late"]]  # a thread started afterwards inherits both
    return len(seen["threads"]) >= 2 and all(p == policy and (nice is None or n == nice) for p, n in rows)


def test_every_thread_of_the_replica_runs_nicer():
    out = _run('lower_process_priority(3)\nout["nicer"] = policies()')
    assert _all(out["nicer"], os.SCHED_OTHER, min(19, os.getpriority(os.PRIO_PROCESS, 0) + 3)), out


def test_every_thread_moves_to_sched_idle():
    out = _run('set_process_policy(os.SCHED_IDLE)\nout["idle"] = policies()')
    assert _all(out["idle"], os.SCHED_IDLE), out


_UNDER_LOAD = """
policy = SchedIdleUnderLoad(4)
out["adaptive"] = policy.adaptive
for streams in (1, 2, 3):
    policy.streams_changed(streams)
out["light"] = policies()
policy.streams_changed(4)
out["loaded"] = policies()
policy.streams_changed(3)
out["still_loaded"] = policies()  # not at half yet: no switch for every stream near the line
policy.streams_changed(2)
out["light_again"] = policies()
"""


def test_sched_idle_only_while_the_replica_carries_enough_streams():
    out = _run(_UNDER_LOAD)
    if not out["adaptive"]:
        pytest.skip("this process may not leave SCHED_IDLE (no CAP_SYS_NICE, RLIMIT_NICE too low)")
    assert _all(out["light"], os.SCHED_OTHER), out
    assert _all(out["loaded"], os.SCHED_IDLE), out
    assert _all(out["still_loaded"], os.SCHED_IDLE), out
    assert _all(out["light_again"], os.SCHED_OTHER), out


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the child as another user")
def test_a_process_that_may_not_leave_sched_idle_stays_there_from_the_start():
    # The child drops to an unprivileged user (its imports done) with RLIMIT_NICE 0: entering
    # SCHED_IDLE is allowed, leaving it is not.
    out = _run("import resource\nresource.setrlimit(resource.RLIMIT_NICE, (0, 0))\n"
               "os.setgid(65534)\nos.setuid(65534)\n" + _UNDER_LOAD)
    assert out["adaptive"] is False
    for phase in ("light", "loaded", "still_loaded", "light_again"):
        assert _all(out[phase], os.SCHED_IDLE), (phase, out)


def test_min_streams_zero_is_sched_idle_throughout():
    out = _run(_UNDER_LOAD.replace("SchedIdleUnderLoad(4)", "SchedIdleUnderLoad(0)"))
    assert out["adaptive"] is False
    assert _all(out["light"], os.SCHED_IDLE) and _all(out["light_again"], os.SCHED_IDLE), out
