"""The Ray Serve application: one router deployment serving both gRPC and HTTP.

Decision: gRPC through Serve's gRPC ingress and HTTP through Serve's HTTP ingress, both
landing on the SAME deployment, `KvmeshRouter`, which is a FastAPI ingress (router/
openai_http.py) and also defines the Kvmesh RPC methods (router/grpc_service.py). Why:

* no proxy hop: neither protocol is translated into the other, so each delta crosses Ray
  once (worker actor -> router replica) before Serve's proxy writes it to the socket;
* Serve's proxies own the ports, run on every node, drain on shutdown, and cancel the
  replica's request when a client disconnects (which is how a vanished client aborts its
  request on the worker and frees its KV blocks; for gRPC, router/grpc_edge.py adds a
  Cancel for the disconnects Serve's proxy does not pass on);
* one `RouterCore` per replica serves both, so auth, quotas, admission, routing and error
  mapping are the same code path whichever protocol a client speaks.

    client ──gRPC──> Serve gRPC proxy ──┐
                                        ├──> KvmeshRouter replica (x router.num_replicas)
    client ──HTTP──> Serve HTTP proxy ──┘        RouterCore ── WorkerPool ──> worker actors

Workers are detached named actors (worker/runtime/actor.py) that every router replica finds by
name, so scaling the router out does not multiply engines. Serve's replica health check is
left to Serve's default (the replica's own liveness): a router whose workers are all down
is healthy but answers UNAVAILABLE / 503, since restarting it would not bring workers back.
"""

# No `from __future__ import annotations`: FastAPI reads the route methods' annotations
# (`request: Request`) after Serve rebuilds them as class-based views, and string
# annotations would not resolve there.
import logging

from fastapi import Request, Response
from ray import serve

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.resources import resolve_worker_num_cpus
from kvmesh.router import openai_http
from kvmesh.router.grpc_service import KvmeshGrpcMethods
from kvmesh.router import tracing
from kvmesh.router.auth import Authenticator
from kvmesh.router.grpc_edge import quiet_client_errors
from kvmesh.router.metrics import RouterMetrics, get_or_create_board, start_publishing
from kvmesh.router.quota import make_quota_store
from kvmesh.router.router_core import RouterCore
from kvmesh.router.worker_pool import WorkerPool
from kvmesh.worker.public_api import load_tokenizer

logger = logging.getLogger(__name__)

# Wraps kvmesh.proto.kvmesh_pb2_grpc.add_KvmeshServicer_to_server (see grpc_service.py for why).
GRPC_SERVICER_FUNCTION = "kvmesh.router.grpc_service.add_KvmeshServicer_to_server"
DEFAULT_APP_NAME = "kvmesh"
# The router is I/O bound (awaiting workers, writing sockets); a fraction of a CPU per
# replica lets it share small nodes with the workers.
ROUTER_REPLICA_NUM_CPUS = 0.25
# Model loads (and a first GGUF conversion) happen before the first worker answers.
WORKER_READY_TIMEOUT_S = 600.0
# Extra concurrent requests a replica accepts so that overload reaches admission, which
# rejects it in microseconds with a retry-after (see build_router_app).
OVERLOAD_HEADROOM = 1024
# How often a replica publishes its metrics snapshot for its peers' /metrics: a scrape may
# lag a peer's latest counts by this much (Prometheus scrapes every 10-60 s).
METRICS_PUBLISH_INTERVAL_S = 2.0

fastapi_app = openai_http.build_openai_app()


@serve.deployment(name="KvmeshRouter", ray_actor_options={"num_cpus": ROUTER_REPLICA_NUM_CPUS})
@serve.ingress(fastapi_app)
class KvmeshRouter(KvmeshGrpcMethods):
    async def __init__(self, config_dict: dict):
        quiet_client_errors()  # Serve would log each refused request with a traceback
        config = KvmeshConfig.from_dict(config_dict)
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
        self.board = get_or_create_board()
        self._publisher = start_publishing(self.board, metrics, METRICS_PUBLISH_INTERVAL_S)
        self.core = RouterCore(config, self.pool, tokenizer, authenticator, quota, model_name, metrics, tracer)
        logger.info("router replica ready: model %s, %d workers", model_name, len(self.pool.worker_ids))

    # ---- OpenAI-compatible HTTP (router/openai_http.py) ------------------------------------

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await openai_http.generate_response(self.core, request, chat=False)

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await openai_http.generate_response(self.core, request, chat=True)

    @fastapi_app.get("/v1/models")
    async def models(self, request: Request) -> dict:
        return openai_http.models_body(self.core, openai_http.bearer_token(request.headers.get("authorization")))

    @fastapi_app.get("/health")
    async def health(self) -> Response:
        return openai_http.health_response(self.core)

    @fastapi_app.get("/metrics")
    async def metrics(self) -> Response:
        return await openai_http.metrics_response(self.core, self.board)

    async def __del__(self):
        self._publisher.cancel()
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
    # Beyond what the router holds (its queue plus the workers' running and queued requests),
    # OVERLOAD_HEADROOM more may be in the replica at once only to be rejected: a request
    # Serve queued in its proxy instead would wait, unanswered, for a slot and only then get
    # the router's RESOURCE_EXHAUSTED (measured: seconds, in tests/test_overload_e2e.py).
    max_ongoing = (config.router.max_queue_len
                   + 2 * config.scheduler.max_num_seqs * config.parallel.num_workers + OVERLOAD_HEADROOM)
    return KvmeshRouter.options(num_replicas=config.router.num_replicas,
                                max_ongoing_requests=max_ongoing).bind(config.to_dict())
