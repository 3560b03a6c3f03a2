"""KV-cache quantization (int8, fp8 e4m3, int4), matching the cache layout of worker/attention/backend.py.

int8 / fp8: one fp16 scale per token per KV head, stored beside the blocks:

    key_cache   [num_blocks, block_size, num_kv_heads, head_dim]  int8 | float8_e4m3fn
    key_scale   [num_blocks, block_size, num_kv_heads]            float16
    value = stored.to(float32) * scale.to(float32)[..., None]

int4: symmetric, one fp16 scale per token, KV head and group of G channels, G the largest
power of two dividing head_dim, at most 32 (32 for head_dim 64 / 128, 16 for 80) (article 004's group-wise int4; one scale per whole head loses too much to outlier
channels at 4 bits), two codes per byte, low nibble = even channel (quant/primitives.py's
weight packing):

    key_cache   [num_blocks, block_size, num_kv_heads, head_dim // 2]  uint8
    key_scale   [num_blocks, block_size, num_kv_heads, head_dim // G]  float16
    code c = round(x / scale) clamped to [-7, 7], stored as the nibble c + 8
    value[d] = (nibble[d] - 8) * scale[d // G]

int8: symmetric, dynamic per token-head, scale = absmax / 127 (values in [-127, 127]).
fp8 e4m3: dynamic per token-head, scale = absmax / 448 (e4m3's largest finite value), or a
static per-layer scale from calibration (`calibrate_kv_scales`), written into every slot of
the scale tensor so the layout and the attention kernels stay the same. A static scale is
an upper bound on what calibration saw; values beyond it saturate at +-448 (fp8) / +-127.

Why fp16 scales: with head_dim 64 an fp32 scale per token-head costs 4 of every 68 bytes,
so int8 KV held only 1.88x the tokens of bf16; fp16 makes it 1.94x. The scale is rounded to
fp16 first and the codes are computed against that rounded scale, so the rounding costs no
accuracy beyond a relative 2**-11 in the scale itself: x / s16 is at most qmax x (1 + 2**-11),
which still rounds (int8) or clamps (fp8) to qmax. The floor is fp16's smallest normal
(2**-14), so every scale keeps fp16's full 11-bit precision and an all-zero token-head
never divides by zero; a token-head whose absmax is below qmax x 2**-14 (< 0.008 for int8)
is then quantized in steps of 2**-14, an absolute error of at most 3e-5.

K is cached after RoPE, but calibration hooks see k_proj's output before RoPE. RoPE rotates
channel pairs (i, i + D/2), so no rotated element exceeds that pair's norm: the K bound is
max over pairs of sqrt(k_i^2 + k_{i+D/2}^2), which holds at every position.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from kvmesh.core.config import ConfigError
from kvmesh.quant.calibration import ForwardFn, hf_forward, layer_index, run_hooked

INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0
INT4_MAX = 7.0  # symmetric int4 codes -7..7; the nibble stores code + 8
INT4_ZERO = 8
KV_INT4_GROUP_SIZE = 32  # channels per int4 scale at most (see kv_int4_group_size)
KV_QUANT_DTYPES = ("int8", "fp8", "int4")
KV_SCALE_DTYPE = torch.float16  # kv/capacity.py counts KV_SCALE_BYTES = 2 of it per token-head
MIN_KV_SCALE = 2.0**-14  # fp16's smallest normal: scales never go subnormal or zero
MAX_KV_SCALE = 65504.0  # fp16's largest finite value: an absurd absmax saturates, never inf


def kv_storage_dtype(kv_dtype: str) -> torch.dtype:
    """The torch dtype a quantized KV cache stores; ConfigError if unknown or unsupported.
    uint8 means packed int4 (no other KV dtype stores uint8)."""
    if kv_dtype == "int8":
        return torch.int8
    if kv_dtype == "int4":
        return torch.uint8
    if kv_dtype == "fp8":
        fp8 = getattr(torch, "float8_e4m3fn", None)
        if fp8 is None:
            raise ConfigError(f"cache.kv_cache_dtype=fp8 needs torch.float8_e4m3fn; torch {torch.__version__} lacks it")
        return fp8
    raise ConfigError(f"KV quantization dtype must be one of {list(KV_QUANT_DTYPES)}, got {kv_dtype!r}")


def kv_int4_group_size(head_dim: int) -> int:
    """Channels per int4 KV scale: the largest power of two dividing head_dim, at most 32
    (a power of two so the kernels can tile a group; head_dim must be even to pack pairs)."""
    if head_dim < 2 or head_dim % 2:
        raise ConfigError(f"int4 KV needs an even head_dim, got {head_dim}")
    return min(KV_INT4_GROUP_SIZE, head_dim & -head_dim)


@dataclass(frozen=True)
class KVCacheLayout:
    """Per KV head and token: stored elements of the last cache dim and fp16 scales."""

    storage: torch.dtype
    stored_head_dim: int  # head_dim, or head_dim // 2 for packed int4
    scales_per_head: int  # 0 unquantized, 1 int8 / fp8, head_dim // G int4


def kv_cache_layout(storage: torch.dtype, head_dim: int) -> KVCacheLayout:
    """How a cache of `storage` dtype lays out one token-head of `head_dim` channels."""
    if storage == torch.uint8:
        return KVCacheLayout(storage, head_dim // 2, head_dim // kv_int4_group_size(head_dim))
    quantized = storage == torch.int8 or storage == getattr(torch, "float8_e4m3fn", None)
    return KVCacheLayout(storage, head_dim, 1 if quantized else 0)


def _qmax(kv_dtype: str) -> float:
    return {"int8": INT8_MAX, "int4": INT4_MAX}.get(kv_dtype, FP8_E4M3_MAX)


def quantize_kv(x: torch.Tensor, kv_dtype: str, static_scale: float | torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H, D] float -> (q [T, H, D] int8 | float8_e4m3fn, scale [T, H] fp16), or for
    int4 (q [T, H, D/2] uint8 packed, scale [T, H, D/G] fp16).

    static_scale: None = dynamic absmax per token-head; else one scale (a float or 0-d
    tensor, e.g. a layer's calibrated K or V scale) used for every token-head (int8 / fp8)."""
    storage = kv_storage_dtype(kv_dtype)
    if x.dim() != 3 or not x.is_floating_point():
        raise ConfigError(f"quantize_kv expects a float [tokens, heads, head_dim] tensor, got {tuple(x.shape)} {x.dtype}")
    if kv_dtype == "int4":
        if static_scale is not None:
            raise ConfigError("static KV scales are for int8 / fp8; int4 KV scales are dynamic per group")
        return _quantize_kv_int4(x)
    qmax = _qmax(kv_dtype)
    x32 = x.float()
    if static_scale is None:
        scale32 = x32.abs().amax(dim=-1) / qmax  # [T, H]
    else:
        value = float(static_scale)
        if not value > 0:
            raise ConfigError(f"static KV scale must be > 0, got {value}")
        scale32 = torch.full(x.shape[:2], value, dtype=torch.float32, device=x.device)
    # Clamp into fp16's normal range, then round: the codes are computed against the stored scale.
    scale = _scale_fp16(scale32, 1.0)
    scaled = (x32 / scale.float()[..., None]).clamp_(-qmax, qmax)
    q = torch.round(scaled).to(storage) if kv_dtype == "int8" else scaled.to(storage)
    return q, scale


def _scale_fp16(absmax: torch.Tensor, qmax: float) -> torch.Tensor:
    """fp16(clamp(absmax / qmax)): the stored scale the codes are computed against."""
    return (absmax / qmax).clamp_(MIN_KV_SCALE, MAX_KV_SCALE).to(KV_SCALE_DTYPE)


def _quantize_kv_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t, h, d = x.shape
    group = kv_int4_group_size(d)
    grouped = x.float().reshape(t, h, d // group, group)
    scale = _scale_fp16(grouped.abs().amax(dim=-1), INT4_MAX)  # [T, H, D/G]
    codes = torch.round((grouped / scale.float()[..., None]).clamp_(-INT4_MAX, INT4_MAX))
    nibbles = (codes + INT4_ZERO).to(torch.uint8).reshape(t, h, d)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q [..., D], scale [...]) -> q.float() * scale in out_dtype (works on whole cache blocks).
    Packed int4 (uint8 q [..., D/2], scale [..., D/G]) unpacks and scales each group."""
    if q.dtype == torch.uint8:
        codes = torch.stack([q & 0x0F, q >> 4], dim=-1).to(torch.float32) - INT4_ZERO  # [..., D/2, 2]
        groups = scale.shape[-1]
        grouped = codes.reshape(*q.shape[:-1], groups, -1) * scale.to(torch.float32)[..., None]
        return grouped.reshape(*q.shape[:-1], q.shape[-1] * 2).to(out_dtype)
    return (q.to(torch.float32) * scale.to(torch.float32)[..., None]).to(out_dtype)


@dataclass(frozen=True)
class KVScales:
    """Static per-layer KV scales from calibration (index = layer)."""

    kv_dtype: str
    key_scales: tuple[float, ...]
    value_scales: tuple[float, ...]


def _rope_pair_bound(k: torch.Tensor, head_dim: int) -> float:
    """k [..., H*D] pre-RoPE -> max over channel pairs (i, i + D/2) of the pair's norm."""
    heads = k.reshape(-1, k.shape[-1] // head_dim, head_dim).float()
    half = head_dim // 2
    return float(torch.sqrt(heads[..., :half] ** 2 + heads[..., half:] ** 2).max())


@torch.inference_mode()
def calibrate_kv_scales(model: nn.Module, sequences: Iterable[torch.Tensor], head_dim: int, *,
                        kv_dtype: str = "fp8", forward: ForwardFn = hf_forward) -> KVScales:
    """Per-layer static K and V scales: (absmax seen on the calibration text) / qmax.

    Hooks the outputs of every `layers.N.*.k_proj` / `v_proj` (HF and kvmesh names)."""
    kv_storage_dtype(kv_dtype)  # fail early on unsupported dtypes
    if kv_dtype == "int4":
        raise ConfigError("static KV scales are for int8 / fp8; int4 KV scales are dynamic per group")
    if head_dim < 2 or head_dim % 2:
        raise ConfigError(f"head_dim must be even for RoPE, got {head_dim}")
    key_max: dict[int, float] = {}
    value_max: dict[int, float] = {}
    handles = []

    def recorder(layer: int, is_key: bool):
        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            if is_key:
                key_max[layer] = max(key_max.get(layer, 0.0), _rope_pair_bound(out.detach(), head_dim))
            else:
                value_max[layer] = max(value_max.get(layer, 0.0), float(out.detach().abs().max()))
        return hook

    for name, module in model.named_modules():
        leaf, layer = name.rsplit(".", 1)[-1], layer_index(name)
        if layer is not None and leaf in ("k_proj", "v_proj"):
            handles.append(module.register_forward_hook(recorder(layer, leaf == "k_proj")))
    if not handles:
        raise ConfigError("KV calibration: no layers.N.*.k_proj / v_proj modules in the model")
    run_hooked(model, sequences, forward, handles)
    layers = sorted(key_max)
    if not layers or layers != list(range(len(layers))) or sorted(value_max) != layers:
        raise ConfigError(f"KV calibration: incomplete layer coverage {layers} (no calibration tokens?)")
    qmax = _qmax(kv_dtype)
    return KVScales(kv_dtype=kv_dtype,
                    key_scales=tuple(max(key_max[i] / qmax, MIN_KV_SCALE) for i in layers),
                    value_scales=tuple(max(value_max[i] / qmax, MIN_KV_SCALE) for i in layers))
