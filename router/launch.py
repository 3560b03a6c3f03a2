"""Serving the router application on Ray from a Python process: start it, redeploy it with
another config, stop it. `kvmesh serve` (deploy/cmd_serve.py) runs these around its wait for
Ctrl-C; the load tests' cluster targets and campaigns (load_tests/) run them around a private
local cluster they then use through the client, as any client would.

    start_serving(config)         Ray (local unless `address`), Serve without proxies, the
                                  router app (its replicas serve HTTP and gRPC themselves and
                                  start the worker actors)
    redeploy_router(config)       the same app name, a new router config; the detached
                                  workers stay up (their models stay loaded)
    drain_serving(config)         before stop_serving: every worker leaves the routable set
                                  and gets router.drain_grace_s to finish its streams
    stop_serving(config)          delete the app, kill its workers and the fallback pool's,
                                  stop Serve (best effort, in that order)

Ray and Ray Serve load inside the functions: importing this module costs nothing.
"""

from __future__ import annotations

import logging
import os

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.resources import resolve_worker_num_cpus
from kvmesh.router.degradation import fallback_app_name, fallback_pool_config

logger = logging.getLogger(__name__)

# A local cluster with no config and no worker count (`kvmesh serve` bare, the engine bench's
# served run) fits the machine (`machine_topology`): the engines' lockstep threads want whole
# cores, and the stack's share of a core is small once tokens travel one message per step
# (docs/deploy.md). Any other count left without parallel.worker_num_cpus gets a share derived
# from the CPUs Ray sees (core/resources.py).
SMALL_MACHINE_CPUS = 4  # up to this many cores: one worker with a thread on every core
THREADS_PER_WORKER = 4  # larger machines: workers of this many threads, one core left to the stack


def machine_topology(num_cpus: int) -> tuple[int, int]:
    """(workers, engine threads per worker) for a machine of `num_cpus` cores.

        2 cores -> 1 x 2   4 -> 1 x 4   8 -> 1 x 7   9 -> 2 x 4   16 -> 3 x 5

    Small machines: one worker with every core. Two 1-thread workers on 2 cores measured
    0.72x of one 2-thread engine without any stack (docs/benchmarks.md): each engine's batch
    is half as large and the weights are read twice. Larger: one core left to the router,
    Serve and Ray; workers of at least THREADS_PER_WORKER threads share the rest evenly."""
    if num_cpus <= SMALL_MACHINE_CPUS:
        return 1, max(1, num_cpus)
    engine_cpus = num_cpus - 1
    workers = max(1, engine_cpus // THREADS_PER_WORKER)
    return workers, engine_cpus // workers


def machine_defaults(num_cpus: int) -> dict[str, dict]:
    """The config fields a bare local `kvmesh serve` fits to a machine of `num_cpus` cores, by
    section: the topology above, and where the engines' threads take every core, a router
    replica that runs only on cores they leave idle (router.sched_idle)."""
    workers, threads = machine_topology(num_cpus)
    return {"parallel": {"num_workers": workers, "cpu_threads": threads},
            "router": {"sched_idle": workers * threads >= num_cpus}}


# The environment of a local Ray that `kvmesh serve` (or a bench standing in for it) starts;
# Ray's processes inherit it from the driver. Each periodic job off or slowed here woke a
# process beside the engine's lockstep threads while nothing of kvmesh reads its output (the
# idle account in docs/deploy.md, section 6, measured with load_tests/process_cpu.py):
LOCAL_RAY_ENV = {
    "RAY_AUTH_MODE": "disabled",  # a private cluster on this machine
    # Ray starts its workers at nice 15, below GCS, raylet and the client, and the engines
    # then lose their cores to every wake-up of those; at 0 they are level with them and
    # above the router replica, which renices itself (router/app.py).
    "RAY_worker_niceness": "0",
    # Serve's controller reconciles every 1 s instead of 0.1 s: each pass wakes it and the
    # GCS (0.03 of 2 cores at 0.1 s, 0.012 at 0.5 s); a deployment, a replica's restart or a
    # health check (every 10 s) waits at most one pass more.
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1.0",
    # Ray's own Prometheus metrics (ray_* on the node's export port, through the dashboard
    # agent): kvmesh's /metrics is the router's (router/metrics.py), and a local cluster runs
    # no dashboard to read Ray's.
    "RAY_enable_metrics_collection": "0",
    # Serve's replica copies its cached request counters into those metrics 10 times a second;
    # our requests never pass Serve's handles, so there is nothing to copy but the wake-up.
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    # Task state events (`ray list tasks`, the dashboard's timeline), sent by every Ray process
    # to the GCS each second, and the event loops' per-handler statistics for Ray's debug logs.
    "RAY_task_events_report_interval_ms": "0",
    "RAY_event_stats": "0",
    # The log monitor tails the workers' log files for drivers with log_to_driver, which
    # `kvmesh serve` does not set; it looks for new files every 5 s instead of every 0.1 s
    # (a glob of the session's log folder each time).
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    "LOG_NAME_UPDATE_INTERVAL_S": "5",
}


def set_local_ray_env() -> None:
    """LOCAL_RAY_ENV into this process's environment, where the caller has not set a value."""
    for name, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(name, value)


def start_serving(config: KvmeshConfig, app_name: str = "kvmesh", address: str | None = None) -> None:
    """Init Ray (local unless `address`), start Serve and deploy the app; returns once the
    router replicas are up (they wait for the workers' models to load)."""
    import ray  # Ray: only where a cluster starts
    from ray import serve

    from kvmesh.router.app import router_num_cpus  # Ray Serve: as above

    if not ray.is_initialized():
        if address is None:
            set_local_ray_env()
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    # Every worker must be placeable, or it waits for CPUs forever with the cluster half up.
    config = resolve_worker_num_cpus(config, ray.cluster_resources().get("CPU", 0.0), router_num_cpus(config))
    # No Serve proxies: the router replicas serve the OpenAI API on router.http_port and
    # kvmesh.v1 on router.grpc_port themselves, with router.tls (router/http_ingress.py,
    # router/grpc_ingress.py); a proxy would take a port from them.
    serve.start(proxy_location="Disabled")
    redeploy_router(config, app_name)


def redeploy_router(config: KvmeshConfig, app_name: str = "kvmesh") -> None:
    """Deploy (or replace) the router app under `app_name` on the running Serve instance."""
    from ray import serve  # Ray Serve: only where a cluster runs

    from kvmesh.router.app import build_router_app  # Ray Serve: as above

    serve.run(build_router_app(config), name=app_name, route_prefix="/")


def drain_serving(config: KvmeshConfig, app_name: str = "kvmesh") -> dict[str, int]:
    """Drain every worker of the app (and of its fallback pool) at once with
    router.drain_grace_s: new requests are refused retryably at once (no routable worker), the
    streams running finish within the grace, and what is left ends retryably (UNAVAILABLE with
    retry-after: a client resumes it once the service is back). Returns {worker: requests
    ended}; {} when the drain itself failed (stop_serving follows either way)."""
    from kvmesh.worker.public_api import drain_workers  # Ray: only where a cluster runs

    try:
        return drain_workers((app_name, fallback_app_name(app_name)), config.router.drain_grace_s)
    except Exception as exc:
        logger.warning("drain before stopping failed: %s", exc)
        return {}


def worker_actors(app_name: str = "kvmesh") -> dict:
    """{actor name: handle} of the app's live worker actors (what an operator, or the chaos
    campaign, kills, drains or asks for stats)."""
    from kvmesh.worker.public_api import find_workers  # Ray: only where a cluster runs

    return find_workers([app_name])


def stop_serving(config: KvmeshConfig, app_name: str = "kvmesh") -> None:
    """Delete the app, kill its detached workers and metrics board, stop Serve (best effort,
    in that order)."""
    from ray import serve  # Ray Serve: only where a cluster runs

    from kvmesh.router.metrics import kill_board  # Ray: as above
    from kvmesh.worker.public_api import kill_workers  # Ray: as above

    for step, action in (("delete app", lambda: serve.delete(app_name)),
                         ("kill workers", lambda: kill_workers(config, app_name)),
                         ("kill fallback workers", lambda: _kill_fallback_workers(config, app_name)),
                         ("kill metrics board", lambda: kill_board(app_name)),
                         ("shutdown serve", serve.shutdown)):
        try:
            action()
        except Exception as exc:
            logger.warning("shutdown step %r failed: %s", step, exc)


def _kill_fallback_workers(config: KvmeshConfig, app_name: str) -> None:
    from kvmesh.worker.public_api import kill_workers  # Ray: only where a cluster runs

    fallback = fallback_pool_config(config)
    if fallback is not None:
        kill_workers(fallback, fallback_app_name(app_name))
