"""What `kvmesh serve` burns with nothing sent: the CPU account (load_tests/process_cpu.py) of
a fresh local deployment, by process role, over a window after it settled.

    python -m kvmesh.load_tests.idle_account                     # the config bench_served serves
    python -m kvmesh.load_tests.idle_account --window-s 60 --set router.stats_refresh_s=1.0

The config is bench_served's (`kvmesh serve` defaults on this machine, on loopback, free ports)
and the Ray is a private local one started as `kvmesh serve` starts it (router/launch.py
LOCAL_RAY_ENV), so the account holds only this deployment's processes. On a small machine
every wake-up of an idle process is taken from an engine's lockstep threads once requests
come (docs/deploy.md, section 6).
"""

from __future__ import annotations

import argparse
import time

from kvmesh.load_tests import process_cpu
from kvmesh.load_tests.bench_served import serve_config
from kvmesh.load_tests.ports import free_port
from kvmesh.router.launch import set_local_ray_env, start_serving, stop_serving

APP_NAME = "kvmesh-idle-account"


def idle_account(overrides: tuple[str, ...], model: str | None, settle_s: float, window_s: float):
    """The CpuAccount of a deployment that serves nothing, `settle_s` after it came up."""
    import ray  # Ray: only once a cluster starts

    ports = (f"router.grpc_port={free_port()}", f"router.http_port={free_port()}")
    config = serve_config(model, ports + overrides)
    set_local_ray_env()
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        start_serving(config, APP_NAME)
        try:
            time.sleep(settle_s)
            before = process_cpu.snapshot()
            time.sleep(window_s)
            return process_cpu.account(before, process_cpu.snapshot())
        finally:
            stop_serving(config, APP_NAME)
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> process_cpu.CpuAccount:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF folder or GGUF (default: the embedded SmolLM2)")
    p.add_argument("--settle-s", type=float, default=15.0, help="wait after the deployment is up")
    p.add_argument("--window-s", type=float, default=30.0, help="the measured window")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="a config override, as `kvmesh serve --set` (repeatable)")
    args = p.parse_args(argv)
    account = idle_account(tuple(args.overrides), args.model, args.settle_s, args.window_s)
    roles = sorted(((cores, role) for role, cores in account.cores_by_role.items() if role != "client"), reverse=True)
    print(f"idle over {account.window_s:.0f} s, in cores of {account.cpus}: {sum(c for c, _ in roles):.3f} in all: "
          + ", ".join(f"{role} {cores:.3f}" for cores, role in roles)
          + f"; the worker actors' threads: {', '.join(f'{c:.3f}' for c in account.worker_thread_cores if c >= 0.0005)}")
    return account


if __name__ == "__main__":
    main()
