"""The Ray Serve application: one router deployment whose replicas serve gRPC and HTTP themselves.

    client ──gRPC──> the replica's own grpc.aio server (SO_REUSEPORT) ──┐
                                                                        ├─> KvmeshRouter replica
    client ──HTTP──> the replica's own uvicorn server (SO_REUSEPORT) ───┘   (x router.num_replicas)
                                               RouterCore ── WorkerPool / WorkerChannels ──> worker actors

* Both edges end in the replica (router/grpc_ingress.py, router/http_ingress.py): a streamed
  message or SSE chunk goes worker -> replica -> client socket, crossing no proxy process;
  Serve's proxies are not started (proxy_location Disabled). Several replicas on a node share
  each port (the kernel spreads connections), so a node keeps one address per protocol.
* Workers stream to the replica over one channel per worker (router/worker_channels.py), a
  plain authenticated socket (router/channel_connection.py): one message per engine step
  holding the deltas of all of this replica's requests there; submits and aborts go the
  other way on it. Ray places, restarts and watches the workers.
* one `RouterCore` per replica serves both protocols, so auth, quotas, admission, routing and
  error mapping are the same code path whichever protocol a client speaks.

Workers are detached named actors (worker/runtime/actor.py) that every router replica finds by
name, so scaling the router out does not multiply engines. Serve's replica health check is
`check_health`: the replica is alive while its HTTP server runs; a router whose workers are all
down is healthy but answers UNAVAILABLE / 503, since restarting it would not bring workers back.
"""

import logging

from ray import serve

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.resources import resolve_worker_num_cpus
from kvmesh.router import openai_http
from kvmesh.router.grpc_ingress import start_grpc_server, stop_grpc_server
from kvmesh.router.http_ingress import HttpIngress
from kvmesh.router.replica_drain import HANDOFF_FLUSH_S, drain_replica
from kvmesh.router.grpc_service import ReplicaGrpcServicer
from kvmesh.router import tracing
from kvmesh.router.auth import Authenticator
from kvmesh.router.grpc_edge import quiet_client_errors
from kvmesh.router.metrics import RouterMetrics, get_or_create_board, start_publishing
from kvmesh.router.family_claims import make_family_claims
from kvmesh.router.quota import make_quota_store
from kvmesh.router.router_core import RouterCore
from kvmesh.router.thread_priority import SchedIdleUnderLoad, lower_process_priority
from kvmesh.router.worker_pool import WorkerPool
from kvmesh.worker.public_api import load_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_APP_NAME = "kvmesh"
# The router is I/O bound (awaiting workers, writing sockets); a fraction of a CPU per
# replica lets it share small nodes with the workers.
ROUTER_REPLICA_NUM_CPUS = 0.25
# Model loads (and a first GGUF conversion) happen before the first worker answers.
WORKER_READY_TIMEOUT_S = 600.0
# Extra concurrent calls Serve lets into a replica beyond what the router holds (see
# build_router_app); clients reach the replicas' own servers, so only handle calls count.
OVERLOAD_HEADROOM = 1024
# What a replica takes of router.replica_resource: a node offering 100 holds any replica count.
ROUTER_REPLICA_RESOURCE = 0.01
# The replica runs this much nicer than the engines: when both are runnable on a busy core the
# engine's lockstep threads win, and a token's delivery waits a little instead of every thread
# of the step waiting at the next barrier for the one the router preempted (docs/deploy.md).
ROUTER_NICE_INCREMENT = 10
# Serve's wait between its counts of a stopping replica's handle calls (its default, 2 s, is
# spent once even by an idle replica); the drain of both edges follows it (router/replica_drain.py).
GRACEFUL_SHUTDOWN_WAIT_LOOP_S = 0.5
# Serve kills a stopping replica this long after router.drain_grace_s: its wait loop, the
# hand-off's flush, closing the worker channels.
SHUTDOWN_MARGIN_S = GRACEFUL_SHUTDOWN_WAIT_LOOP_S + HANDOFF_FLUSH_S + 5.0
# How often a replica publishes its metrics snapshot for its peers' /metrics: a scrape may
# lag a peer's latest counts by this much (Prometheus scrapes every 10-60 s).
METRICS_PUBLISH_INTERVAL_S = 2.0


@serve.deployment(name="KvmeshRouter", ray_actor_options={"num_cpus": ROUTER_REPLICA_NUM_CPUS})
class KvmeshRouter:
    async def __init__(self, config_dict: dict):
        quiet_client_errors()  # Serve would log each refused request with a traceback
        config = KvmeshConfig.from_dict(config_dict)
        lower_process_priority(ROUTER_NICE_INCREMENT)
        sched_idle = SchedIdleUnderLoad(config.router.sched_idle_min_streams) if config.router.sched_idle else None
        app_name = serve.get_replica_context().app_name
        self.pool = WorkerPool(config, app_name)
        self.pool.start()
        if not await self.pool.wait_routable(WORKER_READY_TIMEOUT_S):
            raise RuntimeError(f"no worker became ready within {WORKER_READY_TIMEOUT_S:.0f}s")
        info = self.pool.any_info()
        model_name = config.model.served_model_name or info.model_name
        tokenizer = load_tokenizer(config.model)
        tracer = tracing.get_tracer(tracing.setup_tracing(config.observability, "kvmesh-router"))
        metrics = RouterMetrics(max_num_seqs=config.scheduler.max_num_seqs)
        quota = make_quota_store(config.tenants, num_replicas=config.router.num_replicas,
                                 on_fallback_change=metrics.set_quota_fallback)
        # Tenants added with `kvmesh tenants add` live in the store (Redis, else the tenants
        # file); every replica reloads them each tenant_refresh_s, so a new key works without
        # a restart, and a store down at start is not fatal. A store that comes back wiped
        # gets the registry this replica last read written back (router/auth.py).
        authenticator = Authenticator.from_config(config.tenants,
                                                  on_stale_change=metrics.set_tenant_registry_stale,
                                                  on_restore=metrics.observe_tenant_registry_restore)
        await authenticator.start()
        # Serve sends a scrape to any one replica: each publishes its own request-level
        # metrics to the cluster's board and renders its peers' alongside its own.
        self.board = get_or_create_board(app_name)
        self._publisher = start_publishing(self.board, metrics, METRICS_PUBLISH_INTERVAL_S)
        self.core = RouterCore(config, self.pool, tokenizer, authenticator, quota, model_name, metrics, tracer,
                               make_family_claims(config, app_name, metrics),
                               on_streams_changed=sched_idle.streams_changed if sched_idle is not None else None)
        self._servicer = ReplicaGrpcServicer(self.core)
        self._grpc_server = await start_grpc_server(self._servicer, config.router)
        self._http = HttpIngress(openai_http.build_replica_app(self.core, self.board), config.router)
        await self._http.start()
        logger.info("router replica ready: model %s, %d workers", model_name, len(self.pool.worker_ids))

    async def check_health(self) -> None:
        """Serve's periodic health check: a replica whose HTTP server stopped is restarted."""
        failed = self._http.failed
        if failed is not None:
            raise RuntimeError(f"the replica's HTTP server stopped: {failed!r}")

    async def __del__(self):
        # Each part only if __init__ got that far (a replica that failed to start is destroyed too).
        if hasattr(self, "_publisher"):
            self._publisher.cancel()
        if hasattr(self, "_http"):  # it served both edges: drain them (router/replica_drain.py)
            await drain_replica(self._grpc_server, self._servicer, self._http, self.core.config.router.drain_grace_s)
        else:
            await stop_grpc_server(getattr(self, "_grpc_server", None))
        if hasattr(self, "core"):
            await self.core.channels.close()
        if hasattr(self, "pool"):
            await self.pool.close()


def router_num_cpus(config: KvmeshConfig) -> float:
    """CPUs the router replicas ask for, one replica spare (an update starts the new replica
    before it stops the old one)."""
    return ROUTER_REPLICA_NUM_CPUS * (config.router.num_replicas + 1)


def build_router_app(config: KvmeshConfig):
    """The bound Serve application for `config` (deploy with serve.run / serveConfigV2)."""
    if config.parallel.worker_num_cpus is None:  # derived from the cluster this app runs on
        import ray

        config = resolve_worker_num_cpus(config, ray.cluster_resources().get("CPU", 0.0), router_num_cpus(config))
    # Serve's cap on calls in a replica applies to handle calls only (clients reach the
    # replica's own servers): beyond what the router holds, OVERLOAD_HEADROOM more, so that
    # overload reaches admission, which rejects it in microseconds with a retry-after.
    max_ongoing = (config.router.max_queue_len
                   + 2 * config.scheduler.max_num_seqs * config.parallel.num_workers + OVERLOAD_HEADROOM)
    actor_options = {"num_cpus": ROUTER_REPLICA_NUM_CPUS}
    if config.router.replica_resource:  # only where clients reach router.grpc_port (core/config.py)
        actor_options["resources"] = {config.router.replica_resource: ROUTER_REPLICA_RESOURCE}
    return KvmeshRouter.options(num_replicas=config.router.num_replicas, max_ongoing_requests=max_ongoing,
                                graceful_shutdown_wait_loop_s=GRACEFUL_SHUTDOWN_WAIT_LOOP_S,
                                graceful_shutdown_timeout_s=config.router.drain_grace_s + SHUTDOWN_MARGIN_S,
                                ray_actor_options=actor_options).bind(config.to_dict())
