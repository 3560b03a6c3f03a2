"""Serving the router application on Ray from a Python process: start it, redeploy it with
another config, stop it. `kvmesh serve` (deploy/cmd_serve.py) runs these around its wait for
Ctrl-C; the load tests' cluster targets and campaigns (load_tests/) run them around a private
local cluster they then use through the client, as any client would.

    start_serving(config)         Ray (local unless `address`), Serve's gRPC + HTTP proxies,
                                  the router app (the replicas start the worker actors)
    redeploy_router(config)       the same app name, a new router config; the detached
                                  workers stay up (their models stay loaded)
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
# served run): two workers, each asking half a CPU, so both fit next to the router on a
# 2-core laptop. Any other count left without parallel.worker_num_cpus gets a share derived
# from the CPUs Ray sees (core/resources.py).
LOCAL_NUM_WORKERS = 2
LOCAL_WORKER_NUM_CPUS = 0.5


def start_serving(config: KvmeshConfig, app_name: str = "kvmesh", address: str | None = None) -> None:
    """Init Ray (local unless `address`), start Serve's proxies and deploy the app; returns
    once the router replicas are up (they wait for the workers' models to load)."""
    import ray  # Ray: only where a cluster starts
    from ray import serve
    from ray.serve.config import gRPCOptions, HTTPOptions

    from kvmesh.router.app import GRPC_SERVICER_FUNCTION, router_num_cpus  # Ray Serve: as above
    from kvmesh.router.tls import check_serve_grpc_proxy, serve_http_ssl_options  # only where a cluster starts

    if not ray.is_initialized():
        if address is None:
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local cluster
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    # Every worker must be placeable, or it waits for CPUs forever with the cluster half up.
    config = resolve_worker_num_cpus(config, ray.cluster_resources().get("CPU", 0.0), router_num_cpus(config))
    router = config.router
    check_serve_grpc_proxy(router.tls)  # its proxy speaks plaintext only
    serve.start(http_options=HTTPOptions(host=router.host, port=router.http_port,
                                         **serve_http_ssl_options(router.tls)),
                grpc_options=gRPCOptions(port=router.grpc_port, grpc_servicer_functions=[GRPC_SERVICER_FUNCTION]))
    redeploy_router(config, app_name)


def redeploy_router(config: KvmeshConfig, app_name: str = "kvmesh") -> None:
    """Deploy (or replace) the router app under `app_name` on the running Serve instance."""
    from ray import serve  # Ray Serve: only where a cluster runs

    from kvmesh.router.app import build_router_app  # Ray Serve: as above

    serve.run(build_router_app(config), name=app_name, route_prefix="/")


def stop_serving(config: KvmeshConfig, app_name: str = "kvmesh") -> None:
    """Delete the app, kill its detached workers, stop Serve (best effort, in that order)."""
    from ray import serve  # Ray Serve: only where a cluster runs

    from kvmesh.worker.public_api import kill_workers  # Ray: as above

    for step, action in (("delete app", lambda: serve.delete(app_name)),
                         ("kill workers", lambda: kill_workers(config, app_name)),
                         ("kill fallback workers", lambda: _kill_fallback_workers(config, app_name)),
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
