"""The Ray Serve application: one router deployment serving both gRPC and HTTP.

Decision: gRPC through Serve's gRPC ingress and HTTP through Serve's HTTP ingress, both
landing on the SAME deployment, `KvmeshRouter`, which is a FastAPI ingress (router/
openai_http.py) and also defines the Kvmesh RPC methods (router/grpc_service.py). Why:

* no proxy hop: neither protocol is translated into the other, so each delta crosses Ray
  once (worker actor -> router replica) before Serve's proxy writes it to the socket;
* Serve's proxies own the ports, run on every node, drain on shutdown, and cancel the
  replica's request when a client disconnects (which is how a vanished client aborts its
  request on the worker and frees its KV blocks);
* one `RouterCore` per replica serves both, so auth, quotas, admission, routing and error
  mapping are the same code path whichever protocol a client speaks.

    client ──gRPC──> Serve gRPC proxy ──┐
                                        ├──> KvmeshRouter replica (x router.num_replicas)
    client ──HTTP──> Serve HTTP proxy ──┘        RouterCore ── WorkerPool ──> worker actors

Workers are detached named actors (worker/actor.py) that every router replica finds by
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

from kvmesh.deploy.config import KvmeshConfig
from kvmesh.router import openai_http
from kvmesh.router.grpc_service import KvmeshGrpcMethods

logger = logging.getLogger(__name__)

# Wraps kvmesh.proto.kvmesh_pb2_grpc.add_KvmeshServicer_to_server (see grpc_service.py for why).
GRPC_SERVICER_FUNCTION = "kvmesh.router.grpc_service.add_KvmeshServicer_to_server"
DEFAULT_APP_NAME = "kvmesh"
# The router is I/O bound (awaiting workers, writing sockets); a fraction of a CPU per
# replica lets it share small nodes with the workers.
ROUTER_REPLICA_NUM_CPUS = 0.25
# Model loads (and a first GGUF conversion) happen before the first worker answers.
WORKER_READY_TIMEOUT_S = 600.0

fastapi_app = openai_http.build_openai_app()


@serve.deployment(name="KvmeshRouter", ray_actor_options={"num_cpus": ROUTER_REPLICA_NUM_CPUS})
@serve.ingress(fastapi_app)
class KvmeshRouter(KvmeshGrpcMethods):
    async def __init__(self, config_dict: dict):
        from kvmesh.router import tracing
        from kvmesh.router.auth import Authenticator
        from kvmesh.router.metrics import RouterMetrics
        from kvmesh.router.quota import make_quota_store
        from kvmesh.router.router_core import RouterCore
        from kvmesh.router.tenants import open_tenant_store
        from kvmesh.router.worker_pool import WorkerPool
        from kvmesh.worker.tokenizer import load_tokenizer

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
        # Tenants added with `kvmesh tenants add` live in the store; every replica reloads
        # them each tenant_refresh_s, so a new key works without a restart.
        store = open_tenant_store(config.tenants.redis_url, config.tenants.tenants_file)
        authenticator = Authenticator(config.tenants, store)
        await authenticator.refresh()
        authenticator.start_refresh(config.tenants.tenant_refresh_s)
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
    async def models(self) -> dict:
        return openai_http.models_body(self.core)

    @fastapi_app.get("/health")
    async def health(self) -> Response:
        return openai_http.health_response(self.core)

    @fastapi_app.get("/metrics")
    async def metrics(self) -> Response:
        return openai_http.metrics_response(self.core)

    async def __del__(self):
        await self.pool.close()


def build_router_app(config: KvmeshConfig):
    """The bound Serve application for `config` (deploy with serve.run / serveConfigV2)."""
    max_ongoing = (config.router.max_queue_len
                   + 2 * config.scheduler.max_num_seqs * config.parallel.num_workers)
    return KvmeshRouter.options(num_replicas=config.router.num_replicas,
                                max_ongoing_requests=max_ongoing).bind(config.to_dict())
