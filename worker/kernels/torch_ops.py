"""Plain torch references for the fused worker ops (and the Triton kernels' test oracles).

Each function here is the definition of what the matching kernel in worker/kernels/triton_ops.py or
worker/attention/triton_backend.py computes, written for clarity, not speed. None of them modify
their inputs.

Rounding follows Hugging Face's Llama modules so the fused kernels can be token-exact in
low precision: RMSNorm normalises in fp32, casts back to the input dtype and only then
multiplies by the weight; SiLU-and-mul rounds the activation before the product.

W4A16 packing (quant/primitives.py packs; the kernel reads the same layout):

    weight q[o, i] in [0, 15] (uint4), group-wise asymmetric, groups along the input dim
    dequantized   w[o, i] = (q[o, i] - zeros[o, i // group_size]) * scales[o, i // group_size]
    packed[o, j]  = q[o, 2j] | (q[o, 2j + 1] << 4)       uint8, low nibble = even input index

    packed: [out_features, in_features // 2]            uint8
    scales: [out_features, in_features // group_size]   float (fp32 / fp16 / bf16)
    zeros:  [out_features, in_features // group_size]   float or integer, in q units

KV-cache quantization is defined once, in quant/kv_quant.py (quantize_kv / dequantize_kv);
the Triton write_kv kernel reproduces it bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The int4 packing is quant/'s; re-exported so kernel tests name one module for references.
from kvmesh.quant.primitives import pack_int4, unpack_int4

__all__ = ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "silu_mul", "pack_int4", "unpack_int4",
           "dequantize_w4", "w4a16_matmul", "w8a16_matmul"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, hidden], weight: [hidden] -> [T, hidden] in x.dtype."""
    x32 = x.to(torch.float32)
    rstd = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * (x32 * rstd).to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); the sum rounds to x.dtype first,
    as the unfused decoder layer does."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] = gate | up -> silu(gate) * up: [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for separate gate and up projections."""
    return F.silu(gate) * up


def dequantize_w4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int) -> torch.Tensor:
    """-> w: [out, in] float32, w = (q - zero) * scale per group of the input dim."""
    q = unpack_int4(packed).to(torch.float32)
    scale = scales.to(torch.float32).repeat_interleave(group_size, dim=1)
    zero = zeros.to(torch.float32).repeat_interleave(group_size, dim=1)
    return (q - zero) * scale


def w4a16_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int) -> torch.Tensor:
    """x: [M, in] -> x @ W^T: [M, out] in x.dtype. W is dequantized, rounded to x.dtype (the
    kernel feeds the tensor cores in the activation dtype) and accumulated in fp32."""
    w = dequantize_w4(packed, scales, zeros, group_size).to(x.dtype)
    return (x.to(torch.float32) @ w.to(torch.float32).t()).to(x.dtype)


def w8a16_matmul(x: torch.Tensor, weight_int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x: [M, in] -> x @ (q * scales[:, None])^T: [M, out] in x.dtype. The int8 codes are
    multiplied unscaled (exact in fp32), the product rounds to x.dtype, then each output
    column is scaled and rounds again, as Int8WeightOnlyLinear's F.linear(x, q) * scales."""
    y = (x.to(torch.float32) @ weight_int8.to(torch.float32).t()).to(x.dtype)
    return (y.to(torch.float32) * scales.to(torch.float32)).to(x.dtype)
