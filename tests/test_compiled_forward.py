"""`model.compile: decode` (worker/runner/compiled_forward.py): the inductor-compiled decoder
stack gives the eager model's greedy tokens, and falls back to eager where it cannot compile.

The token test is the one place the suite pays an inductor compile (tens of seconds on 2
cores, less with inductor's on-disk cache warm); everything else runs with compile off.
"""

from __future__ import annotations

import logging

import pytest

from kvmesh.core.config import ConfigError, KvmeshConfig
from kvmesh.core.seams import GenerateRequest, SamplingParams
from kvmesh.worker.engine_loop.engine import Engine
from kvmesh.worker.runner import compiled_forward

from engine_runs import generate_all_greedy

# token-id prompts of mixed lengths: several 16-token prefill chunks, some over cached context
PROMPTS = [tuple(range(100, 100 + n)) for n in (5, 37, 12, 50, 1, 23)]
NEW_TOKENS = 20


def _run(model_dir: str, compile_mode: str, preemption: str) -> tuple[Engine, dict[str, list[int]], dict]:
    engine = Engine.from_config(KvmeshConfig.from_dict({
        # native 0: every step through the compiled (or eager) decoder stack, none native
        "model": {"path": model_dir, "dtype": "fp32", "max_model_len": 512, "compile": compile_mode,
                  "cpu_native_max_tokens": 0},
        "cache": {"num_blocks": 16, "block_size": 8},  # 128 slots for ~330 tokens: decodes must preempt
        "scheduler": {"max_num_batched_tokens": 64, "max_prefill_tokens_per_step": 16, "preemption_mode": preemption,
                      "max_total_kv_tokens": 1 << 20, "max_queue_time_s": 3600},
        "parallel": {"device": "cpu"}}))
    tokens = generate_all_greedy(engine, PROMPTS, NEW_TOKENS)
    stats = engine.stats()
    return engine, tokens, {"preemptions": stats.num_preemptions_recompute + stats.num_preemptions_swap}


def test_compiled_decoder_gives_the_eager_tokens_with_chunked_prefill_and_preemption(tiny_model_dir):
    # recompute preemption: the preempted requests' prefill runs again, through the compiled
    # stack (swap preemption only copies blocks, outside the model)
    _, eager, eager_stats = _run(tiny_model_dir, "off", "recompute")
    engine, compiled, stats = _run(tiny_model_dir, "decode", "recompute")
    decoder = engine.runner.model.compiled
    if decoder is None:
        pytest.skip(f"inductor unavailable here: {compiled_forward.compile_unavailable_reason(engine.runner.model)}")
    assert stats["preemptions"] > 0 and eager_stats["preemptions"] > 0, "the small pool must force preemption"
    assert decoder.steps_run > 0, "the compiled stack really ran"
    assert all(len(t) == NEW_TOKENS for t in compiled.values())
    assert compiled == eager


def test_no_compiler_falls_back_to_eager_with_a_warning(tiny_model_dir, monkeypatch, caplog):
    monkeypatch.setattr(compiled_forward.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger=compiled_forward.__name__):
        engine = Engine.from_config(KvmeshConfig.from_dict({
            "model": {"path": tiny_model_dir, "dtype": "fp32", "max_model_len": 512, "compile": "decode"},
            "cache": {"num_blocks": 16, "block_size": 8}, "parallel": {"device": "cpu"}}))
    assert engine.runner.model.compiled is None
    assert any("no C++ compiler" in r.getMessage() for r in caplog.records)
    engine.add_request(GenerateRequest("r", prompt_token_ids=(5, 6, 7), sampling=SamplingParams(
        max_tokens=3, temperature=0, ignore_eos=True)))
    out = []
    while engine.has_unfinished():
        for delta in engine.step():
            out.extend(delta.token_ids)
    assert len(out) == 3


def test_compile_mode_is_validated():
    with pytest.raises(ConfigError, match="model.compile"):
        KvmeshConfig.from_dict({"model": {"compile": "always"}})
