"""Speculative decoding on CPU, as ratios against speculation off in ONE process and run.

    python -m kvmesh.load_tests.bench_speculative                 # SmolLM2, the full run
    python -m kvmesh.load_tests.bench_speculative --quick --model DIR   # seconds (tests)

Figures (each ratio = off / on, so > 1 means speculation helps):
  * editing     batch-1 TPOT, prompt lookup (ngram) vs off: chat prompts asking to fix the
                typos of a paragraph, so the answer repeats most of the prompt; greedy.
  * chat        batch-1 TPOT, quantized self-draft vs off, on the bundled chat prompts
                (CHAT_PROMPTS); greedy; with the draft acceptance rate.
  * concurrent  output tokens/s of 64 seed-shaped requests (the articles' length shape
                x0.25, load_tests/workloads.py synthetic, seed 0), all sent at t=0, exact
                output lengths, greedy: each method vs off. The never-slower check.
  * forward_cost  the measured forward time of 1 + k tokens against 1 token at batch 1:
                why drafts are nearly free on this CPU (the weights are read once either way).
Off and on alternate per prompt, in ABBA order, so drift of a shared machine hits both alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from dataclasses import asdict, dataclass, field

import torch

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import GenerateRequest, SamplingParams
from kvmesh.load_tests.bench_engine import cpu_flags, seed_shaped_requests
from kvmesh.worker.engine_api import Engine, render_chat
from kvmesh.worker.runner.model_runner import StepInputs

EDIT_PARAGRAPHS = [
    "Teh quick brown fox jumpd over the lazzy dog while the farmer wachted from the porch. He "
    "had seen this happen evry morning for years, and he still found it amusing to watch.",
    "Our team will meet on Tuesdy at ten oclock to revew the quarterly results. Please bring "
    "your notes and be redy to discus the budget for the next three months.",
    "The libary opens at nine in the morming and closes at six in the evning. Visitors must "
    "return all books befor leaving and keep their voices down in the reading rooms.",
]
CHAT_PROMPTS = [  # the bundled chat prompts: short everyday questions
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Explain what a prime number is.",
    "Write a short poem about the sea.",
    "How do I boil an egg?",
    "What are the colors of the rainbow?",
]


@dataclass
class TpotFigures:
    off_tpot_ms: float
    on_tpot_ms: float
    ratio: float  # off / on
    acceptance_rate: float
    mean_accepted_per_step: float
    identical_outputs: bool  # greedy: speculation must not change a token


@dataclass
class SpeculationThroughputFigures:
    off_tok_s: float
    on_tok_s: dict[str, float]
    ratio: dict[str, float]  # on / off
    speculating_steps: dict[str, int]  # steps in which drafts were verified (the load gate)
    off_runs_tok_s: list[float]  # the two off runs (their spread is the machine's noise)
    # The same per CPU-second of this process: other processes' load stretches wall time at
    # random, CPU time much less.
    off_tok_per_cpu_s: float = 0.0
    on_tok_per_cpu_s: dict[str, float] = field(default_factory=dict)
    cpu_ratio: dict[str, float] = field(default_factory=dict)


@dataclass
class SpeculativeReport:
    cpu_flags: str
    torch_threads: int
    editing: TpotFigures | None = None
    chat: TpotFigures | None = None
    concurrent: SpeculationThroughputFigures | None = None
    forward_cost: dict[str, float] = field(default_factory=dict)  # "1+k tokens / 1 token" at batch 1


def _engine(model: str | None, dtype: str, method: str, kv_cache_gib: float = 1.0, **speculative) -> Engine:
    return Engine.from_config(KvmeshConfig.from_dict({
        "model": {"path": model, "dtype": dtype}, "cache": {"cpu_kv_cache_gib": kv_cache_gib},
        "scheduler": {"max_num_seqs": 64, "max_queue_time_s": 3600},
        "speculative": {"method": method, **speculative}}))


def _timed_generate(engine: Engine, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], float]:
    """One request alone; returns its tokens and TPOT (s per output token after the first)."""
    engine.add_request(GenerateRequest("b1", prompt_token_ids=tuple(prompt_ids),
                                       sampling=SamplingParams(max_tokens=max_tokens, temperature=0)))
    tokens: list[int] = []
    first_s = last_s = 0.0
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.token_ids:
                now = time.perf_counter()
                if not tokens:
                    first_s = now
                last_s = now
                tokens.extend(delta.token_ids)
    return tokens, (last_s - first_s) / max(1, len(tokens) - 1)


def bench_tpot(off: Engine, on: Engine, prompts: list[list[int]], max_tokens: int) -> TpotFigures:
    _timed_generate(off, prompts[0][:16], 4)  # warm-up: first-call allocations
    _timed_generate(on, prompts[0][:16], 4)
    before = _counters(on)
    off_tpot, on_tpot, identical = [], [], True
    for i, ids in enumerate(prompts):
        # off-on, then on-off (ABBA): a load that rises or falls through the run would
        # otherwise favour whichever side always runs second.
        if i % 2 == 0:
            off_tokens, t_off = _timed_generate(off, ids, max_tokens)
            on_tokens, t_on = _timed_generate(on, ids, max_tokens)
        else:
            on_tokens, t_on = _timed_generate(on, ids, max_tokens)
            off_tokens, t_off = _timed_generate(off, ids, max_tokens)
        off_tpot.append(t_off)
        on_tpot.append(t_on)
        identical &= off_tokens == on_tokens
    after = _counters(on)
    drafted, accepted, verified = (a - b for a, b in zip(after, before))
    off_ms, on_ms = 1e3 * statistics.mean(off_tpot), 1e3 * statistics.mean(on_tpot)
    return TpotFigures(off_ms, on_ms, off_ms / on_ms, accepted / drafted if drafted else 0.0,
                       accepted / verified if verified else 0.0, identical)


def _counters(engine: Engine) -> tuple[int, int, int]:
    c = engine.speculator.counters
    return c.num_draft_tokens, c.num_accepted_tokens, c.num_verified


def run_concurrent(engine: Engine, requests) -> tuple[float, float]:
    """All requests at t=0, exact output lengths; output tokens per second (wall) and per
    CPU-second of this process."""
    for r in requests:
        engine.add_request(GenerateRequest(f"c{r.index}", prompt_token_ids=r.prompt_token_ids,
                                           sampling=SamplingParams(max_tokens=r.output_tokens, temperature=0,
                                                                   ignore_eos=True)))
    started, cpu_started = time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        engine.step()
    tokens = sum(r.output_tokens for r in requests)
    return tokens / (time.perf_counter() - started), tokens / (time.process_time() - cpu_started)


def forward_cost(engine: Engine, prompt_ids: list[int], ks=(1, 2, 4, 8), repeats: int = 20) -> dict[str, float]:
    """Forward time of 1 + k tokens over 1 token, one sequence with a cached prefix."""
    runner = engine.runner
    bs = engine.block_size
    n = len(prompt_ids)
    blocks = tuple(range(-(-(n + max(ks) + 1) // bs)))

    class Row:  # the few fields StepInputs reads
        request = types.SimpleNamespace(lora_slot=None)  # base weights, no adapter

        def __init__(self, start, tokens):
            self.token_ids, self.num_computed_tokens, self.num_scheduled_tokens = tokens, start, len(tokens)
            self.block_ids, self.sample, self.spec_token_ids = blocks, True, tokens[1:]
            self.positions = range(start, start + len(tokens))

    runner.forward(StepInputs.build([Row(0, tuple(prompt_ids))], bs))  # the prefix KV
    times = {}
    for width in (1, *[1 + k for k in ks]):  # warm-up: first-call allocations per shape
        runner.forward(StepInputs.build([Row(n, tuple(prompt_ids[:width]))], bs))
    for width in (1, *[1 + k for k in ks]):
        inputs = StepInputs.build([Row(n, tuple(prompt_ids[:width]))], bs)
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.forward(inputs)
            samples.append(time.perf_counter() - t0)
        times[width] = statistics.median(samples)
    return {f"1+{k}": times[1 + k] / times[1] for k in ks}


def _chat_ids(engine: Engine, text: str) -> list[int]:
    return list(engine.tokenizer.encode(render_chat(engine.tokenizer, [{"role": "user", "content": text}]),
                                        add_special_tokens=False))


def run(args) -> SpeculativeReport:
    torch.set_num_threads(args.threads)
    parts = set(args.parts.split(","))
    report = SpeculativeReport(cpu_flags(), torch.get_num_threads())
    off = _engine(args.model, args.dtype, "none", args.kv_cache_gib)
    chat_prompts = [_chat_ids(off, p) for p in CHAT_PROMPTS[:args.num_prompts]]
    ngram = _engine(args.model, args.dtype, "ngram", args.kv_cache_gib) if parts & {"editing", "concurrent"} else None
    draft = _engine(args.model, args.dtype, "self_draft", args.kv_cache_gib, draft_quant=args.draft_quant,
                    num_tokens=args.num_tokens) \
        if parts & {"chat", "concurrent"} else None
    if "forward_cost" in parts:
        report.forward_cost = forward_cost(off, chat_prompts[0], repeats=3 if args.quick else 20)
        print(f"[forward_cost] {report.forward_cost}", file=sys.stderr, flush=True)
    if "editing" in parts:
        edit_prompts = [_chat_ids(off, "Fix the typos in this paragraph and write it out corrected:\n\n" + p)
                        for p in EDIT_PARAGRAPHS[:args.num_prompts]]
        report.editing = bench_tpot(off, ngram, edit_prompts, args.max_tokens)
        print(f"[editing] {asdict(report.editing)}", file=sys.stderr, flush=True)
    if "chat" in parts:
        report.chat = bench_tpot(off, draft, chat_prompts, args.max_tokens)
        print(f"[chat] {asdict(report.chat)}", file=sys.stderr, flush=True)
    if "concurrent" in parts:
        report.concurrent = bench_concurrent(off, {"ngram": ngram, "self_draft": draft},
                                             seed_shaped_requests(off.tokenizer, args.num_concurrent, args.scale))
        print(f"[concurrent] {asdict(report.concurrent)}", file=sys.stderr, flush=True)
    return report


def bench_concurrent(off: Engine, engines: dict[str, Engine], requests) -> SpeculationThroughputFigures:
    """off, each method, off again: the baseline is the mean of the off runs around them."""
    off_runs = [run_concurrent(off, requests)]
    on, steps = {}, {}
    for name, engine in engines.items():
        before = engine.speculator.counters.num_steps
        on[name] = run_concurrent(engine, requests)
        steps[name] = engine.speculator.counters.num_steps - before
    off_runs.append(run_concurrent(off, requests))
    off_wall = statistics.mean(r[0] for r in off_runs)
    off_cpu = statistics.mean(r[1] for r in off_runs)
    return SpeculationThroughputFigures(off_wall, {k: v[0] for k, v in on.items()}, {k: v[0] / off_wall for k, v in on.items()},
                             steps, [r[0] for r in off_runs], off_cpu, {k: v[1] for k, v in on.items()},
                             {k: v[1] / off_cpu for k, v in on.items()})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: OpenMP spin-waits make 2 erratic on a shared 2-core machine)")
    p.add_argument("--draft-quant", default="int8", choices=["int8", "int4"])
    p.add_argument("--num-tokens", type=int, default=4, help="speculative.num_tokens of the self-draft engine")
    p.add_argument("--kv-cache-gib", type=float, default=1.0,
                   help="KV cache per engine (0.25 holds the batch-1 parts; keep a shared machine's memory low)")
    p.add_argument("--quick", action="store_true", help="seconds: few prompts, short outputs, 4 concurrent")
    p.add_argument("--parts", default="forward_cost,editing,chat,concurrent",
                   help="comma-separated: forward_cost, editing, chat, concurrent")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    args.num_prompts, args.max_tokens, args.num_concurrent, args.scale = \
        (1, 8, 4, 0.05) if args.quick else (len(CHAT_PROMPTS), 96, 64, 0.25)
    report = run(args)
    text = json.dumps(asdict(report), indent=2)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
