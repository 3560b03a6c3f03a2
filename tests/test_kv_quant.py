"""KV-cache quantization: per token-head scales in the paged layout of worker/attention/backend.py,
attention over int8 / fp8 K and V within tolerance of fp32 attention, static calibration."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from kvmesh.core.config import ConfigError
from kvmesh.quant import calibration
from kvmesh.kv import capacity
from kvmesh.quant.kv_quant import (FP8_E4M3_MAX, INT4_MAX, INT8_MAX, KV_QUANT_DTYPES, KV_SCALE_DTYPE, MAX_KV_SCALE,
                                   MIN_KV_SCALE, calibrate_kv_scales, dequantize_kv, kv_cache_layout,
                                   kv_int4_group_size, kv_storage_dtype, quantize_kv)

QMAX = {"int8": INT8_MAX, "fp8": FP8_E4M3_MAX, "int4": INT4_MAX}


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain fp32 reference. q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]; GQA by repeating KV heads."""
    t, hq, d = q.shape
    group = hq // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), k) / math.sqrt(d)  # [Hq, T, T]
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
    return torch.einsum("hts,shd->thd", probs, v)


def qkv(tokens: int = 40, hq: int = 8, hkv: int = 2, d: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, hq, d, generator=g)
    k = torch.randn(tokens, hkv, d, generator=g) * 2.0
    v = torch.randn(tokens, hkv, d, generator=g)
    k[:, :, 5] += 8.0  # a persistent outlier channel, as real K caches have
    return q, k, v


@pytest.mark.parametrize("kv_dtype,tolerance", [("int8", 2e-2), ("fp8", 8e-2), ("int4", 0.25)])
def test_attention_over_quantized_kv_is_close_to_fp32(kv_dtype, tolerance):
    q, k, v = qkv()
    exact = causal_attention(q, k, v)
    qk, sk = quantize_kv(k, kv_dtype)
    qv, sv = quantize_kv(v, kv_dtype)
    groups = (k.shape[-1] // 32,) if kv_dtype == "int4" else ()
    assert qk.dtype == kv_storage_dtype(kv_dtype) and sk.shape == k.shape[:2] + groups and sk.dtype == KV_SCALE_DTYPE
    approx = causal_attention(q, dequantize_kv(qk, sk), dequantize_kv(qv, sv))
    rel = float((approx - exact).norm() / exact.norm())
    assert rel < tolerance
    # int8 (7 bits of magnitude) is far tighter than e4m3 (3 mantissa bits)
    if kv_dtype == "fp8":
        qk8, sk8 = quantize_kv(k, "int8")
        qv8, sv8 = quantize_kv(v, "int8")
        int8_rel = float((causal_attention(q, dequantize_kv(qk8, sk8), dequantize_kv(qv8, sv8)) - exact).norm()
                         / exact.norm())
        assert int8_rel < rel


def test_int8_round_trip_bound_and_scales():
    _, k, _ = qkv()
    q, scale = quantize_kv(k, "int8")
    # the stored scale is fp16(absmax / 127): within fp16's half-ulp (2**-11 relative)
    assert torch.equal(scale, (k.abs().amax(-1) / 127).to(torch.float16))
    assert torch.allclose(scale.float(), k.abs().amax(-1) / 127, rtol=2**-11, atol=0)
    assert int(q.abs().max()) == 127
    # codes are computed against the stored scale, so the error is half a step of it
    assert torch.all((dequantize_kv(q, scale) - k).abs() <= scale.float()[..., None] / 2 + 1e-6)


def test_int4_codes_scales_and_packing():
    """Group-wise int4: one fp16(absmax / 7) per 32 channels, codes within half a step,
    every group reaching +-7, packed two a byte with the even channel in the low nibble."""
    _, k, _ = qkv(d=64)
    q, scale = quantize_kv(k, "int4")
    assert q.dtype == torch.uint8 and q.shape == (*k.shape[:2], 32) and scale.shape == (*k.shape[:2], 2)
    grouped = k.reshape(*k.shape[:2], 2, 32)
    assert torch.equal(scale, (grouped.abs().amax(-1) / 7).to(torch.float16))
    step = scale.float().repeat_interleave(32, dim=-1)
    back = dequantize_kv(q, scale)
    assert torch.all((back - k).abs() <= step / 2 + 1e-6)
    codes = torch.stack([q & 15, q >> 4], dim=-1).reshape(k.shape).to(torch.int64) - 8
    assert int(codes.min()) >= -7 and int(codes.max()) <= 7
    assert torch.equal(codes.reshape(*k.shape[:2], 2, 32).abs().amax(-1), torch.full((*k.shape[:2], 2), 7))
    # the channel-5 outlier only coarsens its own group: group 1 keeps a finer step
    assert float(scale[..., 1].float().mean()) < 0.8 * float(scale[..., 0].float().mean())
    with pytest.raises(ConfigError):
        quantize_kv(k, "int4", static_scale=1.0)
    with pytest.raises(ConfigError):
        quantize_kv(torch.randn(2, 2, 5), "int4")  # odd head_dim cannot pack pairs


@pytest.mark.parametrize("head_dim,group", [(128, 32), (64, 32), (16, 16), (24, 8), (80, 16), (2, 2)])
def test_int4_group_rule_is_the_capacity_models(head_dim, group):
    assert kv_int4_group_size(head_dim) == group
    assert capacity.kv_int4_scale_groups(head_dim) == head_dim // group
    layout = kv_cache_layout(torch.uint8, head_dim)
    assert (layout.stored_head_dim, layout.scales_per_head) == (head_dim // 2, head_dim // group)


def test_fp8_dynamic_scale_uses_the_full_range():
    _, k, _ = qkv()
    q, scale = quantize_kv(k, "fp8")
    assert torch.equal(scale, (k.abs().amax(-1) / FP8_E4M3_MAX).to(torch.float16))
    assert float(q.float().abs().amax()) == FP8_E4M3_MAX
    rel = (dequantize_kv(q, scale) - k).abs() / k.abs().clamp_min(1e-3)
    assert float(rel[k.abs() > scale.float()[..., None] * 2**-6].max()) <= 2**-4  # e4m3 normals: 3 mantissa bits


def test_scale_bounds_keep_fp16_finite_and_normal():
    """An all-zero token-head gets fp16's smallest normal (no division by zero, no subnormal
    loss of precision); tiny values still round-trip within half that step; an absurd
    absmax saturates at fp16's largest scale instead of becoming inf."""
    x = torch.zeros(3, 1, 4)
    x[1, 0] = torch.tensor([1e-4, -2e-4, 3e-4, 0.0])
    x[2, 0] = torch.tensor([1e9, 1.0, -1.0, 0.0])
    for kv_dtype in KV_QUANT_DTYPES:
        q, scale = quantize_kv(x, kv_dtype)
        assert scale.dtype == KV_SCALE_DTYPE and bool(torch.isfinite(scale).all())
        assert float(scale[0, 0]) == float(scale[1, 0]) == MIN_KV_SCALE
        assert float(scale[2, 0]) == MAX_KV_SCALE
        back = dequantize_kv(q, scale)
        assert torch.equal(back[0], x[0])
        assert float((back[1] - x[1]).abs().max()) <= MIN_KV_SCALE / 2
        assert float(back[2, 0, 0]) == MAX_KV_SCALE * QMAX[kv_dtype]


def test_static_scale_fills_every_slot_and_saturates_beyond():
    x = torch.tensor([[[1.0, -2.0, 900.0]]])  # [T=1, H=1, D=3]
    q, scale = quantize_kv(x, "fp8", static_scale=1.0)
    assert scale.dtype == KV_SCALE_DTYPE and torch.all(scale == 1.0)
    assert q.float().tolist() == [[[1.0, -2.0, FP8_E4M3_MAX]]]
    with pytest.raises(ConfigError):
        quantize_kv(x, "fp8", static_scale=0.0)


def test_quantized_values_in_the_paged_layout():
    """Writing per-token quantized K into [num_blocks, block_size, H, D] at slot_mapping and
    dequantizing whole blocks returns each token's own values."""
    num_blocks, block_size, hkv, d = 6, 4, 2, 16
    _, k, _ = qkv(tokens=10, hkv=hkv, d=d)
    key_cache = torch.zeros(num_blocks, block_size, hkv, d, dtype=torch.int8)
    key_scale = torch.zeros(num_blocks, block_size, hkv, dtype=KV_SCALE_DTYPE)
    slot_mapping = torch.tensor([17, 18, 19, 4, 5, 6, 7, 8, 9, 10])  # block 4 then blocks 1 and 2
    q, scale = quantize_kv(k, "int8")
    key_cache.view(-1, hkv, d)[slot_mapping] = q
    key_scale.view(-1, hkv)[slot_mapping] = scale
    whole = dequantize_kv(key_cache, key_scale)  # [num_blocks, block_size, hkv, d]
    assert torch.equal(whole.view(-1, hkv, d)[slot_mapping], dequantize_kv(q, scale))
    # packed int4: [.., hkv, d / 2] bytes, [.., hkv, d / 16] scales, whole blocks dequantize the same way
    key_cache4 = torch.zeros(num_blocks, block_size, hkv, d // 2, dtype=torch.uint8)
    key_scale4 = torch.zeros(num_blocks, block_size, hkv, 1, dtype=KV_SCALE_DTYPE)
    q4, scale4 = quantize_kv(k, "int4")
    key_cache4.view(-1, hkv, d // 2)[slot_mapping] = q4
    key_scale4.view(-1, hkv, 1)[slot_mapping] = scale4
    whole4 = dequantize_kv(key_cache4, key_scale4)
    assert torch.equal(whole4.view(-1, hkv, d)[slot_mapping], dequantize_kv(q4, scale4))


@pytest.mark.parametrize("kv_dtype", ["int2", "fp16"])
def test_unknown_kv_dtype_is_a_config_error(kv_dtype):
    with pytest.raises(ConfigError):
        quantize_kv(torch.randn(2, 2, 4), kv_dtype)


def test_fp8_without_float8_support_is_a_config_error(monkeypatch):
    # A torch without float8_e4m3fn cannot be installed beside this one; removing the
    # attribute is the only way to produce that fault here.
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(ConfigError, match="float8_e4m3fn"):
        kv_storage_dtype("fp8")


class ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def layer0_post_rope_kv(model, config, ids: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's K after RoPE and its V for one sequence, both [T, Hkv, D]."""
    captured = {}
    attn = model.model.layers[0].self_attn
    hooks = [attn.k_proj.register_forward_hook(lambda m, a, o: captured.__setitem__("k", o)),
             attn.v_proj.register_forward_hook(lambda m, a, o: captured.__setitem__("v", o))]
    with torch.no_grad():
        model(ids[None])
    for h in hooks:
        h.remove()
    t = ids.numel()
    k = captured["k"].view(1, t, -1, head_dim).transpose(1, 2)  # [1, Hkv, T, D]
    cos, sin = LlamaRotaryEmbedding(config=config)(k, torch.arange(t)[None])
    k_rot, _ = apply_rotary_pos_emb(k, k, cos, sin)
    return k_rot[0].transpose(0, 1), captured["v"].view(t, -1, head_dim)


def test_calibrated_static_scales_bound_post_rope_keys():
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    head_dim = 16
    seqs = calibration.token_sequences(ByteTokenizer(), calibration.load_text(), seq_len=128, max_sequences=3)
    scales = calibrate_kv_scales(model, seqs, head_dim, kv_dtype="fp8")
    assert len(scales.key_scales) == len(scales.value_scales) == 2
    assert all(s > 0 for s in scales.key_scales + scales.value_scales)

    # On the calibration text nothing saturates: the pre-RoPE pair bound covers K at every position.
    for ids in seqs:
        k_rot, v = layer0_post_rope_kv(model, config, ids, head_dim)
        assert float(k_rot.abs().max()) <= scales.key_scales[0] * FP8_E4M3_MAX * (1 + 1e-5)
        assert float(v.abs().max()) <= scales.value_scales[0] * FP8_E4M3_MAX * (1 + 1e-5)

    # On held-out text the static scales still quantize K and V well.
    held_out = calibration.token_sequences(ByteTokenizer(), calibration.load_text(calibration.HELDOUT_TEXT),
                                           seq_len=128, max_sequences=1)[0]
    k_rot, v = layer0_post_rope_kv(model, config, held_out, head_dim)
    for x, static in ((k_rot, scales.key_scales[0]), (v, scales.value_scales[0])):
        q, scale = quantize_kv(x, "fp8", static_scale=static)
        rel = float((dequantize_kv(q, scale) - x).norm() / x.norm())
        assert rel < 0.1
