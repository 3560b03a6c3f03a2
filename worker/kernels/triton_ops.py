"""Fused Triton kernels for the Llama decoder: RMSNorm (+ residual add), SiLU-and-mul, W4A16, W8A16.

Each kernel has a plain torch definition in worker/kernels/torch_ops.py, and the tests hold them to
it. Kernels compute in fp32 and round where the unfused torch code rounds, so fp32 results
match the reference to fp32 rounding and bf16/fp16 results to one unit in the last place.

Without CUDA the kernels run only under Triton's interpreter (numpy, slow, for tests only),
which whoever runs them chooses by setting TRITON_INTERPRET=1 before importing this module
(it is read when a kernel is *defined*; attention_triton.py imports from here before
defining its kernels). This module never sets it: importing it without CUDA and without
the interpreter raises ImportError, which the engine reports as "Triton is unavailable".
Under the interpreter bf16 has no numpy type, so values are upcast right after each load.

The W4A16 packing convention (documented in full in torch_ops.py, produced by quant/):
    packed[o, i // 2] = q[o, 2*(i//2)] | (q[o, 2*(i//2) + 1] << 4)    uint8, low nibble = even i
    w[o, i] = (q[o, i] - zeros[o, i // group_size]) * scales[o, i // group_size]
              (+ mins[o, i // group_size] for GGUF Q4_1 / Q4_K layers, quant/gguf_layouts.py)
W8A16 (quant/linear.py's Int8WeightOnlyLinear): w[o, i] = q[o, i] * scales[o], q int8; the
codes are exact in fp16 / bf16, so the kernel feeds them to tl.dot unscaled and applies the
per-row scale once to the accumulator, as the torch path scales after its matmul.

Which of these run (Triton on CUDA, torch elsewhere) is decided in one place:
worker/kernels/dispatch.py.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not INTERPRETED and not torch.cuda.is_available():
    raise ImportError("Triton kernels need a CUDA device, or TRITON_INTERPRET=1 set before import "
                      "(the interpreter: tests only)")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra import libdevice  # noqa: E402

from kvmesh.core.errors import InvalidRequestError  # noqa: E402

logger = logging.getLogger(__name__)


def _reinterpret_triton_language() -> None:
    """When triton was imported before TRITON_INTERPRET was set (torch._dynamo imports it,
    and transformers imports torch._dynamo), triton.language's own @jit helpers (tl.zeros,
    tl.max, tl.cdiv, ...) are compiled-mode functions that refuse to run inside an
    interpreted kernel. Re-wrap them as the interpreter would have at import time."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    wrapped: dict[int, InterpretedFunction] = {}
    namespaces = [m for name, m in sys.modules.items() if name.startswith("triton.language") and m is not None]
    for namespace in [*namespaces, tl.tensor]:
        for name, value in list(vars(namespace).items()):
            if isinstance(value, JITFunction) and not isinstance(value, InterpretedFunction):
                if id(value) not in wrapped:
                    wrapped[id(value)] = InterpretedFunction(value.fn)
                setattr(namespace, name, wrapped[id(value)])
    if wrapped:
        logger.info("re-wrapped %d triton.language helpers for the interpreter", len(wrapped))


if INTERPRETED:
    _reinterpret_triton_language()

# The interpreter casts fp32 -> bf16 by truncation and fp32 -> fp8 with a carry bug; GPUs
# round to nearest even. Kernels cast through round_to() so both agree with torch.
_EMULATE_RNE = tl.constexpr(INTERPRETED)

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def compute_dtype(dtype: torch.dtype) -> tl.dtype:
    """The dtype kernels feed to tl.dot: the activation dtype on GPU, fp32 in the
    interpreter (numpy has no bf16)."""
    if dtype not in _TL_DTYPES:
        raise InvalidRequestError(f"unsupported activation dtype {dtype}; use fp32, fp16 or bf16")
    return tl.float32 if INTERPRETED else _TL_DTYPES[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get IEEE dots (TF32 would break fp32 exactness); others the default."""
    return "ieee" if compute_dtype(dtype) == tl.float32 else "tf32"


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise InvalidRequestError(message)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """View x as [rows, last_dim] with a unit inner stride (copying only when needed)."""
    _require(x.dim() >= 1 and x.numel() > 0, f"{name} must be a non-empty tensor")
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """Cast fp32 x to dtype, rounding to nearest even (NaN payloads aside). In the
    interpreter, first round x in fp32 onto the target's grid, so its cast is exact."""
    if _EMULATE_RNE:
        if dtype == tl.bfloat16:  # keep 7 of fp32's 23 mantissa bits
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
        if dtype == tl.float8e4nv:  # 3 mantissa bits; below 2**-6, multiples of 2**-9
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFFF + ((bits >> 20) & 1)
            normal = ((bits >> 20) << 20).to(tl.float32, bitcast=True)
            subnormal = (x + 24576.0) - 24576.0  # 24576 = 1.5 * 2**14: its fp32 ulp is 2**-9
            x = tl.where(tl.abs(x) < 0.015625, subnormal, normal)
    return x.to(dtype)


@triton.jit
def round_half_even(x):
    """fp32 x rounded to the nearest integer, ties to even (torch.round), still fp32."""
    if _EMULATE_RNE:  # the interpreter has no libdevice: adding and subtracting 1.5 * 2**23
        x = (x + 12582912.0) - 12582912.0  # leaves the rounded integer, for |x| < 2**22
    else:
        x = libdevice.rint(x)
    return x


# ----------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [T, hidden] x dtype
    residual_out_ptr,  # [T, hidden] x dtype, written only when HAS_RESIDUAL
    x_ptr,  # [T, hidden]
    residual_ptr,  # [T, hidden], read only when HAS_RESIDUAL
    weight_ptr,  # [hidden]
    hidden, eps,
    stride_out, stride_res_out, stride_x, stride_res,  # row strides, in elements
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= hidden: one program holds one whole row
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=valid, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + row * stride_res + cols, mask=valid, other=0.0).to(tl.float32)
        # Round the sum to the activation dtype, as the unfused `x + residual` does.
        summed = round_to(x + res, residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_res_out + cols, summed, mask=valid)
        x = summed.to(tl.float32)
    # Correctly rounded sqrt and division: the approximate ones shift bf16 rounding.
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.sum(x * x, axis=0) / hidden + eps))
    normed = round_to(x * rstd, out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, round_to(normed * w, out_ptr.dtype.element_ty), mask=valid)


def _launch_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    x2 = _rows(x, "x")
    hidden = x2.shape[1]
    _require(weight.shape == (hidden,), f"weight must be [{hidden}], got {tuple(weight.shape)}")
    _require(weight.device == x.device, "weight and x must be on the same device")
    _require(eps > 0, f"eps must be > 0, got {eps}")
    out = torch.empty_like(x2)
    res2 = res_out = x2  # placeholders when there is no residual: never touched
    if residual is not None:
        _require(residual.shape == x.shape and residual.dtype == x.dtype,
                 "residual must match x in shape and dtype")
        res2 = _rows(residual, "residual")
        res_out = torch.empty_like(x2)
    _rms_norm_kernel[(x2.shape[0],)](
        out, res_out, x2, res2, weight.contiguous(), hidden, float(eps),
        out.stride(0), res_out.stride(0), x2.stride(0), res2.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden))
    new_residual = res_out.view(x.shape) if residual is not None else None
    return out.view(x.shape), new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden], weight: [hidden] -> [..., hidden] in x.dtype."""
    return _launch_rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual) in one pass; inputs are not modified."""
    out, new_residual = _launch_rms_norm(x, residual, weight, eps)
    assert new_residual is not None
    return out, new_residual


# ----------------------------------------------------------------------------- SiLU-and-mul


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [T, I] x dtype
    gate_ptr,  # [T, I] (row stride stride_gate): a view of gate | up, or its own tensor
    up_ptr,  # [T, I] (row stride stride_up)
    intermediate, stride_out, stride_gate, stride_up,
    BLOCK: tl.constexpr,  # columns of the output per program
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < intermediate
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=valid, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + cols, mask=valid, other=0.0).to(tl.float32)
    # Round silu(gate) to the activation dtype before the product, as F.silu(gate) * up does.
    act = round_to(gate / (1.0 + tl.exp(-gate)), out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, round_to(act * up, out_ptr.dtype.element_ty), mask=valid)


def _launch_silu_mul(gate: torch.Tensor, up: torch.Tensor, lead: torch.Size) -> torch.Tensor:
    """gate, up: [T, I] with unit inner stride -> silu(gate) * up: [*lead, I]."""
    intermediate = gate.shape[1]
    out = torch.empty((gate.shape[0], intermediate), dtype=gate.dtype, device=gate.device)
    block = min(1024, triton.next_power_of_2(intermediate))
    grid = (gate.shape[0], triton.cdiv(intermediate, block))
    _silu_and_mul_kernel[grid](out, gate, up, intermediate, out.stride(0), gate.stride(0), up.stride(0), BLOCK=block)
    return out.view(*lead, intermediate)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] = gate | up -> silu(gate) * up: [..., I]."""
    x2 = _rows(x, "x")
    _require(x2.shape[1] % 2 == 0, f"silu_and_mul needs an even last dim, got {x2.shape[1]}")
    intermediate = x2.shape[1] // 2
    return _launch_silu_mul(x2[:, :intermediate], x2[:, intermediate:], x.shape[:-1])


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for separate gate and up projections ([..., I] each), no concat."""
    _require(gate.shape == up.shape and gate.dtype == up.dtype and gate.device == up.device,
             "gate and up must match in shape, dtype and device")
    return _launch_silu_mul(_rows(gate, "gate"), _rows(up, "up"), gate.shape[:-1])


# ----------------------------------------------------------------------------- W4A16 matmul


@triton.jit
def _load_rows_tile(x_ptr, offs_m, offs_k, m_valid, k_valid, stride_xm, COMPUTE: tl.constexpr):
    """Activation tile x[offs_m, offs_k] of a row-major [M, K] matrix (zeros outside), in COMPUTE."""
    return tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                   mask=m_valid[:, None] & k_valid[None, :], other=0.0).to(COMPUTE)


def _gemm_tiles(num_rows: int, out_features: int) -> tuple[int, int, int, tuple[int, int]]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, grid) of the weight-only GEMMs. Small M is the decode case:
    one row block of 16 (tl.dot's minimum) and wide N blocks."""
    block_m = 16 if num_rows <= 16 else 32
    block_n, block_k = 64, 64
    return block_m, block_n, block_k, (triton.cdiv(num_rows, block_m), triton.cdiv(out_features, block_n))


@triton.jit
def _w4a16_matmul_kernel(
    out_ptr,  # [M, N] x dtype
    x_ptr,  # [M, K] activations
    packed_ptr,  # [N, K // 2] uint8, two int4 weights per byte, low nibble = even k
    scales_ptr,  # [N, K // GROUP_SIZE]
    zeros_ptr,  # [N, K // GROUP_SIZE]
    mins_ptr,  # [N, K // GROUP_SIZE] float offsets (GGUF Q4_1 / Q4_K), read only when HAS_MINS
    M, N, K,
    stride_xm, stride_om, stride_pn, stride_sn, stride_zn, stride_mn,  # row strides, in elements
    GROUP_SIZE: tl.constexpr,
    HAS_MINS: tl.constexpr,
    COMPUTE: tl.constexpr,  # dtype fed to tl.dot
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid = offs_m < M
    n_valid = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        x = _load_rows_tile(x_ptr, offs_m, offs_k, m_valid, k_valid, stride_xm, COMPUTE)  # [BM, BK]
        wk_mask = k_valid[:, None] & n_valid[None, :]
        byte = tl.load(packed_ptr + offs_n[None, :].to(tl.int64) * stride_pn + (offs_k[:, None] // 2),
                       mask=wk_mask, other=0)  # [BK, BN] uint8, each byte read for k and k+1
        shift = ((offs_k % 2) * 4).to(tl.uint8)
        q = ((byte >> shift[:, None]) & 0xF).to(tl.float32)
        group = offs_k // GROUP_SIZE
        scale = tl.load(scales_ptr + offs_n[None, :].to(tl.int64) * stride_sn + group[:, None],
                        mask=wk_mask, other=0.0).to(tl.float32)
        zero = tl.load(zeros_ptr + offs_n[None, :].to(tl.int64) * stride_zn + group[:, None],
                       mask=wk_mask, other=0.0).to(tl.float32)
        w = (q - zero) * scale
        if HAS_MINS:
            w += tl.load(mins_ptr + offs_n[None, :].to(tl.int64) * stride_mn + group[:, None],
                         mask=wk_mask, other=0.0).to(tl.float32)
        w = round_to(w, x_ptr.dtype.element_ty).to(COMPUTE)  # [BK, BN], rounded like the reference
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             round_to(acc, out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


def w4a16_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, mins: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., in] @ dequant(packed)^T -> [..., out] in x.dtype (packing: see module doc);
    mins: an optional per-group float offset, w = (q - zero) * scale + min."""
    x2 = _rows(x, "x")
    in_features = x2.shape[1]
    out_features = packed.shape[0]
    _require(packed.dtype == torch.uint8 and packed.dim() == 2, "packed must be a 2-D uint8 tensor")
    _require(group_size >= 2 and group_size % 2 == 0 and in_features % group_size == 0,
             f"in_features {in_features} must be a multiple of an even group_size {group_size}")
    _require(packed.shape[1] * 2 == in_features,
             f"packed is [{out_features}, {packed.shape[1]}], expected [out, {in_features // 2}]")
    groups = (out_features, in_features // group_size)
    _require(tuple(scales.shape) == groups and tuple(zeros.shape) == groups,
             f"scales and zeros must be {list(groups)}, got {list(scales.shape)} and {list(zeros.shape)}")
    _require(packed.device == x.device == scales.device == zeros.device, "all tensors on one device")
    _require(mins is None or (tuple(mins.shape) == groups and mins.device == x.device),
             f"mins must be {list(groups)} on the activations' device")
    packed, scales, zeros = packed.contiguous(), scales.contiguous(), zeros.contiguous()
    mins = None if mins is None else mins.contiguous()
    out = torch.empty((x2.shape[0], out_features), dtype=x.dtype, device=x.device)
    block_m, block_n, block_k, grid = _gemm_tiles(x2.shape[0], out_features)
    _w4a16_matmul_kernel[grid](
        out, x2, packed, scales, zeros, scales if mins is None else mins, x2.shape[0], out_features, in_features,
        x2.stride(0), out.stride(0), packed.stride(0), scales.stride(0), zeros.stride(0),
        0 if mins is None else mins.stride(0),
        GROUP_SIZE=group_size, HAS_MINS=mins is not None, COMPUTE=compute_dtype(x.dtype), DOT_PRECISION=dot_precision(x.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out.view(*x.shape[:-1], out_features)


# ----------------------------------------------------------------------------- W8A16 matmul


@triton.jit
def _w8a16_matmul_kernel(
    out_ptr,  # [M, N] x dtype
    x_ptr,  # [M, K] activations
    weight_ptr,  # [N, K] int8
    scales_ptr,  # [N], one per output row
    M, N, K,
    stride_xm, stride_om, stride_wn,  # row strides, in elements
    COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid = offs_m < M
    n_valid = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_valid = offs_k < K
        x = _load_rows_tile(x_ptr, offs_m, offs_k, m_valid, k_valid, stride_xm, COMPUTE)  # [BM, BK]
        w = tl.load(weight_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                    mask=k_valid[:, None] & n_valid[None, :], other=0)  # [BK, BN] int8
        acc = tl.dot(x, w.to(COMPUTE), acc, input_precision=DOT_PRECISION)  # int8 codes are exact in 16 bits
    scale = tl.load(scales_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)
    # Round the unscaled product to the activation dtype first, as F.linear(x, q) * scales does.
    y = round_to(acc, out_ptr.dtype.element_ty).to(tl.float32) * scale[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             round_to(y, out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


def w8a16_matmul(x: torch.Tensor, weight_int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x: [..., in] @ (weight_int8 * scales[:, None])^T -> [..., out] in x.dtype."""
    x2 = _rows(x, "x")
    _require(weight_int8.dtype == torch.int8 and weight_int8.dim() == 2, "weight must be a 2-D int8 tensor")
    out_features, in_features = weight_int8.shape
    _require(x2.shape[1] == in_features, f"x has {x2.shape[1]} features, the weight {in_features}")
    _require(tuple(scales.shape) == (out_features,), f"scales must be [{out_features}], got {list(scales.shape)}")
    _require(weight_int8.device == x.device == scales.device, "all tensors on one device")
    weight_int8 = weight_int8 if weight_int8.stride(-1) == 1 else weight_int8.contiguous()
    out = torch.empty((x2.shape[0], out_features), dtype=x.dtype, device=x.device)
    block_m, block_n, block_k, grid = _gemm_tiles(x2.shape[0], out_features)
    _w8a16_matmul_kernel[grid](
        out, x2, weight_int8, scales.contiguous(), x2.shape[0], out_features, in_features,
        x2.stride(0), out.stride(0), weight_int8.stride(0),
        COMPUTE=compute_dtype(x.dtype), DOT_PRECISION=dot_precision(x.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out.view(*x.shape[:-1], out_features)
