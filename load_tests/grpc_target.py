"""Targets that talk to a kvmesh router over gRPC with the client library.

  grpc     an already running router at `address` (host:port)
  cluster  a private local cluster started for the run (kvmesh.deploy.cmd_serve) from the
           run's config overrides -- how the prefix-routing campaign compares routing
           policies on 2 workers -- then load-tested over gRPC and torn down

Retries: by default the client library's own retries are off (max_attempts=1) so that the
driver's DriverRetryPolicy (none | naive | backoff) is the only one in play and every retry is
counted. `client_retries: true` turns the library's backoff + jitter + retry budget on
instead; its retries are then invisible to the driver (not counted as attempts).
Server samples come from the router's GetStats (cluster totals over healthy workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator

from kvmesh.load_tests.ports import free_port  # noqa: F401 (tests and campaigns import it from here)
from kvmesh.load_tests.targets import StreamChunk, Target, TargetRequest, check_loopback
from kvmesh.core.errors import InvalidRequestError, WorkerFailedError
from kvmesh.router.client import AsyncKvmeshClient
from kvmesh.router.retry import RetryPolicy
from kvmesh.router.client import StreamRestart
from kvmesh.core.config import KvmeshConfig

logger = logging.getLogger(__name__)


def cluster_sample(stats) -> dict[str, float]:
    """ClusterStats -> the server-sample keys the report plots (sums over healthy workers)."""
    healthy = [w for w in stats.workers if w.healthy]
    blocks_total = sum(w.num_blocks_total for w in healthy)
    return {
        "kv_usage": sum(w.num_blocks_used for w in healthy) / blocks_total if blocks_total else 0.0,
        "kv_tokens_used": float(stats.totals.kv_tokens_used),
        "num_running": float(stats.totals.num_running),
        "num_waiting": float(stats.totals.num_waiting + stats.totals.router_queue_len),
        "num_preemptions": float(sum(w.num_preemptions_recompute + w.num_preemptions_swap for w in healthy)),
        "num_priority_preemptions": float(sum(w.num_preemptions_priority for w in healthy)),
        "num_priority_preemptions_kv": float(sum(w.num_preemptions_priority_kv for w in healthy)),
        "num_outgrown_estimates": float(sum(w.num_outgrown_estimates for w in healthy)),
        "prefix_cache_hit_rate": (sum(w.prefix_cache_hit_rate for w in healthy) / len(healthy)) if healthy else 0.0,
        "num_healthy_workers": float(len(healthy)),
        "num_adapter_loads": float(sum(w.num_adapter_loads for w in healthy)),
    }


class GrpcTarget(Target):
    name = "grpc"

    def __init__(self, address: str, allow_remote: bool = False, client_retries: bool = False,
                 max_attempts: int = 4, timeout_s: float | None = None):
        check_loopback(f"grpc://{address}", allow_remote)
        self.address = address
        self.client_retries = client_retries
        self.max_attempts = max_attempts
        self.timeout_s = timeout_s
        self._channel = None
        self._clients: dict[str | None, object] = {}  # one per API key, sharing the channel

    async def start(self) -> None:
        import grpc

        self._channel = grpc.aio.insecure_channel(self.address)

    def _client(self, api_key: str | None):
        if api_key not in self._clients:
            policy = RetryPolicy(max_attempts=self.max_attempts if self.client_retries else 1)
            self._clients[api_key] = AsyncKvmeshClient(self.address, api_key=api_key, retry_policy=policy,
                                                       channel=self._channel)
        return self._clients[api_key]

    async def stream(self, request: TargetRequest) -> AsyncIterator[StreamChunk]:
        sampling = request.sampling()
        deltas = self._client(request.api_key).generate(prompt_token_ids=request.prompt_token_ids,
                                                        sampling=sampling, request_id=request.request_id,
                                                        model=request.adapter or "", timeout_s=self.timeout_s)
        async with contextlib.aclosing(deltas) as stream:
            async for delta in stream:
                if isinstance(delta, StreamRestart):  # only with restart_mid_stream, which we never set
                    raise WorkerFailedError("stream restarted")
                usage = delta.usage if delta.finished else None
                yield StreamChunk(len(delta.token_ids), finished=delta.finished, text=delta.text,
                                  completion_tokens=usage.completion_tokens if usage else None,
                                  cached_tokens=usage.cached_tokens if usage else None,
                                  degraded=bool(delta.finished and delta.degraded),
                                  token_ids=tuple(delta.token_ids))

    async def server_sample(self) -> dict[str, float] | None:
        try:
            stats = await self._client(None).get_stats(timeout_s=2.0)
        except Exception as exc:  # a slow or absent stats answer must not fail the load test
            logger.debug("GetStats failed: %s", exc)
            return None
        return cluster_sample(stats)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        self._clients.clear()


def _init_ray_on_this_thread() -> None:
    """ray.init from the event loop's (main) thread, once per process. A driver initialised
    inside a worker thread (as start_serving would in asyncio.to_thread) loses its cluster when
    that thread's executor shuts down at the end of the run. Blocks the loop for the few
    seconds of a local start, before any request is sent."""
    import os

    import ray

    if not ray.is_initialized():
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local cluster
        # address="local": always a new cluster, never one some other process on this machine
        # started (a plain ray.init() joins the latest one it finds).
        ray.init(address="local", include_dashboard=False, log_to_driver=False)


class ClusterTarget(GrpcTarget):
    """Start kvmesh (Ray + Serve, local) from the run's config, test it over gRPC, stop it.
    `redis: true` starts a redis-server of its own on a free loopback port (a temp dir, the
    append-only file on) and points tenants.redis_url at it: the Redis the chaos campaign
    stops and restarts (load_tests/faults.py)."""

    name = "cluster"

    def __init__(self, config: dict, app_name: str = "kvmesh-load", redis: bool = False, **grpc_options):
        router = dict(config.get("router") or {})
        if router.get("host", "127.0.0.1") not in ("127.0.0.1", "localhost"):
            raise InvalidRequestError("a cluster target serves on loopback only (router.host: 127.0.0.1)")
        router.setdefault("grpc_port", free_port())
        router.setdefault("http_port", free_port())
        self.config = KvmeshConfig.from_dict({**config, "router": router})
        self.app_name = app_name
        self.wants_redis = redis
        self.redis = None  # the RedisServer this target owns, once started
        self._redis_dir = None
        super().__init__(f"127.0.0.1:{self.config.router.grpc_port}", **grpc_options)

    async def start(self) -> None:
        from kvmesh.router.launch import start_serving  # Ray Serve: only for a cluster target

        if self.wants_redis:
            self._start_redis()
        try:
            _init_ray_on_this_thread()
            await asyncio.to_thread(start_serving, self.config, self.app_name)
        except BaseException:
            self._stop_redis()  # close() is only called on a started target
            raise
        await super().start()

    def _start_redis(self) -> None:
        import tempfile

        from kvmesh.load_tests.redis_server import RedisServer  # a subprocess: only with target.redis

        self._redis_dir = tempfile.TemporaryDirectory(prefix="kvmesh-load-redis-")
        self.redis = RedisServer.start(self._redis_dir.name)
        self.config = self.config.replace(tenants={"redis_url": self.redis.url})

    async def close(self) -> None:
        from kvmesh.router.launch import stop_serving  # Ray Serve: only for a cluster target

        await super().close()
        await asyncio.to_thread(stop_serving, self.config, self.app_name)
        self._stop_redis()

    def _stop_redis(self) -> None:
        if self.redis is not None:
            self.redis.stop()
            self._redis_dir.cleanup()
            self.redis = None
