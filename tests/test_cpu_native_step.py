"""The native CPU step (worker/kernels/cpu_native_step.py, model.cpu_native_max_tokens):
every step it serves (decode rows, and prefill chunks with several tokens of one request)
gives the eager forward's logits (fp32: to float rounding; bf16: to the
eager bf16 path's own rounding), the engine's greedy tokens do not change in fp32 with
chunked prefill and preemption, threads do not change a bit, and what it does not implement
falls back to eager with the reason logged."""

from __future__ import annotations

import logging

import pytest
import torch

from kvmesh.core.config import ConfigError, KvmeshConfig
from kvmesh.worker.engine_loop.engine import Engine
from kvmesh.worker.kernels import cpu_abi, cpu_build, cpu_native_step
from kvmesh.worker.runner import cpu_model_runner

from engine_runs import generate_all_greedy

pytestmark = pytest.mark.skipif(cpu_native_step.unavailable_reason() is not None,
                                reason=f"native decode unavailable: {cpu_native_step.unavailable_reason()}")
# Where only the avx2 build runs (AVX2-only CPUs, the CI machine among them), a subset runs: the
# fp32 token identity, each weight kind's logits and int4; the runner logic and the AVX-512
# paths' cases (16-bit steps up to 64 tokens, AMX, thread counts) run where the CPU has AVX-512,
# which keeps this file's CI time on AVX2 machines to a few engines.
AVX512_CPU = any(v.native_step and v is not cpu_build.AVX2 for v in cpu_build.runnable_variants())
avx512_cpu_only = pytest.mark.skipif(not AVX512_CPU, reason="runner / AVX-512 case: run on AVX-512 CPUs only")

PROMPTS = [tuple(range(100, 100 + n)) for n in (5, 37, 12, 50, 1, 23)]
NEW_TOKENS = 20


def _engine(model_dir: str, dtype: str = "fp32", quant: str = "none", native: int | None = 4, kv: str = "auto",
            preemption: str = "recompute", prefill_chunk: int = 16, num_blocks: int = 16,
            step_tokens: int = 64) -> Engine:
    return Engine.from_config(KvmeshConfig.from_dict({
        "model": {"path": model_dir, "dtype": dtype, "max_model_len": 512, "cpu_native_max_tokens": native},
        "quant": {"weight": quant},
        # 16 blocks: 128 slots for ~330 tokens, so requests are preempted
        "cache": {"num_blocks": num_blocks, "block_size": 8, "kv_cache_dtype": kv},
        "scheduler": {"max_num_batched_tokens": step_tokens, "max_prefill_tokens_per_step": prefill_chunk,
                      "preemption_mode": preemption,
                      "max_total_kv_tokens": 1 << 20, "max_queue_time_s": 3600},
        "parallel": {"device": "cpu"}}))


def _generate(engine: Engine) -> dict[str, list[int]]:
    return generate_all_greedy(engine, PROMPTS, NEW_TOKENS)


def _check_each_step_against_eager(engine: Engine, compare) -> list:
    """Wraps the native step: the eager forward re-runs each step it served, on the same cache,
    and compare(native logits, eager logits, inputs) records the difference. The eager forward
    rewrites the step's K/V slots with its own values, so later steps start from eager's cache."""
    runner = engine.runner
    native = runner.native_decoder
    real_run = native.run
    records = []

    def checked(inputs):
        logits = real_run(inputs)
        if logits is not None and inputs.sample_at:
            hidden = runner._eager_forward(inputs)[torch.tensor(inputs.sample_at)]
            eager = runner.model.compute_logits(hidden).float()
            records.append(compare(logits, eager, inputs))
        return logits

    native.run = checked
    return records


def _relative(native: torch.Tensor, eager: torch.Tensor, inputs) -> float:
    return ((native - eager).abs().max() / eager.abs().max()).item()


@pytest.mark.parametrize("native,preemption", [pytest.param(4, "recompute", marks=avx512_cpu_only),
                                               pytest.param(4, "swap", marks=avx512_cpu_only), (16, "recompute")])
def test_fp32_tokens_equal_eager_with_chunked_prefill_and_preemption(tiny_model_dir, native, preemption):
    """max_tokens 4: decode batches of up to 4 rows; 16: whole prefill chunks too (a 16-token
    chunk over cached context, a request's tokens split over the step's threads)."""
    eager = _generate(_engine(tiny_model_dir, native=0, preemption=preemption))
    engine = _engine(tiny_model_dir, native=native, preemption=preemption)
    records = _check_each_step_against_eager(engine, lambda n, e, inputs: (_relative(n, e, inputs),
                                                                           max(inputs.query_lens)))
    tokens = _generate(engine)
    stats = engine.stats()
    assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0, "the small pool must force preemption"
    assert engine.runner.native_decoder.steps_run >= 20, "the native step served the decode steps"
    worst = max(diff for diff, _ in records)
    assert worst < 1e-5, f"fp32 logits differ from eager by {worst}"
    if native == 16:
        assert max(longest for _, longest in records) > 8, "prefill chunks ran natively"
    assert tokens == eager


@pytest.mark.parametrize("dtype,quant,tolerance", [("fp32", "int8", 1e-5),
                                                   pytest.param("bf16", "none", 0.02, marks=avx512_cpu_only),
                                                   ("bf16", "int8", 0.02)])
def test_other_weight_kinds_give_the_eager_logits(tiny_model_dir, dtype, quant, tolerance):
    """int8 per-row weights (quant.weight: int8) and bf16 weights: the same logits as eager,
    to float rounding where eager also computes in fp32, to bf16 rounding where eager rounds
    every op's output to bf16 and the native step does not."""
    engine = _engine(tiny_model_dir, dtype=dtype, quant=quant, native=8)
    diffs = _check_each_step_against_eager(engine, _relative)
    _generate(engine)
    assert len(diffs) >= 20
    assert max(diffs) < tolerance, f"{dtype}/{quant}: logits differ from eager by up to {max(diffs)}"


@avx512_cpu_only
def test_bf16_steps_of_up_to_64_tokens_give_the_eager_logits(tiny_model_dir):
    """Steps of 17-64 tokens (up to 58 prompt tokens, decode rows beside them): on an AMX CPU
    two to four 16-token tiles per weight block, else the GEMV row groups."""
    engine = _engine(tiny_model_dir, dtype="bf16", native=64, prefill_chunk=58, num_blocks=64)
    diffs = _check_each_step_against_eager(engine, lambda n, e, inputs: (_relative(n, e, inputs),
                                                                         len(inputs.input_ids)))
    sizes = []
    checked = engine.runner.native_decoder.run

    kv_diffs = []

    def sized(inputs):
        out = checked(inputs)
        if out is not None:
            sizes.append(len(inputs.input_ids))
            if len(inputs.input_ids) > 48:  # the K/V it wrote: eager rewrites the same slots
                slots = torch.tensor(inputs.slot_mapping)
                cache = engine.runner.kv_caches[-1].key_cache
                native_k = cache.view(-1, *cache.shape[2:])[slots].float()
                engine.runner._eager_forward(inputs)
                eager_k = cache.view(-1, *cache.shape[2:])[slots].float()
                kv_diffs.append(((native_k - eager_k).abs().max() / eager_k.abs().max()).item())
        return out

    engine.runner.native_decoder.run = sized
    prompts = [tuple(range(200, 260)), tuple(range(300, 303)), tuple(range(400, 445)), (7,)]
    tokens = generate_all_greedy(engine, prompts, NEW_TOKENS)
    assert max(sizes) > 48, f"steps of more than three 16-token groups ran natively ({sorted(set(sizes))})"
    assert max(size for _, size in diffs) > 32, "and sampled (logits compared) with three groups"
    worst = max(diff for diff, _ in diffs)
    assert worst < 0.02, f"bf16 logits differ from eager by up to {worst}"
    assert kv_diffs and max(kv_diffs) < 0.02, f"last layer's K of the 49+-token steps vs eager: {kv_diffs}"
    assert len(tokens) == len(prompts) and all(len(t) == NEW_TOKENS for t in tokens.values())


@avx512_cpu_only
def test_mid_prompt_chunks_run_natively_and_return_no_logits(tiny_model_dir):
    """A step where no request samples (a prompt's middle chunk) runs natively too (its K/V
    into the cache, no LM head); the runner returns None for it, as the eager forward does."""
    engine = _engine(tiny_model_dir, native=16, prefill_chunk=8)
    seen = []
    real_run = engine.runner.native_decoder.run

    def spy(inputs):
        out = real_run(inputs)
        if not inputs.sample_at:
            seen.append(None if out is None else tuple(out.shape))
        return out

    engine.runner.native_decoder.run = spy
    prompts = [tuple(range(100, 150))]  # alone: 8-token chunks, only the last one samples
    eager = generate_all_greedy(_engine(tiny_model_dir, native=0, prefill_chunk=8), prompts, NEW_TOKENS)
    assert generate_all_greedy(engine, prompts, NEW_TOKENS) == eager
    assert seen and all(shape == (0, engine.runner.native_decoder.vocab) for shape in seen)


@avx512_cpu_only
def test_int8_activations_for_the_self_draft_stay_near_the_eager_int8_logits(tiny_model_dir):
    """int8_activations (what the self-draft asks for): on an AMX CPU the int8 layers run as
    int8 x int8 AMX products over per-row quantized activations, so their logits differ from
    weight-only int8 by the activations' rounding, not more; elsewhere the same FMA GEMV."""
    engine = _engine(tiny_model_dir, dtype="bf16", quant="int8", native=0)
    runner = engine.runner
    runner.native_decoder = cpu_native_step.NativeDecoder.build(runner.model, runner.kv_caches, 8,
                                                                  int8_activations=True)
    amx_int8 = cpu_native_step.amx_available() and bool(cpu_build.load().features & cpu_native_step._FEATURE_AMX_INT8)
    assert runner.native_decoder.int8_amx == amx_int8
    diffs = _check_each_step_against_eager(engine, _relative)
    _generate(engine)
    assert len(diffs) >= 20
    assert max(diffs) < 0.1, f"int8 x int8 logits differ from weight-only int8 by up to {max(diffs)}"
    if amx_int8:
        assert max(diffs) > 1e-4, "the activations were quantized (else this would be the FMA path)"


@avx512_cpu_only
@pytest.mark.parametrize("variant", [v for v in cpu_build.VARIANTS if v.native_step], ids=lambda v: v.name)
@pytest.mark.parametrize("dtype,tolerance", [("fp32", 1e-5), ("bf16", 0.02)])
def test_every_variant_this_cpu_runs_gives_the_eager_logits(tiny_model_dir, variant, dtype, tolerance):
    """Each build of the step (not only the one picked for this CPU): on an AMX CPU the AMX,
    VDPBF16PS, AVX-512 FMA and AVX2 projections each against eager; every variant compiles in
    tests/test_cpu_kernels.py."""
    if variant not in cpu_build.runnable_variants():
        pytest.skip(f"this CPU does not run the {variant.name} build")
    engine = _engine(tiny_model_dir, dtype=dtype, native=0)
    runner = engine.runner
    runner.native_decoder = cpu_native_step.NativeDecoder.build(runner.model, runner.kv_caches, 8,
                                                                  kernels=cpu_build.load_variant(variant))
    assert runner.native_decoder.variant == variant.name
    diffs = _check_each_step_against_eager(engine, _relative)
    _generate(engine)
    assert len(diffs) >= 20 and max(diffs) < tolerance, (variant.name, dtype, max(diffs))


@avx512_cpu_only
def test_threads_do_not_change_a_bit(tiny_model_dir):
    engine = _engine(tiny_model_dir, dtype="bf16", native=8)
    runner = engine.runner
    real_run = runner.native_decoder.run
    checked = []
    threads = torch.get_num_threads()

    def run_with_one_and_three_threads(inputs):
        try:
            torch.set_num_threads(1)
            one = real_run(inputs)
            one = None if one is None else one.clone()  # the next run writes the same buffer
            torch.set_num_threads(3)
            three = real_run(inputs)  # rewrites the same K/V slots with the same bits
        finally:
            torch.set_num_threads(threads)
        if one is not None:
            checked.append(torch.equal(one, three))
        return one

    runner.native_decoder.run = run_with_one_and_three_threads
    _generate(engine)
    assert len(checked) >= 20 and all(checked)


@avx512_cpu_only
def test_steps_over_max_tokens_run_eagerly(tiny_model_dir):
    """Steps of more than max_tokens tokens go to the eager forward; smaller ones, prefill
    chunks included, run natively."""
    engine = _engine(tiny_model_dir, native=2)
    native = engine.runner.native_decoder
    seen = []
    real_run = native.run

    def spy(inputs):
        out = real_run(inputs)
        seen.append((len(inputs.input_ids), max(inputs.query_lens), out is not None))
        return out

    native.run = spy
    _generate(engine)
    assert any(taken for *_, taken in seen) and any(not taken for *_, taken in seen)
    for tokens, longest, taken in seen:
        assert taken == (tokens <= 2), (tokens, longest, taken)


@avx512_cpu_only
@pytest.mark.parametrize("overrides,reason", [({"kv": "int8"}, "quantized")])
def test_what_it_does_not_implement_falls_back_with_the_reason(tiny_model_dir, caplog, overrides, reason):
    with caplog.at_level(logging.WARNING, logger=cpu_model_runner.__name__):
        engine = _engine(tiny_model_dir, native=4, **overrides)
    assert engine.runner.native_decoder is None
    assert reason in caplog.text and "eager forward" in caplog.text
    assert all(len(t) == NEW_TOKENS for t in _generate(engine).values())


LONG_PROMPTS = [tuple(range(100 + n, 100 + 2 * n)) for n in (300, 140, 90, 5, 70)]


def _long_prompt_steps(engine: Engine, guard: int | None = None) -> tuple[dict[str, list[int]], list[int], list[int]]:
    """Greedy tokens of LONG_PROMPTS, and the sizes of the steps the native step took and refused
    (guard: its prefill_attention_pairs_max)."""
    decoder = engine.runner.native_decoder
    if guard is not None:
        decoder.prefill_attention_pairs_max = guard
    real_run, taken, refused = decoder.run, [], []

    def sized(inputs):
        out = real_run(inputs)
        (taken if out is not None else refused).append(len(inputs.input_ids))
        return out

    decoder.run = sized
    return generate_all_greedy(engine, LONG_PROMPTS, NEW_TOKENS), taken, refused


def test_prefill_steps_past_64_tokens_give_the_eager_tokens(tiny_model_dir):
    """Steps of up to 200 tokens (prompt chunks of up to 150 over cached context, up to 300-token
    prompts in three chunks, decode rows beside them) as one native call, the projections taking
    the tokens 64 at a time: fp32 logits eager's to float rounding, the greedy tokens eager's; the
    logits buffer holds the rows that sample, not the step's tokens."""
    shape = {"prefill_chunk": 150, "step_tokens": 200, "num_blocks": 128}
    eager = generate_all_greedy(_engine(tiny_model_dir, native=0, **shape), LONG_PROMPTS, NEW_TOKENS)
    engine = _engine(tiny_model_dir, native=200, **shape)
    diffs = _check_each_step_against_eager(engine, _relative)
    tokens, taken, refused = _long_prompt_steps(engine)
    assert max(taken) > 128 and not refused, "steps of three token blocks and more ran natively"
    assert max(diffs) < 1e-5, f"fp32 logits differ from eager by {max(diffs)}"
    assert tokens == eager
    assert engine.runner.native_decoder.logits_rows <= 8


def test_prompt_chunks_of_long_attention_run_eagerly(tiny_model_dir):
    """A step whose prompt tokens attend to more (token, context) pairs than the guard allows runs
    eagerly (the native step's attention reads a request's K/V once a token); the others natively,
    decode steps whatever their context; the tokens are eager's either way."""
    shape = {"prefill_chunk": 150, "step_tokens": 200, "num_blocks": 128}
    eager = generate_all_greedy(_engine(tiny_model_dir, native=0, **shape), LONG_PROMPTS, NEW_TOKENS)
    engine = _engine(tiny_model_dir, native=200, **shape)
    tokens, taken, refused = _long_prompt_steps(engine, guard=20_000)
    assert refused and min(refused) > 100, "the long prompt's chunks ran eagerly"
    assert engine.runner.eager_step_reasons["prefill_attention"] == len(refused)
    assert max(taken) > 64 and min(taken) <= len(LONG_PROMPTS), "short chunks and decode steps ran natively"
    assert tokens == eager


def test_prefill_attention_pairs_count_each_prompt_tokens_context():
    # a 150-token chunk over 300 cached tokens: 150 x 300 + 150 x 151 / 2; decode rows not counted
    assert cpu_native_step.prefill_attention_pairs((150, 1, 1), (450, 900, 3)) == 150 * 300 + 150 * 151 // 2
    assert cpu_native_step.prefill_attention_pairs((1, 1), (4000, 4000)) == 0


@avx512_cpu_only
def test_switched_off_by_the_environment(tiny_model_dir, monkeypatch, caplog):
    monkeypatch.setenv("KVMESH_NATIVE_DECODE", "0")
    with caplog.at_level(logging.WARNING, logger=cpu_model_runner.__name__):
        engine = _engine(tiny_model_dir, native=4)
    assert engine.runner.native_decoder is None and "KVMESH_NATIVE_DECODE=0" in caplog.text


def test_max_batch_is_validated():
    with pytest.raises(ConfigError, match="cpu_native_max_tokens"):
        KvmeshConfig.from_dict({"model": {"cpu_native_max_tokens": -1}})


def test_bf16_projections_take_the_cpu_s_fastest_bf16_instructions(tiny_model_dir):
    """AMX tiles where the CPU has them (and Linux grants the tile state), else VDPBF16PS
    with AVX512_BF16, else widening FMAs; the logits tests above check whichever runs here
    against eager. fp32 models run FMAs."""
    engine = _engine(tiny_model_dir, dtype="bf16", native=8)
    flags = cpu_build.cpu_flags()
    expected = ("amx" if cpu_native_step.amx_available() else
                "avx512_bf16" if "avx512_bf16" in flags else "fma" if AVX512_CPU else "avx2")
    decoder = engine.runner.native_decoder
    assert decoder.path == expected and decoder.variant == cpu_build.runnable_variants()[0].name
    if cpu_build.AMX in cpu_build.runnable_variants():
        assert expected == "amx", "this CPU has AMX: the native step must use it"
    # With AMX every projection and the LM head run from a copy laid out for its tiles.
    model = engine.runner.model
    weights = [model.lm_head.weight] + [w for layer in model.model.layers for w in (
        layer.self_attn.qkv.weight, layer.self_attn.o_proj.weight, layer.mlp.gate_up.weight,
        layer.mlp.down_proj.weight)]
    assert decoder.amx_packed_bytes == (sum(w.nbytes for w in weights) if expected == "amx" else 0)
    assert _engine(tiny_model_dir, dtype="fp32", native=8).runner.native_decoder.path == ("fma" if AVX512_CPU
                                                                                          else "avx2")


def test_auto_step_size_follows_the_measured_crossover_with_eager():
    """docs/benchmarks.md, "Forward paths on CPU": every step it takes with AMX or with VDPBF16PS on
    a CPU without AMX tiles, else 12 tokens a thread up to 24."""
    largest = cpu_native_step.amx_available() or cpu_native_step.dpbf16_without_amx()
    expected = [64, 64, 64] if largest else [12, 24, 24]
    assert [cpu_native_step.max_tokens_for(None, torch.bfloat16, t) for t in (1, 2, 4)] == expected
    # fp32 float weights: fp32 GEMVs whatever the CPU (token-exact, on by default)
    assert [cpu_native_step.max_tokens_for(None, torch.float32, t) for t in (1, 2, 4)] == [12, 24, 24]
    assert cpu_native_step.max_tokens_for(5, torch.float32, 2) == 5
    assert cpu_native_step.max_tokens_for(0, torch.float32, 2) == 0
    # fp32 with quantized weights: eager dequantizes every call, so native by default
    assert cpu_native_step.max_tokens_for(None, torch.float32, 2, "int4") == 64
    assert cpu_native_step.max_tokens_for(None, torch.float32, 2, "int8") == expected[1]


@pytest.mark.parametrize("amx,dpbf16_only,expected", [(True, False, 64), (False, True, 512), (False, False, 24)])
def test_vdpbf16ps_without_amx_takes_every_step_of_the_budget(monkeypatch, amx, dpbf16_only, expected):
    """A CPU with VDPBF16PS and no AMX tiles (Zen 4): the GEMVs, 64 tokens a call, stay ahead of
    eager's (AMX-less) GEMMs to the scheduler's 512-token steps, so auto takes every step of a bf16
    model's bf16 or int4 (bf16 products) weights; with AMX 64; int8 weights and int4 x int8
    activations keep the small-step size."""
    monkeypatch.setattr(cpu_native_step, "amx_available", lambda: amx)
    monkeypatch.setattr(cpu_native_step, "dpbf16_without_amx", lambda: dpbf16_only)
    assert cpu_native_step.max_tokens_for(None, torch.bfloat16, 2, max_step_tokens=512) == expected
    assert cpu_native_step.max_tokens_for(None, torch.bfloat16, 2, "int4", max_step_tokens=512) == expected
    small = 64 if amx or dpbf16_only else 24
    assert cpu_native_step.max_tokens_for(None, torch.bfloat16, 2, "int4", True, max_step_tokens=512) == small
    assert cpu_native_step.max_tokens_for(None, torch.bfloat16, 2, "int8", max_step_tokens=512) == small
    assert cpu_native_step.max_tokens_for(None, torch.bfloat16, 2, max_step_tokens=32) == min(expected, 64)


def test_amx_packed_layout_is_tdpbf16ps_b_operand():
    """[N/16][K/32][16 pairs][16 rows][2]: element (nb, kb, p, r, e) is weight row nb*16 + r,
    column kb*32 + 2p + e; whole 16-row blocks only (the kernel reads the rest in place), and
    no copy where the packed kernel does not apply."""
    weight = torch.randn(40, 96).to(torch.bfloat16)
    packed = cpu_native_step.amx_packed(weight)
    assert packed.shape == (2, 3, 16, 16, 2)
    nb, kb, p, r, e = torch.meshgrid(*(torch.arange(n) for n in packed.shape), indexing="ij")
    assert torch.equal(packed, weight[nb * 16 + r, kb * 32 + 2 * p + e])
    assert cpu_native_step.amx_packed(torch.randn(32, 48).to(torch.bfloat16)) is None  # K not a multiple of 32
    assert cpu_native_step.amx_packed(torch.randn(32, 64)) is None  # fp32
    assert cpu_native_step.amx_packed(torch.randn(8, 64).to(torch.bfloat16)) is None  # not one whole block


def _int4_engine(model_dir: str, group: int, native: int | None, activations: str = "fp32") -> Engine:
    return Engine.from_config(KvmeshConfig.from_dict({
        "model": {"path": model_dir, "dtype": "fp32", "max_model_len": 512, "cpu_native_max_tokens": native},
        "quant": {"weight": "int4", "group_size": group, "int4_activations": activations},
        "cache": {"num_blocks": 64, "block_size": 8},
        "scheduler": {"max_num_batched_tokens": 64, "max_prefill_tokens_per_step": 16,
                      "max_total_kv_tokens": 1 << 20, "max_queue_time_s": 3600},
        "parallel": {"device": "cpu"}}))


@pytest.mark.parametrize("group", [128])  # group 32 with GGUF's fp16 metadata: tests/test_gguf_kept.py
def test_int4_groups_give_the_eager_logits_and_tokens(tiny_model_dir, group):
    """quant.weight int4 (scale + zero per group, in the model dtype), steps of up to 64 tokens
    in fp32 (auto). quant.int4_activations int8: int4 x int8 activations per 32-input block,
    the eager logits to the activations' int8 rounding, the greedy tokens nearly all eager's.
    By default (fp32 activations) it dequantizes each group in registers as the eager layer
    does (bit for bit): the logits are eager's to fp32 summation order, the tokens eager's,
    with prefill chunks and decode batches."""
    eager = _generate(_int4_engine(tiny_model_dir, group, 0))
    engine = _int4_engine(tiny_model_dir, group, None, activations="int8")
    runner = engine.runner
    assert runner.native_decoder.path == "int4_avx2_a8" and runner.native_decoder.max_tokens == 64
    assert runner.cpu_step.numerics == "int8 activations, not token-exact"
    a8 = _check_each_step_against_eager(engine, lambda n, e, inputs: (_relative(n, e, inputs),
                                                                      (n.argmax(-1) == e.argmax(-1)).float().mean()))
    _generate(engine)
    worst, argmax_same = max(d for d, _ in a8), sum(same for _, same in a8) / len(a8)
    assert 1e-4 < worst < 0.05, f"int4 x int8 logits differ from eager by {worst}"
    # every step's greedy token on the same inputs (the tiny random model's logits are nearly
    # flat, so free-running sequences part at the first near-tie)
    assert argmax_same >= 0.9, f"the same greedy token as eager in {argmax_same:.0%} of the steps"

    exact = _int4_engine(tiny_model_dir, group, None)  # the default
    assert exact.runner.native_decoder.path == "int4_avx2" and exact.runner.cpu_step.numerics == "fp32, token-exact"
    diffs = _check_each_step_against_eager(exact, lambda n, e, inputs: (_relative(n, e, inputs),
                                                                        len(inputs.input_ids)))
    assert _generate(exact) == eager
    assert max(size for _, size in diffs) >= 6, "batched decode / prefill steps ran natively"
    worst = max(diff for diff, _ in diffs)
    assert worst < 1e-5, f"int4 logits differ from eager by {worst}"


@pytest.mark.parametrize("int8_activations,factored,tolerance", [(False, True, 1e-5), (False, False, 1e-5),
                                                                  (True, False, 0.05)])
def test_int4_kernel_equals_torch_on_every_scale_dtype_and_min(tiny_model_dir, int8_activations, factored, tolerance):
    """Scales / zeros / mins in fp16 (GGUF Q4_0 / Q4_1), fp32 (Q4_K) and bf16, with and without
    a min term, odd token counts (the 8-token passes and their tail): every int4 layer's
    metadata rewritten, the native step's logits against the eager forward's (dequantize +
    F.linear), for both activation paths and both fp32 forms (factorised, the default, and
    each weight dequantized bit for bit). int8 activations run over the codes laid out in 8-row
    panels (int4_panels.c): the same int8 products as the row-at-a-time kernel, summed in another
    order, so each step's logits are that kernel's to fp32 rounding, and the eager layers,
    reading the same bytes, compute the weights they did."""
    engine = _engine(tiny_model_dir, quant="int4", native=0)
    runner = engine.runner
    generator = torch.Generator().manual_seed(3)
    # zero None: integers 5..10 (with a min the kernel's general form, each group subtracting its
    # zero); 0 with fp16 mins is GGUF Q4_1's layout, 8 with no min Q4_0's: the fast form's folds
    for i, (scale_dtype, zero_dtype, with_mins, fixed_zero) in enumerate((
            (torch.float16, torch.float16, True, None), (torch.float32, torch.float16, True, None),
            (torch.bfloat16, torch.bfloat16, False, None), (torch.float16, torch.float16, True, 0.0),
            (torch.float16, torch.float16, False, 8.0))):
        for model_layer in runner.model.model.layers:
            attn, mlp = model_layer.self_attn, model_layer.mlp
            for layer, first in ((attn.qkv.merged, attn.q_proj), (attn.o_proj, None), (mlp.gate_up.merged, mlp.gate_proj),
                                 (mlp.down_proj, None)):
                shape = layer.scales.shape
                layer.scales = (torch.rand(shape, generator=generator) * 0.05 + 0.01).to(scale_dtype)
                layer.zeros = (torch.randint(5, 11, shape, generator=generator) if fixed_zero is None  # as quantizers do
                               else torch.full(shape, fixed_zero)).to(zero_dtype)
                layer.mins = (torch.randn(shape, generator=generator) * 0.02).to(scale_dtype) if with_mins else None
                if first is not None:  # a fused group stays usable while its first member views the merged rows
                    first.scales = layer.scales[:first.out_features]
        weights = [m.dequantized_weight() for m in runner.model.modules() if hasattr(m, "panel_rows")]
        decoder = cpu_native_step.NativeDecoder.build(runner.model, runner.kv_caches, 13,
                                                      int8_activations=int8_activations)
        runner.native_decoder = decoder
        assert decoder.int4_factored == (not int8_activations)  # the default form
        assert decoder.int4_interleaved == int8_activations
        assert all(torch.equal(w, m.dequantized_weight())
                   for w, m in zip(weights, (m for m in runner.model.modules() if hasattr(m, "panel_rows"))))
        decoder.int4_factored = factored
        panels_vs_rows = []

        def compare(native, eager, inputs):
            if int8_activations:  # the same step by the row-at-a-time kernel over the plain codes
                panels = native.clone()
                decoder.int4_interleaved = False
                panels_vs_rows.append(_relative(panels, type(decoder).run(decoder, inputs), inputs))
                decoder.int4_interleaved = True
                runner._eager_forward(inputs)  # eager's K/V back in the step's slots
            return _relative(native, eager, inputs), len(inputs.input_ids)

        diffs = _check_each_step_against_eager(engine, compare)
        # a new prompt each round (no cached prefix): one 11-token step, then decode rows
        tokens = generate_all_greedy(engine, [tuple(range(100 + 20 * i, 111 + 20 * i))], 6)
        assert all(len(t) == 6 for t in tokens.values())
        assert diffs and max(d for d, _ in diffs) < tolerance, (scale_dtype, zero_dtype, with_mins, fixed_zero,
                                                                max(diffs))
        assert max(size for _, size in diffs) > 8, "a pass of 8 tokens and a tail"
        assert len(panels_vs_rows) == len(diffs) * int8_activations and max(panels_vs_rows, default=0) < 1e-5
        assert runner.native_decoder.path == ("int4_avx2_a8" if int8_activations else "int4_avx2")


@pytest.mark.parametrize("factored", [True, False])
def test_int4_metadata_made_at_load_gives_the_per_call_logits_bit_for_bit(tiny_model_dir, factored):
    """Groups of 32 (GGUF's): each int4 projection's scales and offsets are laid out for the
    fp32-activation kernels once at load (the layer descriptor's *_packed fields), where every
    group folds, and a step reading them gives the logits of the kernels regrouping the stored
    metadata every call (the fields cleared), bit for bit, in both forms: GGUF Q4_1's layout
    (zero 0, fp16 mins) and Q4_0's (zero 8, no min); general zeros with mins do not fold (none
    made: the rows go one at a time). Codes in 8-row panels (int4 x int8) keep regrouping a call."""
    engine = _int4_engine(tiny_model_dir, 32, 0)
    runner = engine.runner
    generator = torch.Generator().manual_seed(5)
    fields = [f"{name}_packed" for name in ("qkv", "o", "gate_up", "down")]
    for i, (fixed_zero, with_mins) in enumerate(((0.0, True), (8.0, False), (None, True))):
        for model_layer in runner.model.model.layers:
            attn, mlp = model_layer.self_attn, model_layer.mlp
            for layer, first in ((attn.qkv.merged, attn.q_proj), (attn.o_proj, None), (mlp.gate_up.merged, mlp.gate_proj),
                                 (mlp.down_proj, None)):
                shape = layer.scales.shape
                layer.scales = (torch.rand(shape, generator=generator) * 0.05 + 0.01).half()
                layer.zeros = (torch.randint(5, 11, shape, generator=generator) if fixed_zero is None
                               else torch.full(shape, fixed_zero)).half()
                layer.mins = (torch.randn(shape, generator=generator) * 0.02).half() if with_mins else None
                if first is not None:
                    first.scales = layer.scales[:first.out_features]
        if i == 0:  # panels: none made
            panels = cpu_native_step.NativeDecoder.build(runner.model, runner.kv_caches, 13, int8_activations=True)
            assert not any(getattr(layer, f) for layer in panels._description.layers for f in fields)
            panels.int4_interleaved = False  # the plain rows again, for the fp32 decoder below
        decoder = cpu_native_step.NativeDecoder.build(runner.model, runner.kv_caches, 13)
        runner.native_decoder = decoder
        decoder.int4_factored = factored
        layers = decoder._description.layers
        assert all(bool(getattr(layer, f)) == (fixed_zero is not None) for layer in layers for f in fields)
        same = []

        def compare(native, eager, inputs):
            saved = [[getattr(layer, f) for f in fields] for layer in layers]
            for layer in layers:
                for f in fields:
                    setattr(layer, f, 0)
            per_call = type(decoder).run(decoder, inputs).clone()
            for layer, values in zip(layers, saved):
                for f, v in zip(fields, values):
                    setattr(layer, f, v)
            runner._eager_forward(inputs)  # eager's K/V back in the step's slots
            same.append(torch.equal(native, per_call))
            return len(inputs.input_ids)

        sizes = _check_each_step_against_eager(engine, compare)
        generate_all_greedy(engine, [tuple(range(100 + 20 * i, 111 + 20 * i))], 6)  # a new prompt: no cached prefix
        assert sizes and max(sizes) > 8 and all(same), (fixed_zero, same)


def test_int8_row_panels_put_each_code_where_the_head_kernel_reads_it():
    """cpu_native_step.int8_row_panels: row n's codes 4c .. 4c + 3 at panel n // 16, chunk c, slot
    n % 16 (kvmesh_gemv_i8_panels' layout); the rows that pad the last panel are zero."""
    codes = torch.randint(-127, 128, (37, 64), generator=torch.Generator().manual_seed(11), dtype=torch.int8)
    panels = cpu_native_step.int8_row_panels(codes)
    assert panels.shape == (3, 16, 16, 4) and panels.is_contiguous()
    n, k = torch.meshgrid(torch.arange(37), torch.arange(64), indexing="ij")
    assert torch.equal(panels[n // 16, k // 4, n % 16, k % 4], codes)
    assert not panels[2, :, 37 - 32:].any()


def test_int4_int8_step_reads_a_float_heads_int8_copy_in_panels_against_int8_activations(tiny_model_dir):
    """The int4 x int8 step's int8 copy of a float LM head is kept only in 16-row panels
    (lm_head_packed) and read against the final hidden state quantized per 32-input block
    (int4_panels.c), as the int4 layers and a Q8_0 head are: each step's logits are those of the
    same codes read as a Q8_0 table (every group scale its row's) by the Q8_0 x int8 head kernel,
    to fp32 summation order (an fp32-activation read differs by the activations' int8 rounding)."""
    from kvmesh.quant.primitives import quantize_int8_per_channel

    engine = _int4_engine(tiny_model_dir, 32, 0)
    runner = engine.runner
    panels = cpu_native_step.NativeDecoder.build(runner.model, runner.kv_caches, 13, int8_activations=True)
    runner.native_decoder = panels
    head = runner.model.lm_head.weight
    vocab, hidden = head.shape
    model = panels._description.model
    assert model.lm_head_kind == cpu_abi.WEIGHT_KINDS["W_I8"] and model.lm_head_packed == model.lm_head_weight
    assert panels.int8_head_bytes == -(-vocab // 16) * 16 * hidden + vocab * 4  # the panels and fp32 row scales
    q8_0 = cpu_native_step.NativeDecoder.build(runner.model, runner.kv_caches, 13, int8_activations=True)
    codes, scales = quantize_int8_per_channel(head)
    groups = scales[:, None].expand(vocab, hidden // 32).contiguous()
    q8_0._description.keep += [codes, groups]
    other = q8_0._description.model
    other.lm_head_kind, other.lm_head_packed = cpu_abi.WEIGHT_KINDS["W_I8G"], 0
    other.lm_head_weight, other.lm_head_scales = codes.data_ptr(), groups.data_ptr()

    def compare(native, eager, inputs):
        table = type(q8_0).run(q8_0, inputs).clone()
        runner._eager_forward(inputs)  # eager's K/V back in the step's slots
        return _relative(native, table, inputs)

    diffs = _check_each_step_against_eager(engine, compare)
    generate_all_greedy(engine, [tuple(range(100, 111))], 6)
    assert diffs and max(diffs) < 1e-5, max(diffs)


def test_batched_kernels_give_the_per_row_kernels_logits(tiny_model_dir):
    """Steps of at least int4_gemm_min_rows tokens (8 by default) run the int4 layers and a Q8_0
    LM head through the batched kernels (cpu/int4_gemm_avx2.c: weight panels dequantized once,
    tiles over every token). Every step here runs both ways on the same inputs (threshold 1:
    decode rows and token tails of 1-2 included; above every step: the per-row kernels): each
    gives eager's logits to fp32 summation order, and the two are not a bit for bit copy of
    each other (the switch took); the greedy tokens are eager's."""
    from kvmesh.quant.primitives import dequantize_int8_groupwise

    engine = _engine(tiny_model_dir, quant="int4", native=64)
    runner = engine.runner
    head = runner.model.lm_head.weight
    generator = torch.Generator().manual_seed(7)
    codes = torch.randint(-127, 128, head.shape, generator=generator, dtype=torch.int8)
    codes[:, ::32] = 127  # ggml's Q8_0: each group's largest |code| is 127
    scales = (torch.rand(head.shape[0], head.shape[1] // 32, generator=generator) * 1e-3 + 1e-4).half()
    with torch.no_grad():
        head.copy_(dequantize_int8_groupwise(codes, scales))
    runner.native_decoder = cpu_native_step.NativeDecoder.build(runner.model, runner.kv_caches, 64)
    decoder = runner.native_decoder
    assert decoder.head_q8_0 and decoder.path == "int4_avx2" and decoder.int4_gemm_min_rows == 8
    real_run, records = decoder.run, []

    def both_ways(inputs):
        try:
            decoder.int4_gemm_min_rows = 1 << 30
            per_row = real_run(inputs)
            per_row = None if per_row is None else per_row.clone()
            decoder.int4_gemm_min_rows = 1
            batched = real_run(inputs)
        finally:
            decoder.int4_gemm_min_rows = 8
        if batched is not None and inputs.sample_at:
            eager = runner.model.compute_logits(runner._eager_forward(inputs)[torch.tensor(inputs.sample_at)]).float()
            records.append((_relative(batched, eager, inputs), _relative(per_row, eager, inputs),
                            torch.equal(batched, per_row), len(inputs.input_ids)))
        return batched

    decoder.run = both_ways
    tokens = _generate(engine)
    eager = _engine(tiny_model_dir, quant="int4", native=0)
    with torch.no_grad():
        eager.runner.model.lm_head.weight.copy_(head)
    assert tokens == _generate(eager)
    assert len(records) >= 20 and {1, 2, 3} <= {n % 3 + 1 for *_, n in records}, "every token tail"
    assert max(r[0] for r in records) < 1e-5 and max(r[1] for r in records) < 1e-5, max(records)
    assert not all(r[2] for r in records), "the batched kernels did not run"


def test_an_lm_head_that_is_a_q8_0_table_is_read_as_its_int8_groups(tiny_model_dir):
    """An fp32 LM head whose every 32-input group is an int8 code times one scale (a GGUF Q8_0
    embedding dequantized at load, as the embedded model's is) is read as those codes and scales:
    the same weights bit for bit, so the logits are eager's to fp32 summation order and the
    greedy tokens eager's; any other fp32 head stays fp32."""
    from kvmesh.quant.primitives import dequantize_int8_groupwise, int8_groups_if_exact

    engine = _engine(tiny_model_dir, native=8)
    runner = engine.runner
    assert not runner.native_decoder.head_q8_0  # random fp32 weights: not such a table
    head = runner.model.lm_head.weight
    generator = torch.Generator().manual_seed(5)
    codes = torch.randint(-127, 128, head.shape, generator=generator, dtype=torch.int8)
    codes[:, ::32] = 127  # ggml's Q8_0: each group's largest |code| is 127
    scales = (torch.rand(head.shape[0], head.shape[1] // 32, generator=generator) * 1e-3 + 1e-4).half()
    scales[3] = 0  # an all-zero group of rows
    with torch.no_grad():
        head.copy_(dequantize_int8_groupwise(codes, scales))
    got = int8_groups_if_exact(head)
    assert got is not None and torch.equal(got[0][4:], codes[4:]) and torch.equal(got[1], scales.float())
    runner.native_decoder = cpu_native_step.NativeDecoder.build(runner.model, runner.kv_caches, 8)
    assert runner.native_decoder.head_q8_0 and runner.native_decoder.int8_head_bytes == head.numel() * 9 // 8
    diffs = _check_each_step_against_eager(engine, _relative)
    tokens = _generate(engine)
    assert len(diffs) >= 20 and max(diffs) < 1e-5, f"the Q8_0 head's logits differ from eager by {max(diffs)}"
    eager = _engine(tiny_model_dir, native=0)
    with torch.no_grad():
        eager.runner.model.lm_head.weight.copy_(head)
    assert tokens == _generate(eager)
    with torch.no_grad():
        head[0, 0] += 1e-7  # one weight off the grid
    assert int8_groups_if_exact(head) is None


@pytest.mark.skipif(cpu_native_step.unavailable_reason() is not None or cpu_build.load() is None
                    or not cpu_build.load().features & cpu_abi.FEATURES["KVMESH_FEATURE_DPBF16"],
                    reason="no VDPBF16PS build")
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_bf16_weights_are_quants_dequantization_rounded_to_bf16(group):
    """The int4_bf16 form's weights (the kernels' int4 -> bf16, what its eager layers multiply):
    quant's own dequantization in fp32 rounded to bf16, bit for bit, for RTN int4 (bf16 scales,
    integer zeros) and with fp16 mins added (GGUF's offsets), 37 rows (a tail short of 4); a Q8_0
    head's rows alike."""
    from kvmesh.quant.linear import Int4WeightOnlyLinear

    generator = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(256, 37, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(37, 256, generator=generator) * 0.05)
    layer = Int4WeightOnlyLinear.from_linear(linear, group)
    dense = cpu_native_step.Bf16Dense(cpu_build.load())
    assert torch.equal(dense(layer), layer.dequantized_weight(torch.bfloat16))
    layer.mins = (torch.randn(layer.scales.shape, generator=generator) * 0.02).half()
    layer.scales = layer.scales.half()
    assert torch.equal(dense(layer), layer.dequantized_weight(torch.bfloat16))
    # a Q8_0 head's rows (its eager forward in that mode): the table's rows in bf16
    from kvmesh.quant.int8_group_table import Int8GroupEmbedding

    codes = torch.randint(-127, 128, (37, 256), generator=generator, dtype=torch.int8)
    table = Int8GroupEmbedding(codes, torch.rand(37, 8, generator=generator).half().float() * 1e-3, torch.bfloat16)
    assert torch.equal(dense.q8_0_rows(table.codes, table.scales), table.rows(0, 37))


@pytest.mark.skipif(cpu_native_step.unavailable_reason() is not None or cpu_build.load() is None
                    or not cpu_build.load().features & cpu_abi.FEATURES["KVMESH_FEATURE_DPBF16"],
                    reason="no VDPBF16PS build")
def test_int4_bf16_tables_take_one_fma_only_where_the_product_is_exact():
    """Zeros all 0 with mins (GGUF Q4_1's form): with fp16 scales every code x scale is exact in
    fp32, so the kernels build a group's table with one FMA; with fp32 scales they keep the
    multiply and the add. Here an fp32 scale (1 + 2^-23) x code 5 rounds, and the min puts the
    add's sum on a bf16 tie (1 + 2^-8) that one FMA's sum (1 + 2^-8 + 2^-22) rounds the other way:
    the weights must still be quant's own, bit for bit, in both dtypes."""
    from kvmesh.quant import primitives
    from kvmesh.quant.linear import Int4WeightOnlyLinear

    generator = torch.Generator().manual_seed(4)
    rows, inputs, group = 9, 128, 32
    codes = torch.randint(0, 16, (rows, inputs), generator=generator)
    codes[:, ::3] = 5
    zeros = torch.zeros(rows, inputs // group)
    scales = torch.full((rows, inputs // group), 1 + 2 ** -23)
    mins = torch.full((rows, inputs // group), float.fromhex("-0x1.ff8004p+1"))
    layer = Int4WeightOnlyLinear(primitives.pack_int4(codes), scales, zeros, group, mins=mins)
    expected = layer.dequantized_weight(torch.bfloat16)
    one_rounding = (codes.double() * scales.double().repeat_interleave(group, 1)
                    + mins.double().repeat_interleave(group, 1)).float().to(torch.bfloat16)
    assert (one_rounding != expected).sum() >= rows * inputs // 3, "the data no longer tells the forms apart"
    dense = cpu_native_step.Bf16Dense(cpu_build.load())
    assert torch.equal(dense(layer), expected)
    layer.scales = (torch.rand(rows, inputs // group, generator=generator) * 1e-2).half()
    layer.mins = (torch.randn(rows, inputs // group, generator=generator) * 0.02).half()
    assert torch.equal(dense(layer), layer.dequantized_weight(torch.bfloat16))
