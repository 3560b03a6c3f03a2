"""One prefill step of the scheduler's token budget, as one native call against the eager forward,
alternated in one engine (what `kvmesh serve` deploys on this machine, plus --set overrides):

    python -m kvmesh.load_tests.bench_prefill_step [--shapes seed,512@0,512@2048] [--rounds 5]
        [--sides native,eager] [--set quant.weight=none]

Shapes: `seed` is the seed-shaped run's prefill step (512 prompt tokens of 45-token prompts, as
the run's first steps: contexts under 100 tokens); `N@C` is one prompt's chunk of N tokens at
context offset C (the last step of a C + N token prompt's chunked prefill; its earlier chunks run
eagerly and are not timed). Each round times every shape once a side, the sides' order
alternating round by round (the box drifts); prompts are corpus windows no other trial read, so
no prefix cache hit. Prints the engine step's median wall per shape and side, native / eager,
and each step's attention pairs (the sum of its prompt tokens' contexts: the native step's
guard, cpu_native_step.PREFILL_ATTENTION_PAIRS_MAX). `--sides eager` runs on any tree (the A/B
baseline: the file itself against another checkout's kvmesh).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from kvmesh.core.seams import GenerateRequest, SamplingParams
from kvmesh.load_tests import bench_served
from kvmesh.load_tests.corpus import TokenCorpus
from kvmesh.worker.engine_api import Engine, load_tokenizer

SEED_PROMPT_TOKENS = 45


def shape_prompts(shape: str, budget: int) -> tuple[list[int], int]:
    """A shape's prompt lengths and the index of the step to time (0-based)."""
    if shape == "seed":
        return [SEED_PROMPT_TOKENS] * (budget // SEED_PROMPT_TOKENS + 1), 0
    n, c = (int(v) for v in shape.split("@"))
    if c % budget or n > budget:
        raise SystemExit(f"shape {shape}: the offset must be a multiple of the step budget {budget}, N <= it")
    return [c + n], c // budget


def attention_pairs(prompts: list[int], budget: int, step: int) -> int:
    """The sum of the timed step's prompt tokens' contexts (each token attends to itself and
    every token before it)."""
    start, total, left = step * budget, 0, budget
    for p in prompts:
        if start >= p:
            start -= p
            continue
        take = min(left, p - start)
        total += take * start + take * (take + 1) // 2
        left -= take
        start = 0
        if not left:
            break
    return total


def timed_step(engine: Engine, corpus: TokenCorpus, prompts: list[int], step: int, native: bool, offsets) -> float:
    """Add the prompts (1 output token each), run to completion; the wall of step `step`, which
    runs natively or eagerly (every other step eagerly)."""
    decoder = engine.runner.native_decoder
    ids = [f"p{next(offsets)}" for _ in prompts]
    for rid, n in zip(ids, prompts):
        engine.add_request(GenerateRequest(rid, prompt_token_ids=corpus.window(int(rid[1:]) * 7919, n),
                                           sampling=SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)))
    wall, i = 0.0, 0
    while engine.has_unfinished():
        if decoder is not None:
            decoder.max_tokens = (1 << 20) if native and i == step else 0
            decoder.prefill_attention_pairs_max = 1 << 62  # the guard's crossover is what this measures
        t = time.perf_counter()
        engine.step()
        if i == step:
            wall = time.perf_counter() - t
            for rid in ids:  # the rest (the tail's prefill) is not timed
                engine.abort(rid)
        i += 1
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="seed,512@0,512@1024,512@2048")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sides", default="native,eager")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override on top of what serve deploys (repeatable)")
    args = ap.parse_args()
    config = bench_served.serve_config(None, tuple(args.set) + ("cache.enable_prefix_caching=false",))
    budget = config.scheduler.max_num_batched_tokens
    engine = Engine.from_config(config)
    decoder = engine.runner.native_decoder
    sides = args.sides.split(",")
    if "native" in sides and decoder is None:
        raise SystemExit("the native step is off on this machine")
    configured = decoder.max_tokens if decoder is not None else 0
    corpus = TokenCorpus(load_tokenizer(config.model))
    offsets = itertools.count(1)
    shapes = args.shapes.split(",")
    print(f"threads {torch.get_num_threads()}, step budget {budget} tokens, native path "
          f"{decoder.path if decoder is not None else 'none'}, configured native steps <= {configured} tokens")
    walls: dict[tuple[str, str], list[float]] = {}
    for r in range(-1, args.rounds):  # round -1 warms every shape and side up (oneDNN's first calls)
        for shape in shapes:
            prompts, step = shape_prompts(shape, budget)
            for side in (sides if r % 2 == 0 else sides[::-1]):
                wall = timed_step(engine, corpus, prompts, step, side == "native", offsets)
                if r >= 0:
                    walls.setdefault((shape, side), []).append(wall)
    if decoder is not None:
        decoder.max_tokens = configured
    print("| shape | attention pairs | " + " | ".join(f"{s} ms (median)" for s in sides)
          + (" | native / eager |" if len(sides) == 2 else " |"))
    for shape in shapes:
        prompts, step = shape_prompts(shape, budget)
        ms = [statistics.median(walls[(shape, s)]) * 1e3 for s in sides]
        ratio = f" {ms[sides.index('native')] / ms[sides.index('eager')]:.2f} |" if len(sides) == 2 else ""
        print(f"| {shape} | {attention_pairs(prompts, budget, step)} | "
              + " | ".join(f"{v:.1f}" for v in ms) + " |" + ratio)
    for shape, side in walls:
        print(f"# {shape} {side}: " + " ".join(f"{w * 1e3:.0f}" for w in walls[(shape, side)]))
    engine.close()


if __name__ == "__main__":
    main()
