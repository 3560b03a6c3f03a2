"""One engine step of the seed-shaped run, by batch: where a decode step of 8, 32 or 64 rows
spends its time in the default mode (what `kvmesh serve` deploys: the embedded GGUF's int4
kept, the native step), and the batched int4 kernel against the per-row one, A/B in one run:

    python -m kvmesh.load_tests.bench_batched_step [--batches 8,32,64] [--steps 24]
        [--rounds 3] [--threads 2] [--ab | --after-prefill] [--set model.dtype=float32]

Each batch: B requests with ~45-token prompts (the seed run's shape) are prefilled, then
`--steps` decode steps are timed (contexts ~45-100 tokens). Per step: the engine's step wall,
the runner's forward, the native call; the rest of the step is Python scheduling, sampling
and output. The achieved GFLOP/s counts the projections and the LM head (2 x weights x rows;
attention is ~3 % of that at these contexts).

--after-prefill: the seed run's decode steps come between 512-token prefill steps; here each
third step takes a prompt of 512 - B tokens beside the B decode rows (a step of the scheduler's
whole budget, native where auto takes it), and the two decode steps after it are timed apart: the
one right after the big step against the one after a decode step ("after-prefill" / "after-decode"
sides), step by step in one engine.

--ab: the steps alternate between the batched int4 GEMM (worker/kernels/cpu/int4_gemm_avx2.c,
the default above its row threshold) and the per-row kernels (threshold set past the batch),
step by step in one engine, so the shared box's drift hits both alike; prints the per-batch
ratio of their median native-step times (batched / per-row below 1 = faster).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from kvmesh.core.seams import GenerateRequest, SamplingParams
from kvmesh.load_tests import bench_served
from kvmesh.load_tests.corpus import TokenCorpus
from kvmesh.worker.engine_api import Engine, load_tokenizer

PROMPT_TOKENS = 45


@dataclass
class StepTimes:
    step_s: list[float]
    native_s: list[float]
    native_cpu_s: list[float]

    def median_ms(self) -> tuple[float, float, float]:
        return (statistics.median(self.step_s) * 1e3, statistics.median(self.native_s) * 1e3,
                statistics.median(self.native_cpu_s) * 1e3)


def model_flops_a_row(engine: Engine) -> float:
    """2 x the projection and LM head weights a decode row multiplies (FLOPs)."""
    cfg = engine.model_config if hasattr(engine, "model_config") else None
    model = engine.runner.model
    hf = getattr(model, "config", cfg)
    h, i, layers = hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers
    d = getattr(hf, "head_dim", None) or h // hf.num_attention_heads
    qkv = h * (hf.num_attention_heads + 2 * hf.num_key_value_heads) * d
    per_layer = qkv + hf.num_attention_heads * d * h + 3 * h * i
    return 2.0 * (layers * per_layer + h * hf.vocab_size)


class TimedDecoder:
    """Wraps the engine's NativeDecoder.run to time each native call."""

    def __init__(self, decoder):  # the engine runner's NativeDecoder
        self.decoder, self.last_s, self.last_cpu_s, self.last_tokens = decoder, 0.0, 0.0, 0
        self._run = decoder.run

        def run(inputs):
            t, c = time.perf_counter(), time.process_time()
            out = self._run(inputs)
            self.last_s, self.last_cpu_s = time.perf_counter() - t, time.process_time() - c
            self.last_tokens = len(inputs.input_ids) if out is not None else 0
            return out
        decoder.run = run


def decode_steps(engine: Engine, timer: TimedDecoder, corpus: TokenCorpus, batch: int, steps: int,
                 before_step=None, tag: str = "") -> list[tuple[int, float, float, float]]:
    """(step index, step s, native s, native CPU s) of `steps` decode steps at `batch` rows."""
    for i in range(batch):
        engine.add_request(GenerateRequest(f"b{tag}{batch}-{i}", prompt_token_ids=corpus.window(97 * i, PROMPT_TOKENS),
                                           sampling=SamplingParams(max_tokens=steps + 4, temperature=0,
                                                                   ignore_eos=True)))
    out: list[tuple[int, float, float, float]] = []
    while engine.has_unfinished():
        if len(out) < steps and before_step is not None:
            before_step(len(out))
        timer.last_tokens = 0
        t = time.perf_counter()
        deltas = engine.step()
        dt = time.perf_counter() - t
        # a decode step: every request one token through the native step (prefill steps and the
        # tail as requests finish are not counted)
        if timer.last_tokens == batch and len(deltas) == batch and len(out) < steps:
            out.append((len(out), dt, timer.last_s, timer.last_cpu_s))
    return out


def decode_steps_after_prefill(engine: Engine, timer: TimedDecoder, corpus: TokenCorpus, batch: int, steps: int,
                               step_tokens: int, tag: str = "") -> dict[str, list[tuple[float, float, float]]]:
    """(step s, native s, native CPU s) of `steps` decode steps at `batch` rows on each side: right
    after a step of `step_tokens` tokens (the rows plus a prompt's chunk), and one step later."""
    for i in range(batch):
        engine.add_request(GenerateRequest(f"p{tag}{batch}-{i}", prompt_token_ids=corpus.window(97 * i, PROMPT_TOKENS),
                                           sampling=SamplingParams(max_tokens=3 * steps + 8, temperature=0,
                                                                   ignore_eos=True)))
    out: dict[str, list[tuple[float, float, float]]] = {"after-prefill": [], "after-decode": []}
    phase, prompts = -1, 0  # -1 until the rows decode; then 0 (add a prompt), 1 (after it), 2 (a step later)
    while engine.has_unfinished():
        if phase == 0 and min(map(len, out.values())) < steps:
            engine.add_request(GenerateRequest(f"p{tag}{batch}-long{prompts}",
                                               prompt_token_ids=corpus.window(7919 * (prompts + 1), step_tokens - batch),
                                               sampling=SamplingParams(max_tokens=1, temperature=0)))
            prompts += 1
        timer.last_tokens = 0
        t = time.perf_counter()
        deltas = engine.step()
        dt = time.perf_counter() - t
        decode = timer.last_tokens == batch and len(deltas) == batch
        side = {1: "after-prefill", 2: "after-decode"}.get(phase)
        if decode and side is not None and len(out[side]) < steps:
            out[side].append((dt, timer.last_s, timer.last_cpu_s))
        # the cycle starts on a decode step (the rows' own prompts done) and restarts when one is off-pattern
        phase = (phase + 1) % 3 if (decode or phase == 0) else -1
        if phase == -1 and decode:
            phase = 0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="8,32,64")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="engine threads (default: what serve deploys)")
    ap.add_argument("--ab", action="store_true", help="batched int4 GEMM against the per-row kernels, step by step")
    ap.add_argument("--after-prefill", action="store_true",
                    help="decode steps right after a step of the whole token budget against one step later")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override on top of what serve deploys (repeatable), e.g. model.dtype=float32")
    args = ap.parse_args()
    overrides = tuple(args.set) + (() if args.threads is None else (f"parallel.cpu_threads={args.threads}",))
    config = bench_served.serve_config(None, overrides)
    engine = Engine.from_config(config)
    decoder = engine.runner.native_decoder
    if decoder is None:
        raise SystemExit("the native step is off on this machine: nothing to profile")
    timer = TimedDecoder(decoder)
    corpus = TokenCorpus(load_tokenizer(config.model))
    flops_row = model_flops_a_row(engine)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"threads {torch.get_num_threads()}, native path {decoder.path} ({decoder.variant} build), "
          f"steps <= {decoder.max_tokens} tokens, {flops_row / 1e6:.0f} MFLOP a row (projections + LM head)")
    decode_steps(engine, timer, corpus, 4, 4, tag="warm")
    default_rows = decoder.int4_gemm_min_rows
    per_row_rows = 1 << 30
    results: dict[tuple[int, str], StepTimes] = {}
    for r in range(args.rounds):
        for batch in batches:
            if args.after_prefill:
                budget = config.scheduler.max_num_batched_tokens
                for side, got in decode_steps_after_prefill(engine, timer, corpus, batch, args.steps, budget,
                                                            tag=f"r{r}").items():
                    t = results.setdefault((batch, side), StepTimes([], [], []))
                    for step_s, native_s, cpu_s in got:
                        t.step_s.append(step_s)
                        t.native_s.append(native_s)
                        t.native_cpu_s.append(cpu_s)
                continue
            sides = ("batched", "per-row") if args.ab else ("default",)
            if args.ab and r % 2:
                sides = sides[::-1]

            def before(i: int) -> None:
                side = sides[i % len(sides)]
                decoder.int4_gemm_min_rows = per_row_rows if side == "per-row" else default_rows

            got = decode_steps(engine, timer, corpus, batch, args.steps * len(sides), before, tag=f"r{r}")
            for i, step_s, native_s, cpu_s in got:
                t = results.setdefault((batch, sides[i % len(sides)]), StepTimes([], [], []))
                t.step_s.append(step_s)
                t.native_s.append(native_s)
                t.native_cpu_s.append(cpu_s)
    decoder.int4_gemm_min_rows = default_rows
    if args.after_prefill:
        print(f"after a {config.scheduler.max_num_batched_tokens}-token step: native path "
              f"{'takes' if decoder.max_tokens >= config.scheduler.max_num_batched_tokens else 'leaves eager'} it")
    # CPU ms: the process's CPU time in the native call (its threads' spins at barriers included);
    # on a shared box the wall time also holds what other processes took
    print("| rows | side | step ms (median) | native ms | native CPU ms | Python + sampling ms | GFLOP/s a CPU second |")
    print("|---|---|---|---|---|---|---|")
    for (batch, side), t in sorted(results.items()):
        step_ms, native_ms, cpu_ms = t.median_ms()
        print(f"| {batch} | {side} | {step_ms:.1f} | {native_ms:.1f} | {cpu_ms:.1f} | {step_ms - native_ms:.1f} | "
              f"{flops_row * batch / cpu_ms / 1e6:.1f} |")
    if args.after_prefill:
        for batch in batches:
            a, b = results[(batch, "after-prefill")].median_ms()[1], results[(batch, "after-decode")].median_ms()[1]
            print(f"batch {batch}: native decode step after the big step / after a decode step {a / b:.2f}x "
                  f"({a:.1f} vs {b:.1f} ms)")
    if args.ab:
        for batch in batches:
            (_, a, ac), (_, b, bc) = results[(batch, "batched")].median_ms(), results[(batch, "per-row")].median_ms()
            print(f"batch {batch}: batched / per-row native step wall {a / b:.2f}x ({a:.1f} vs {b:.1f} ms), "
                  f"CPU {ac / bc:.2f}x ({ac:.1f} vs {bc:.1f} ms); medians of "
                  f"{len(results[(batch, 'batched')].native_s)} steps each")
    engine.close()


if __name__ == "__main__":
    main()
