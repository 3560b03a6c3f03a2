"""Speculative decoding through the real engine (tiny random Llama): greedy outputs
token-identical to plain decoding under chunked prefill, preemption and prefix-cache hits;
stop conditions exact with several tokens accepted per step; every block returned."""

import pytest

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import FinishReason, GenerateRequest, SamplingParams
from kvmesh.worker.engine_loop.draft_proposers import find_ngram_continuation
from kvmesh.worker.engine_loop.engine import Engine
from kvmesh.worker.engine_loop.speculator import StepCostCurve

SHARED = "Fix the typos in this paragraph: the quick brown fox jumps over the lazy dog. " * 3
PROMPTS = [SHARED + "Again: the quick brown", SHARED + "Once more, the lazy", "1, 2, 3, 4, 5, 6, 7,",
           "def add(a, b):\n    return a + b\n\ndef add(", "Hello there", SHARED + "dog dog dog"]


def _engine(model_dir, method="none", **overrides):
    data = {
        "model": {"path": model_dir, "dtype": "fp32", "max_model_len": 512},
        # A pool small enough that decodes preempt, prefill chunks of 16 tokens.
        "cache": {"num_blocks": 26, "block_size": 8},
        "scheduler": {"max_num_batched_tokens": 64, "max_prefill_tokens_per_step": 16,
                      "max_total_kv_tokens": 1 << 20, "max_queue_time_s": 3600},
        # A fixed threshold: speculate in every step (the measured gate is tested on its own).
        "speculative": {"method": method, "num_tokens": 4, "ngram_min_tokens": 1, "load_threshold_tokens": 1000},
    }
    for section, values in overrides.items():
        data[section].update(values)
    return Engine.from_config(KvmeshConfig.from_dict(data))


def _run(engine, requests):
    for rid, prompt, params in requests:
        engine.add_request(GenerateRequest(rid, prompt=prompt, sampling=params))
    tokens = {rid: [] for rid, _, _ in requests}
    finals = {}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.token_ids)
            if delta.finished:
                finals[delta.request_id] = delta
        engine.check_integrity()
    assert engine.stats().num_blocks_used == 0, "every finished request returns its blocks"
    return tokens, finals


def test_ngram_lookup_takes_the_longest_latest_match():
    assert find_ngram_continuation([1, 2, 3, 4, 9, 9, 1, 2, 3], 1, 3, 2) == [4, 9]
    # The longer match (2 3) wins over the later single-token match of 3.
    assert find_ngram_continuation([2, 3, 7, 3, 8, 2, 3], 1, 3, 1) == [7]
    assert find_ngram_continuation([5, 6, 7], 1, 3, 4) == []
    assert find_ngram_continuation([5, 6, 5, 6, 5], 2, 2, 3) == [6, 5]  # overlapping repeats
    assert find_ngram_continuation([1, 2, 1], 2, 3, 2) == []  # below min_n


def test_greedy_ngram_is_token_identical_with_chunked_prefill_preemption_and_prefix_hits(tiny_model_dir):
    requests = [(f"r{i}", p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
                for i, p in enumerate(PROMPTS)]
    plain_engine = _engine(tiny_model_dir)
    plain, _ = _run(plain_engine, requests)
    spec_engine = _engine(tiny_model_dir, "ngram")
    spec, finals = _run(spec_engine, requests)
    assert spec == plain
    counters = spec_engine.speculator.counters
    assert counters.num_accepted_tokens > 20, "drafts were verified and many kept"
    assert counters.num_accepted_tokens < counters.num_draft_tokens, "and some rejected (rolled back)"
    stats = spec_engine.scheduler.stats()
    assert stats.num_preemptions_recompute > 0, "the pool is small enough to preempt"
    assert stats.prefix_cache_hit_rate > 0, "the shared paragraph is a prefix hit"
    assert spec_engine.num_forward_tokens != plain_engine.num_forward_tokens
    assert all(f.usage.completion_tokens == 40 for f in finals.values())


def test_stop_conditions_hold_exactly_with_multi_token_acceptance(tiny_model_dir):
    # This prompt makes the tiny model repeat one token: drafts are kept several per step.
    prompt = PROMPTS[2]
    plain_engine = _engine(tiny_model_dir)
    base, _ = _run(plain_engine, [("b", prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))])
    repeated = base["b"][0]
    cases = {
        # The repeated token is blocked until 13 tokens are out (then it would stop the request).
        "min_tokens": SamplingParams(max_tokens=30, temperature=0, stop_token_ids=(repeated,), min_tokens=13),
        "stop_str": SamplingParams(max_tokens=30, temperature=0, stop=(plain_engine.tokenizer.decode([repeated] * 6),)),
        "max_tokens": SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
        "penalty": SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, repetition_penalty=1.5,
                                  frequency_penalty=0.5),
    }
    requests = [(name, prompt, params) for name, params in cases.items()]
    plain, plain_finals = _run(_engine(tiny_model_dir), requests)
    spec_engine = _engine(tiny_model_dir, "ngram")
    spec, spec_finals = _run(spec_engine, requests)
    assert spec == plain
    for name in cases:
        assert spec_finals[name].finish_reason == plain_finals[name].finish_reason, name
        assert spec_finals[name].usage == plain_finals[name].usage, name
        assert spec_finals[name].text == plain_finals[name].text, name
    assert len(spec["min_tokens"]) >= 13 and repeated not in spec["min_tokens"][:13]
    # Six repeats of one token: the stop lands inside a step's accepted drafts.
    assert spec_finals["stop_str"].finish_reason == FinishReason.STOP and len(spec["stop_str"]) < 12
    assert spec_finals["max_tokens"].finish_reason == FinishReason.LENGTH and len(spec["max_tokens"]) == 7
    assert spec_engine.speculator.counters.num_accepted_tokens > 4


def test_opt_out_and_logprobs_requests_decode_plainly(tiny_model_dir):
    engine = _engine(tiny_model_dir, "ngram")
    _run(engine, [("o", PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, speculative=False)),
                  ("l", PROMPTS[1], SamplingParams(max_tokens=12, temperature=0, logprobs=True))])
    assert engine.speculator.counters.num_draft_tokens == 0


def test_cost_curve_interpolates_measured_step_times():
    curve = StepCostCurve(smoothing=1.0)
    curve.observe(1, 0.010)
    assert curve.seconds(8) == pytest.approx(0.010)  # one size seen: flat (optimistic)
    curve.observe(64, 0.073)
    assert curve.seconds(32) == pytest.approx(0.010 + 31 * 0.001)
    assert curve.seconds(128) == pytest.approx(0.010 + 127 * 0.001)  # the last slope extended
