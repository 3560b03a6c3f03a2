"""`kvmesh serve`: bring up the router (gRPC + OpenAI HTTP) and the workers on Ray.

    kvmesh serve                                  # embedded SmolLM2, 2 workers, local Ray
    kvmesh serve --config kvmesh.yaml --workers 4 --policy least_loaded
    kvmesh serve --model ./my-hf-folder --grpc-port 50051 --http-port 8000
    kvmesh serve --address auto                   # join a running Ray cluster

Flags map onto the KvmeshConfig fields (`--set section.field=value` reaches any of them);
the precedence is defaults < --config < flags < --set. It starts a local Ray cluster unless
`--address` is given, deploys the Serve application, prints the endpoints and blocks until
Ctrl-C / SIGTERM, then deletes the application and kills the detached worker actors.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from kvmesh.core.config import ConfigError, KvmeshConfig

# Function-level imports: each `kvmesh` command imports only what it runs, so the CLI starts
# (and `--help` answers) without loading torch, Ray or transformers.

logger = logging.getLogger(__name__)

# `kvmesh serve` with no config and no --workers fits the machine (`machine_topology`): the
# engines' lockstep threads want whole cores, and the stack's share of a core is small once
# tokens travel one message per step (docs/deploy.md). Any other count left without
# parallel.worker_num_cpus gets a share derived from the CPUs Ray sees (core/resources.py).
SMALL_MACHINE_CPUS = 4  # up to this many cores: one worker with a thread on every core
THREADS_PER_WORKER = 4  # larger machines: workers of this many threads, one core left to the stack
EXIT_CONFIG_ERROR = 2


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


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the model over gRPC and OpenAI-compatible HTTP on Ray",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="KvmeshConfig YAML (flags override its values)")
    p.add_argument("--model", help="HF folder or .gguf file (default: embedded SmolLM2)")
    p.add_argument("--workers", type=int, help="number of engine workers (parallel.num_workers)")
    p.add_argument("--tp", type=int, help="tensor-parallel size per worker")
    p.add_argument("--host", help="address the proxies bind (router.host)")
    p.add_argument("--grpc-port", type=int, help="gRPC port (router.grpc_port)")
    p.add_argument("--http-port", type=int, help="HTTP port (router.http_port)")
    p.add_argument("--policy", choices=("prefix_aware", "least_loaded", "round_robin"), help="routing policy")
    p.add_argument("--max-num-seqs", type=int, help="max running requests per worker (scheduler.max_num_seqs)")
    p.add_argument("--speculative", choices=("none", "ngram", "self_draft"),
                   help="speculative decoding proposer (speculative.method)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override any config field, e.g. --set cache.block_size=32 (repeatable)")
    p.add_argument("--address", help="join this Ray cluster (e.g. 'auto') instead of starting one")
    p.add_argument("--app-name", default="kvmesh", help="Serve application name (default kvmesh)")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> KvmeshConfig:
    from kvmesh.deploy.serve_config import apply_overrides

    config = KvmeshConfig.from_yaml(args.config) if args.config else KvmeshConfig()
    data = config.to_dict()
    if not args.config and args.workers is None:
        workers, threads = machine_topology(os.cpu_count() or 1)
        data["parallel"].update(num_workers=workers, cpu_threads=threads)
    flag_fields = {("model", "path"): args.model, ("parallel", "num_workers"): args.workers,
                   ("parallel", "tensor_parallel_size"): args.tp, ("router", "host"): args.host,
                   ("router", "grpc_port"): args.grpc_port, ("router", "http_port"): args.http_port,
                   ("router", "policy"): args.policy, ("scheduler", "max_num_seqs"): args.max_num_seqs,
                   ("speculative", "method"): args.speculative}
    for (section, name), value in flag_fields.items():
        if value is not None:
            data[section][name] = value
    return apply_overrides(KvmeshConfig.from_dict(data), args.overrides)


def set_local_ray_env() -> None:
    """Process plumbing for a local Ray that `kvmesh serve` (or a bench standing in for it)
    starts: no auth on a private cluster, and Ray's workers at nice 0. Ray starts them at 15,
    below GCS, raylet and the client, and the engines then lose their cores to every wake-up
    of those; at 0 they are level with them and above the router replica, which renices
    itself (router/app.py)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_worker_niceness", "0")


def start_serving(config: KvmeshConfig, app_name: str = "kvmesh", address: str | None = None) -> None:
    """Init Ray (local unless `address`), start Serve's proxies and deploy the app; returns
    once the router replicas are up (they wait for the workers' models to load)."""
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions

    from kvmesh.core.resources import resolve_worker_num_cpus
    from kvmesh.router.app import build_router_app, router_num_cpus

    if not ray.is_initialized():
        if address is None:
            set_local_ray_env()
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    # Every worker must be placeable, or it waits for CPUs forever with the cluster half up.
    config = resolve_worker_num_cpus(config, ray.cluster_resources().get("CPU", 0.0), router_num_cpus(config))
    router = config.router
    # No Serve gRPC proxy: the router replicas serve kvmesh.v1 on router.grpc_port themselves.
    serve.start(http_options=HTTPOptions(host=router.host, port=router.http_port))
    serve.run(build_router_app(config), name=app_name, route_prefix="/")


def stop_serving(config: KvmeshConfig, app_name: str = "kvmesh") -> None:
    """Delete the app, kill its detached workers, stop Serve (best effort, in that order)."""
    from ray import serve

    from kvmesh.worker.runtime.actor import kill_workers

    for step, action in (("delete app", lambda: serve.delete(app_name)),
                         ("kill workers", lambda: kill_workers(config, app_name)),
                         ("kill fallback workers", lambda: _kill_fallback_workers(config, app_name)),
                         ("shutdown serve", serve.shutdown)):
        try:
            action()
        except Exception as exc:
            logger.warning("shutdown step %r failed: %s", step, exc)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"kvmesh serve: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    stop = threading.Event()
    router = config.router
    parallel = config.parallel
    print(f"kvmesh serve: {os.cpu_count()} CPU(s): {parallel.num_workers} worker(s) x "
          f"{parallel.engine_threads()} engine thread(s), {config.router.num_replicas} router replica(s); "
          f"starting {config.model.path or 'embedded SmolLM2'} (the first start converts the model) ...", flush=True)
    try:
        try:
            start_serving(config, args.app_name, args.address)
        except ConfigError as exc:  # found once Ray reported the machine: nothing was deployed
            print(f"kvmesh serve: {exc}", file=sys.stderr)
            return EXIT_CONFIG_ERROR
        # After ray.init, which installs a SIGTERM handler that exits at once: ours lets the
        # finally below delete the app and kill the detached workers first.
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        print(f"kvmesh serve: ready\n  gRPC    {router.host}:{router.grpc_port}  (kvmesh.v1.Kvmesh)\n"
              f"  HTTP    http://{router.host}:{router.http_port}/v1  (OpenAI-compatible)\n"
              f"  health  http://{router.host}:{router.http_port}/health\n"
              f"  metrics http://{router.host}:{router.http_port}/metrics\nCtrl-C to stop.", flush=True)
        while not stop.wait(timeout=1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        print("kvmesh serve: shutting down ...", flush=True)
        stop_serving(config, args.app_name)
        import ray

        ray.shutdown()
    return 0


def _kill_fallback_workers(config: KvmeshConfig, app_name: str) -> None:
    from kvmesh.router.degradation import fallback_app_name, fallback_pool_config
    from kvmesh.worker.runtime.actor import kill_workers

    fallback = fallback_pool_config(config)
    if fallback is not None:
        kill_workers(fallback, fallback_app_name(app_name))
