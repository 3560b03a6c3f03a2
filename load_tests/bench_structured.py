"""Structured output's cost, as ratios in ONE process and run (in-process engine, CPU).

    python -m kvmesh.load_tests.bench_structured --rounds 2 --max-tokens 64   # SmolLM2, 64 concurrent
    python -m kvmesh.load_tests.bench_structured --quick --model DIR   # seconds (tests)

Figures:
  * throughput  64 concurrent requests, each with a JSON schema (the held-out shapes below,
                cycled), temperature 0.7, seeded; then the SAME requests unconstrained, each
                generating exactly as many tokens as its constrained run did (ignore_eos,
                max_tokens = that count). Output tokens/s of each; ratio = constrained /
                unconstrained (the issue's bar: >= 0.9). Rounds alternate A B B A, so drift of
                a shared machine hits both alike; the same ratio in tokens per CPU second of
                this process (the steadier one where other processes share the cores) and
                the share of the constrained time spent computing masks are printed beside.
  * new_schema  16 free requests decoding; after 16 steps one more request arrives, validated
                on another thread and added between steps (as AsyncEngine does): a
                never-seen 50-property schema, or (the control) free text of the same prompt.
                The others' extra delay over the 8 steps from the arrival (longer if its
                first token comes later) = sum(gap - median gap) / median gap, in steps; the schema's cost = its delay - the control's,
                median over A/B pairs alternating in order (the bar: <= 1 step). Also shown:
                the delays themselves, the longest gap, steps to the new request's first token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import torch

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import GenerateRequest, SamplingParams, StructuredOutput
from kvmesh.worker.engine_api import Engine

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["name", "age", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                      "temp_c": {"type": "number", "minimum": -40, "maximum": 50},
                                      "wind": {"type": "object", "properties": {
                                          "kmh": {"type": "integer", "minimum": 0, "maximum": 200}},
                                          "required": ["kmh"], "additionalProperties": False}},
     "required": ["city", "temp_c", "wind"], "additionalProperties": False},
]
PROMPT = "Return one record as JSON."


def wide_schema(num_properties: int = 50, salt: str = "") -> dict:
    """A schema no cache has seen (property names carry `salt`)."""
    props = {f"p{i}{salt}": {"type": "integer", "minimum": 0, "maximum": 9} for i in range(num_properties)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def _drain(engine: Engine, cpu_s: list[float] | None = None) -> tuple[dict[str, int], float]:
    """Step to the end: (tokens by request, wall seconds); appends this process's CPU seconds
    to `cpu_s` (steadier than wall time where other processes share the cores)."""
    counts: dict[str, int] = {}
    started, cpu_started = time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        for d in engine.step():
            counts[d.request_id] = counts.get(d.request_id, 0) + len(d.token_ids)
    if cpu_s is not None:
        cpu_s.append(time.process_time() - cpu_started)
    return counts, time.perf_counter() - started


def throughput_round(engine: Engine, num_requests: int, max_tokens: int, lengths: dict[int, int],
                     round_index: int) -> tuple[float, float, float, float]:
    """(constrained tokens/s, unconstrained tokens/s, the share of the constrained half's time
    spent computing masks, the constrained / unconstrained ratio of tokens per CPU second of
    this process) of one round. `lengths` (request index -> constrained output tokens) fills
    on the first round; seeded requests sample the same tokens in any batch, so later rounds
    may run the unconstrained half first (ABBA order)."""
    mask_share: list[float] = []
    cpu_s: dict[str, list[float]] = {"c": [], "f": []}

    def constrained() -> float:
        mask_s = engine.structured.mask_s_total
        for i in range(num_requests):
            engine.add_request(GenerateRequest(f"c{round_index}-{i}", prompt=PROMPT, sampling=SamplingParams(
                max_tokens=max_tokens, temperature=0.7, seed=i,
                structured=StructuredOutput("json_schema", json.dumps(SCHEMAS[i % len(SCHEMAS)])))))
        counts, seconds = _drain(engine, cpu_s["c"])
        for i in range(num_requests):
            lengths.setdefault(i, counts[f"c{round_index}-{i}"])
        mask_share.append((engine.structured.mask_s_total - mask_s) / seconds)
        return sum(counts.values()) / seconds

    def free() -> float:
        for i in range(num_requests):
            engine.add_request(GenerateRequest(f"f{round_index}-{i}", prompt=PROMPT, sampling=SamplingParams(
                max_tokens=lengths[i], temperature=0.7, seed=i, ignore_eos=True)))
        counts, seconds = _drain(engine, cpu_s["f"])
        return sum(counts.values()) / seconds

    if round_index % 2 == 0 or len(lengths) < num_requests:
        c = constrained()
        f = free()
    else:
        f = free()
        c = constrained()
    # the same tokens in both halves: tokens per CPU second compare as CPU seconds, inverted
    return c, f, mask_share[0], cpu_s["f"][0] / cpu_s["c"][0]


def arrival_window(engine: Engine, num_free: int, tag: str, schema: dict | None) -> tuple[float, float, int]:
    """`num_free` free requests decode; after 16 steps one more request arrives: with
    `schema` (never seen) constrained, else free text of the same prompt. As in serving, it
    is validated on another thread (AsyncEngine's event loop) and added between steps (its
    step thread). Returns (the others' extra delay over the steps from the arrival (8, or
    through the step after the new request's first token), in median steps outside them:
    sum(gap - median) / median; the longest of those gaps the same way; steps from the
    arrival to its first token)."""
    for i in range(num_free):
        engine.add_request(GenerateRequest(f"d{tag}-{i}", prompt=PROMPT, sampling=SamplingParams(
            max_tokens=64, temperature=0.7, seed=i, ignore_eos=True)))
    sampling = (SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True) if schema is None else
                SamplingParams(max_tokens=400, temperature=0.0, structured=StructuredOutput("json_schema",
                                                                                            json.dumps(schema))))
    arriving = GenerateRequest(f"new{tag}", prompt=PROMPT, sampling=sampling)
    validated: list[list[int]] = []
    checker = threading.Thread(target=lambda: validated.append(engine.validate(arriving)))
    gaps: list[float] = []  # every step's gap; the window starts at step 16
    first_token_step = -1
    queued = False
    last = time.perf_counter()
    for step in range(48):
        if step == 16:
            checker.start()
        if validated and not queued:
            engine.add_request(arriving, validated[0])
            queued = True
        deltas = engine.step()
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        if first_token_step < 0 and any(d.request_id == arriving.request_id for d in deltas):
            first_token_step = step - 16
    checker.join()
    engine.abort(arriving.request_id)  # its own decoding is not the question
    _drain(engine)
    # the window: 8 steps, or through the step after the new request's first token if later
    size = max(8, first_token_step + 2) if first_token_step >= 0 else 32
    window, before = gaps[16:16 + size], gaps[:16] + gaps[16 + size:]
    median = statistics.median(before)
    return sum(g - median for g in window) / median, (max(window) - median) / median, first_token_step


def new_schema_delay(engine: Engine, pairs: int) -> dict:
    """A/B pairs in one run (order alternating): a never-seen 50-property schema arriving
    against free text arriving; the schema's cost = the difference of the others' delay."""
    added, longest, first_token, control = [], [], [], []
    for r in range(pairs):
        order = (False, True) if r % 2 == 0 else (True, False)
        for constrained in order:
            extra, worst, steps = arrival_window(engine, 16, f"{'s' if constrained else 'f'}{r}",
                                                 wide_schema(salt=f"x{r}") if constrained else None)
            if constrained:
                added.append(extra)
                longest.append(worst)
                first_token.append(steps)
            else:
                control.append(extra)
    diffs = [a - c for a, c in zip(added, control)]
    return {"new_schema_extra_steps": statistics.median(diffs), "per_pair": diffs,
            "new_schema_delay_steps": added, "free_arrival_delay_steps": control,
            "new_schema_longest_gap_extra_steps": longest, "new_schema_first_token_after_steps": first_token}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--concurrent", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="A/B pairs (A B then B A)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="8 concurrent, 1 round (tests)")
    p.add_argument("--new-schema-only", type=int, default=0, metavar="PAIRS",
                   help="only the new-schema figure, over this many A/B pairs")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    # the served default dtype (auto: bf16 on AMX CPUs, where steps run as one native call whose
    # logits the Python sampler masks), fp32 for --quick's tiny model
    model = ({"dtype": "fp32"} if args.quick else {}) | ({"path": args.model} if args.model else {})
    concurrent, rounds = (8, 1) if args.quick else (args.concurrent, args.rounds)
    engine = Engine.from_config(KvmeshConfig.from_dict({
        "model": model, "scheduler": {"max_num_seqs": max(concurrent, 16), "max_queue_time_s": 3600},
        "cache": {"num_blocks": 4096 if not args.quick else 1024}}))
    engine.structured.prepare()  # as AsyncEngine does before its step thread starts
    # warm-up: the schemas' compiles, the forward paths
    throughput_round(engine, min(concurrent, 4), 16, {}, -2)
    if args.new_schema_only:
        print(json.dumps(new_schema_delay(engine, args.new_schema_only), indent=1))
        engine.close()
        return 0
    ratios, lengths, mask_shares, cpu_ratios = [], {}, [], []
    for r in range(2 * rounds):
        c, f, mask_share, cpu_ratio = throughput_round(engine, concurrent, args.max_tokens, lengths, r)
        ratios.append(c / f)
        mask_shares.append(mask_share)
        cpu_ratios.append(cpu_ratio)
        print(f"round {r}: constrained {c:.1f} tok/s, unconstrained {f:.1f} tok/s, ratio {c / f:.3f}; per CPU "
              f"second {cpu_ratio:.3f}; masks {mask_share:.1%} of the constrained time", flush=True)
    delay = new_schema_delay(engine, max(4, 2 * rounds))
    out = {"concurrent": concurrent, "throughput_ratio": statistics.median(ratios), "ratios": ratios,
           "throughput_ratio_per_cpu_s": statistics.median(cpu_ratios), "ratios_per_cpu_s": cpu_ratios,
           "mask_share": mask_shares, **delay, "mask_s_total": engine.structured.mask_s_total,
           "figures": engine.structured.figures().__dict__}
    print(json.dumps(out, indent=1, default=str))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
