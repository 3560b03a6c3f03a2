"""GGUF files served in their own quantization (quant.weight: gguf).

Tiny random Llama GGUFs written with the `gguf` package's writer (load_tests/gguf_checkpoints.py),
one per kept type (Q8_0, Q4_0, Q4_1, Q4_K):

- loading keeps every projection quantized (the int8-group / int4 layers, no float weight),
  and each layer's dequantized weight equals gguf's own `gguf.quants.dequantize` of the file's
  tensor bit for bit (q / k rows un-permuted as transformers does);
- greedy tokens through the engine equal those of the same file served with quant.weight none
  (transformers' GGUF loader: gguf-dequantized fp32 weights), with chunked prefill, eager and
  through the native step's int4 path (the default, fp32 activations); its int4 x int8 path
  (quant.int4_activations int8) agrees with the eager kept path's greedy tokens step by step;
- `kvmesh capacity --weight-dtype gguf` counts exactly the bytes the loaded layers hold;
- a projection of another type (Q5_0) is refused at load with the type and tensor named.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmesh.core.config import ConfigError, KvmeshConfig
from kvmesh.load_tests import gguf_checkpoints as gc
from kvmesh.load_tests.family_checkpoints import greedy_continuations
from kvmesh.quant.gguf_layouts import UnsupportedGgufTypeError
from kvmesh.quant.linear import Int4WeightOnlyLinear, Int8GroupWeightOnlyLinear
from kvmesh.worker.engine_api import Engine, embedded_gguf_path
from kvmesh.worker.kernels import cpu_native_step
from kvmesh.worker.model.gguf_loader import _unpermute_rows
from kvmesh.worker.runner.model_setup import load_model, resolve_model

NEW_TOKENS = 12
PROMPTS = [[5, 17, 300, 42, 7], list(range(100, 141))]  # the second is prefilled in 3 chunks


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """Converted folders (quant.weight none) and cached configs of these files, in a temp dir."""
    mp = pytest.MonkeyPatch()
    mp.setenv("KVMESH_CACHE_DIR", str(tmp_path_factory.mktemp("kvmesh-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="module", params=gc.KEPT_TYPES)
def gguf_file(request, tmp_path_factory, cache_dir):
    return request.param, gc.write_tiny_llama_gguf(tmp_path_factory.mktemp(request.param) / "tiny.gguf",
                                                  request.param)


def _config(path, weight: str, native: int | None = None, int4_activations: str = "fp32") -> KvmeshConfig:
    return KvmeshConfig.from_dict({
        "model": {"path": str(path), "dtype": "fp32", "cpu_native_max_tokens": native},
        "quant": {"weight": weight, "int4_activations": int4_activations},
        "cache": {"num_blocks": 32, "block_size": 8},
        "scheduler": {"max_num_batched_tokens": 32, "max_prefill_tokens_per_step": 16, "max_queue_time_s": 3600},
        "parallel": {"attention_backend": "cpu", "device": "cpu"},
    })


def _greedy(config: KvmeshConfig) -> tuple[list[list[int]], Engine]:
    engine = Engine.from_config(config)
    return greedy_continuations(engine, PROMPTS, NEW_TOKENS), engine


def test_projections_stay_quantized_and_dequantize_as_gguf_does(gguf_file):
    import gguf

    type_name, path = gguf_file
    config = _config(path, "gguf")
    spec = resolve_model(config)
    model = load_model(config, spec)
    layer_type = Int8GroupWeightOnlyLinear if type_name == "Q8_0" else Int4WeightOnlyLinear
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    cfg = spec.hf_config
    for i, layer in enumerate(model.model.layers):
        for hf, name, heads in (("self_attn.q_proj", "attn_q", cfg.num_attention_heads),
                                ("self_attn.k_proj", "attn_k", cfg.num_key_value_heads),
                                ("self_attn.v_proj", "attn_v", None), ("self_attn.o_proj", "attn_output", None),
                                ("mlp.gate_proj", "ffn_gate", None), ("mlp.up_proj", "ffn_up", None),
                                ("mlp.down_proj", "ffn_down", None)):
            module = layer.get_submodule(hf)
            assert type(module) is layer_type and not any(p.is_floating_point() and p.dim() == 2 and
                                                           p.shape == (module.out_features, module.in_features)
                                                           for p in module.buffers()), f"{hf} holds a float weight"
            tensor = tensors[f"blk.{i}.{name}.weight"]
            assert tensor.tensor_type.name == type_name
            want = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            want = want if heads is None else _unpermute_rows(want, heads)
            got = module.dequantized_weight(torch.float32).numpy()
            assert np.array_equal(got, want), f"layer {i} {hf}: max diff {np.abs(got - want).max()}"
    if type_name in ("Q4_1", "Q4_K"):  # the min term is what these types add
        assert model.model.layers[0].mlp.up_proj.mins is not None
    assert not any(p.is_meta for p in model.parameters())


def test_capacity_counts_the_bytes_the_loaded_model_holds(gguf_file):
    from kvmesh.kv.capacity import estimate_weight_bytes, load_model_shape

    type_name, path = gguf_file
    config = _config(path, "gguf").replace(model={"dtype": "bf16"})  # capacity counts unquantized tensors 16-bit
    model = load_model(config, resolve_model(config))
    held = sum(t.numel() * t.element_size() for name, t in [*model.named_parameters(), *model.named_buffers()]
               if "rotary" not in name)  # the RoPE tables are no weights
    assert estimate_weight_bytes(load_model_shape(path), "gguf").total_bytes == held, type_name


def test_greedy_equals_the_gguf_dequantized_model(gguf_file):
    type_name, path = gguf_file
    # transformers' GGUF loader: fp32 weights from gguf.dequantize; both eager (the reference path)
    want, dequantized = _greedy(_config(path, "none", native=0))
    got, kept = _greedy(_config(path, "gguf", native=0))  # the eager kept path
    assert all(len(w) == NEW_TOKENS for w in want)
    assert got == want, f"{type_name}: kept-quantized tokens differ from the dequantized model's"
    if type_name != "Q8_0" and cpu_native_step.unavailable_reason() is None:
        # the default for int4 types: the native step, each weight dequantized in registers
        default, engine = _greedy(_config(path, "gguf"))
        assert engine.runner.cpu_step.path == "int4_avx2" and engine.runner.native_decoder.steps_run >= NEW_TOKENS
        assert default == want, f"{type_name}: the native int4 step's tokens differ from the dequantized model's"
        _native_int4_agrees_with_eager_kept(path, type_name)
    # memory by part on CPU (kvmesh_memory_planned_bytes{part}): the weights the engine holds,
    # the step workspace and the KV pool, each reported; the kept weights are the smaller
    for engine in (dequantized, kept):
        plan = engine.parts.plan
        split = plan.device.split()
        assert split["weights"] == plan.weight_bytes > 0 and split["kv_pool"] == plan.kv_cache_bytes > 0
        assert split["activations"] > 0 and split["sampler"] > 0
    assert kept.parts.plan.weight_bytes < dequantized.parts.plan.weight_bytes


def _native_int4_agrees_with_eager_kept(path, type_name: str) -> cpu_native_step.NativeDecoder:
    """quant.int4_activations int8 (the fastest mode): the native step, int4 x int8 activations
    per 32 inputs. Each step it serves is re-run by the eager kept path on the same inputs:
    logits within the activations' int8 rounding, the same greedy token in nearly every row
    (teacher-forced: the tiny random model's near-flat logits part free-running sequences at
    the first near-tie)."""
    engine = Engine.from_config(_config(path, "gguf", int4_activations="int8"))
    runner = engine.runner
    assert runner.cpu_step.path == "int4_avx2_a8"
    real_run, rows = runner.native_decoder.run, []

    def checked(inputs):
        logits = real_run(inputs)
        if logits is not None and inputs.sample_at:
            eager = runner.model.compute_logits(runner._eager_forward(inputs)[torch.tensor(inputs.sample_at)]).float()
            rows.append(((logits - eager).abs().max() / eager.abs().max()).item())
            rows[-1] = (rows[-1], (logits.argmax(-1) == eager.argmax(-1)).float().mean().item())
        return logits

    runner.native_decoder.run = checked
    greedy_continuations(engine, PROMPTS, NEW_TOKENS)
    assert runner.native_decoder.steps_run >= NEW_TOKENS
    worst, same = max(d for d, _ in rows), sum(s for _, s in rows) / len(rows)
    assert worst < 0.05 and same >= 0.9, f"{type_name}: native int4 vs eager kept: logits {worst}, argmax {same:.0%}"
    return runner.native_decoder


def _bf16_step_logits(path, weight: str, native: int | None, prompts=PROMPTS,
                      **scheduler) -> tuple[list[list[int]], list[torch.Tensor], Engine]:
    """Greedy tokens of `path` in bf16 and the logits of every native step that sampled (the sizes
    of the steps it ran: engine.native_step_sizes)."""
    config = _config(path, weight, native).replace(model={"dtype": "bf16"})
    if scheduler:
        config = config.replace(scheduler=scheduler, cache={"num_blocks": 128})
    engine = Engine.from_config(config)
    decoder, logits = engine.runner.native_decoder, []
    real_run = decoder.run
    engine.native_step_sizes = []

    def kept(inputs):
        out = real_run(inputs)
        if out is not None:
            engine.native_step_sizes.append(len(inputs.input_ids))
        if out is not None and inputs.sample_at:
            logits.append(out.clone())
        return out

    decoder.run = kept
    return greedy_continuations(engine, prompts, NEW_TOKENS), logits, engine


@pytest.mark.skipif(not cpu_native_step.dpbf16_without_amx(), reason="the bf16 model's GEMVs are not VDPBF16PS here")
@pytest.mark.parametrize("tied", [False, True], ids=["f16-head", "tied-q8_0-head"])
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K", "embedded"])
def test_bf16_int4_layers_compute_the_bf16_dequantized_models_logits(type_name, tied, tmp_path, cache_dir):
    """quant.weight gguf in a bf16 model: the int4 layers (and a Q8_0 head) dequantized to bf16 a
    4-row group at a time and multiplied by the bf16 model's VDPBF16PS GEMV: every native step's
    logits those of the file dequantized at load (quant.weight none, rounded to bf16) bit for bit,
    with the prompts' chunks run eagerly (native steps of <= 4 tokens: the eager int4 layers
    multiply the same bf16 values) and natively."""
    if type_name == "embedded":
        if tied:
            pytest.skip("the embedded file is one case")
        path = embedded_gguf_path()
    else:
        path = gc.write_tiny_llama_gguf(tmp_path / "tiny.gguf", type_name, tied=tied)
    for native in (4, 64):
        want_tokens, want, _ = _bf16_step_logits(path, "none", native)
        got_tokens, got, engine = _bf16_step_logits(path, "gguf", native)
        assert engine.runner.cpu_step.path == "int4_avx512_bf16", engine.runner.cpu_step.describe()
        assert got_tokens == want_tokens and len(got) == len(want) >= NEW_TOKENS - 1
        for step, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), f"{type_name} step {step}: max diff {(g - w).abs().max()}"


@pytest.mark.skipif(not cpu_native_step.dpbf16_without_amx(), reason="the bf16 model's GEMVs are not VDPBF16PS here")
@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_K"])
def test_bf16_int4_prefill_steps_past_64_tokens_keep_the_dequantized_models_logits(type_name, tmp_path, cache_dir):
    """Steps of up to 200 tokens (auto on a VDPBF16PS CPU without AMX: every step of the budget):
    the int4 rows are dequantized to bf16 once a step and the tokens go 64 at a time through the
    same VDPBF16PS walk, so every step's logits stay the dequantized bf16 model's bit for bit."""
    path = gc.write_tiny_llama_gguf(tmp_path / "tiny.gguf", type_name, tied=True)
    prompts = [list(range(100, 100 + n)) for n in (180, 150, 30)]
    budget = {"max_num_batched_tokens": 200, "max_prefill_tokens_per_step": 190}
    want_tokens, want, _ = _bf16_step_logits(path, "none", None, prompts, **budget)
    got_tokens, got, engine = _bf16_step_logits(path, "gguf", None, prompts, **budget)
    assert engine.runner.cpu_step.path == "int4_avx512_bf16" and engine.runner.native_max_tokens == 200
    assert max(engine.native_step_sizes) > 128, "steps of three token blocks ran natively"
    assert got_tokens == want_tokens and len(got) == len(want) >= NEW_TOKENS - 1
    for step, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"{type_name} step {step}: max diff {(g - w).abs().max()}"


@pytest.mark.skipif(cpu_native_step.unavailable_reason() is not None, reason="no native step")
def test_int8_activations_read_a_tied_q8_0_head_with_int8_activations_too(tmp_path, cache_dir):
    """The embedded model's shape: Q4_1 layers and the LM head tied to the Q8_0 token table.
    With int8 activations the head is that table's groups against the hidden state quantized
    per 32 inputs (llama.cpp's Q8_0 x Q8_0), its codes and group scales read in 16-row panels
    (int4_panels.c, a copy beside the table): the eager kept path's logits within the int8
    rounding and its greedy token in nearly every step."""
    path = gc.write_tiny_llama_gguf(tmp_path / "tied.gguf", "Q4_1", tied=True)
    decoder = _native_int4_agrees_with_eager_kept(path, "Q4_1 tied")
    assert decoder.head_q8_0 and decoder.int4_interleaved
    model = decoder._description.model
    assert model.lm_head_packed and model.lm_head_packed != model.lm_head_weight  # the table stays the embedding


def test_a_type_without_an_exact_layout_is_refused_by_name(tmp_path, cache_dir):
    path = gc.write_tiny_llama_gguf(tmp_path / "q5.gguf", "Q4_0", overrides={"blk.1.ffn_down.weight": "Q5_0"})
    config = _config(path, "gguf")
    with pytest.raises(UnsupportedGgufTypeError, match=r"'blk\.1\.ffn_down\.weight' is Q5_0"):
        load_model(config, resolve_model(config))


def test_gguf_mode_needs_a_gguf_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a .gguf file"):
        resolve_model(_config(tmp_path, "gguf"))


@pytest.mark.skipif(cpu_native_step.unavailable_reason() is not None, reason="no native step")
@pytest.mark.parametrize("type_name, dpbf16_without_amx, want", [
    ("Q4_1", True, "gguf"), ("Q4_K", True, "gguf"),  # 4-bit layers, VDPBF16PS and no AMX: the bytes kept
    ("Q8_0", True, "none"),  # int8 layers: no bf16-product kernel takes them, the bf16 copy
    ("Q4_1", False, "none"),  # AMX (or no VDPBF16PS): the bf16 copy
])
def test_quant_weight_auto_keeps_a_bf16_models_4_bit_layers_where_bf16_products_run_on_them(
        type_name, dpbf16_without_amx, want, tmp_path, cache_dir, monkeypatch):
    """In bf16, auto keeps a GGUF's int4 layers only where the native step reads them as the bf16
    model's products (int4_bf16: the bf16 copy's logits, above) and that beats the copy."""
    path = gc.write_tiny_llama_gguf(tmp_path / "tiny.gguf", type_name)
    monkeypatch.setattr(cpu_native_step, "dpbf16_without_amx", lambda: dpbf16_without_amx)
    config = _config(path, "auto").replace(model={"dtype": "bf16"})
    assert resolve_model(config).weight_quant == want


def test_quant_weight_auto_is_resolved_once_and_travels_on_the_spec(tmp_path, cache_dir, monkeypatch):
    """resolve_model resolves quant.weight auto and the ModelSpec carries it; load_model loads
    what the spec says without resolving again (tools and tests call both directly)."""
    from kvmesh.worker.runner import model_setup

    path = gc.write_tiny_llama_gguf(tmp_path / "tiny.gguf", "Q4_1")
    config = _config(path, "auto")
    spec = resolve_model(config)
    want = "gguf" if cpu_native_step.unavailable_reason() is None else "none"  # fp32 on a CPU: its own int4
    assert spec.weight_quant == want
    monkeypatch.setattr(model_setup, "resolve_weight_quant", lambda c: pytest.fail("resolved a second time"))
    model = load_model(config, spec)
    assert isinstance(model.model.layers[0].mlp.up_proj, Int4WeightOnlyLinear) == (want == "gguf")
