"""`kvmesh quant-report` on a tiny random Llama through the real engine: the modes run, the
baseline's teacher-forced logits are HF's, and memory figures match the capacity model."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from kvmesh.deploy import cmd_quant_report
from kvmesh.core.config import KvmeshConfig
from kvmesh.kv import capacity


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvmesh")
    cmd_quant_report.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["quant-report", *argv])


SMALL = ["--ppl-seq-len", "48", "--ppl-sequences", "2", "--prompts", "2", "--batch", "3", "--prompt-tokens", "16",
         "--max-tokens", "6", "--group-size", "32", "--kv-budget-gib", "0.5", "--needle-tokens", "64",
         "--needle-depths", "0", "1"]


def test_report_modes_on_a_tiny_model(tiny_model_dir, capsys):
    args = parse(["--model", tiny_model_dir, "--dtype", "fp32", "--json", "--modes", "w8", "w4-awq", "kv-int8",
                  "kv-int4", *SMALL])
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)["modes"]
    rows = {r["mode"]: r for r in report}
    assert list(rows) == ["baseline", "w8", "w4-awq", "kv-int8", "kv-int4"]  # baseline always first
    base = rows["baseline"]
    assert base["greedy_agreement"] == 1.0
    assert all(math.isfinite(r["perplexity"]) and r["perplexity"] > 1 for r in rows.values())
    assert all(0.0 <= r["greedy_agreement"] <= 1.0 and r["ttft_s"] > 0 for r in rows.values())
    # int8 weights barely move perplexity; they and int4 shrink the weights
    assert abs(rows["w8"]["perplexity"] - base["perplexity"]) < 0.02 * base["perplexity"]
    assert rows["w8"]["weight_bytes"] < base["weight_bytes"] and rows["w4-awq"]["weight_bytes"] < rows["w8"]["weight_bytes"]
    # the engine's KV bytes per token are the capacity model's (tiny model: 2 layers, 2 KV heads, d 16)
    assert base["kv_bytes_per_token"] == capacity.kv_bytes_per_token(2, 2, 16, "fp32")
    # batch 3 ran: three requests decoding together, their rates summed
    assert all(r["batch"] == 3 and r["batch_ttft_s"] > 0 and r["batch_decode_tok_s"] > 0 for r in rows.values())
    # capacity in 0.5 GiB, in whole 16-token blocks: fp32 512 B/token; int8 128 + 16 (fp16 scales)
    for mode, kv in (("baseline", "fp32"), ("kv-int8", "int8")):
        per_token = capacity.kv_bytes_per_token(2, 2, 16, kv)
        assert rows[mode]["kv_capacity_tokens"] == (2**29 // (per_token * 16)) * 16
    assert rows["kv-int8"]["kv_capacity_tokens"] / base["kv_capacity_tokens"] == pytest.approx(512 / 144, rel=1e-3)
    assert rows["w8"]["kv_capacity_tokens"] == base["kv_capacity_tokens"]  # weights do not change KV
    # int4 KV: 8 bytes of codes + one fp16 scale (group 16 = head_dim) per token-head, K and V
    assert rows["kv-int4"]["kv_bytes_per_token"] == capacity.kv_bytes_per_token(2, 2, 16, "int4") == 2 * 2 * 2 * 10
    # the needle probe ran at both depths in every mode; the baseline agrees with itself
    for r in rows.values():
        assert r["needle_depths"] == [0.0, 1.0] and len(r["needle_hits"]) == 2
        assert r["needle_retrieval"] == sum(r["needle_hits"]) / 2
        assert math.isfinite(r["needle_answer_logprob"]) and r["needle_answer_logprob"] < 0
        assert 0.0 <= r["needle_agreement"] <= 1.0
    assert base["needle_agreement"] == 1.0
    # projections (14 of them: 2 layers x 7) against the same layers in bf16
    proj_params = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)  # per layer: q, o 64x64; k, v 64x32; mlp 3 x 64x128
    assert all(r["projection_bf16_bytes"] == 2 * proj_params for r in rows.values())
    assert base["projection_weight_bytes"] == 4 * proj_params  # fp32
    out_rows = 2 * (64 + 32 + 32 + 64 + 128 + 128 + 64)  # one fp32 int8 scale per output row
    assert rows["w8"]["projection_weight_bytes"] == proj_params + 4 * out_rows
    table = cmd_quant_report.format_report(report)
    assert "| tok/s @3 |" in table and "| needle @64 |" in table and table.count("\n") == 1 + len(report)  # header, rule, one line a mode
    assert "| kv-int8 |" in table and f"| {256 / 144:.2f} |" in table  # KV x bf16 = 256 / (128 + 16)


def test_teacher_forced_logits_equal_hf_and_kv_int8_stays_close(tiny_model_dir):
    from transformers import LlamaForCausalLM

    cfg = KvmeshConfig().replace(model={"path": tiny_model_dir, "dtype": "fp32"})
    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(0))
    hf = LlamaForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    baseline = cmd_quant_report.build_engine(cfg, "baseline", 32, None, 40, 40)
    torch.testing.assert_close(cmd_quant_report.teacher_forced_logits(baseline, ids).cpu(), theirs,
                               atol=1e-4, rtol=1e-4)
    # int8 KV through the engine's real paged cache: close to fp32, and sized as the capacity model says
    kv_int8 = cmd_quant_report.build_engine(cfg, "kv-int8", 32, None, 40, 40)
    assert kv_int8.parts.plan.kv_bytes_per_token == capacity.kv_bytes_per_token(2, 2, 16, "int8")
    ours = cmd_quant_report.teacher_forced_logits(kv_int8, ids).cpu()
    assert not torch.equal(ours, theirs)  # the cache really is quantized
    assert float((ours - theirs).norm() / theirs.norm()) < 0.02


def test_bad_input_exits_2(capsys):
    args = parse(["--ppl-seq-len", "1"])
    assert args.func(args) == 2
    assert "error:" in capsys.readouterr().err


def test_agreement():
    assert cmd_quant_report.agreement([[1, 2, 3]], [[1, 5, 3]]) == pytest.approx(2 / 3)
    assert cmd_quant_report.agreement([[1, 2]], [[1, 2, 3]]) == pytest.approx(2 / 3)


class ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def test_needle_prompts_place_the_fact_at_each_depth():
    from kvmesh.core.config import ConfigError
    from kvmesh.quant import needle

    tok = ByteTokenizer()
    prompts = needle.needle_prompts(tok, "abc", 10, depths=(0.0, 0.5, 1.0), code="42")
    fact = tok.encode(needle.NEEDLE_TEXT.format(code="42"))
    question = tok.encode(needle.QUESTION_TEXT)
    for p, at in zip(prompts, (0, 5, 10)):
        ids = list(p.prompt_ids)
        assert ids[at:at + len(fact)] == fact  # the filler (repeated "abc") is cut around it
        assert ids[:at] == tok.encode("abcabcabca")[:at] and ids[-len(question):] == question
        assert len(ids) == 10 + len(fact) + len(question)
    assert prompts[0].answer_ids == tuple(tok.encode(" 42."))
    assert needle.retrieved(prompts[0], list(tok.encode(" 42. more"))) and not needle.retrieved(prompts[0], [1])
    with pytest.raises(ConfigError):
        needle.needle_prompts(tok, "abc", 10, depths=(1.5,))
