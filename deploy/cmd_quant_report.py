"""`kvmesh quant-report`: each quantization mode against the unquantized model, on the four
axes the articles name: quality (held-out perplexity, greedy agreement), TTFT, decode speed,
memory (weights and KV bytes per token, separately).

    kvmesh quant-report                                   # embedded SmolLM2, every mode
    kvmesh quant-report --modes baseline w8 kv-int8 --dtype bf16 --json

Every mode runs on a fresh kvmesh Engine (the real paged KV cache and attention backend).
int4_awq is the engine's own start-up path (worker/awq_calibration.py): calibrated on the
calibration text through the engine's model, scales searched (and cached), then quantized.
Perplexity is teacher-forced over the held-out text (bundled: quant/data/heldout.txt),
one sequence per forward, reading K/V back from the (possibly quantized) paged cache.
Greedy agreement: the share of generated token positions equal to the baseline's. TTFT and
decode speed are medians over single, unbatched requests. Exit codes: 0 report, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

# mode -> (quant.weight, cache.kv_cache_dtype)
MODES = {
    "baseline": ("none", "auto"),
    "w8": ("int8", "auto"),
    "w4": ("int4", "auto"),
    "w4-awq": ("int4_awq", "auto"),
    "kv-int8": ("none", "int8"),
    "kv-fp8": ("none", "fp8"),
    "w8+kv-int8": ("int8", "int8"),
}
EXIT_BAD_INPUT = 2


def register(subparsers) -> None:
    p = subparsers.add_parser("quant-report", help="quality, speed and memory of each quantization mode",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF folder or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"),
                   help="activation dtype (bf16 on CPU uses torch's packed int8/int4 kernels)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                   help="modes to compare; baseline is always run first")
    p.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128), help="int4 group size")
    p.add_argument("--calibration", help="calibration text (default: the bundled corpus)")
    p.add_argument("--heldout", help="held-out text for perplexity and prompts (default: bundled)")
    p.add_argument("--ppl-seq-len", type=int, default=256, help="tokens per perplexity sequence")
    p.add_argument("--ppl-sequences", type=int, default=4, help="perplexity sequences (at most)")
    p.add_argument("--prompts", type=int, default=4, help="greedy prompts for agreement and speed")
    p.add_argument("--prompt-tokens", type=int, default=64, help="tokens per greedy prompt")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens generated per prompt")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvmesh.deploy.config import ConfigError, KvmeshConfig

    modes = ["baseline"] + [m for m in dict.fromkeys(args.modes) if m != "baseline"]
    try:
        for name in ("ppl_seq_len", "ppl_sequences", "prompts", "prompt_tokens", "max_tokens"):
            if getattr(args, name) < (2 if name == "ppl_seq_len" else 1):
                raise ConfigError(f"--{name.replace('_', '-')} is too small: {getattr(args, name)}")
        base = KvmeshConfig().replace(model={"path": args.model, "dtype": args.dtype})
        rows = compare_modes(base, modes, args)
    except ConfigError as exc:
        print(f"kvmesh quant-report: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps({"modes": rows}, indent=2))
    else:
        print(format_report(rows))
    return 0


def compare_modes(base, modes: list[str], args: argparse.Namespace) -> list[dict]:
    from kvmesh.quant.calibration import HELDOUT_TEXT, load_text

    heldout = load_text(args.heldout or HELDOUT_TEXT)
    load_text(args.calibration)  # a missing or empty calibration file fails before any engine starts
    rows, baseline_tokens = [], None
    for mode in modes:
        max_seq_tokens = max(args.ppl_seq_len, args.prompt_tokens + args.max_tokens)
        engine = build_engine(base, mode, args.group_size, args.calibration, max_seq_tokens)
        row = measure(engine, heldout, args)
        if baseline_tokens is None:
            baseline_tokens = row.pop("_greedy")
            row["greedy_agreement"] = 1.0
        else:
            row["greedy_agreement"] = agreement(baseline_tokens, row.pop("_greedy"))
        rows.append({"mode": mode, "weight": MODES[mode][0], "kv_cache_dtype": MODES[mode][1]} | row)
        del engine
    return rows


def build_engine(base, mode: str, group_size: int, calibration_path: str | None, max_seq_tokens: int):
    """A fresh engine for `mode`, with just the KV blocks one request of `max_seq_tokens`
    needs (allocating the default 1 GiB pool dominates start-up on small models). Prefix
    caching is off so teacher-forced forwards may use blocks 0..n of the idle cache without
    corrupting cached prefixes."""
    from kvmesh.worker.engine import Engine

    weight, kv = MODES[mode]
    cfg = base.replace(quant={"weight": weight, "group_size": group_size, "calibration_path": calibration_path},
                       cache={"kv_cache_dtype": kv, "enable_prefix_caching": False, "swap_space_gib": 0.0,
                              "num_blocks": 2 * -(-max_seq_tokens // base.cache.block_size) + 2})
    return Engine.from_config(cfg)


def teacher_forced_logits(engine, ids):
    """One sequence through the engine's model and (possibly quantized) paged cache as a
    single prefill: ids [T] -> logits [T, V] fp32. The engine must be idle."""
    from kvmesh.worker.model_runner import prefill_logits

    runner = engine.runner
    return prefill_logits(runner.model, ids, runner.kv_caches, runner.backend)


def perplexity(engine, text: str, seq_len: int, max_sequences: int) -> float:
    """exp(mean next-token NLL) over up to `max_sequences` [seq_len] pieces of `text`."""
    import torch.nn.functional as F

    from kvmesh.quant.calibration import token_sequences

    nll, count = 0.0, 0
    for ids in token_sequences(engine.tokenizer, text, seq_len=seq_len, max_sequences=max_sequences):
        logits = teacher_forced_logits(engine, ids)
        nll += float(F.cross_entropy(logits[:-1].cpu(), ids[1:], reduction="sum"))
        count += ids.numel() - 1
    return math.exp(nll / count)


def greedy_runs(engine, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Each prompt alone, greedy, exactly max_tokens: its tokens, TTFT and decode rate."""
    from kvmesh.worker.api import GenerateRequest, SamplingParams

    runs = []
    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(GenerateRequest(f"report-{i}", prompt_token_ids=tuple(prompt), sampling=sampling))
        tokens, final = [], None
        while engine.has_unfinished():
            for delta in engine.step():
                tokens.extend(delta.token_ids)
                if delta.finished:
                    final = delta
        if final is None or final.error:
            raise RuntimeError(f"greedy request {i} failed: {final.error if final else 'no final delta'}")
        tm = final.timings
        decode_s = tm.finished_time - tm.first_token_time
        runs.append({"tokens": tokens, "ttft_s": tm.ttft_s,
                     "decode_tok_s": (len(tokens) - 1) / decode_s if decode_s > 0 else float("nan")})
    return runs


def measure(engine, heldout: str, args: argparse.Namespace) -> dict:
    from kvmesh.quant.calibration import token_sequences

    model = engine.runner.model
    weight_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    prompts = [ids.tolist() for ids in token_sequences(engine.tokenizer, heldout, seq_len=args.prompt_tokens,
                                                       max_sequences=args.prompts)]
    start = time.perf_counter()
    ppl = perplexity(engine, heldout, args.ppl_seq_len, args.ppl_sequences)
    runs = greedy_runs(engine, prompts, args.max_tokens)
    return {"perplexity": ppl,
            "ttft_s": statistics.median(r["ttft_s"] for r in runs),
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
            "weight_bytes": weight_bytes, "kv_bytes_per_token": engine.parts.plan.kv_bytes_per_token,
            "measure_s": time.perf_counter() - start, "_greedy": [r["tokens"] for r in runs]}


def agreement(reference: list[list[int]], candidate: list[list[int]]) -> float:
    """Share of token positions where the candidate's greedy output equals the reference's."""
    same = total = 0
    for ref, cand in zip(reference, candidate):
        same += sum(a == b for a, b in zip(ref, cand))
        total += max(len(ref), len(cand))
    return same / total if total else 1.0


def format_report(rows: list[dict]) -> str:
    base = rows[0]
    head = (f"{'mode':<12}{'ppl':>9}{'d ppl':>8}{'greedy':>8}{'TTFT ms':>9}{'tok/s':>8}"
            f"{'weights MiB':>13}{'KV B/token':>12}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['mode']:<12}{r['perplexity']:>9.3f}{r['perplexity'] - base['perplexity']:>+8.3f}"
                     f"{r['greedy_agreement']:>8.1%}{r['ttft_s'] * 1e3:>9.1f}{r['decode_tok_s']:>8.1f}"
                     f"{r['weight_bytes'] / 2**20:>13.1f}{r['kv_bytes_per_token']:>12,}")
    return "\n".join(lines)
