"""Engine speed on CPU, side by side in ONE process and run: kvmesh per dtype / quant mode,
HF transformers static batches of 8, and llama.cpp's `llama-server` when a binary is given.

    python -m kvmesh.load_tests.bench_engine                       # the full comparison
    python -m kvmesh.load_tests.bench_engine --llama-server PATH   # + llama.cpp on the GGUF
    python -m kvmesh.load_tests.bench_engine --quick --model DIR   # seconds, tiny model (tests)
    python -m kvmesh.load_tests.bench_engine --ab bf16-grouped,bf16 --rounds 3   # interleaved A/B
    python -m kvmesh.load_tests.bench_engine --ab bf16-int8-eager,bf16-int8 --big-batch 8

Figures per kvmesh mode:
  * the seed-shaped run: 64 requests, the articles' length shape x0.25 (load_tests/workloads.py
    synthetic kind, seed 0), all at t=0, exact output lengths (ignore_eos), greedy:
    output tok/s and E2E P50 / P99;
  * decode tok/s at batch 1 (40-token prompt, 72 new tokens) and batch 64 (64 such requests),
    the median step over the steady decode steps;
  * the fraction of this process's measured GEMM rate ([64 x H] x [H x I], in the engine's
    dtype, the better of F.linear and a prepacked bf16 weight, sampled between the batch-64
    steps) that the batch-64 step reaches: linear FLOPs of a step / step time / GEMM rate;
    and, on a line of its own, the same against F.linear alone (the issue table's reference);
  * the same step against its memory floor: the bytes it must read (every weight, and the K/V
    its rows attend over) at this process's measured read bandwidth, as a share of the step;
  * bf16 only: greedy agreement with HF transformers in bf16 over a fixed prompt set (tokens
    equal up to the first divergence, over all generated tokens).
The served stack against this engine is load_tests/bench_served.py (the same config on both
sides, alternating).
The machine is shared and noisy: compare figures within one run (ratios), not across runs.
--ab A,B builds both modes' engines in one process and alternates them, round by round, on
the batch-1 and batch-64 decode figures only (the fairest A/B such a machine allows).
"""

from __future__ import annotations

# Function-level imports: torch, transformers and the engine load only for the modes a run
# measures, so `--help` and the --quick smoke run start fast.

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from kvmesh.core.config import KvmeshConfig
from kvmesh.load_tests.corpus import TokenCorpus
from kvmesh.load_tests.workloads import WorkloadRequest, WorkloadSpec, generate_workload
from kvmesh.core.seams import GenerateRequest, SamplingParams
from kvmesh.worker.engine_api import Engine

# (name, model.dtype, quant.weight); int8/int4 run their packed CPU kernels on bf16 activations
FULL_MODES = [("fp32", "fp32", "none"), ("bf16", "bf16", "none"), ("bf16-unpacked", "bf16", "none"),
              ("bf16-int8", "bf16", "int8"), ("bf16-int4", "bf16", "int4"), ("bf16-ngram", "bf16", "none")]
# Config beyond dtype / quant for a mode: bf16-unpacked is bf16 with plain F.linear weights,
# the in-run A/B of the oneDNN prepacking (worker/kernels/packed_weights.py).
# The eager-path A/Bs (prepacking, the attention kernel, inductor) switch the native small steps
# off, or batch 1 would not reach the path they compare.
MODE_OVERRIDES = {"bf16-unpacked": {"model": {"cpu_prepack_weights": False, "cpu_native_max_tokens": 0}},
                  "bf16-grouped": {"model": {"cpu_decode_kernel": False, "cpu_native_max_tokens": 0}},
                  "bf16-compiled": {"model": {"compile": "decode", "cpu_native_max_tokens": 0}},
                  "bf16-int4-compiled": {"model": {"compile": "decode", "cpu_native_max_tokens": 0}},
                  "bf16-eager": {"model": {"cpu_native_max_tokens": 0}},
                  "bf16-int8-eager": {"model": {"cpu_native_max_tokens": 0}},
                  "fp32-native": {"model": {"cpu_native_max_tokens": 16}},
                  # n-gram speculation (speculative.method ngram; README, the paragraph on speculative decoding): greedy
                  # outputs identical to bf16's; it pays where the batch is small, the long tail
                  "bf16-ngram": {"speculative": {"method": "ngram"}}}
# Only on request (--modes): the inductor-compiled decoder (model.compile decode, compiled at
# engine start: a minute or more on 2 cores), the in-run A/B against bf16 / bf16-int4;
# bf16-grouped: bf16 with decode attention on the gather + SDPA path instead of the paged C
# kernel (worker/kernels/cpu_paged_attention.py), the in-run A/B of that kernel; *-eager: the
# 16-bit modes without their default native small steps (worker/kernels/cpu_native_step.py),
# fp32-native: fp32 with them (steps of <= 16 tokens).
OPTIONAL_MODES = [("bf16-compiled", "bf16", "none"), ("bf16-int4-compiled", "bf16", "int4"),
                  ("bf16-grouped", "bf16", "none"), ("bf16-eager", "bf16", "none"),
                  ("bf16-int8-eager", "bf16", "int8"), ("fp32-native", "fp32", "none")]
QUICK_MODES = [("fp32", "fp32", "none"), ("bf16-int8", "bf16", "int8")]
AGREEMENT_PROMPTS = [  # fixed, mixed lengths and kinds; 32 greedy tokens each
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a young girl who loved to read books about dragons,",
    "List three primary colors:",
    "<|im_start|>user\nWhat is the boiling point of water at sea level?<|im_end|>\n<|im_start|>assistant\n",
    "Photosynthesis is the process by which green plants use sunlight to synthesize foods from",
    "1, 2, 3, 4, 5,",
    "Translate to French: 'Good morning, how are you today?'",
]


@dataclass
class EngineRunFigures:
    output_tok_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    wall_s: float
    output_tokens: int


@dataclass
class ModeFigures:
    mode: str
    dtype: str
    quant: str
    seed_run: EngineRunFigures
    batch1_decode_tok_s: float
    batch64_decode_tok_s: float
    batch64_step_ms: float
    gemm_gflop_s: float  # this process's [64 x H] x [H x I] rate in the engine dtype
    batch64_gflop_s: float  # linear FLOPs of one batch-64 decode step / its time
    gemm_fraction: float
    # The batch-64 step against the memory it must read: weights + the KV it attends over,
    # at this process's measured read bandwidth (MemoryProbe). The GEMM rate above is a
    # cache-resident [64 x H] x [H x I]; a whole step streams every weight from memory.
    batch64_read_mb: float = 0.0
    read_gb_s: float = 0.0
    bandwidth_fraction: float = 0.0  # (read_mb / read_gb_s) / step time: 1.0 = at the memory floor
    hf_agreement: dict | None = None  # vs HF bf16
    hf_fp32_agreement: dict | None = None  # vs HF fp32
    # plain F.linear alone on the same shape, sampled with the GEMM rate above (which is the
    # better of it and a oneDNN-prepacked weight): the issue's own reference measurement
    plain_gemm_gflop_s: float = 0.0


@dataclass
class BenchReport:
    cpu_flags: list[str]
    torch_threads: int
    torch_version: str
    model: str
    modes: list[ModeFigures] = field(default_factory=list)
    hf_static: EngineRunFigures | None = None
    llama_server: EngineRunFigures | None = None
    llama_server_batch1_tok_s: float | None = None  # its own decode rate, one request alone


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def run_figures(finish_s: list[float], output_tokens: int, wall_s: float) -> EngineRunFigures:
    return EngineRunFigures(output_tokens / wall_s, percentile(finish_s, 50), percentile(finish_s, 99), wall_s,
                      output_tokens)


def cpu_flags() -> list[str]:
    want = {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile"}
    try:
        with open("/proc/cpuinfo") as f:
            return sorted(want & set(f.read().split()))
    except OSError:
        return [platform.processor()]


# ---- kvmesh --------------------------------------------------------------------------------


def engine_config(model: str | None, dtype: str, quant: str, threads: int, max_num_seqs: int = 64,
                  kv_gib: float = 1.0) -> KvmeshConfig:
    return KvmeshConfig.from_dict({
        "model": {"dtype": dtype, **({"path": model} if model else {})},
        "quant": {"weight": quant},
        "cache": {"block_size": 16, "cpu_kv_cache_gib": kv_gib},
        "scheduler": {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": 2048, "max_new_tokens": 4096,
                      "max_queue_time_s": 3600},
        "parallel": {"device": "cpu", "worker_num_cpus": threads},
    })


def run_engine_workload(engine: Engine, requests: list[WorkloadRequest]) -> EngineRunFigures:
    """Every request added at t=0; E2E of a request = when its final delta comes out."""
    t0 = time.perf_counter()
    for r in requests:
        engine.add_request(GenerateRequest(f"w{r.index}", prompt_token_ids=r.prompt_token_ids, sampling=SamplingParams(
            max_tokens=r.output_tokens, temperature=0, ignore_eos=True)))
    finish: list[float] = []
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.finished:
                finish.append(time.perf_counter() - t0)
    return run_figures(finish, sum(r.output_tokens for r in requests), time.perf_counter() - t0)


def decode_rate(engine: Engine, prompt_ids: tuple[int, ...], batch: int, new_tokens: int,
                between_steps: Callable[[], None] | None = None) -> tuple[float, float]:
    """(decode tok/s, median step ms) over the steps where every request decodes.
    between_steps runs after each step, outside the timing (the interleaved GEMM probe)."""
    for i in range(batch):
        engine.add_request(GenerateRequest(f"d{batch}-{i}", prompt_token_ids=prompt_ids, sampling=SamplingParams(
            max_tokens=new_tokens, temperature=0, ignore_eos=True)))
    steps = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
        if engine.scheduler.stats().num_running != batch:
            steps.pop()  # prefill and the tail are not steady decode steps
        elif between_steps is not None:
            between_steps()
    step = statistics.median(steps[1:] or steps)  # the first step after prefill warms caches
    return batch / step, step * 1e3


class GemmProbe:
    """[rows x hidden] x [hidden x inter] in dtype, the better of plain F.linear and (bf16 on
    CPU) a oneDNN-prepacked weight: the machine's GEMM rate, whichever way the engine calls it.
    Sampled between the batch-64 decode steps, so the step and its reference see the same
    load on a shared machine (measured minutes apart they differed by up to 3x)."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, rows: int = 64):
        from kvmesh.worker.kernels.packed_weights import PackedWeight

        self.flops = 2 * rows * hidden * inter
        x = torch.randn(rows, hidden).to(dtype)
        w = torch.randn(inter, hidden).to(dtype)
        packed = PackedWeight.pack(w)
        self.calls = [lambda: F.linear(x, w)] + ([lambda: packed.linear(x)] if packed is not None else [])
        for call in self.calls:
            call()  # first-call setup (oneDNN primitive creation) is not the rate
        self.samples: list[float] = []
        self.plain_samples: list[float] = []  # F.linear's own rate in each sample

    def sample(self, seconds: float = 0.02) -> float:
        rates = []
        for call in self.calls:
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds / len(self.calls) or n < 2:
                call()
                n += 1
            rates.append(self.flops * n / (time.perf_counter() - t0) / 1e9)
        self.plain_samples.append(rates[0])
        self.samples.append(max(rates))
        return self.samples[-1]

    def rate_gflop_s(self) -> float:
        return statistics.median(self.samples) if self.samples else self.sample(1.0)

    def plain_rate_gflop_s(self) -> float:
        """F.linear alone (the median of its samples): what the issue's table measured."""
        if not self.plain_samples:
            self.sample(1.0)
        return statistics.median(self.plain_samples)


class MemoryProbe:
    """This process's read bandwidth at the engine's thread count: the best of a few
    `sum()`s over a bf16 buffer far larger than the caches (what a decode step does to its
    weights: read once, nothing reused)."""

    def __init__(self, mib: int = 512):
        self.buffer = torch.ones(mib * 2**20 // 2, dtype=torch.bfloat16)
        self.buffer.sum()  # touch every page before timing

    def read_gb_s(self, rounds: int = 5) -> float:
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            self.buffer.sum()
            best = min(best, time.perf_counter() - t0)
        return self.buffer.nbytes / best / 1e9


def step_read_bytes(engine: Engine, batch: int, mean_context: float) -> float:
    """What one decode step of `batch` rows reads at least: every parameter once (the tied
    embedding counts once, as the LM head that reads it whole) and the K/V of each row's
    context in every layer (the engine's own KV bytes a token, kv/capacity.py)."""
    weights = sum(t.nbytes for t in engine.runner.model.parameters())
    weights += sum(t.nbytes for t in engine.runner.model.buffers() if t.dtype in (torch.int8, torch.uint8))
    return weights + batch * mean_context * engine.parts.plan.kv_bytes_per_token


def linear_flops_per_token(hf_config) -> int:
    """2 x the multiply-adds of every projection and the LM head for one token."""
    h, i = hf_config.hidden_size, hf_config.intermediate_size
    d = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * d, hf_config.num_key_value_heads * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    return 2 * (per_layer * hf_config.num_hidden_layers + h * hf_config.vocab_size)


def bench_mode(name: str, dtype: str, quant: str, model: str | None, threads: int,
               requests: list[WorkloadRequest], decode_prompt: tuple[int, ...], decode_tokens: int,
               big_batch: int, gemm_seconds: float, agreement: bool) -> ModeFigures:
    kv_gib = 1.0 if big_batch >= 64 else 0.05
    config = engine_config(model, dtype, quant, threads, max(64, big_batch), kv_gib)
    engine = Engine.from_config(config.replace(**MODE_OVERRIDES.get(name, {})))
    hf = engine.parts.hf_config
    torch_dtype = next(engine.runner.model.parameters()).dtype
    decode_rate(engine, decode_prompt, 1, 4)  # warm-up
    b1, _ = decode_rate(engine, decode_prompt, 1, decode_tokens)
    probe = GemmProbe(hf.hidden_size, hf.intermediate_size, torch_dtype)
    b64, step_ms = decode_rate(engine, decode_prompt, big_batch, decode_tokens,
                               between_steps=lambda: probe.sample(gemm_seconds))
    seed = run_engine_workload(engine, requests)
    gemm = probe.rate_gflop_s()
    step_gflop_s = linear_flops_per_token(hf) * big_batch / (step_ms / 1e3) / 1e9
    # the measured steps run from the prompt's end to its end + decode_tokens: mean context
    read_bytes = step_read_bytes(engine, big_batch, len(decode_prompt) + decode_tokens / 2)
    read_gb_s = MemoryProbe(64 if big_batch < 64 else 512).read_gb_s()
    floor_ms = read_bytes / (read_gb_s * 1e9) * 1e3
    agree = agree32 = None
    if agreement and name.startswith("bf16") and quant == "none":
        agree, agree32 = hf_agreement(engine, model), hf_agreement(engine, model, reference_dtype=torch.float32)
    return ModeFigures(name, dtype, quant, seed, b1, b64, step_ms, gemm, step_gflop_s, step_gflop_s / gemm,
                       read_bytes / 1e6, read_gb_s, floor_ms / step_ms, agree, agree32, probe.plain_rate_gflop_s())


@dataclass
class AbRound:
    mode: str
    batch1_decode_tok_s: float
    big_batch: int  # 64 unless --big-batch
    big_batch_decode_tok_s: float
    big_batch_step_ms: float
    gemm_fraction: float  # the big-batch step's linear FLOP rate / the GEMM rate sampled between its steps


def run_ab(modes: list[tuple[str, str, str]], model: str | None, threads: int, decode_prompt: tuple[int, ...],
           decode_tokens: int, big_batch: int, rounds: int, gemm_seconds: float) -> list[AbRound]:
    """The modes' engines side by side in this process, run alternately for `rounds` rounds:
    each round measures every mode's batch-1 and batch-`big_batch` decode, so load drifts on a
    shared machine hit both sides alike. KV pools sized to the decode runs (64 x 112 tokens of
    SmolLM2 take ~0.17 GiB), so several engines stay within a few GB of memory."""
    kv_gib = 0.3 if big_batch >= 64 else 0.05
    engines = []
    for name, dtype, quant in modes:
        config = engine_config(model, dtype, quant, threads, max(64, big_batch), kv_gib)
        engine = Engine.from_config(config.replace(**MODE_OVERRIDES.get(name, {})))
        decode_rate(engine, decode_prompt, 1, 4)  # warm-up
        engines.append((name, engine))
    hf = engines[0][1].parts.hf_config
    out = []
    for _ in range(rounds):
        for name, engine in engines:
            probe = GemmProbe(hf.hidden_size, hf.intermediate_size, next(engine.runner.model.parameters()).dtype)
            b1, _ = decode_rate(engine, decode_prompt, 1, decode_tokens)
            b64, step_ms = decode_rate(engine, decode_prompt, big_batch, decode_tokens,
                                       between_steps=lambda: probe.sample(gemm_seconds))
            step_gflop_s = linear_flops_per_token(hf) * big_batch / (step_ms / 1e3) / 1e9
            out.append(AbRound(name, b1, big_batch, b64, step_ms, step_gflop_s / probe.rate_gflop_s()))
            print(f"[ab] {json.dumps(asdict(out[-1]))}", file=sys.stderr, flush=True)
    return out


def format_ab(rounds: list[AbRound]) -> str:
    """Medians per mode and each mode's ratio to the first."""
    names = list(dict.fromkeys(r.mode for r in rounds))
    med = {n: {f: statistics.median(getattr(r, f) for r in rounds if r.mode == n)
               for f in ("batch1_decode_tok_s", "big_batch_decode_tok_s", "big_batch_step_ms", "gemm_fraction")}
           for n in names}
    base = med[names[0]]
    big = rounds[0].big_batch
    lines = [f"interleaved A/B, median of {len(rounds) // len(names)} rounds",
             f"| mode | batch-1 decode tok/s | batch-{big} decode tok/s | batch-{big} step ms | step / GEMM rate |",
             "|---|---|---|---|---|"]
    for n in names:
        m = med[n]
        lines.append(f"| {n} | {m['batch1_decode_tok_s']:.1f} ({m['batch1_decode_tok_s'] / base['batch1_decode_tok_s']:.2f}x)"
                     f" | {m['big_batch_decode_tok_s']:.1f} ({m['big_batch_decode_tok_s'] / base['big_batch_decode_tok_s']:.2f}x)"
                     f" | {m['big_batch_step_ms']:.1f} | {m['gemm_fraction']:.0%} |")
    return "\n".join(lines)


def hf_agreement(engine: Engine, model: str | None, new_tokens: int = 32,
                 reference_dtype: torch.dtype = torch.bfloat16) -> dict:
    """Greedy tokens of this (bf16) engine vs HF transformers in reference_dtype on
    AGREEMENT_PROMPTS. Against HF bf16 it measures how alike the two roundings are (bf16
    greedy decoding flips on near-ties, so kernels that round differently diverge); against
    HF fp32, how close the engine stays to the unrounded model."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(_hf_dir(model), dtype=reference_dtype).eval()
    agreeing = total = identical = 0
    for i, prompt in enumerate(AGREEMENT_PROMPTS):
        ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        with torch.inference_mode():
            want = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                pad_token_id=0)[0, len(ids):].tolist()
        engine.add_request(GenerateRequest(f"agree{i}", prompt_token_ids=tuple(ids), sampling=SamplingParams(
            max_tokens=new_tokens, temperature=0, ignore_eos=True)))
        got: list[int] = []
        while engine.has_unfinished():
            for delta in engine.step():
                got.extend(delta.token_ids)
        prefix = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        agreeing += prefix
        total += len(want)
        identical += prefix == len(want)
    return {"prompts": len(AGREEMENT_PROMPTS), "identical_prompts": identical,
            "tokens_before_first_divergence": agreeing, "tokens": total, "agreement": agreeing / total}


def _hf_dir(model: str | None) -> str:
    from kvmesh.core.config import ModelConfig
    from kvmesh.worker.engine_api import ensure_hf_dir

    return str(ensure_hf_dir(ModelConfig(path=model) if model else ModelConfig()).hf_dir)


# ---- peers ---------------------------------------------------------------------------------


def run_hf_static(model: str | None, requests: list[WorkloadRequest], dtype: torch.dtype, batch_size: int = 8
                  ) -> EngineRunFigures:
    """HF generate in static batches of `batch_size` in request order, left-padded; a request
    finishes at the step where its own output length is reached."""
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    ref = AutoModelForCausalLM.from_pretrained(_hf_dir(model), dtype=dtype).eval()
    finish: list[float] = []
    t0 = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        batch = requests[start:start + batch_size]
        width = max(r.prompt_tokens for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):
            ids[row, width - r.prompt_tokens:] = torch.tensor(r.prompt_token_ids)
            mask[row, width - r.prompt_tokens:] = 1
        longest = max(r.output_tokens for r in batch)
        step = [0]

        class _FinishTimer(LogitsProcessor):
            def __call__(self, input_ids, scores):
                step[0] += 1
                finish.extend(time.perf_counter() - t0 for r in batch if r.output_tokens == step[0])
                return scores

        with torch.inference_mode():
            ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                         do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([_FinishTimer()]))
    return run_figures(finish, sum(r.output_tokens for r in requests), time.perf_counter() - t0)


def run_llama_server(binary: str, gguf: str, requests: list[WorkloadRequest], threads: int,
                     decode_prompt: list[int], decode_tokens: int, slots: int = 8, port: int = 18089,
                     timeout_s: float = 3600) -> tuple[EngineRunFigures, float]:
    """llama.cpp's llama-server on loopback with `slots` parallel slots; every request sent
    at t=0 (one client thread each) to /completion with its token ids, greedy, ignore_eos.
    First, its batch-1 decode rate: the decode prompt alone for decode_tokens tokens, the
    server's own `predicted_per_second` (decode only, as kvmesh's batch-1 figure)."""
    ctx = slots * (max(r.prompt_tokens + r.output_tokens for r in requests) + 16)
    proc = subprocess.Popen([binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
                             "-c", str(ctx), "-t", str(threads), "--cont-batching"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not become healthy (exit code {proc.poll()})")
            time.sleep(0.5)
        def complete(prompt: list[int], n: int) -> dict:
            body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True,
                               "cache_prompt": False}).encode()
            req = urllib.request.Request(f"{base}/completion", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return json.load(resp)

        complete(list(decode_prompt), 4)  # warm-up
        batch1 = statistics.median(complete(list(decode_prompt), decode_tokens)["timings"]["predicted_per_second"]
                                   for _ in range(3))
        finish: list[float] = []
        errors: list[str] = []
        t0 = time.perf_counter()

        def one(r: WorkloadRequest) -> None:
            try:
                complete(list(r.prompt_token_ids), r.output_tokens)
                finish.append(time.perf_counter() - t0)
            except OSError as exc:
                errors.append(str(exc))

        workers = [threading.Thread(target=one, args=(r,)) for r in requests]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if errors:
            raise RuntimeError(f"{len(errors)} llama-server requests failed: {errors[0]}")
        return run_figures(finish, sum(r.output_tokens for r in requests), time.perf_counter() - t0), batch1
    finally:
        proc.terminate()
        proc.wait(30)


# ---- the run -------------------------------------------------------------------------------


def seed_shaped_requests(tokenizer, num_requests: int, scale: float) -> list[WorkloadRequest]:
    return generate_workload(WorkloadSpec(kind="synthetic", num_requests=num_requests, scale=scale, seed=0),
                             TokenCorpus(tokenizer))


def run(args) -> BenchReport:
    torch.set_num_threads(args.threads)
    from kvmesh.worker.engine_api import load_tokenizer
    from kvmesh.core.config import ModelConfig

    tokenizer = load_tokenizer(ModelConfig(path=args.model) if args.model else ModelConfig())
    if args.quick:
        requests = seed_shaped_requests(tokenizer, 6, 0.05)
        decode_tokens, big_batch, gemm_seconds, modes = 6, 4, 0.005, QUICK_MODES
    else:
        requests = seed_shaped_requests(tokenizer, 64, 0.25)
        decode_tokens, big_batch, gemm_seconds, modes = 72, 64, 0.05, FULL_MODES
    big_batch = args.big_batch or big_batch
    if args.modes:
        modes = [m for m in FULL_MODES + OPTIONAL_MODES + QUICK_MODES if m[0] in args.modes.split(",")]
    corpus = TokenCorpus(tokenizer)
    decode_prompt = corpus.window(0, 40)
    if args.ab:
        by_name = {m[0]: m for m in FULL_MODES + OPTIONAL_MODES + QUICK_MODES}
        ab = run_ab([by_name[n] for n in args.ab.split(",")], args.model, args.threads, decode_prompt,
                    decode_tokens, big_batch, args.rounds, gemm_seconds)
        print(format_ab(ab))
        return BenchReport(cpu_flags(), torch.get_num_threads(), torch.__version__, args.model or "embedded SmolLM2")
    report = BenchReport(cpu_flags(), torch.get_num_threads(), torch.__version__, args.model or "embedded SmolLM2")
    for name, dtype, quant in dict.fromkeys(modes):
        figures = bench_mode(name, dtype, quant, args.model, args.threads, requests, decode_prompt, decode_tokens,
                             big_batch, gemm_seconds, agreement=not args.quick)
        report.modes.append(figures)
        print(f"[{name}] {json.dumps(asdict(figures))}", file=sys.stderr, flush=True)
    if not args.no_hf:
        report.hf_static = run_hf_static(args.model, requests, torch.float32 if args.quick else torch.bfloat16)
    if args.llama_server:
        gguf = args.gguf or str(_gguf_path(args.model))
        report.llama_server, report.llama_server_batch1_tok_s = run_llama_server(
            args.llama_server, gguf, requests, args.threads, decode_prompt, decode_tokens)
    return report


def _gguf_path(model: str | None):
    from kvmesh.worker.engine_api import embedded_gguf_path

    if model and model.endswith(".gguf"):
        return model
    return embedded_gguf_path()


def ratio_lines(report: BenchReport) -> list[str]:
    """The issue's in-run ratios: best mode vs HF static and llama.cpp; the default mode (the
    dtype the server picks, model.dtype auto) vs HF static."""
    from kvmesh.worker.engine_api import cpu_has_native_bf16

    lines = []
    best = max(report.modes, key=lambda m: m.seed_run.output_tok_s) if report.modes else None
    default = "bf16" if cpu_has_native_bf16() else "fp32"
    in_process = next((m for m in report.modes if m.mode == default), None)
    if best is not None and report.hf_static is not None:
        lines.append(f"seed-shaped run: kvmesh {best.mode} / HF static = "
                     f"{best.seed_run.output_tok_s / report.hf_static.output_tok_s:.2f}x")
        if in_process is not None and in_process is not best:
            lines.append(f"seed-shaped run: kvmesh {default} (the default mode) / HF static = "
                         f"{in_process.seed_run.output_tok_s / report.hf_static.output_tok_s:.2f}x")
    if best is not None and report.llama_server is not None:
        fastest = max(report.modes, key=lambda m: m.batch1_decode_tok_s)
        lines.append(f"batch-1 decode: kvmesh {fastest.mode} / llama.cpp = "
                     f"{fastest.batch1_decode_tok_s / report.llama_server_batch1_tok_s:.2f}x")
        lines.append(f"seed-shaped run: kvmesh {best.mode} / llama.cpp 8 slots = "
                     f"{best.seed_run.output_tok_s / report.llama_server.output_tok_s:.2f}x throughput, "
                     f"E2E P99 {best.seed_run.e2e_p99_s / report.llama_server.e2e_p99_s:.2f}x")
    return lines


def format_table(report: BenchReport) -> str:
    lines = [f"CPU flags: {' '.join(report.cpu_flags)}; torch {report.torch_version}, {report.torch_threads} threads; "
             f"model {report.model}",
             "| target | output tok/s | E2E P50 s | E2E P99 s | batch-1 decode tok/s | batch-64 decode tok/s | "
             "batch-64 step / GEMM rate |",
             "|---|---|---|---|---|---|---|"]
    for m in report.modes:
        s = m.seed_run
        lines.append(f"| kvmesh {m.mode} | {s.output_tok_s:.1f} | {s.e2e_p50_s:.1f} | {s.e2e_p99_s:.1f} | "
                     f"{m.batch1_decode_tok_s:.1f} | {m.batch64_decode_tok_s:.1f} | "
                     f"{m.gemm_fraction:.0%} ({m.batch64_gflop_s:.0f} / {m.gemm_gflop_s:.0f} GFLOP/s) |")
    for name, peer in (("HF static batches of 8", report.hf_static), ("llama-server, 8 slots", report.llama_server)):
        if peer is not None:
            batch1 = report.llama_server_batch1_tok_s if peer is report.llama_server else None
            lines.append(f"| {name} | {peer.output_tok_s:.1f} | {peer.e2e_p50_s:.1f} | {peer.e2e_p99_s:.1f} | "
                         f"{'-' if batch1 is None else f'{batch1:.1f}'} | - | - |")
    lines += [""] + ratio_lines(report)
    for m in report.modes:
        if m.read_gb_s:
            lines.append(f"\nbatch-64 step at the memory floor ({m.mode}): it reads >= {m.batch64_read_mb:.0f} MB "
                         f"(weights + attended K/V) in {m.batch64_step_ms:.1f} ms; at this process's "
                         f"{m.read_gb_s:.1f} GB/s read bandwidth that takes "
                         f"{m.batch64_read_mb / m.read_gb_s:.1f} ms = {m.bandwidth_fraction:.0%} of the step")
    for m in report.modes:
        if m.plain_gemm_gflop_s:
            lines.append(f"\nbatch-64 step / plain F.linear ({m.mode}): {m.batch64_gflop_s / m.plain_gemm_gflop_s:.0%} "
                         f"({m.batch64_gflop_s:.0f} / {m.plain_gemm_gflop_s:.0f} GFLOP/s); the table's GEMM rate is "
                         f"the better of F.linear and a oneDNN-prepacked weight")
    for m in report.modes:
        for ref, a in (("bf16", m.hf_agreement), ("fp32", m.hf_fp32_agreement)):
            if a:
                lines.append(f"\nbf16 greedy agreement with HF {ref} ({m.mode}): {a['agreement']:.1%} of tokens before "
                             f"the first divergence, {a['identical_prompts']}/{a['prompts']} prompts identical")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> BenchReport:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF folder or GGUF (default: the embedded SmolLM2)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (and llama-server's)")
    p.add_argument("--modes", help="comma-separated subset of: " + ", ".join(m[0] for m in FULL_MODES + OPTIONAL_MODES))
    p.add_argument("--quick", action="store_true", help="a few tiny requests, two modes: a smoke run in seconds")
    p.add_argument("--no-hf", action="store_true", help="skip HF transformers static batches")
    p.add_argument("--llama-server", metavar="PATH", help="llama.cpp llama-server binary to compare against")
    p.add_argument("--gguf", help="GGUF for llama-server (default: the embedded model's)")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    p.add_argument("--ab", metavar="A,B", help="only the interleaved decode A/B of these modes (see above)")
    p.add_argument("--rounds", type=int, default=3, help="--ab rounds")
    p.add_argument("--big-batch", type=int, help="--ab: the second decode batch size (default 64; 4 with --quick)")
    args = p.parse_args(argv)
    known = {m[0] for m in FULL_MODES + OPTIONAL_MODES + QUICK_MODES}
    if args.ab and not set(args.ab.split(",")) <= known:
        p.error(f"--ab {args.ab}: modes are {', '.join(sorted(known))}")
    if args.llama_server and not shutil.which(args.llama_server) and not os.path.exists(args.llama_server):
        p.error(f"--llama-server {args.llama_server}: no such binary")
    report = run(args)
    if not args.ab:  # --ab printed its own table
        print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(report), f, indent=1)
    return report


if __name__ == "__main__":
    main()
