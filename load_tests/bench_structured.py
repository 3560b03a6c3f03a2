"""Structured output's cost, as ratios in ONE process and run (in-process engine, CPU).

    python -m kvmesh.load_tests.bench_structured               # SmolLM2, 64 concurrent, 3 rounds
    python -m kvmesh.load_tests.bench_structured --quick --model DIR   # seconds (tests)

Figures:
  * throughput  64 concurrent requests, each with a JSON schema (the held-out shapes below,
                cycled), temperature 0.7, seeded; then the SAME requests unconstrained, each
                generating exactly as many tokens as its constrained run did (ignore_eos,
                max_tokens = that count). Output tokens/s of each; ratio = constrained /
                unconstrained (the issue's bar: >= 0.9). Rounds alternate A B B A, so drift of
                a shared machine hits both alike.
  * new_schema  16 free requests decoding; a request with a never-seen 50-property schema
                arrives mid-run. The others' gaps between consecutive steps in the window
                while it compiles, against their median gap: extra steps of delay =
                (longest gap - median gap) / median gap (the bar: <= 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
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


def _drain(engine: Engine) -> tuple[dict[str, int], float]:
    counts: dict[str, int] = {}
    started = time.perf_counter()
    while engine.has_unfinished():
        for d in engine.step():
            counts[d.request_id] = counts.get(d.request_id, 0) + len(d.token_ids)
    return counts, time.perf_counter() - started


def throughput_round(engine: Engine, num_requests: int, max_tokens: int, lengths: dict[int, int],
                     round_index: int) -> tuple[float, float]:
    """(constrained tokens/s, unconstrained tokens/s) of one round. `lengths` (request index ->
    constrained output tokens) fills on the first round; seeded requests sample the same tokens
    in any batch, so later rounds may run the unconstrained half first (ABBA order)."""
    def constrained() -> float:
        for i in range(num_requests):
            engine.add_request(GenerateRequest(f"c{round_index}-{i}", prompt=PROMPT, sampling=SamplingParams(
                max_tokens=max_tokens, temperature=0.7, seed=i,
                structured=StructuredOutput("json_schema", json.dumps(SCHEMAS[i % len(SCHEMAS)])))))
        counts, seconds = _drain(engine)
        for i in range(num_requests):
            lengths.setdefault(i, counts[f"c{round_index}-{i}"])
        return sum(counts.values()) / seconds

    def free() -> float:
        for i in range(num_requests):
            engine.add_request(GenerateRequest(f"f{round_index}-{i}", prompt=PROMPT, sampling=SamplingParams(
                max_tokens=lengths[i], temperature=0.7, seed=i, ignore_eos=True)))
        counts, seconds = _drain(engine)
        return sum(counts.values()) / seconds

    if round_index % 2 == 0 or len(lengths) < num_requests:
        c = constrained()
        return c, free()
    f = free()
    return constrained(), f


def new_schema_delay(engine: Engine, num_free: int, salt: str) -> float:
    """Extra steps of delay the others see while a never-seen 50-property schema compiles."""
    for i in range(num_free):
        engine.add_request(GenerateRequest(f"d{salt}-{i}", prompt=PROMPT, sampling=SamplingParams(
            max_tokens=64, temperature=0.7, seed=i, ignore_eos=True)))
    gaps: list[float] = []
    window: list[float] = []
    last = time.perf_counter()
    added = False
    for step in range(48):
        if step == 16:
            engine.add_request(GenerateRequest(f"wide{salt}", prompt=PROMPT, sampling=SamplingParams(
                max_tokens=400, temperature=0.0, structured=StructuredOutput("json_schema", json.dumps(
                    wide_schema(salt=salt))))))
            added = True
        engine.step()
        now = time.perf_counter()
        (window if added and len(window) < 8 else gaps).append(now - last)
        last = now
    _drain(engine)
    median = statistics.median(gaps)
    return (max(window) - median) / median


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--concurrent", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="A/B pairs (A B then B A)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="8 concurrent, 1 round (tests)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    # the served default dtype (auto: bf16 on AMX CPUs, where steps run as one native call whose
    # logits the Python sampler masks), fp32 for --quick's tiny model
    model = ({"dtype": "fp32"} if args.quick else {}) | ({"path": args.model} if args.model else {})
    concurrent, rounds = (8, 1) if args.quick else (args.concurrent, args.rounds)
    engine = Engine.from_config(KvmeshConfig.from_dict({
        "model": model, "scheduler": {"max_num_seqs": max(concurrent, 16), "max_queue_time_s": 3600},
        "cache": {"num_blocks": 4096 if not args.quick else 1024}}))
    # warm-up: the tokenizer for masks (~1 s once), the schemas' compiles, the forward paths
    throughput_round(engine, min(concurrent, 4), 16, {}, -2)
    ratios, lengths = [], {}
    for r in range(2 * rounds):
        c, f = throughput_round(engine, concurrent, args.max_tokens, lengths, r)
        ratios.append(c / f)
        print(f"round {r}: constrained {c:.1f} tok/s, unconstrained {f:.1f} tok/s, ratio {c / f:.3f}", flush=True)
    delays = [new_schema_delay(engine, 16, salt=f"x{r}") for r in range(rounds)]
    out = {"concurrent": concurrent, "throughput_ratio": statistics.median(ratios), "ratios": ratios,
           "new_schema_extra_steps": max(delays), "mask_s_total": engine.structured.mask_s_total,
           "figures": engine.structured.figures().__dict__}
    print(json.dumps(out, indent=1, default=str))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
