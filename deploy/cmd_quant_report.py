"""`kvmesh quant-report`: each quantization mode against the unquantized model, on the four
axes the articles name: quality (held-out perplexity, greedy agreement), TTFT, decode speed,
memory (weights and KV bytes per token, separately).

    kvmesh quant-report                                   # embedded SmolLM2, every mode
    kvmesh quant-report --modes baseline w8 kv-int8 --dtype bf16 --json

Every mode runs on a fresh kvmesh Engine (the real paged KV cache and attention backend).
int4_awq is the engine's own start-up path (worker/runner/awq_calibration.py): calibrated on the
calibration text through the engine's model, scales searched (and cached), then quantized.
Perplexity is teacher-forced over the held-out text (bundled: quant/data/heldout.txt),
one sequence per forward, reading K/V back from the (possibly quantized) paged cache.
Greedy agreement: the share of generated token positions equal to the baseline's. Long-
context retrieval (quant/needle.py): a fact placed at several depths of a --needle-tokens
filler context, asked for at the end; the row reports the share of depths whose greedy
answer is right, the mean log-probability of the answer's tokens (teacher-forced, through
the mode's KV cache) and how often the mode's answer equals the baseline's. Speed, as
vLLM's bench conventions (exact output lengths, ignore_eos): at batch 1 the medians over
requests run alone; at batch B (--batch, 16) B requests submitted together, TTFT their median
and decode tok/s the sum of their decode rates. KV capacity: tokens that fit in
--kv-budget-gib at the mode's KV bytes per token, in whole blocks (kv/capacity.py).
Exit codes: 0 report, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

# Function-level imports: each `kvmesh` command imports only what it runs, so the CLI starts
# (and `--help` answers) without loading torch, Ray or transformers.

# mode -> (quant.weight, cache.kv_cache_dtype, activation dtype: None = the report's --dtype)
MODES = {
    "baseline": ("none", "auto", None),
    "w8": ("int8", "auto", None),
    # W8 as a CPU deployment would run it: bf16 activations reach torch's packed int8 kernel
    # (fp32 activations dequantize instead); compared with the baseline in the same process.
    "w8-bf16": ("int8", "auto", "bf16"),
    "w4": ("int4", "auto", None),
    "w4-awq": ("int4_awq", "auto", None),
    "kv-int8": ("none", "int8", None),
    "kv-fp8": ("none", "fp8", None),
    "kv-int4": ("none", "int4", None),
    "w8+kv-int8": ("int8", "int8", None),
}
EXIT_BAD_INPUT = 2
# needle prompt = filler + needle sentence + question; the margin bounds the last two (and
# the answer) in tokens, so the engine's blocks fit the longest teacher-forced sequence
NEEDLE_MARGIN_TOKENS = 64


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
    p.add_argument("--prompts", type=int, default=4, help="greedy prompts run alone (agreement, batch-1 speed)")
    p.add_argument("--batch", type=int, default=16, help="prompts run together for the batched TTFT and speed")
    p.add_argument("--kv-budget-gib", type=float, default=1.0, help="KV memory budget for the capacity column")
    p.add_argument("--prompt-tokens", type=int, default=64, help="tokens per greedy prompt")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens generated per prompt")
    p.add_argument("--needle-tokens", type=int, default=1024, help="filler tokens around the retrieval needle")
    p.add_argument("--needle-depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0],
                   help="relative depths of the needle in the filler (0 = start)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvmesh.core.config import ConfigError, KvmeshConfig

    modes = ["baseline"] + [m for m in dict.fromkeys(args.modes) if m != "baseline"]
    try:
        for name in ("ppl_seq_len", "ppl_sequences", "prompts", "batch", "prompt_tokens", "max_tokens",
                     "needle_tokens"):
            if getattr(args, name) < (2 if name == "ppl_seq_len" else 1):
                raise ConfigError(f"--{name.replace('_', '-')} is too small: {getattr(args, name)}")
        if any(not 0.0 <= d <= 1.0 for d in args.needle_depths):
            raise ConfigError(f"--needle-depths must be in [0, 1], got {args.needle_depths}")
        if not args.kv_budget_gib > 0:
            raise ConfigError(f"--kv-budget-gib must be > 0, got {args.kv_budget_gib}")
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
    rows, baseline_tokens, baseline_needle = [], None, None
    # the longest teacher-forced sequence: a perplexity piece, or a needle prompt with its answer
    sequence_tokens = max(args.ppl_seq_len, args.needle_tokens + NEEDLE_MARGIN_TOKENS)
    for mode in modes:
        engine = build_engine(base, mode, args.group_size, args.calibration, sequence_tokens,
                              args.prompt_tokens + args.max_tokens, args.batch)
        row = measure(engine, heldout, args)
        if baseline_tokens is None:
            baseline_tokens, baseline_needle = row.pop("_greedy"), row.pop("_needle")
            row["greedy_agreement"] = row["needle_agreement"] = 1.0
        else:
            row["greedy_agreement"] = agreement(baseline_tokens, row.pop("_greedy"))
            row["needle_agreement"] = agreement(baseline_needle, row.pop("_needle"))
        weight, kv, dtype = MODES[mode]
        rows.append({"mode": mode, "weight": weight, "kv_cache_dtype": kv, "dtype": dtype or base.model.dtype} | row)
        del engine
    return rows


def build_engine(base, mode: str, group_size: int, calibration_path: str | None, ppl_seq_len: int,
                 request_tokens: int, batch: int = 1):
    """A fresh engine for `mode`, with just the KV blocks the report's work needs: one
    teacher-forced sequence, or `batch` requests of `request_tokens` at once (allocating the
    default 1 GiB pool dominates start-up on small models). Prefix caching is off so
    teacher-forced forwards may use blocks 0..n of the idle cache without corrupting cached
    prefixes."""
    from kvmesh.worker.engine_loop.engine import Engine

    weight, kv, dtype = MODES[mode]
    bs = base.cache.block_size
    num_blocks = max(-(-ppl_seq_len // bs), batch * -(-request_tokens // bs)) + 2
    cfg = base.replace(model={"dtype": dtype or base.model.dtype},
                       quant={"weight": weight, "group_size": group_size, "calibration_path": calibration_path},
                       cache={"kv_cache_dtype": kv, "enable_prefix_caching": False, "swap_space_gib": 0.0,
                              "num_blocks": num_blocks},
                       scheduler={"max_num_seqs": max(batch, base.scheduler.max_num_seqs)})
    return Engine.from_config(cfg)


def teacher_forced_logits(engine, ids):
    """One sequence through the engine's model and (possibly quantized) paged cache as a
    single prefill: ids [T] -> logits [T, V] fp32. The engine must be idle."""
    from kvmesh.worker.runner.model_runner import prefill_logits

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


def run_together(engine, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """All `prompts` submitted at once, greedy, exactly max_tokens each: per request its
    tokens, TTFT and decode rate ((tokens - 1) / (finished - first token))."""
    from kvmesh.core.seams import GenerateRequest, SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"report-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(GenerateRequest(request_id, prompt_token_ids=tuple(prompt), sampling=sampling))
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    finals: dict[str, object] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.token_ids)
            if delta.finished:
                finals[delta.request_id] = delta
    runs = []
    for request_id in ids:
        final = finals.get(request_id)
        if final is None or final.error:
            raise RuntimeError(f"greedy request {request_id} failed: {final.error if final else 'no final delta'}")
        tm = final.timings
        decode_s = tm.finished_time - tm.first_token_time
        runs.append({"tokens": tokens[request_id], "ttft_s": tm.ttft_s,
                     "decode_tok_s": (len(tokens[request_id]) - 1) / decode_s if decode_s > 0 else float("nan")})
    return runs


def batch_prompts(engine, text: str, prompt_tokens: int, count: int) -> list[list[int]]:
    """`count` prompts of exactly `prompt_tokens` tokens cut from `text`, reused in turn when
    the text holds fewer (prefix caching is off in the report's engines, so repeats cost
    what distinct prompts would)."""
    from kvmesh.quant.calibration import token_sequences

    pieces = [ids.tolist() for ids in token_sequences(engine.tokenizer, text, seq_len=prompt_tokens,
                                                      max_sequences=count)]
    return [pieces[i % len(pieces)] for i in range(count)]


def measure(engine, heldout: str, args: argparse.Namespace) -> dict:
    """One mode's row: quality, TTFT and decode speed alone and in a batch, memory."""
    from kvmesh.kv.capacity import kv_bytes_per_token, num_blocks_for_budget
    from kvmesh.quant.calibration import is_projection

    model = engine.runner.model
    weight_bytes = _tensor_bytes(model)
    # The projections (what quant.weight replaces), against the same layers in bf16.
    projections = [m for name, m in model.named_modules() if is_projection(name)]
    projection_bf16_bytes = 2 * sum(m.in_features * m.out_features for m in projections)
    hf = engine.parts.hf_config
    bf16_kv_bytes = kv_bytes_per_token(hf.num_hidden_layers, model.num_kv_heads, model.head_dim, "bf16")
    plan = engine.parts.plan
    start = time.perf_counter()
    ppl = perplexity(engine, heldout, args.ppl_seq_len, args.ppl_sequences)
    alone = [run_together(engine, [p], args.max_tokens)[0]
             for p in batch_prompts(engine, heldout, args.prompt_tokens, args.prompts)]
    batched = run_together(engine, batch_prompts(engine, heldout, args.prompt_tokens, args.batch), args.max_tokens)
    needle = needle_retrieval(engine, heldout, args.needle_tokens, args.needle_depths)
    budget_bytes = int(args.kv_budget_gib * 2**30)
    return {"perplexity": ppl,
            "needle_tokens": args.needle_tokens, "needle_depths": list(args.needle_depths),
            "needle_retrieval": needle["retrieval"], "needle_answer_logprob": needle["answer_logprob"],
            "needle_hits": needle["hits"],
            "ttft_s": statistics.median(r["ttft_s"] for r in alone),
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in alone),
            "batch": args.batch,
            "batch_ttft_s": statistics.median(r["ttft_s"] for r in batched),
            # the batch's requests decode together: their rates add up
            "batch_decode_tok_s": sum(r["decode_tok_s"] for r in batched),
            "weight_bytes": weight_bytes, "projection_weight_bytes": sum(_tensor_bytes(m) for m in projections),
            "projection_bf16_bytes": projection_bf16_bytes,
            "kv_bytes_per_token": plan.kv_bytes_per_token, "kv_bf16_bytes_per_token": bf16_kv_bytes,
            "kv_budget_gib": args.kv_budget_gib,
            "kv_capacity_tokens": num_blocks_for_budget(budget_bytes, plan.block_size, plan.kv_bytes_per_token)
            * plan.block_size,
            "measure_s": time.perf_counter() - start, "_greedy": [r["tokens"] for r in alone],
            "_needle": needle["tokens"]}


def needle_retrieval(engine, filler: str, context_tokens: int, depths) -> dict:
    """The needle probe (quant/needle.py) at each depth: greedy answers, whether each is
    right, and the answer's mean log-probability teacher-forced through the KV cache."""
    import torch

    from kvmesh.core.config import ConfigError
    from kvmesh.quant.needle import needle_prompts, retrieved

    prompts = needle_prompts(engine.tokenizer, filler, context_tokens, depths)
    hits, tokens, logprobs = [], [], []
    for prompt in prompts:
        sequence = prompt.prompt_ids + prompt.answer_ids
        if len(sequence) > context_tokens + NEEDLE_MARGIN_TOKENS:
            raise ConfigError(f"needle prompt of {len(sequence)} tokens exceeds its {NEEDLE_MARGIN_TOKENS}-token margin")
        generated = run_together(engine, [list(prompt.prompt_ids)], len(prompt.answer_ids))[0]["tokens"]
        hits.append(retrieved(prompt, generated))
        tokens.append(generated)
        ids = torch.tensor(sequence, dtype=torch.long)
        logits = teacher_forced_logits(engine, ids).cpu().log_softmax(-1)
        start = len(prompt.prompt_ids)
        answer = ids[start:]
        logprobs.append(float(logits[start - 1:-1].gather(1, answer[:, None]).mean()))
    return {"retrieval": sum(hits) / len(hits), "answer_logprob": statistics.fmean(logprobs),
            "hits": hits, "tokens": tokens}


def _tensor_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def agreement(reference: list[list[int]], candidate: list[list[int]]) -> float:
    """Share of token positions where the candidate's greedy output equals the reference's."""
    same = total = 0
    for ref, cand in zip(reference, candidate):
        same += sum(a == b for a, b in zip(ref, cand))
        total += max(len(ref), len(cand))
    return same / total if total else 1.0


def format_report(rows: list[dict]) -> str:
    """A markdown table, one row per mode. Ratios: perplexity against the baseline (the first
    row); projection weights against the same layers in bf16; KV tokens against a bf16 KV
    cache of the same budget (the articles' reference points)."""
    base = rows[0]
    batch = base["batch"]
    head = ["mode", "ppl", "d ppl", "greedy", f"needle @{base['needle_tokens']}", "needle logp", "needle = base",
            "TTFT ms @1", "tok/s @1", f"TTFT ms @{batch}", f"tok/s @{batch}",
            "weights MiB", "proj. MiB", "proj. x bf16", "KV B/token", f"KV tokens in {base['kv_budget_gib']:g} GiB",
            "KV x bf16"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["mode"], f"{r['perplexity']:.3f}", f"{r['perplexity'] / base['perplexity'] - 1:+.2%}",
                 f"{r['greedy_agreement']:.1%}", f"{r['needle_retrieval']:.0%}", f"{r['needle_answer_logprob']:.2f}",
                 f"{r['needle_agreement']:.0%}", f"{r['ttft_s'] * 1e3:.1f}", f"{r['decode_tok_s']:.1f}",
                 f"{r['batch_ttft_s'] * 1e3:.1f}", f"{r['batch_decode_tok_s']:.1f}",
                 f"{r['weight_bytes'] / 2**20:.1f}", f"{r['projection_weight_bytes'] / 2**20:.1f}",
                 f"{r['projection_weight_bytes'] / r['projection_bf16_bytes']:.3f}",
                 f"{r['kv_bytes_per_token']:,}", f"{r['kv_capacity_tokens']:,}",
                 f"{r['kv_bf16_bytes_per_token'] / r['kv_bytes_per_token']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
