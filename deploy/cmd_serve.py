"""`kvmesh serve`: bring up the router (gRPC + OpenAI HTTP) and the workers on Ray.

    kvmesh serve                                  # embedded SmolLM2, 2 workers, local Ray
    kvmesh serve --config kvmesh.yaml --workers 4 --policy least_loaded
    kvmesh serve --model ./my-hf-folder --grpc-port 50051 --http-port 8000
    kvmesh serve --address auto                   # join a running Ray cluster

Flags map onto the KvmeshConfig fields (`--set section.field=value` reaches any of them);
the precedence is defaults < --config < flags < --set. It starts a local Ray cluster unless
`--address` is given, deploys the Serve application, prints the endpoints and blocks until
Ctrl-C / SIGTERM, then drains (every worker leaves the routable set, so new requests are
refused retryably at once, and the streams running get router.drain_grace_s to finish; what
is left ends retryably), deletes the application and kills the detached worker actors. A
second Ctrl-C skips what is left of the drain.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from kvmesh.core.config import ConfigError, KvmeshConfig, RouterConfig, apply_overrides
from kvmesh.router.launch import drain_serving, machine_defaults, start_serving, stop_serving

# Function-level imports: each `kvmesh` command imports only what it runs, so the CLI starts
# (and `--help` answers) without loading torch, Ray or transformers.


EXIT_CONFIG_ERROR = 2


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
    p.add_argument("--policy", choices=("prefix_aware", "predicted_latency", "least_loaded", "round_robin"), help="routing policy")
    p.add_argument("--max-num-seqs", type=int, help="max running requests per worker (scheduler.max_num_seqs)")
    p.add_argument("--speculative", choices=("none", "ngram", "self_draft"),
                   help="speculative decoding proposer (speculative.method)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override any config field, e.g. --set cache.block_size=32 (repeatable)")
    p.add_argument("--address", help="join this Ray cluster (e.g. 'auto') instead of starting one")
    p.add_argument("--app-name", default="kvmesh", help="Serve application name (default kvmesh)")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> KvmeshConfig:
    config = KvmeshConfig.from_yaml(args.config) if args.config else KvmeshConfig()
    data = config.to_dict()
    if not args.config and args.workers is None:  # the local defaults (router/launch.py)
        for section, fields in machine_defaults(os.cpu_count() or 1).items():
            data[section].update(fields)
    flag_fields = {("model", "path"): args.model, ("parallel", "num_workers"): args.workers,
                   ("parallel", "tensor_parallel_size"): args.tp, ("router", "host"): args.host,
                   ("router", "grpc_port"): args.grpc_port, ("router", "http_port"): args.http_port,
                   ("router", "policy"): args.policy, ("scheduler", "max_num_seqs"): args.max_num_seqs,
                   ("speculative", "method"): args.speculative}
    for (section, name), value in flag_fields.items():
        if value is not None:
            data[section][name] = value
    return apply_overrides(KvmeshConfig.from_dict(data), args.overrides)


def _sched_idle_note(router: RouterConfig) -> str:
    if not router.sched_idle:
        return ""
    if router.sched_idle_min_streams == 0:
        return " (SCHED_IDLE: on cores the engine leaves idle)"
    return f" (SCHED_IDLE from {router.sched_idle_min_streams} streams: on cores the engine leaves idle)"


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"kvmesh serve: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    stop = threading.Event()
    started = False
    router = config.router
    parallel = config.parallel
    print(f"kvmesh serve: {os.cpu_count()} CPU(s): {parallel.num_workers} worker(s) x "
          f"{parallel.engine_threads()} engine thread(s), {config.router.num_replicas} router replica(s)"
          f"{_sched_idle_note(router)}; "
          f"starting {config.model.path or 'embedded SmolLM2'} (the first start converts the model) ...", flush=True)
    try:
        try:
            start_serving(config, args.app_name, args.address)
        except ConfigError as exc:  # found once Ray reported the machine: nothing was deployed
            print(f"kvmesh serve: {exc}", file=sys.stderr)
            return EXIT_CONFIG_ERROR
        started = True
        # After ray.init, which installs a SIGTERM handler that exits at once: ours lets the
        # finally below delete the app and kill the detached workers first.
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        http = f"{'https' if router.tls.enabled else 'http'}://{router.host}:{router.http_port}"
        print(f"kvmesh serve: ready\n  gRPC    {router.host}:{router.grpc_port}  (kvmesh.v1.Kvmesh)\n"
              f"  HTTP    {http}/v1  (OpenAI-compatible)\n"
              f"  health  {http}/health\n"
              f"  metrics {http}/metrics\nCtrl-C to stop.", flush=True)
        while not stop.wait(timeout=1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        if started:
            print(f"kvmesh serve: draining (streams get up to {router.drain_grace_s:g} s) ...", flush=True)
            try:
                ended = drain_serving(config, args.app_name)
                print(f"kvmesh serve: drained {len(ended)} worker(s); {sum(ended.values())} request(s) "
                      f"outlived the grace and ended retryably", flush=True)
            except KeyboardInterrupt:  # a second Ctrl-C: stop now
                pass
        import ray

        # A Ray that never came up (its start timed out) has nothing to stop, and Serve's calls
        # in stop_serving would start a local Ray of their own just to find nothing there.
        if ray.is_initialized():
            print("kvmesh serve: shutting down ...", flush=True)
            stop_serving(config, args.app_name)
            ray.shutdown()
    return 0
