"""Speculative decoding through the real engine (tiny random Llama): greedy outputs
token-identical to plain decoding under chunked prefill, preemption and prefix-cache hits;
stop conditions exact with several tokens accepted per step; every block returned."""

import pytest
import torch

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import FinishReason, GenerateRequest, SamplingParams
from kvmesh.worker.engine_loop.draft_proposers import find_ngram_continuation
from kvmesh.worker.engine_loop.engine import Engine
from kvmesh.worker.engine_loop.speculator import StepCostCurve
from kvmesh.worker.kernels import cpu_build, cpu_native_step
from kvmesh.worker.runner.rejection_sampler import Verified, verify
from kvmesh.worker.runner.sampler import SamplingRow
from kvmesh.worker.model.tokenizer import render_chat

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


def test_opt_out_decodes_plainly_and_logprobs_requests_speculate_with_one_logprob_per_token(tiny_model_dir):
    opt_out = ("o", PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, speculative=False))
    engine = _engine(tiny_model_dir, "ngram")
    _run(engine, [opt_out])
    assert engine.speculator.counters.num_draft_tokens == 0

    def with_logprobs(engine):
        engine.add_request(GenerateRequest("l", prompt=PROMPTS[2], sampling=SamplingParams(
            max_tokens=24, temperature=0, ignore_eos=True, logprobs=True)))
        tokens, logprobs = [], []
        while engine.has_unfinished():
            for delta in engine.step():
                assert not delta.token_ids or len(delta.logprobs) == len(delta.token_ids)
                tokens += delta.token_ids
                logprobs += delta.logprobs
        return tokens, logprobs

    plain_tokens, plain_logprobs = with_logprobs(_engine(tiny_model_dir))
    spec_tokens, spec_logprobs = with_logprobs(engine)
    assert engine.speculator.counters.num_accepted_tokens > 0  # several tokens (and logprobs) per step
    assert spec_tokens == plain_tokens
    assert spec_logprobs == pytest.approx(plain_logprobs, abs=1e-4)


def test_cost_curve_interpolates_measured_step_times():
    curve = StepCostCurve(smoothing=1.0)
    curve.observe(1, 0.010)
    assert curve.seconds(8) == pytest.approx(0.080)  # one size seen: proportional (pessimistic)
    curve.observe(64, 0.073)
    assert curve.seconds(32) == pytest.approx(0.010 + 31 * 0.001)
    assert curve.seconds(128) == pytest.approx(0.010 + 127 * 0.001)  # the last slope extended


def _filtered(logits, temperature, top_k):
    probs = torch.softmax(logits / temperature, dim=-1)
    keep = torch.topk(probs, top_k).indices
    out = torch.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()


@pytest.mark.parametrize("temperature,top_k", [(1.0, 4), (0.7, 3)])
def test_rejection_sampling_leaves_the_two_token_distribution_unchanged(temperature, top_k):
    """A known two-step model over 4 tokens; drafts (0, 1) one-hot. The joint law of the first
    two emitted tokens (a rejected first draft: the second comes from plain sampling, as the
    next step would) must be p1(x1) p2(x2 | x1) of the filtered target. Chi-square over the
    16 cells, 8k seeded trials; 37.7 is the 0.1% critical value for 15 degrees of freedom."""
    gen = torch.Generator().manual_seed(7)
    logits1 = torch.randn(4, generator=gen)
    logits2 = torch.randn(4, 4, generator=gen)  # [x1] -> logits of x2
    logits3 = torch.randn(4, 4, 4, generator=gen)
    drafts = (0, 1)
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=8)
    row = SamplingRow(params, [5], [], gen)
    rows_logits = torch.stack([logits1, logits2[0], logits3[0, 1]])
    counts = torch.zeros(4, 4)
    trials = 8_000
    for _ in range(trials):
        tokens = verify(rows_logits, [drafts], [row], gen)[0].token_ids
        x1 = tokens[0]
        x2 = tokens[1] if len(tokens) > 1 else int(torch.multinomial(
            _filtered(logits2[x1], temperature, top_k), 1, generator=gen))
        counts[x1, x2] += 1
    p1 = _filtered(logits1, temperature, top_k)
    expected = torch.stack([p1[a] * _filtered(logits2[a], temperature, top_k) for a in range(4)]) * trials
    cells = expected > 0
    assert counts[~cells].sum() == 0, "a token outside the filtered support was emitted"
    chi2 = float((((counts - expected) ** 2)[cells] / expected[cells]).sum())
    assert chi2 < 37.7, f"chi-square {chi2:.1f}: the distribution changed"


def test_greedy_verify_keeps_the_agreeing_prefix_then_corrects():
    logits = torch.full((4, 10), -5.0)
    for i, t in enumerate([3, 4, 9, 2]):  # the target's argmax per row
        logits[i, t] = 5.0
    row = SamplingRow(SamplingParams(temperature=0, max_tokens=8), [1], [], None)
    gen = torch.Generator().manual_seed(0)
    assert verify(logits, [(3, 4, 5)], [row], gen)[0] == Verified((3, 4), 9)
    assert verify(logits, [(3, 4, 9)], [row], gen)[0] == Verified((3, 4, 9), 2)  # bonus token
    assert verify(logits, [(0, 4, 9)], [row], gen)[0] == Verified((), 3)


def test_sampled_requests_speculate_through_the_engine(tiny_model_dir):
    engine = _engine(tiny_model_dir, "ngram")
    requests = [(f"s{i}", PROMPTS[2], SamplingParams(max_tokens=24, temperature=0.3, top_k=4, seed=i))
                for i in range(4)]
    tokens, finals = _run(engine, requests)
    assert all(len(tokens[rid]) == finals[rid].usage.completion_tokens for rid, _, _ in requests)
    assert engine.speculator.counters.num_accepted_tokens > 0
    again, _ = _run(_engine(tiny_model_dir, "ngram"), requests)
    assert again == tokens, "seeded requests stay reproducible with speculation"


@pytest.mark.parametrize("draft_quant", ["int8", "int4"])
def test_quantized_self_draft_is_token_identical_and_frees_its_pool(tiny_model_dir, draft_quant):
    requests = [(f"r{i}", p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
                for i, p in enumerate(PROMPTS[:4])]
    small_pool = {"num_blocks": 18, "block_size": 8}
    plain, _ = _run(_engine(tiny_model_dir, cache=small_pool), requests)
    engine = _engine(tiny_model_dir, "self_draft", cache=small_pool,
                     speculative={"draft_quant": draft_quant, "draft_num_blocks": 40})
    spec, _ = _run(engine, requests)
    assert spec == plain
    counters = engine.speculator.counters
    assert counters.num_draft_tokens > 0 and counters.acceptance_rate > 0.5, counters
    assert engine.speculator.proposer.num_held_blocks == 0, "the draft pool is whole again"
    assert engine.scheduler.stats().num_preemptions_recompute > 0
    # quantized drafts run their small steps as one native call (worker/kernels/cpu_native_step.py;
    # int4 as int4 x int8 activations)
    native = engine.speculator.proposer.runner.native_decoder
    if cpu_native_step.unavailable_reason() is not None:
        assert native is None
    else:
        assert native.steps_run > 0
        assert (native.path == "int4_avx2_a8") == (draft_quant == "int4")
        # with int8 x int8 AMX products where the CPU has them (the outputs above are still the
        # target's own: only acceptance can change)
        assert native.int8_amx == (cpu_native_step.amx_available()
                                   and bool(cpu_build.load().features & cpu_native_step._FEATURE_AMX_INT8))


def test_a_long_draft_catch_up_is_read_in_native_sized_steps(tiny_model_dir):
    """The tokens a draft's KV lacks (a whole prompt at a request's first proposal) are read
    in steps no larger than the draft's native step, so no draft forward falls to the eager
    int8 path the speculator's cost calibration never measured; outputs stay the target's."""
    requests = [("long", PROMPTS[0], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))]
    plain, _ = _run(_engine(tiny_model_dir), requests)
    engine = _engine(tiny_model_dir, "self_draft", speculative={"draft_quant": "int8"})
    runner = engine.speculator.proposer.runner
    if cpu_native_step.unavailable_reason() is not None:
        pytest.skip(f"no native step here ({cpu_native_step.unavailable_reason()})")
    assert runner.native_decoder is not None, "with a compiler the int8 draft runs natively"
    runner.native_decoder.max_tokens = 4
    sizes = []
    real_forward = runner.forward

    def spy(inputs):
        sizes.append(len(inputs.input_ids))
        return real_forward(inputs)

    runner.forward = spy
    spec, _ = _run(engine, requests)
    assert spec == plain
    assert engine.speculator.counters.num_draft_tokens > 0
    assert max(sizes) <= 4 and sizes.count(4) >= 2, sizes  # the prompt went in 4-token steps


def test_speculation_reaches_the_worker_metrics_and_the_request_step_log(tiny_model_dir):
    from prometheus_client.parser import text_string_to_metric_families

    from kvmesh.core.telemetry import EngineMetrics, RequestStepLog

    engine = _engine(tiny_model_dir, "ngram")
    metrics, log = EngineMetrics("w0"), RequestStepLog()
    engine.phase_clock.observers += [metrics.observe_step_report, log.observe_step_report]
    _run(engine, [("m", PROMPTS[2], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))])
    samples = {(s.name, s.labels.get("method")): s.value
               for family in text_string_to_metric_families(metrics.snapshot().decode())
               for s in family.samples}
    counters = engine.speculator.counters
    assert counters.num_accepted_tokens > 0
    assert samples[("kvmesh_spec_draft_tokens_total", "ngram")] == counters.num_draft_tokens
    assert samples[("kvmesh_spec_accepted_tokens_total", "ngram")] == counters.num_accepted_tokens
    assert samples[("kvmesh_spec_verified_requests_total", "ngram")] == counters.num_verified
    steps = log.pop("m")
    assert (steps.spec_method, steps.num_draft_tokens, steps.num_accepted_tokens) == (
        "ngram", counters.num_draft_tokens, counters.num_accepted_tokens)
    # One span event per speculating step on the decode span, with that step's counts.
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvmesh.core import telemetry
    from kvmesh.core.config import ObservabilityConfig
    from kvmesh.core.seams import GenerateRequest, RequestTimings, Usage

    exporter = InMemorySpanExporter()
    provider = telemetry.setup_tracing(ObservabilityConfig(tracing_exporter="console"), "test",
                                       span_exporter=exporter, set_global=False)
    first, last = steps.spec_steps[0][0], steps.spec_steps[-1][0]
    telemetry.record_worker_spans(telemetry.get_tracer(provider), GenerateRequest("m", prompt_token_ids=(1,)),
                                  RequestTimings(arrival_time=first - 1, first_scheduled_time=first - 1,
                                                 first_token_time=first - 0.5, finished_time=last),
                                  Usage(1, 24), "length", steps)
    provider.shutdown()
    decode = next(s for s in exporter.get_finished_spans() if s.name == telemetry.SPAN_WORKER_DECODE)
    events = [e for e in decode.events if e.name == telemetry.EVENT_SPEC_STEP]
    assert len(events) == counters.num_steps == steps.num_spec_steps
    assert sum(e.attributes[telemetry.ATTR_SPEC_DRAFT_TOKENS] for e in events) == counters.num_draft_tokens
    assert sum(e.attributes[telemetry.ATTR_SPEC_ACCEPTED_TOKENS] for e in events) == counters.num_accepted_tokens


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_kv_speculation_matches_plain_decoding_on_the_same_kv_dtype(tiny_model_dir, kv_cache_dtype):
    requests = [(f"q{i}", p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
                for i, p in enumerate(PROMPTS[1:4])]
    cache = {"kv_cache_dtype": kv_cache_dtype}
    plain, _ = _run(_engine(tiny_model_dir, cache=cache), requests)
    engine = _engine(tiny_model_dir, "ngram", cache=cache)
    spec, _ = _run(engine, requests)
    assert spec == plain
    assert engine.speculator.counters.num_accepted_tokens > 0


def _decoding_requests(n):
    from kvmesh.worker.engine_loop.request import Request

    requests = []
    for i in range(n):
        r = Request(f"g{i}", [5, 6, 7, 8] * 4, SamplingParams(max_tokens=64, temperature=0), arrival_time=0.0)
        r.num_computed_tokens = r.num_tokens - 1  # decode-ready
        requests.append(r)
    return requests


def _speculator(curve_points):
    from kvmesh.core.config import SpeculativeConfig
    from kvmesh.worker.engine_loop.draft_proposers import NgramProposer
    from kvmesh.worker.engine_loop.speculator import Speculator

    spec = Speculator(SpeculativeConfig(method="ngram", num_tokens=4), NgramProposer(1, 3), max_model_len=512,
                      max_num_batched_tokens=512)
    for tokens, seconds in curve_points:
        spec.cost.observe(tokens, seconds)
    return spec


def test_the_measured_step_curve_switches_speculation_per_step():
    # Memory-bound (a 512-token step costs 1.5x a 1-token one): one request drafts fully.
    memory_bound = [(1, 0.020), (512, 0.030)]
    alone = _decoding_requests(1)
    _speculator(memory_bound).propose(alone)
    assert alone[0].spec_token_ids == [5, 6, 7, 8]
    # Compute-bound (time proportional to tokens): 64 decoding requests draft nothing.
    compute_bound = [(1, 0.001), (64, 0.064), (512, 0.512)]
    busy = _decoding_requests(64)
    _speculator(compute_bound).propose(busy)
    assert all(r.spec_token_ids == [] for r in busy)
    # The same compute-bound curve at batch 1 has a fixed cost to amortise: drafts are cut short.
    small = _decoding_requests(1)
    _speculator([(1, 0.010), (64, 0.073)]).propose(small)
    assert 1 <= len(small[0].spec_token_ids) <= 4


def test_cli_flags_and_the_proto_field_reach_the_engine(tiny_model_dir, capsys):
    from kvmesh.deploy import cli
    from kvmesh.deploy.cmd_generate import _sampling
    from kvmesh.deploy.cmd_serve import config_from_args
    from kvmesh.router.convert import sampling_from_pb, sampling_to_pb

    parser = cli.build_parser()
    assert config_from_args(parser.parse_args(["serve", "--speculative", "ngram"])).speculative.method == "ngram"
    assert config_from_args(parser.parse_args(["serve"])).speculative.method == "none"
    # Remote generate: no flag leaves the server's choice; `none` opts the request out.
    remote = ["generate", "x", "--server", "127.0.0.1:1"]
    assert _sampling(parser.parse_args(remote)).speculative is True
    opted_out = _sampling(parser.parse_args(remote + ["--speculative", "none"]))
    assert opted_out.speculative is False
    assert sampling_from_pb(sampling_to_pb(opted_out)).speculative is False
    assert sampling_from_pb(sampling_to_pb(SamplingParams())).speculative is True  # absent = allowed
    # In-process generate with prompt lookup prints the same text as without.
    args = ["generate", PROMPTS[2], "--model", tiny_model_dir, "--max-tokens", "12", "--dtype", "fp32"]
    assert cli.main(args) == 0
    plain = capsys.readouterr().out
    assert cli.main(args + ["--speculative", "ngram"]) == 0
    assert capsys.readouterr().out == plain and plain


@pytest.mark.parametrize("method", ["ngram", "self_draft"])
def test_smollm2_greedy_is_token_identical_in_fp32(smollm2_dir, method):
    """The real weights: an editing prompt (prompt lookup drafts most of the answer) and a
    chat question. fp32, where a forward's numerics do not depend on how many rows it scores
    (in bf16 a verify forward of 1 + k rows may flip a near-tie, as batching does)."""
    engine = _engine(smollm2_dir, "none")
    chat = ["Fix the typos: Teh cat sat on teh mat and lookd at the dor.", "What is the capital of France?"]
    prompts = [render_chat(engine.tokenizer, [{"role": "user", "content": c}]) for c in chat]
    requests = [(f"s{i}", p, SamplingParams(max_tokens=16, temperature=0)) for i, p in enumerate(prompts)]
    plain, _ = _run(engine, requests)
    spec_engine = _engine(smollm2_dir, method)
    spec, _ = _run(spec_engine, requests)
    assert spec == plain
    assert spec_engine.speculator.counters.num_accepted_tokens > 0


def test_bench_speculative_quick_run_reports_every_figure(tiny_model_dir, tmp_path):
    import json

    from kvmesh.load_tests import bench_speculative

    out = tmp_path / "spec.json"
    assert bench_speculative.main(["--quick", "--model", tiny_model_dir, "--dtype", "fp32", "--threads", "1",
                                   "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["forward_cost"]) == {"1+1", "1+2", "1+4", "1+8"}
    for part in ("editing", "chat"):
        assert report[part]["identical_outputs"] and report[part]["on_tpot_ms"] > 0
    assert set(report["concurrent"]["ratio"]) == {"ngram", "self_draft"}


def test_a_self_draft_that_is_far_behind_does_not_speculate_under_load():
    """The proposer's own cost is part of the gate: on a memory-bound curve, 64 fresh
    requests draft nothing with a model proposer whose draft costs a forward per token and
    that still has to read every prompt, while prompt lookup (free reading) drafts."""
    from kvmesh.core.config import SpeculativeConfig
    from kvmesh.worker.engine_loop.draft_proposers import NgramProposer
    from kvmesh.worker.engine_loop.speculator import Speculator

    class FarBehind(NgramProposer):
        prior_s_per_token = 0.020  # a forward per draft

        def catch_up_forwards(self, request):
            return 0.5 * (request.num_tokens - 1)

    curve = [(1, 0.020), (64, 0.022), (512, 0.030)]
    for proposer, drafts in ((FarBehind(1, 3), False), (NgramProposer(1, 3), True)):
        spec = Speculator(SpeculativeConfig(method="ngram"), proposer, max_model_len=512, max_num_batched_tokens=512)
        for tokens, seconds in curve:
            spec.cost.observe(tokens, seconds)
        busy = _decoding_requests(64)
        for r in busy:
            r.sampling = SamplingParams(max_tokens=4, temperature=0)  # little output left to amortise over
        spec.propose(busy)
        assert any(r.spec_token_ids for r in busy) == drafts


def test_a_draft_pool_too_small_for_a_request_only_skips_its_drafts(tiny_model_dir):
    requests = [("t", PROMPTS[2], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]
    plain, _ = _run(_engine(tiny_model_dir), requests)
    engine = _engine(tiny_model_dir, "self_draft", speculative={"draft_num_blocks": 1})  # 8 slots
    spec, _ = _run(engine, requests)
    assert spec == plain
    assert engine.speculator.counters.num_draft_tokens == 0 and engine.speculator.proposer.num_held_blocks == 0


def test_the_http_api_carries_the_per_request_opt_out():
    from kvmesh.core.errors import InvalidRequestError
    from kvmesh.router.openai_http import _sampling

    assert _sampling({"max_tokens": 4}, chat=True).speculative is True  # absent = allowed
    assert _sampling({"max_tokens": 4, "speculative": False}, chat=False).speculative is False
    with pytest.raises(InvalidRequestError):
        _sampling({"max_tokens": 4, "speculative": "no"}, chat=True)
