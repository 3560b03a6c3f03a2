"""Many LoRA adapters on one base model: the two figures of the LoRA design, as ratios in ONE run.

    python -m kvmesh.load_tests.bench_lora                      # SmolLM2, both parts
    python -m kvmesh.load_tests.bench_lora --part throughput    # engine only (no Ray)
    python -m kvmesh.load_tests.bench_lora --quick --model DIR  # seconds, tiny model (tests)

  * throughput  64 concurrent requests spread evenly over 8 adapters (rank 16, every
                projection), 4 adapter slots, against the same 64 requests on the base model,
                in one in-process engine: output tok/s, adapter / base (target >= 0.7), and
                failed requests (target 0). Base and adapter runs alternate (ABAB) so the
                drift of a shared machine hits both alike. The base run may use the native
                CPU step; a step with adapter rows runs eagerly (its reason is counted).
  * routing     the many-adapter campaign on a local 2-worker cluster (Ray + Serve, gRPC): 8
                adapters with Zipf popularity (s = 1.1), 4 slots per worker, requests sent by
                a pool of concurrent clients; adapter loads summed over the workers' stats,
                adapter-aware routing (router.policy prefix_aware) / round robin (target <= 0.5).

Prints one JSON report and a summary line per figure.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

# Function-level imports: the engine part needs no Ray, the routing part no in-process engine;
# each loads only what it runs.

from kvmesh.core.config import KvmeshConfig, ModelConfig
from kvmesh.core.seams import AdapterRef, FinishReason, GenerateRequest, SamplingParams
from kvmesh.load_tests.lora_campaign import write_random_adapters
from kvmesh.load_tests.workloads import zipf_adapter_choices


@dataclass
class ThroughputFigures:
    base_tok_s: list[float]
    adapter_tok_s: list[float]
    ratio: float  # mean adapter / mean base
    failed_requests: int
    adapter_loads: int
    eager_lora_steps: int


@dataclass
class RoutingFigures:
    num_requests: int
    adapter_aware_loads: int
    round_robin_loads: int
    ratio: float  # adapter-aware / round robin
    failed_requests: dict[str, int]


def _prompts(num: int, length: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    rng = np.random.default_rng(seed)
    return [tuple(int(t) for t in rng.integers(100, min(vocab, 20000), length)) for _ in range(num)]


def _engine_config(model: str | None, max_loras: int, quick: bool) -> KvmeshConfig:
    return KvmeshConfig.from_dict({
        "model": {"path": model, **({"dtype": "fp32"} if quick else {})},
        "cache": {"num_blocks": 1024 if not quick else 256},
        "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 512, "max_queue_time_s": 3600},
        "lora": {"max_loras": max_loras},
    })


def _drain(engine, requests: list[GenerateRequest]) -> tuple[float, int, int]:
    """Run the requests to the end: (output tok/s, output tokens, failed requests)."""
    started = time.perf_counter()
    for r in requests:
        engine.add_request(r)
    tokens = failed = 0
    while engine.has_unfinished():
        for delta in engine.step():
            tokens += len(delta.token_ids)
            failed += delta.finished and delta.finish_reason != FinishReason.LENGTH
    return tokens / (time.perf_counter() - started), tokens, failed


def bench_throughput(model: str | None, quick: bool, rounds: int) -> ThroughputFigures:
    from kvmesh.worker.engine_api import Engine

    engine = Engine.from_config(_engine_config(model, 4, quick))
    num, prompt_len, new_tokens = (16, 16, 8) if quick else (64, 64, 64)
    root = tempfile.mkdtemp(prefix="kvmesh-lora-bench-")
    paths = write_random_adapters(engine.parts.hf_config, root, 8, rank=16)
    refs = [AdapterRef(name, path) for name, path in paths.items()]
    prompts = _prompts(num, prompt_len, engine.parts.hf_config.vocab_size, seed=1)
    sampling = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    base_tok_s, adapter_tok_s, failed = [], [], 0
    for r in range(rounds):
        for with_adapters in (False, True):  # ABAB
            batch = [GenerateRequest(f"r{r}-{with_adapters}-{i}", prompt_token_ids=p, sampling=sampling,
                                     adapter=refs[i % len(refs)] if with_adapters else None)
                     for i, p in enumerate(prompts)]
            tok_s, _, bad = _drain(engine, batch)
            (adapter_tok_s if with_adapters else base_tok_s).append(tok_s)
            failed += bad
    return ThroughputFigures(base_tok_s, adapter_tok_s, statistics.mean(adapter_tok_s) / statistics.mean(base_tok_s),
                             failed, engine.runner.lora_slots.num_loads,
                             engine.runner.eager_step_reasons["lora_rows"])


def _cluster_loads(config: KvmeshConfig, app_name: str, requests: list[tuple[tuple[int, ...], str]],
                   max_tokens: int, concurrency: int) -> tuple[int, int]:
    """Serve `requests` (prompt, adapter) on a fresh app; (adapter loads over the workers, failures)."""
    import grpc

    from kvmesh.router.launch import start_serving, stop_serving
    from kvmesh.proto import kvmesh_pb2 as pb
    from kvmesh.proto import kvmesh_pb2_grpc

    start_serving(config, app_name)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{config.router.grpc_port}")
        stub = kvmesh_pb2_grpc.KvmeshStub(channel)
        sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

        def one(item) -> bool:
            prompt, adapter = item
            request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), sampling=sampling, adapter=adapter)
            try:
                return any(m.finished for m in stub.Generate(request, timeout=600))
            except grpc.RpcError:
                return False

        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            ok = list(pool.map(one, requests))
        stats = stub.GetStats(pb.GetStatsRequest(), timeout=30)
        channel.close()
        return sum(w.num_adapter_loads for w in stats.workers), ok.count(False)
    finally:
        stop_serving(config, app_name)


def bench_routing(model: str | None, quick: bool) -> RoutingFigures:
    import ray
    from transformers import AutoConfig

    from kvmesh.load_tests.grpc_target import free_port
    from kvmesh.worker.engine_api import ensure_hf_dir

    hf_dir = model or str(ensure_hf_dir(ModelConfig()).hf_dir)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    root = tempfile.mkdtemp(prefix="kvmesh-lora-campaign-")
    paths = write_random_adapters(hf_config, root, 8, rank=16)
    num = 48 if quick else 160
    choices = zipf_adapter_choices(num, len(paths), s=1.1, seed=0)
    names = list(paths)
    requests = [(p, names[c]) for p, c in zip(_prompts(num, 32, hf_config.vocab_size, seed=2), choices)]
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # num_cpus=4 as the e2e clusters: the router, its proxy and 2 workers ask for fractions of a core
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    loads, failed = {}, {}
    try:
        for policy in ("prefix_aware", "round_robin"):
            config = KvmeshConfig.from_dict({
                "model": {"path": model, **({"dtype": "fp32"} if quick else {})},
                "cache": {"num_blocks": 512},
                "scheduler": {"max_num_seqs": 16, "max_queue_time_s": 600},
                "parallel": {"num_workers": 2, "device": "cpu", "worker_num_cpus": 0.5},
                "router": {"host": "127.0.0.1", "grpc_port": free_port(), "http_port": free_port(),
                           "policy": policy, "stats_refresh_s": 0.1},
                "lora": {"max_loras": 4, "adapters": [{"name": n, "path": p} for n, p in paths.items()]},
            })
            loads[policy], failed[policy] = _cluster_loads(config, f"kvmesh-lora-{policy}", requests,
                                                           max_tokens=4 if quick else 8, concurrency=8)
    finally:
        ray.shutdown()
    aware, rr = loads["prefix_aware"], loads["round_robin"]
    return RoutingFigures(num, aware, rr, aware / rr if rr else float("inf"), failed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF model folder (default: the embedded SmolLM2)")
    parser.add_argument("--part", choices=("all", "throughput", "routing"), default="all")
    parser.add_argument("--rounds", type=int, default=2, help="ABAB rounds of the throughput part")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="small sizes, fp32 (tests)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = {}
    if args.part in ("all", "throughput"):
        t = bench_throughput(args.model, args.quick, args.rounds)
        report["throughput"] = asdict(t)
        print(f"throughput: 64 requests over 8 adapters (4 slots) at {t.ratio:.2f}x the base model's tok/s "
              f"(target >= 0.7), {t.failed_requests} failed", flush=True)
    if args.part in ("all", "routing"):
        r = bench_routing(args.model, args.quick)
        report["routing"] = asdict(r)
        print(f"routing: adapter-aware {r.adapter_aware_loads} adapter loads vs round robin {r.round_robin_loads} "
              f"= {r.ratio:.2f}x (target <= 0.5), failed {r.failed_requests}", flush=True)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
