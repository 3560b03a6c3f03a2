"""The host KV tier against recompute, side by side in ONE process and run (ratios, not absolutes).

    python -m kvmesh.load_tests.bench_kv_tier                         # SmolLM2, 16 x 1,000-token prefixes
    python -m kvmesh.load_tests.bench_kv_tier --model DIR --quick     # seconds, any small model (tests)

Workload: `families` shared prefixes of `prefix_tokens` tokens each (random token ids, one
seed per family) and a device pool with room for `pool_families` of them (LRU). Each request
is a family prefix plus a short unique question; the families are visited round-robin, so
without the tier every visit finds its prefix evicted and recomputes it, with the tier it
copies it back from host memory. Two engines (tier off / tier on, same weights, same pool)
take the requests alternately, one at a time, so the machine's noise falls on both alike.
Round 0 warms both caches and is not measured; TTFT (request added -> first token out) is
measured over the remaining rounds.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import GenerateRequest, SamplingParams
from kvmesh.load_tests.bench_engine import cpu_flags, percentile
from kvmesh.worker.engine_api import Engine


@dataclass(frozen=True)
class TierBenchSpec:
    families: int = 16
    pool_families: int = 4  # device pool room, in family prefixes
    prefix_tokens: int = 1000
    question_tokens: int = 8
    max_tokens: int = 2
    rounds: int = 2  # measured rounds after the warm-up round
    block_size: int = 16
    dtype: str = "fp32"


@dataclass(frozen=True)
class TierBenchReport:
    cpu_flags: list[str]
    torch_threads: int
    model: str
    spec: dict
    num_pool_blocks: int
    num_tier_blocks: int
    ttft_p50_s_recompute: float
    ttft_p50_s_tier: float
    ttft_p50_ratio: float  # recompute / tier: how many times lower TTFT is with the tier
    ttft_mean_s_recompute: float
    ttft_mean_s_tier: float
    tier_hit_tokens: int  # prompt tokens copied back instead of recomputed (measured rounds included)
    tier_bytes_loaded: int
    tier_bytes_stored: int
    tier_load_s: float
    tier_store_s: float
    tier_load_gib_per_s: float
    outputs_equal: bool  # greedy tokens of every request equal with and without the tier


def _engine(model: str | None, spec: TierBenchSpec, num_blocks: int, num_tier_blocks: int) -> Engine:
    return Engine.from_config(KvmeshConfig.from_dict({
        "model": {"dtype": spec.dtype, **({"path": model} if model else {})},
        "cache": {"block_size": spec.block_size, "num_blocks": num_blocks, "swap_space_gib": 0.0,
                  "host_tier_num_blocks": num_tier_blocks},
        "scheduler": {"max_num_batched_tokens": 2048, "max_prefill_tokens_per_step": 2048,
                      "max_queue_time_s": 3600},
        "parallel": {"device": "cpu"},
    }))


def _ttft(engine: Engine, request_id: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    started = time.perf_counter()
    engine.add_request(GenerateRequest(request_id, prompt_token_ids=prompt,
                                       sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)))
    first, tokens = None, []
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.token_ids and first is None:
                first = time.perf_counter() - started
            tokens.extend(delta.token_ids)
    return first, tokens


def run(model: str | None, spec: TierBenchSpec) -> TierBenchReport:
    per_request = spec.prefix_tokens + spec.question_tokens + spec.max_tokens
    blocks_per_family = -(-per_request // spec.block_size)
    num_blocks = spec.pool_families * blocks_per_family
    num_tier = (spec.families + 1) * blocks_per_family
    plain, tiered = _engine(model, spec, num_blocks, 0), _engine(model, spec, num_blocks, num_tier)
    vocab = int(plain.parts.hf_config.vocab_size)
    prefixes = [[random.Random(f).randrange(100, vocab) for _ in range(spec.prefix_tokens)]
                for f in range(spec.families)]
    rng = random.Random(1234)
    ttft = {"plain": [], "tier": []}
    equal = True
    for round_index in range(spec.rounds + 1):
        for family, prefix in enumerate(prefixes):
            prompt = prefix + [rng.randrange(100, vocab) for _ in range(spec.question_tokens)]
            rid = f"r{round_index}-f{family}"
            t_plain, out_plain = _ttft(plain, rid, prompt, spec.max_tokens)
            t_tier, out_tier = _ttft(tiered, rid, prompt, spec.max_tokens)
            equal &= out_plain == out_tier
            if round_index:
                ttft["plain"].append(t_plain)
                ttft["tier"].append(t_tier)
    tier_stats = tiered.scheduler.kv.host_tier.stats()
    store = tiered.parts.host_tier_store
    p50_plain, p50_tier = percentile(ttft["plain"], 50), percentile(ttft["tier"], 50)
    return TierBenchReport(
        cpu_flags(), torch.get_num_threads(), model or "embedded SmolLM2", asdict(spec), num_blocks, num_tier,
        p50_plain, p50_tier, p50_plain / p50_tier, statistics.mean(ttft["plain"]), statistics.mean(ttft["tier"]),
        tier_stats.num_hit_tokens, store.num_bytes_loaded, store.num_bytes_stored, store.load_time_s,
        store.store_time_s, store.num_bytes_loaded / max(store.load_time_s, 1e-9) / 2**30, equal)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="4 families of 64 tokens, room for 1 (smoke run)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--out", default=None, help="also write the JSON report here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = TierBenchSpec(families=4, pool_families=1, prefix_tokens=64, rounds=1) if args.quick else TierBenchSpec()
    if args.rounds is not None:
        spec = TierBenchSpec(**{**asdict(spec), "rounds": args.rounds})
    print_report(run(args.model, spec), args.out)
    return 0


def print_report(report, out: str | None) -> None:
    """A benchmark's report dataclass as JSON on stdout, and in `out` when given."""
    text = json.dumps(asdict(report), indent=2)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
