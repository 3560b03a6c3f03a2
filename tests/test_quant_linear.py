"""Quantized linear layers against their dequantized reference, tensor-parallel shards against
the whole layer, AWQ against RTN, and quantize_model on a random tiny HF Llama."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from kvmesh.core.config import ConfigError, QuantConfig
from kvmesh.quant import awq, calibration
from kvmesh.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear
from kvmesh.quant.linear import merge_output_rows, quantize_model

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def linear(n: int = 64, k: int = 128, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.mul_(3.0)
        if bias:
            layer.bias.uniform_(-1, 1)
    return layer


def quantized(kind: str, layer: nn.Linear, input_scale: torch.Tensor | None = None) -> nn.Module:
    if kind == "int8":
        return Int8WeightOnlyLinear.from_linear(layer, input_scale=input_scale)
    return Int4WeightOnlyLinear.from_linear(layer, int(kind.removeprefix("int4_g")), input_scale=input_scale)


def reference(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """fp32 x @ W_hat^T (+ bias), W_hat the layer's own dequantized weight, input scale applied."""
    x = x.float()
    if module.input_inv_scale is not None:
        x = x * module.input_inv_scale
    y = x @ module.dequantized_weight(torch.float32).t()
    return y if module.bias is None else y + module.bias.float()


KINDS = ["int8", "int4_g32", "int4_g64", "int4_g128"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_matches_dequantized_reference(kind, dtype):
    layer = linear(bias=True).to(dtype)
    module = quantized(kind, layer)
    x = torch.randn(2, 5, 128).to(dtype)  # [batch, seq, K]: leading dims pass through
    y = module(x)
    assert y.dtype == dtype and y.shape == (2, 5, 64)
    expected = reference(module, x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: 8-bit mantissa on x, scales and output
    assert (y.float() - expected).abs().max() <= tol * expected.abs().max()
    # and it approximates the original float layer (quantization error, not a wrong formula)
    dense = layer.float()(x.float())
    rel = (y.float() - dense).norm() / dense.norm()
    assert rel < (0.02 if kind == "int8" else 0.2)


def test_int4_bf16_cpu_uses_the_packed_kernel_and_agrees_with_fallback():
    module = quantized("int4_g32", linear()).to(torch.bfloat16)
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    y_kernel = module(x)
    assert module._kernel_operands is not None  # the CPU int4 kernel ran
    y_fallback = module(x.float())  # fp32 takes the dequantize path
    assert (y_kernel.float() - y_fallback).abs().max() <= 2e-2 * y_fallback.abs().max()


def test_int4_kernel_rejected_shape_falls_back():
    module = quantized("int4_g32", linear(n=24))  # the CPU kernel needs N % 16 == 0
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    y = module.to(torch.bfloat16)(x)
    assert module._kernel_operands is None
    assert (y.float() - reference(module, x)).abs().max() <= 2e-2 * reference(module, x).abs().max()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_column_parallel_shards_concatenate_to_the_whole(kind, world_size):
    module = quantized(kind, linear(n=64, k=512, bias=True), input_scale=torch.rand(512) + 0.5)
    x = torch.randn(3, 512)
    parts = [module.shard(0, r, world_size)(x) for r in range(world_size)]
    assert torch.allclose(torch.cat(parts, dim=-1), module(x), atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_row_parallel_shards_sum_to_the_whole(kind, world_size):
    module = quantized(kind, linear(n=64, k=512, bias=True), input_scale=torch.rand(512) + 0.5)
    x = torch.randn(3, 512)
    width = 512 // world_size
    shards = [module.shard(1, r, world_size) for r in range(world_size)]
    total = sum(s(x[:, r * width:(r + 1) * width]) for r, s in enumerate(shards))
    assert torch.allclose(total, module(x), atol=1e-4)
    assert shards[0].bias is not None and all(s.bias is None for s in shards[1:])
    if kind != "int8":  # packed bytes and group columns split with the inputs
        assert shards[0].qweight.shape == (64, width // 2)
        assert shards[0].scales.shape == (64, width // module.group_size)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_output_rows_compute_the_members_concatenated(kind, dtype):
    """merged QKV / gate-up: one call == each member's output side by side, bit for bit, and the
    members (now views of the merged buffers) compute exactly what they did before."""
    scale = torch.rand(128) + 0.5
    members = [quantized(kind, linear(n=n, k=128, bias=True, seed=i), input_scale=scale).to(dtype)
               for i, n in enumerate((64, 32, 32))]
    x = torch.randn(5, 128).to(dtype)
    before = [m(x) for m in members]
    merged = merge_output_rows(members)
    assert merged is not None and merged.out_features == 128
    assert torch.equal(merged(x), torch.cat(before, dim=-1))
    assert all(torch.equal(m(x), b) for m, b in zip(members, before))
    assert members[1].scales.data_ptr() == merged.scales[64:].data_ptr()  # views, not copies


def test_merge_output_rows_refuses_what_one_call_cannot_compute():
    a, b = linear(n=32, k=128, seed=1), linear(n=32, k=128, seed=2)
    assert merge_output_rows([quantized("int4_g32", a), quantized("int4_g64", b)]) is None  # group sizes
    assert merge_output_rows([quantized("int8", a), quantized("int4_g32", b)]) is None  # kinds
    assert merge_output_rows([quantized("int8", a, torch.rand(128) + 0.5), quantized("int8", b)]) is None  # AWQ
    assert merge_output_rows([a, b]) is None  # float layers: the model's FusedLinears


def test_row_parallel_needs_whole_groups():
    module = quantized("int4_g128", linear(n=64, k=256))
    with pytest.raises(ConfigError, match="groups"):
        module.shard(1, 0, 4)  # 64 columns per shard: half a group
    with pytest.raises(ConfigError):
        module.shard(2, 0, 2)
    with pytest.raises(ConfigError):
        module.shard(0, 2, 2)


def test_wrong_input_width_is_a_config_error():
    with pytest.raises(ConfigError):
        quantized("int8", linear())(torch.randn(2, 127))


# ---- AWQ --------------------------------------------------------------------------------


def outlier_activations(tokens: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g)
    x[:, :: k // 8] *= 30.0  # a few input channels carry much larger activations (as in LLMs)
    return x


def test_awq_beats_rtn_on_outlier_channels():
    layer = linear(n=64, k=256)
    x = outlier_activations(256, 256)
    found = awq.search_awq_scale(layer.weight, x, x.abs().mean(0), group_size=128)
    assert found.alpha > 0
    assert found.mse < 0.8 * found.rtn_mse
    assert found.rtn_mse == pytest.approx(awq.int4_output_mse(layer.weight, x, 128))
    # the module built with that scale realises the searched MSE on the same inputs
    module = Int4WeightOnlyLinear.from_linear(layer, 128, input_scale=found.input_scale)
    with torch.no_grad():
        mse_module = float((module(x) - layer(x)).pow(2).mean())
        mse_rtn = float((Int4WeightOnlyLinear.from_linear(layer, 128)(x) - layer(x)).pow(2).mean())
    assert mse_module == pytest.approx(found.mse, rel=1e-3)
    assert mse_module < mse_rtn
    # and the gain carries over to held-out activations from the same distribution
    x_new = outlier_activations(256, 256, seed=1)
    assert awq.int4_output_mse(layer.weight, x_new, 128, found.input_scale) < \
        awq.int4_output_mse(layer.weight, x_new, 128)


def test_awq_scale_is_normalised():
    s = awq.awq_input_scale(torch.tensor([0.1, 1.0, 10.0]), 1.0)
    assert float(s.max() * s.min()) == pytest.approx(1.0)
    assert torch.all(awq.awq_input_scale(torch.rand(16), 0.0) == 1.0)


# ---- quantize_model on a real (random, tiny) HF Llama -------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama_config():
    return transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def tiny_llama(config) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


class ByteTokenizer:
    """UTF-8 bytes as token ids: enough to push real text through a 256-token test model."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


@pytest.mark.parametrize("mode", ["int8", "int4", "int4_awq"])
def test_quantize_model_replaces_projections_only(tiny_llama_config, mode):
    model = tiny_llama(tiny_llama_config)
    ids = torch.randint(0, 256, (1, 24))
    with torch.no_grad():
        dense_logits = model(ids).logits
    awq_results = None
    if mode == "int4_awq":
        seqs = calibration.token_sequences(ByteTokenizer(), calibration.load_text(), seq_len=64, max_sequences=4)
        stats = calibration.collect_activation_stats(model, seqs, max_samples=128)
        awq_results = awq.search_model_awq(model, stats, 32)
    report = quantize_model(model, QuantConfig(weight=mode, group_size=32), awq_results)
    names = dict(model.named_modules())
    assert len(report.replaced) == 2 * 7
    expected_cls = Int8WeightOnlyLinear if mode == "int8" else Int4WeightOnlyLinear
    for name in report.replaced:
        assert name.rsplit(".", 1)[-1] in PROJECTIONS and isinstance(names[name], expected_cls)
    assert isinstance(model.lm_head, nn.Linear) and isinstance(model.model.embed_tokens, nn.Embedding)
    params = report.weight_bytes_before // 4  # fp32 model
    rows = sum(names[n].out_features for n in report.replaced)
    if mode == "int8":  # int8 weights + one fp32 scale per output row
        assert report.weight_bytes_after == params + rows * 4
    else:  # half a byte per weight + fp32 scale and zero per group of 32 (+ AWQ input scales)
        awq_bytes = sum(names[n].in_features * 4 for n in report.replaced) if mode == "int4_awq" else 0
        assert report.weight_bytes_after == params // 2 + params // 32 * 8 + awq_bytes
    assert (mode == "int4_awq") == bool(report.awq_alphas)
    with torch.no_grad():
        logits = model(ids).logits
    rel = (logits - dense_logits).norm() / dense_logits.norm()
    assert rel < (0.02 if mode == "int8" else 0.25)


def test_quantize_model_none_is_a_no_op(tiny_llama_config):
    model = tiny_llama(tiny_llama_config)
    report = quantize_model(model, QuantConfig(weight="none"))
    assert report.replaced == () and isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear)


@pytest.mark.parametrize("cfg,stats,match", [
    (QuantConfig(weight="int5"), None, "quant.weight"),
    (QuantConfig(weight="int4", group_size=48), None, "group_size"),
    (QuantConfig(weight="int4", group_size=128), None, "does not divide|divide"),  # hidden is 64
    (QuantConfig(weight="int4_awq", group_size=32), None, "calibration"),
])
def test_bad_quant_config_fails_before_touching_the_model(tiny_llama_config, cfg, stats, match):
    model = tiny_llama(tiny_llama_config)
    with pytest.raises(ConfigError, match=match):
        quantize_model(model, cfg, stats)
    assert all(not isinstance(m, (Int8WeightOnlyLinear, Int4WeightOnlyLinear)) for m in model.modules())


def test_calibration_statistics(tiny_llama_config):
    model = tiny_llama(tiny_llama_config)
    seqs = calibration.token_sequences(ByteTokenizer(), calibration.load_text(), seq_len=32, max_sequences=5)
    assert len(seqs) == 5 and all(s.shape == (32,) for s in seqs)
    stats = calibration.collect_activation_stats(model, seqs, max_samples=100)
    assert set(stats) == {f"model.layers.{i}.{p}" for i in range(2)
                          for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    down = stats["model.layers.0.mlp.down_proj"]
    assert down.num_tokens == 160 and down.samples.shape == (100, 128) and down.mean_abs.shape == (128,)
    # q, k and v read the same normalised input: identical statistics
    q, k = stats["model.layers.1.self_attn.q_proj"], stats["model.layers.1.self_attn.k_proj"]
    assert torch.equal(q.mean_abs, k.mean_abs)
    assert torch.all(down.max_abs >= down.samples.abs().amax(0))
    assert not any(m._forward_pre_hooks for m in model.modules())  # hooks removed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", KINDS)
def test_quantized_linear_on_cuda_uses_the_fallback(kind):
    module = quantized(kind, linear()).to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 128, device="cuda", dtype=torch.bfloat16)
    expected = reference(module.float().cpu(), x.float().cpu())
    assert (module(x).float().cpu() - expected).abs().max() <= 2e-2 * expected.abs().max()
