"""The embedded GGUF served dequantized (quant.weight none, the default) against kept in its
own quantization (quant.weight gguf): decode speed A/B and resident memory by mode.

    python -m kvmesh.load_tests.bench_gguf [--rounds 4] [--tokens 48] [--batch 1,8]

Speed: both engines live in one process and decode in alternating rounds (A B A B ...), so
the shared box's drift hits both alike; it prints tokens/s per mode and batch and the ratio
gguf / none. Memory: each mode loads in a fresh child process (`--load-only MODE`), which
reports its RSS after the imports, after the engine is up, and the engine's weight / KV
pool bytes, so RSS growth can be held against what the engine says it holds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import GenerateRequest, SamplingParams
from kvmesh.worker.engine_api import Engine

MODES = ("none", "gguf")


def _config(mode: str, kv_gib: float = 0.25) -> KvmeshConfig:
    return KvmeshConfig.from_dict({"quant": {"weight": mode}, "cache": {"cpu_kv_cache_gib": kv_gib},
                                   "parallel": {"device": "cpu"}})


def _decode_tok_s(engine: Engine, batch: int, tokens: int, tag: str) -> float:
    """Decode tokens / s of `batch` requests (32-token prompts), timed from their first token."""
    for i in range(batch):
        engine.add_request(GenerateRequest(f"{tag}-{i}", prompt_token_ids=tuple(range(10 + i, 42 + i)),
                                           sampling=SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0)))
    produced, start = 0, None
    while engine.has_unfinished():
        deltas = engine.step()
        n = sum(len(d.token_ids) for d in deltas)
        if start is None and n:
            start, n = time.perf_counter(), 0  # prefill's step: the clock starts after it
        produced += n
    return produced / (time.perf_counter() - start)


def bench_speed(rounds: int, tokens: int, batches: list[int]) -> None:
    engines = {mode: Engine.from_config(_config(mode)) for mode in MODES}
    rates: dict[tuple[str, int], list[float]] = {}
    for r in range(rounds):
        for batch in batches:
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                rate = _decode_tok_s(engines[mode], batch, tokens, f"{mode}-{r}-{batch}")
                rates.setdefault((mode, batch), []).append(rate)
    print("batch  none tok/s  gguf tok/s  gguf/none (median of rounds, alternating A/B)")
    for batch in batches:
        med = {m: sorted(rates[(m, batch)])[len(rates[(m, batch)]) // 2] for m in MODES}
        print(f"{batch:5d}  {med['none']:10.1f}  {med['gguf']:10.1f}  {med['gguf'] / med['none']:9.2f}")


def load_only(mode: str) -> None:
    import psutil

    proc = psutil.Process()
    rss_imports = proc.memory_info().rss
    engine = Engine.from_config(_config(mode))
    plan = engine.parts.plan
    print(json.dumps({"mode": mode, "rss_after_imports": rss_imports, "rss_engine_up": proc.memory_info().rss,
                      "weight_bytes": plan.weight_bytes, "kv_pool_bytes": plan.kv_cache_bytes,
                      "swap_bytes": plan.num_swap_blocks * plan.block_size * plan.kv_bytes_per_token,
                      "planned": plan.device.split()}))


def bench_memory() -> None:
    print("mode  RSS after imports  RSS engine up  growth  weights  KV pool  swap  rest = growth - the three (MiB)")
    for mode in MODES:
        out = subprocess.run([sys.executable, "-P", "-m", "kvmesh.load_tests.bench_gguf", "--load-only", mode],
                             check=True, capture_output=True, text=True).stdout
        m = json.loads(out.strip().splitlines()[-1])
        mib = 2 ** 20
        growth = m["rss_engine_up"] - m["rss_after_imports"]
        print(f"{mode:5s} {m['rss_after_imports'] / mib:17.0f}  {m['rss_engine_up'] / mib:13.0f}  "
              f"{growth / mib:6.0f}  {m['weight_bytes'] / mib:7.0f}  {m['kv_pool_bytes'] / mib:7.0f}  "
              f"{m['swap_bytes'] / mib:4.0f}  {(growth - m['weight_bytes'] - m['kv_pool_bytes'] - m['swap_bytes']) / mib:6.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--load-only", choices=MODES, help="(child process) load one mode, print its memory")
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args()
    if args.load_only:
        load_only(args.load_only)
        return
    bench_memory()
    if not args.skip_speed:
        bench_speed(args.rounds, args.tokens, [int(b) for b in args.batch.split(",")])


if __name__ == "__main__":
    main()
