"""Helpers for end-to-end modules that run the real Serve app on a private local Ray cluster
(tenants, observability, fairness).

    config = tiny_cluster_config(tiny_model_dir, num_workers=1, router={"num_replicas": 2}, ...)
    with serving(config, "kvmesh-obs"):      # the app, on the session's shared Ray cluster
        ...

Starting Ray costs 5-20 s on a 2-core machine, so the modules marked `shared_ray` share one
cluster (`shared_ray()`: started by the first, kept until the session ends; conftest.py runs
those modules last and together, so it is not idling beside the rest of the suite). Each
module still deploys and deletes its own Serve app, workers and metrics board. A module that
needs a cluster of its own shape (several nodes, fake GPUs, another CPU count) takes
`own_ray(...)`, which stops the shared one first.
"""

from __future__ import annotations

import contextlib
import os
import time

from kvmesh.core.config import KvmeshConfig
from kvmesh.load_tests.grpc_target import free_port

# Keys of test tenants are made with a cheap PBKDF2 count: the cost is per distinct key and
# process, and the tests measure nothing about it.
TEST_HASH_ITERATIONS = 1_000


def tiny_cluster_config(model_dir: str, *, num_workers: int = 1, max_num_seqs: int = 8, num_blocks: int = 256,
                        block_size: int = 16, max_new_tokens: int | None = 512, router: dict | None = None,
                        parallel: dict | None = None, tenants: dict | None = None,
                        observability: dict | None = None) -> KvmeshConfig:
    """The tiny random Llama on CPU workers, with Serve on free loopback ports (the one cluster
    config of the end-to-end modules; each passes what it varies). max_new_tokens None: the
    config's default."""
    scheduler = {"max_num_seqs": max_num_seqs}
    if max_new_tokens is not None:
        scheduler["max_new_tokens"] = max_new_tokens
    return KvmeshConfig.from_dict({
        "model": {"path": model_dir, "dtype": "fp32"},
        "cache": {"block_size": block_size, "num_blocks": num_blocks},
        "scheduler": scheduler,
        "parallel": {"num_workers": num_workers, "device": "cpu", "worker_num_cpus": 0.5, **(parallel or {})},
        "router": {"host": "127.0.0.1", "grpc_port": free_port(), "http_port": free_port(),
                   "stats_refresh_s": 0.1, **(router or {})},
        "tenants": tenants or {},
        "observability": observability or {},
    })


@contextlib.contextmanager
def serving(config: KvmeshConfig, app_name: str, env: dict[str, str] | None = None):
    """The Serve app on the shared Ray cluster; the app, its workers and Serve are torn down
    after (the cluster stays). `env` must be part of SHARED_RAY_ENV (Ray processes inherit
    the environment the cluster started with); anything else gets a cluster of its own."""
    from kvmesh.router.launch import start_serving, stop_serving

    with contextlib.ExitStack() as stack:
        if env and not env.items() <= SHARED_RAY_ENV.items():
            stack.enter_context(own_ray(num_cpus=SHARED_RAY_CPUS, env=env))
        else:
            shared_ray()
        try:
            start_serving(config, app_name)
            yield config
        finally:
            stop_serving(config, app_name)


# The shared cluster: the CPU count the actors' fractions were sized for, and the environment
# every module's Ray processes may need (Ray processes inherit it when the cluster starts).
SHARED_RAY_CPUS = 4
SHARED_RAY_ENV = {"RAY_AUTH_MODE": "disabled", "OTEL_BSP_SCHEDULE_DELAY": "100"}
_shared_ray_running = False


def shared_ray():
    """The session's shared private Ray cluster (started on first use); returns `ray`."""
    global _shared_ray_running
    import ray

    if ray.is_initialized() and _shared_ray_running:
        return ray
    stop_shared_ray()  # a Ray of another shape (a module that started its own)
    os.environ.update(SHARED_RAY_ENV)
    # address="local": always a private cluster, never another engineer's running one.
    ray.init(address="local", num_cpus=SHARED_RAY_CPUS, include_dashboard=False, log_to_driver=False)
    _shared_ray_running = True
    return ray


def stop_shared_ray() -> None:
    """Shut down whatever Ray this process runs (the shared cluster), before a module that
    starts a cluster of its own shape by hand."""
    global _shared_ray_running
    import ray

    if ray.is_initialized():
        ray.shutdown()
    _shared_ray_running = False


@contextlib.contextmanager
def own_ray(env: dict[str, str] | None = None, **init_kwargs):
    """A private Ray cluster of this module's own shape (ray.init's `init_kwargs`), stopping
    the shared one first; shut down after. `env` is set before it starts."""
    import ray

    stop_shared_ray()
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ.update(env or {})
    ray.init(address="local", include_dashboard=False, log_to_driver=False, **init_kwargs)
    try:
        yield ray
    finally:
        ray.shutdown()


def wait_for(predicate, timeout_s: float = 30.0, what: str = "condition", interval_s: float = 0.1):
    """Poll until `predicate()` is truthy (returned); AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval_s)


def scrape(http_base: str) -> dict[tuple[str, tuple], float]:
    """GET /metrics -> {(sample name, sorted label items): value}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{http_base}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def total(samples: dict, name: str, **labels) -> float:
    """Sum of `name` over every label set that includes `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


# Router replicas publish their metrics for their peers every 2 s (router/app.py).
PUBLISH_INTERVAL_S = 2.0


def settled_scrape(http_base: str, timeout_s: float = 20.0) -> dict[tuple[str, tuple], float]:
    """A scrape that includes every replica's latest counts: two scrapes one publish interval
    apart agree on the request and rejection counters."""
    def counters(samples: dict) -> tuple[float, float]:
        return total(samples, "kvmesh_requests_total"), total(samples, "kvmesh_rejections_total")

    deadline = time.monotonic() + timeout_s
    previous = scrape(http_base)
    while True:
        time.sleep(PUBLISH_INTERVAL_S + 0.3)
        current = scrape(http_base)
        if counters(current) == counters(previous) or time.monotonic() > deadline:
            return current
        previous = current
