"""Pure weight-quantization functions: no modules, no state (the modules live in linear.py).

Weights are nn.Linear layout, w: [out_features N, in_features K].

int8, per output channel, symmetric (W8A16):
    scale[n] = max_k |w[n, k]| / 127            q = clamp(round(w / scale), -127, 127)
    w_hat = q * scale                           |w - w_hat| <= scale / 2

int4, group-wise, asymmetric with integer zero points (groups of G along K):
    lo = min(0, min w[n, group]), hi = max(0, max w[n, group])   (0 is always representable)
    scale = (hi - lo) / 15     zero = round(-lo / scale) in [0, 15]
    q = clamp(round(w / scale) + zero, 0, 15)   w_hat = (q - zero) * scale
    |w - w_hat| <= scale / 2

GGUF's own layouts (quant/gguf_layouts.py) keep the file's numbers: int4 groups whose offset
is a float min instead of an integer zero point (Q4_1, Q4_K: w_hat = (q - zero) * scale + min,
zero 0), and int8 with one scale per group of G inputs (Q8_0: w_hat = q * scale[n, k // G]).

int4 packing, two values per byte along K (so a row-parallel shard of whole groups is a
contiguous slice of bytes):

    q[n, :]      = [q0, q1, q2, q3, ...]          values 0..15
    packed[n, :] = [q0 | q1 << 4, q2 | q3 << 4, ...]   uint8, K / 2 bytes per row
"""

from __future__ import annotations

import torch

from kvmesh.core.config import ConfigError

INT8_MAX = 127
INT4_LEVELS = 15  # q in [0, 15]
SUPPORTED_GROUP_SIZES = (32, 64, 128)
_TINY = 1e-12  # floor on scales so an all-zero row or group does not divide by zero


def _check_weight(w: torch.Tensor) -> None:
    if w.dim() != 2 or not w.is_floating_point():
        raise ConfigError(f"expected a floating [out_features, in_features] weight, got {tuple(w.shape)} {w.dtype}")


def largest_valid_group_size(in_features: list[int], configured: int) -> int:
    """The largest supported int4 group size <= `configured` that divides every projection's
    in_features (e.g. 64 for SmolLM2's hidden size 576 when 128 is configured)."""
    for g in sorted(SUPPORTED_GROUP_SIZES, reverse=True):
        if g <= configured and all(k % g == 0 for k in in_features):
            return g
    raise ConfigError(f"no int4 group size in {SUPPORTED_GROUP_SIZES} up to {configured} divides the model's "
                      f"projection widths {sorted(set(in_features))}")


def check_group_size(in_features: int, group_size: int) -> None:
    if group_size <= 0 or group_size % 2 or in_features % group_size:
        raise ConfigError(f"int4 group size {group_size} must be even and divide in_features {in_features}")


# ---- int8 per-channel -------------------------------------------------------------------------


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q [N, K] int8, scale [N] float32)."""
    _check_weight(w)
    w32 = w.detach().float()
    scale = (w32.abs().amax(dim=1) / INT8_MAX).clamp_min(_TINY)
    q = torch.round(w32 / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8_per_channel(q: torch.Tensor, scale: torch.Tensor,
                                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q [N, K] int8, scale [N]) -> w_hat [N, K] in `dtype`."""
    return (q.float() * scale.float()[:, None]).to(dtype)


# ---- int4 group-wise --------------------------------------------------------------------------


def quantize_int4_groupwise(w: torch.Tensor, group_size: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q [N, K] uint8 in 0..15, scale [N, K/G] fp32, zero [N, K/G] fp32).

    zero holds integers 0..15 (kept as float so it can live in the activation dtype)."""
    _check_weight(w)
    n, k = w.shape
    check_group_size(k, group_size)
    groups = w.detach().float().reshape(n, k // group_size, group_size)
    lo = groups.amin(dim=2).clamp(max=0.0)
    hi = groups.amax(dim=2).clamp(min=0.0)
    scale = ((hi - lo) / INT4_LEVELS).clamp_min(_TINY)
    zero = torch.round(-lo / scale).clamp_(0, INT4_LEVELS)
    q = torch.round(groups / scale[..., None]) + zero[..., None]
    q = q.clamp_(0, INT4_LEVELS).to(torch.uint8).reshape(n, k)
    return q, scale, zero


def dequantize_int4_groupwise(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                              dtype: torch.dtype = torch.float32, mins: torch.Tensor | None = None) -> torch.Tensor:
    """(q [N, K] 0..15, scale [N, K/G], zero [N, K/G], optional mins [N, K/G]) -> w_hat [N, K]
    in `dtype`: (q - zero) * scale (+ min), computed in fp32 (for GGUF's codes and scales the
    product is exact, so only the min's addition rounds, as in gguf's own dequantization)."""
    n, k = q.shape
    num_groups = scale.shape[1]
    group_size = k // num_groups
    groups = q.reshape(n, num_groups, group_size).float()
    w_hat = (groups - zero.float()[..., None]) * scale.float()[..., None]
    if mins is not None:
        w_hat = w_hat + mins.float()[..., None]
    return w_hat.reshape(n, k).to(dtype)


def int8_groups_if_exact(w: torch.Tensor, group_size: int = 32, chunk_rows: int = 4096
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """w [N, K] fp32 -> (codes [N, K] int8, scales [N, K/G] fp32) with codes * scales == w for
    every element, or None where w is not such a table. A GGUF Q8_0 tensor dequantized to fp32
    is one: each group's largest |w| is 127 x its fp16 scale (ggml rounds x / (amax / 127)),
    so amax / 127 gives the scale back exactly and w / scale the codes. Rows in chunks, so the
    temporaries stay small; the first chunk that fails ends the search."""
    n, k = w.shape
    if w.dtype != torch.float32 or k % group_size:
        return None
    codes = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // group_size, dtype=torch.float32)
    for start in range(0, n, chunk_rows):
        groups = w[start:start + chunk_rows].reshape(-1, k // group_size, group_size)
        scale = groups.abs().amax(dim=2) / 127.0
        q = torch.round(groups / torch.where(scale > 0, scale, 1.0)[..., None])
        if not torch.equal(q * scale[..., None], groups) or q.abs().max() > 127:
            return None
        codes[start:start + chunk_rows] = q.to(torch.int8).reshape(-1, k)
        scales[start:start + chunk_rows] = scale
    return codes, scales


def dequantize_int8_groupwise(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q [N, K] int8, scale [N, K/G]) -> w_hat [N, K] in `dtype` (q * scale, exact in fp32 for
    GGUF Q8_0's fp16 scales)."""
    n, k = q.shape
    num_groups = scale.shape[1]
    w_hat = q.reshape(n, num_groups, k // num_groups).float() * scale.float()[..., None]
    return w_hat.reshape(n, k).to(dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] integers 0..15 -> packed [N, K/2] uint8, even columns in the low nibble."""
    if q.shape[-1] % 2:
        raise ConfigError(f"int4 packing needs an even in_features, got {q.shape[-1]}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > INT4_LEVELS):
        raise ConfigError("int4 values must be in 0..15")
    q8 = q.to(torch.uint8)
    return q8[..., 0::2] | (q8[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """packed [N, K/2] uint8 -> q [N, K] uint8 0..15 (exact inverse of pack_int4)."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def tinygemm_scale_and_zero(scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype,
                            mins: torch.Tensor | None = None) -> torch.Tensor:
    """Our (scale, zero[, min]) [N, K/G] -> torch's int4pack qScaleAndZeros [K/G, N, 2].

    torch's kernels compute w_hat = (q - 8) * scale + z_float; ours is (q - zero) * scale
    (+ min), so z_float = (8 - zero) * scale (+ min)."""
    z_float = (8.0 - zero.float()) * scale.float()
    if mins is not None:
        z_float = z_float + mins.float()
    return torch.stack([scale.float().t(), z_float.t()], dim=-1).contiguous().to(dtype)


INT4_PANEL_ROWS = 8  # rows of an int4 panel: the native step's int4 x int8 kernel (worker/kernels/cpu/int4_panels.c)


def interleave_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """packed [N, K/2] (pack_int4's layout) -> the same bytes in 8-row panels: for rows [8P,
    8P + 8) and each 32-input block (16 bytes a row), four chunks of 32 bytes, chunk c holding
    each row's bytes 4c .. 4c + 3 in row order, so one 32-bit lane of a chunk is one row's (the
    layout int4_panels.c reads). N % 8 == 0 and K % 32 == 0."""
    n, half_k = packed.shape
    if n % INT4_PANEL_ROWS or (2 * half_k) % 32:
        raise ConfigError(f"int4 panels need rows % {INT4_PANEL_ROWS} and in_features % 32, got [{n}, {2 * half_k}]")
    panels = packed.reshape(n // INT4_PANEL_ROWS, INT4_PANEL_ROWS, half_k // 16, 4, 4)  # [P, r, block, chunk, byte]
    return panels.permute(0, 2, 3, 1, 4).reshape(n, half_k)


def deinterleave_int4_rows(panels: torch.Tensor) -> torch.Tensor:
    """The inverse of interleave_int4_rows: pack_int4's layout back."""
    n, half_k = panels.shape
    blocks = panels.reshape(n // INT4_PANEL_ROWS, half_k // 16, 4, INT4_PANEL_ROWS, 4)  # [P, block, chunk, r, byte]
    return blocks.permute(0, 3, 1, 2, 4).reshape(n, half_k)
