"""The embedded GGUF by mode: decode speed of the CPU step's paths, llama.cpp on the same file,
and resident memory dequantized (quant.weight none) against kept (quant.weight gguf, the default here).
The issue's ratio lines, batch 1 on 2 threads, as one paired run:

    python -m kvmesh.load_tests.bench_gguf --skip-memory --batch 1 --threads 2 \
        --modes default,native-int4x,native-int4 --llama-python /path/to/venv/bin/python

    python -m kvmesh.load_tests.bench_gguf [--rounds 4] [--tokens 48] [--batch 1,8]
        [--threads 2] [--llama-python /path/to/venv/bin/python] [--skip-memory]

Speed: every mode's engine lives in one process and they decode in alternating rounds (the
order reversed every other round), so the shared box's drift hits all alike; it prints
tokens/s per mode and batch (medians of rounds) and each mode's ratio to eager fp32 and to
llama.cpp. The modes (the model in fp32, as `kvmesh serve` picks on a CPU without bf16):

    eager-fp32    quant.weight none, the eager forward (model.cpu_native_max_tokens 0)
    default       every setting its default (quant.weight auto): on CPUs without bf16 the file's
                  Q4_1 kept and the native step's exact int4 (native-int4x); on CPUs with bf16
                  (model.dtype auto -> bf16) the file dequantized to bf16, the native bf16 step
    native-fp32   quant.weight none (the file dequantized to fp32), the native step (fp32
                  GEMVs, token-exact: HF's tokens)
    native-int8   quant.weight int8 (per-row int8), the native step (auto)
    native-int4bf quant.weight gguf in a bf16 model on a CPU with VDPBF16PS (model.dtype auto there):
                  each 4-row group of int4 codes dequantized to the bf16 values of the default's
                  weights, VDPBF16PS products (int4_avx512_bf16: the default's logits bit for bit, the
                  LM head read as its Q8_0 groups alike)
    native-int4x  quant.weight gguf (the file's Q4_1 kept), the native step (auto), int4 layers
                  exact (quant.int4_activations fp32: greedy tokens those of the dequantized model),
                  each group's code x input sum times its scale (the factorised form, the default
                  on CPUs without VDPBF16PS; on a bf16 one, the int4_bf16 form turned off)
    native-int4b  the same with each weight dequantized bit for bit as eager's (the other form)
    native-int4   the same with int8 activations (quant.int4_activations int8, llama.cpp's scheme),
                  the codes in 8-row panels (int4_panels.c, the default for int8 activations)
    native-int4r  the same one row at a time over the plain codes (NativeDecoder.int4_interleaved off)
    llama.cpp     llama-cpp-python's Llama on the same .gguf, batch 1 only, in a child process
                  run by --llama-python (an interpreter with llama_cpp installed), 2 threads

Memory: each of none / gguf loads in a fresh child process (`--load-only MODE`), which reports
its RSS after the imports, after the engine is up, and the engine's weight / KV pool bytes, so
RSS growth can be held against what the engine says it holds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import GenerateRequest, SamplingParams
from kvmesh.worker.engine_api import Engine, embedded_gguf_path

MODES = ("none", "gguf")  # memory: dequantized against kept
# name: (quant.weight, model.cpu_native_max_tokens, quant.int4_activations)
SPEED_MODES = {"eager-fp32": ("none", 0, "fp32"), "default": ("auto", None, "fp32"),
               "native-int4bf": ("gguf", None, "fp32"),
               "native-fp32": ("none", None, "fp32"), "native-int8": ("int8", None, "fp32"),
               "native-int4x": ("gguf", None, "fp32"), "native-int4b": ("gguf", None, "fp32"),
               "native-int4": ("gguf", None, "int8"), "native-int4r": ("gguf", None, "int8")}
BIT_EXACT_MODES = ("native-int4b",)  # the exact int4 layers' bit-exact form (NativeDecoder.int4_factored off)
ROW_MODES = ("native-int4r",)
# int4 layers with fp32 activations in a bf16 model too (NativeDecoder.int4_bf16 off)
FP32_ACTIVATION_MODES = ("native-int4x", "native-int4b")  # int8 activations one row at a time (NativeDecoder.int4_interleaved off)
PROMPT_TOKENS = 32


def _config(mode: str, kv_gib: float = 0.25, native: int | None = None, threads: int | None = None,
            int4_activations: str = "fp32") -> KvmeshConfig:
    return KvmeshConfig.from_dict({"quant": {"weight": mode, "int4_activations": int4_activations},
                                   "cache": {"cpu_kv_cache_gib": kv_gib},
                                   "model": {"cpu_native_max_tokens": native},
                                   "parallel": {"device": "cpu", "cpu_threads": threads}})


def _decode_tok_s(engine: Engine, batch: int, tokens: int, tag: str) -> float:
    """Decode tokens / s of `batch` requests (32-token prompts), timed from their first token."""
    for i in range(batch):
        engine.add_request(GenerateRequest(f"{tag}-{i}", prompt_token_ids=tuple(range(10 + i, 10 + PROMPT_TOKENS + i)),
                                           sampling=SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0)))
    produced, start = 0, None
    while engine.has_unfinished():
        deltas = engine.step()
        n = sum(len(d.token_ids) for d in deltas)
        if start is None and n:
            start, n = time.perf_counter(), 0  # prefill's step: the clock starts after it
        produced += n
    return produced / (time.perf_counter() - start)


# The child that runs llama.cpp: one Llama on the file, then one line of tok/s per line read.
_LLAMA_CHILD = """
import sys, time
from llama_cpp import Llama
path, threads = sys.argv[1], int(sys.argv[2])
llm = Llama(model_path=path, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
for i, line in enumerate(sys.stdin):
    tokens = int(line)
    prompt = list(range(10 + i % 8, 10 + i % 8 + PROMPT_TOKENS))
    gen = llm.generate(prompt, temp=0.0, reset=True)
    next(gen)
    start, n = time.perf_counter(), 0
    for _ in gen:
        n += 1
        if n == tokens:
            break
    print(n / (time.perf_counter() - start), flush=True)
""".replace("PROMPT_TOKENS", str(PROMPT_TOKENS))


class LlamaCpp:
    """llama.cpp's decode of the same file in a child interpreter (batch 1, greedy)."""

    def __init__(self, python: str, path: str, threads: int):
        self.proc = subprocess.Popen([python, "-c", _LLAMA_CHILD, path, str(threads)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def decode_tok_s(self, tokens: int) -> float:
        self.proc.stdin.write(f"{tokens}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the llama.cpp child exited")
        return float(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def bench_speed(rounds: int, tokens: int, batches: list[int], llama_python: str | None, threads: int,
                modes: list[str]) -> None:
    engines = {name: Engine.from_config(_config(weight, native=native, threads=threads, int4_activations=acts))
               for name, (weight, native, acts) in SPEED_MODES.items() if name in modes}
    for name, engine in engines.items():
        decoder = engine.runner.native_decoder
        if name in FP32_ACTIVATION_MODES and decoder is not None and decoder.int4_bf16:
            decoder.int4_bf16 = False
        if name in BIT_EXACT_MODES:
            engine.runner.native_decoder.int4_factored = False
        if name in ROW_MODES:
            engine.runner.native_decoder.int4_interleaved = False
        print(f"{name}: CPU step {engine.runner.cpu_step.describe()}")
    runners = {name: (lambda b, t, tag, e=e: _decode_tok_s(e, b, t, tag)) for name, e in engines.items()}
    llama = None
    if llama_python:
        llama = LlamaCpp(llama_python, str(embedded_gguf_path()), threads)
        runners["llama.cpp"] = lambda b, t, tag: llama.decode_tok_s(t) if b == 1 else None
    rates: dict[tuple[str, int], list[float]] = {}
    try:
        for r in range(rounds):
            for batch in batches:
                order = list(runners) if r % 2 == 0 else list(runners)[::-1]
                for name in order:
                    rate = runners[name](batch, tokens, f"{name}-{r}-{batch}")
                    if rate is not None:
                        rates.setdefault((name, batch), []).append(rate)
    finally:
        if llama is not None:
            llama.close()
    print(f"\n{threads} threads, {rounds} rounds of {tokens} tokens, median tok/s (alternating)")
    print("mode          batch   tok/s   / eager-fp32   / llama.cpp (batch 1)   rounds")
    med = {key: sorted(v)[len(v) // 2] for key, v in rates.items()}
    for batch in batches:
        for name in runners:
            if (name, batch) not in med:
                continue
            base, ref = med.get(("eager-fp32", batch)), med.get(("llama.cpp", 1))
            vs_eager = f"{med[(name, batch)] / base:10.2f}" if base else "         -"
            vs_llama = f"{med[(name, batch)] / ref:8.2f}" if ref and batch == 1 else "       -"
            print(f"{name:12s} {batch:6d}  {med[(name, batch)]:6.1f}   {vs_eager}   "
                  f"{vs_llama}               {' '.join(f'{v:.1f}' for v in rates[(name, batch)])}")


def load_only(mode: str) -> None:
    import psutil

    proc = psutil.Process()
    rss_imports = proc.memory_info().rss
    engine = Engine.from_config(_config(mode))
    plan = engine.parts.plan
    decoder = engine.runner.native_decoder
    print(json.dumps({"mode": mode, "rss_after_imports": rss_imports, "rss_engine_up": proc.memory_info().rss,
                      "weight_bytes": plan.weight_bytes, "kv_pool_bytes": plan.kv_cache_bytes,
                      "head_copy_bytes": decoder.int8_head_bytes if decoder is not None else 0,
                      "swap_bytes": plan.num_swap_blocks * plan.block_size * plan.kv_bytes_per_token,
                      "planned": plan.device.split()}))


# the line: a worker's RSS at most its weights (the model's, and the native step's
# head copy) + its KV pool + 500 MB
RSS_ALLOWANCE_BYTES = 500 * 10 ** 6


def bench_memory() -> None:
    """Each mode in a fresh process. The swap space (cache.swap_space_gib) is allocated but not
    touched, so it is resident only as blocks are swapped out: its size is shown, not counted."""
    print("mode  RSS after imports  RSS engine up  weights  head copy  KV pool  rest = RSS - weights - KV  "
          "(swap space, not resident)  budget = weights + KV + 500 MB  RSS / budget (MiB)")
    for mode in MODES:
        out = subprocess.run([sys.executable, "-P", "-m", "kvmesh.load_tests.bench_gguf", "--load-only", mode],
                             check=True, capture_output=True, text=True).stdout
        m = json.loads(out.strip().splitlines()[-1])
        mib = 2 ** 20
        weights = m["weight_bytes"] + m["head_copy_bytes"]
        budget = weights + m["kv_pool_bytes"] + RSS_ALLOWANCE_BYTES
        print(f"{mode:5s} {m['rss_after_imports'] / mib:17.0f}  {m['rss_engine_up'] / mib:13.0f}  "
              f"{m['weight_bytes'] / mib:7.0f}  {m['head_copy_bytes'] / mib:9.0f}  {m['kv_pool_bytes'] / mib:7.0f}  "
              f"{(m['rss_engine_up'] - weights - m['kv_pool_bytes']) / mib:25.0f}  {m['swap_bytes'] / mib:26.0f}  "
              f"{budget / mib:30.0f}  {m['rss_engine_up'] / budget:12.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--load-only", choices=MODES, help="(child process) load one mode, print its memory")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--modes", default=",".join(SPEED_MODES), help="a subset of " + ", ".join(SPEED_MODES))
    parser.add_argument("--threads", type=int, default=2, help="engine threads (parallel.cpu_threads) and llama.cpp's")
    parser.add_argument("--llama-python", help="an interpreter with llama_cpp installed: llama.cpp on the same file")
    args = parser.parse_args()
    if args.load_only:
        load_only(args.load_only)
        return
    if not args.skip_memory:
        bench_memory()
    if not args.skip_speed:
        bench_speed(args.rounds, args.tokens, [int(b) for b in args.batch.split(",")], args.llama_python, args.threads,
                    args.modes.split(","))


if __name__ == "__main__":
    main()
