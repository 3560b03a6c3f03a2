"""Prefix transfer between workers against recompute, in ONE run over real Ray (ratios, not absolutes).

    python -m kvmesh.load_tests.bench_kv_transfer                       # SmolLM2, 1,000-token prefixes
    python -m kvmesh.load_tests.bench_kv_transfer --model DIR --quick   # seconds, any small model

Two worker actors (host tier on, cache.kv_transfer=auto: the cost model decides). The holder
computes `families` prefixes of `prefix_tokens` tokens, then is kept saturated by long decode
requests. Each family then gets one request on the other worker, as the router sends a
request away from a saturated holder: alternately with the transfer hint (kv_source = the
holder, so the worker may pull the prefix) and without (it recomputes). Every family is used
once, so neither side finds the prefix locally. TTFT = request sent -> first token back at
this driver; both arms share the machine's noise (the holder's decode load included).
"""

from __future__ import annotations

# Function-level imports: Ray, Prometheus' parser and the worker load only once a run starts.

import argparse
import asyncio
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import GenerateRequest, SamplingParams
from kvmesh.load_tests.bench_engine import cpu_flags, percentile
from kvmesh.load_tests.worker_metrics import read_worker_metrics
from kvmesh.load_tests.bench_kv_tier import print_report

APP_NAME = "kvmesh-bench-transfer"


@dataclass(frozen=True)
class TransferBenchSpec:
    families: int = 8  # half measured with the hint, half without
    prefix_tokens: int = 1000
    question_tokens: int = 8
    saturating_requests: int = 4  # long decodes kept on the holder
    saturating_tokens: int = 2000  # 4 x 2,000 fit the holder's KV budget with room to spare
    block_size: int = 16
    # Sized for a shared 24 GiB machine where Ray's memory monitor kills workers at 95% use
    # (SmolLM2 bf16: 22.5 KiB of KV per token, 22 MiB a family).
    dtype: str = "bf16"
    kv_cache_gib: float = 0.25
    host_tier_gib: float = 0.3  # the holder keeps in pool + tier every family (up to ~16)


@dataclass(frozen=True)
class TransferBenchReport:
    cpu_flags: list[str]
    model: str
    spec: dict
    ttft_p50_s_transfer: float
    ttft_p50_s_recompute: float
    ttft_p50_ratio: float  # recompute / transfer
    ttft_s_transfer: list[float]
    ttft_s_recompute: list[float]
    cached_tokens_transfer: list[int]  # per request: prompt tokens served from pulled blocks
    cached_tokens_recompute: list[int]
    transfer_blocks: float
    transfer_bytes: float
    transfer_s: float
    transfer_fallbacks: float
    holder_running_during: list[int]  # the holder's running requests at each measured request


def _config(model: str | None, spec: TransferBenchSpec) -> KvmeshConfig:
    return KvmeshConfig.from_dict({
        "model": {"dtype": spec.dtype, **({"path": model} if model else {})},
        "cache": {"block_size": spec.block_size, "cpu_kv_cache_gib": spec.kv_cache_gib,
                  "host_tier_gib": spec.host_tier_gib, "kv_transfer": "auto",
                  "swap_space_gib": 0.0},
        "scheduler": {"max_num_seqs": 16, "max_new_tokens": spec.saturating_tokens,
                      "max_num_batched_tokens": 2048, "max_prefill_tokens_per_step": 2048,
                      "max_queue_time_s": 3600},
        "parallel": {"num_workers": 2, "device": "cpu", "worker_num_cpus": 1},
    })


async def _first_token(handle, request: GenerateRequest) -> tuple[float, int]:
    """(TTFT seconds, cached prompt tokens) of one request, consumed to its end."""
    started = time.perf_counter()
    ttft, usage = None, None
    async for ref in handle.generate.options(num_returns="streaming").remote(request):
        for delta in await ref:
            if delta.token_ids and ttft is None:
                ttft = time.perf_counter() - started
            if delta.finished:
                if delta.error:
                    raise RuntimeError(f"{request.request_id}: {delta.error}")
                usage = delta.usage
    return ttft, usage.cached_tokens


async def _measure(model: str | None, spec: TransferBenchSpec, holder, other, holder_name: str,
                   vocab: int) -> TransferBenchReport:
    import ray

    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prefixes = [[random.Random(f).randrange(100, vocab) for _ in range(spec.prefix_tokens)]
                for f in range(spec.families)]
    rng = random.Random(99)

    def question() -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(spec.question_tokens)]

    for f, prefix in enumerate(prefixes):  # the holder computes every family
        await _first_token(holder, GenerateRequest(f"warm-{f}", prompt_token_ids=tuple(prefix + question()),
                                                   sampling=greedy))
    saturating = [asyncio.ensure_future(_first_token(holder, GenerateRequest(
        f"load-{i}", prompt_token_ids=tuple(question()),
        sampling=SamplingParams(max_tokens=spec.saturating_tokens, temperature=0.0, ignore_eos=True))))
        for i in range(spec.saturating_requests)]
    await asyncio.sleep(1.0)
    ttft = {True: [], False: []}
    cached = {True: [], False: []}
    running = []
    for f, prefix in enumerate(prefixes):
        with_hint = f % 2 == 0
        request = GenerateRequest(f"measured-{f}", prompt_token_ids=tuple(prefix + question()), sampling=greedy,
                                  kv_source=holder_name if with_hint else None)
        running.append(ray.get(holder.stats.remote()).num_running)
        t, c = await _first_token(other, request)
        ttft[with_hint].append(t)
        cached[with_hint].append(c)
    for task in saturating:
        task.cancel()
    p50_transfer, p50_recompute = percentile(ttft[True], 50), percentile(ttft[False], 50)
    metrics = read_worker_metrics(other)
    return TransferBenchReport(
        cpu_flags(), model or "embedded SmolLM2", asdict(spec), p50_transfer, p50_recompute,
        p50_recompute / p50_transfer, ttft[True], ttft[False], cached[True], cached[False],
        metrics.total("kvmesh_kv_transfer_blocks_total"),
        metrics.total("kvmesh_kv_tier_bytes_total", direction="transfer_in"),
        metrics.total("kvmesh_kv_tier_copy_seconds_total", kind="transfer"),
        metrics.total("kvmesh_kv_transfer_fallbacks_total"), running)


def run(model: str | None, spec: TransferBenchSpec) -> TransferBenchReport:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from kvmesh.worker.engine_api import kill_workers, resolve_model, start_workers

    config = _config(model, spec)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        holder, other = start_workers(config, APP_NAME)
        infos = ray.get([holder.info.remote(), other.info.remote()], timeout=600)
        vocab = int(resolve_model(config).hf_config.vocab_size)
        return asyncio.run(_measure(model, spec, holder, other, infos[0].actor_name, vocab))
    finally:
        kill_workers(config, APP_NAME)
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    parser.add_argument("--quick", action="store_true", help="4 families of 64 tokens (smoke run)")
    parser.add_argument("--families", type=int, default=None, help="measured requests (half of them pulled)")
    parser.add_argument("--out", default=None, help="also write the JSON report here")
    args = parser.parse_args(argv)
    spec = (TransferBenchSpec(families=4, prefix_tokens=64, saturating_requests=2, saturating_tokens=200,
                              kv_cache_gib=0.01, host_tier_gib=0.01) if args.quick else TransferBenchSpec())
    if args.families is not None:
        spec = TransferBenchSpec(**{**asdict(spec), "families": args.families})
    print_report(run(args.model, spec), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
