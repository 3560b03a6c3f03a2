"""Where a machine's CPU went during a run, per process role: the served benchmark's account.

A served run shares the machine's cores between the engine and everything that carries its
tokens (Serve's proxy, the router replica, Ray's GCS / raylet / log monitor, the client). On a
small machine that share decides how close served throughput can come to the in-process
engine's, so `bench_served` prints it next to the figures: cores used per role over
the timed window, and the cores nobody used.

Processes are grouped by their Ray process title (`ray::WorkerActor`, `ray::ProxyActor`,
`ray::ServeReplica:...`) or executable (raylet, gcs_server), read with psutil (a Ray
dependency). A process that starts or ends inside the window counts what it used while both
snapshots saw it; one that lives only between them is missed (none do in a benchmark run).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import psutil

_EXECUTABLES = {"gcs_server": "Ray GCS", "raylet": "raylet"}  # basename of argv[0] -> role
_TITLES = (  # (start of a Ray process title, role), first match wins
    ("ray::WorkerActor", "worker actors"),
    ("ray::ServeReplica", "router replica"),
    ("ray::ProxyActor", "Serve proxy"),
    ("ray::ServeController", "Serve controller"),
    ("ray::MetricsBoard", "metrics board"),
    ("ray::", "other Ray processes"),
)
BUSY_THREAD_CORES = 0.25  # a worker actor thread above this is one of the engine's team
_SCRIPTS = {"log_monitor.py": "Ray log monitor", "dashboard.py": "other Ray processes",
            "monitor.py": "other Ray processes"}  # Ray's helper scripts, by file name


def role_of(argv: list[str]) -> str | None:
    """The role of a process with this command line, or None when it is not Ray's."""
    if not argv:
        return None
    if os.path.basename(argv[0]) in _EXECUTABLES:
        return _EXECUTABLES[os.path.basename(argv[0])]
    for prefix, role in _TITLES:
        if argv[0].startswith(prefix):
            return role
    for arg in argv[1:3]:  # python <script> ...
        if os.path.basename(arg) in _SCRIPTS:
            return _SCRIPTS[os.path.basename(arg)]
    return None


@dataclass(frozen=True)
class CpuSnapshot:
    at_s: float
    per_pid: dict[int, tuple[str, float]]  # pid -> (role, user + system seconds so far)
    idle_s: float  # the whole machine's idle seconds so far (all CPUs)
    # worker actor pid -> thread id -> its user + system seconds so far: the engine's thread
    # team against the actor's other threads (event loop, Ray's core worker), which share its cores
    worker_threads: dict[int, dict[int, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class CpuAccount:
    window_s: float
    cores_by_role: dict[str, float]  # mean cores each role used over the window
    idle_cores: float
    cpus: int
    worker_thread_cores: tuple[float, ...] = ()  # every worker actor thread's cores, busiest first

    def summary(self) -> str:
        roles = sorted(self.cores_by_role.items(), key=lambda kv: -kv[1])
        parts = ", ".join(f"{role} {cores:.2f}{self._threads() if role == 'worker actors' else ''}"
                          for role, cores in roles if cores >= 0.005)
        return f"CPU over the {self.window_s:.1f} s window, in cores of {self.cpus}: {parts}; idle {self.idle_cores:.2f}"

    def _threads(self) -> str:
        """E.g. " (threads 0.85 + 0.84, the other threads 0.11)": the busy ones (the engine's team),
        then the rest together."""
        busy = [c for c in self.worker_thread_cores if c >= BUSY_THREAD_CORES]
        if not self.worker_thread_cores:
            return ""
        rest = sum(self.worker_thread_cores) - sum(busy)
        return f" (threads {' + '.join(f'{c:.2f}' for c in busy) or 'none busy'}, the other threads {rest:.2f})"


def snapshot() -> CpuSnapshot:
    """The CPU so far of every Ray process this process started (its own local cluster: GCS,
    raylet and the workers they fork are its descendants), and its own as "client". Only
    descendants: on a shared machine other people's Ray clusters run beside it."""
    me = psutil.Process()
    per_pid: dict[int, tuple[str, float]] = {}
    threads: dict[int, dict[int, float]] = {}
    for proc in [me] + me.children(recursive=True):
        try:
            role = "client" if proc.pid == me.pid else role_of(proc.cmdline())
            if role is None:
                continue
            times = proc.cpu_times()
            per_pid[proc.pid] = (role, times.user + times.system)
            if role == "worker actors":
                threads[proc.pid] = {t.id: t.user_time + t.system_time for t in proc.threads()}
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return CpuSnapshot(time.monotonic(), per_pid, psutil.cpu_times().idle, threads)


def account(before: CpuSnapshot, after: CpuSnapshot) -> CpuAccount:
    window_s = max(1e-9, after.at_s - before.at_s)
    used: dict[str, float] = {}
    for pid, (role, cpu_s) in after.per_pid.items():
        if pid in before.per_pid:
            used[role] = used.get(role, 0.0) + (cpu_s - before.per_pid[pid][1])
    thread_cores = [(cpu_s - before.worker_threads[pid][tid]) / window_s
                    for pid, by_tid in after.worker_threads.items() if pid in before.worker_threads
                    for tid, cpu_s in by_tid.items() if tid in before.worker_threads[pid]]
    return CpuAccount(window_s, {role: s / window_s for role, s in used.items()},
                      (after.idle_s - before.idle_s) / window_s, psutil.cpu_count() or 1,
                      tuple(sorted(thread_cores, reverse=True)))
