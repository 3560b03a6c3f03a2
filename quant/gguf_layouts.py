"""GGUF's quantized tensors as kvmesh's weight-only layers, with the file's own numbers.

A GGUF projection tensor is N rows (output features) of K/B blocks along K (llama.cpp's
ggml-quants.c, and gguf.quants for the same formulas in numpy). Each type maps onto a layer
of quant/linear.py without requantizing, so the dequantized value is the one gguf's own
`gguf.quants.dequantize` computes (bit for bit: every code x scale product is exact in fp32,
only the min's addition rounds, in the same order):

    type  block bytes                              w                  kvmesh layer (G = 32)
    Q8_0  32 w: d fp16, q int8 x32                 d * q              Int8GroupWeightOnlyLinear, scales = d
    Q4_0  32 w: d fp16, 16 B nibbles               d * (q - 8)        Int4WeightOnlyLinear, zero 8
    Q4_1  32 w: d fp16, m fp16, 16 B nibbles       d * q + m          Int4WeightOnlyLinear, zero 0, mins = m
    Q4_K  256 w: d, dmin fp16, 12 B of 6-bit       (d*sc_j) * q       Int4WeightOnlyLinear, zero 0,
          scale/min pairs for 8 sub-blocks of 32,    - (dmin*m_j)       scales = d*sc_j, mins = -dmin*m_j
          128 B nibbles                                                 (fp32: the products are exact)

Nibble order differs from kvmesh's (primitives.pack_int4: even k low, odd k high): Q4_0 / Q4_1
keep elements 0..15 of a block in the low nibbles and 16..31 in the high ones; Q4_K does so
per 64 elements (low = 32 elements, high = the next 32). The codes are repacked once at load
(bytes to bytes, no float copy). Other types (Q5_*, Q6_K, Q2_K, IQ*, ...) are refused by name:
kvmesh has no layout that holds them exactly.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from kvmesh.core.config import ConfigError
from kvmesh.quant import primitives as P
from kvmesh.quant.linear import Int4WeightOnlyLinear, Int8GroupWeightOnlyLinear

KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")  # quantized types served in their own bytes
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # the kept types that load as int4 groups
FLOAT_TYPES = ("F32", "F16", "BF16")  # plain tensors: loaded in the model dtype
GROUP_SIZE = 32  # every kept type scales groups of 32 inputs (Q4_K: its sub-blocks)


class UnsupportedGgufTypeError(ConfigError):
    """A GGUF tensor whose type kvmesh cannot keep quantized (named with the tensor)."""


def refuse(tensor_name: str, type_name: str) -> UnsupportedGgufTypeError:
    return UnsupportedGgufTypeError(
        f"GGUF tensor {tensor_name!r} is {type_name}, which kvmesh cannot serve in its quantized form "
        f"(it keeps {', '.join(KEPT_TYPES)} and {', '.join(FLOAT_TYPES)}); serve the file with "
        f"quant.weight: none to dequantize it at load instead")


def _blocks(raw: np.ndarray, rows: int, block_bytes: int) -> np.ndarray:
    """[N, row bytes] uint8 -> [N, K/B, block bytes] (a view)."""
    return np.asarray(raw, dtype=np.uint8).reshape(rows, -1, block_bytes)


def _f16(blocks: np.ndarray, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of every block: [N, K/B] float16."""
    return torch.from_numpy(np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0])


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """[..., bytes] packed so that each `run` bytes hold elements i (low) and i + run (high)
    -> codes [..., 2 * bytes] in element order."""
    shaped = qs.reshape(*qs.shape[:-1], -1, run)
    return np.stack((shaped & 0x0F, shaped >> 4), axis=-2).reshape(*qs.shape[:-1], -1)


def _int4(codes: np.ndarray, rows: int, scales: torch.Tensor, zero: float, mins: torch.Tensor | None,
          bias: torch.Tensor | None) -> Int4WeightOnlyLinear:
    packed = P.pack_int4(torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, -1))))
    zeros = torch.full(scales.shape, zero, dtype=torch.float16)
    return Int4WeightOnlyLinear(packed, scales, zeros, GROUP_SIZE, bias, mins=mins)


def q8_0_groups(raw: np.ndarray, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor's rows -> (codes [N, K] int8, scales [N, K/32] fp32): the stored fp16
    scales widened (exact), so code x scale is gguf's dequantized value in fp32."""
    b = _blocks(raw, rows, 2 + 32)
    codes = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, -1))
    return codes, _f16(b, 0).float()


def quantized_linear(tensor_name: str, type_name: str, raw: np.ndarray, rows: int,
                     bias: torch.Tensor | None = None) -> nn.Module:
    """One projection's GGUF rows ([N, row bytes] uint8, rows in output order) -> its layer."""
    if type_name == "Q8_0":
        b = _blocks(raw, rows, 2 + 32)
        codes = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, -1))
        return Int8GroupWeightOnlyLinear(codes, _f16(b, 0), GROUP_SIZE, bias)
    if type_name == "Q4_0":
        b = _blocks(raw, rows, 2 + 16)
        return _int4(_nibbles(b[..., 2:], 16), rows, _f16(b, 0), 8.0, None, bias)
    if type_name == "Q4_1":
        b = _blocks(raw, rows, 2 + 2 + 16)
        return _int4(_nibbles(b[..., 4:], 16), rows, _f16(b, 0), 0.0, _f16(b, 2), bias)
    if type_name == "Q4_K":
        from gguf.quants import Q4_K  # the gguf package's own unpacking of the 6-bit scale/min pairs

        b = _blocks(raw, rows, 2 + 2 + 12 + 128)
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12))  # [N * K/256, 8] each
        d, dmin = _f16(b, 0).float()[..., None], _f16(b, 2).float()[..., None]  # [N, K/256, 1]
        scales = (d * torch.from_numpy(sc.astype(np.float32)).reshape(rows, -1, 8)).reshape(rows, -1)
        mins = -(dmin * torch.from_numpy(mn.astype(np.float32)).reshape(rows, -1, 8)).reshape(rows, -1)
        return _int4(_nibbles(b[..., 16:], 32), rows, scales, 0.0, mins, bias)
    raise refuse(tensor_name, type_name)


def float_tensor(tensor_name: str, type_name: str, data: np.ndarray) -> torch.Tensor:
    """A plain GGUF tensor (norms, biases, F16 projections) as fp32, or any kept type
    dequantized by gguf itself (the embedding table, which is read by row, not multiplied)."""
    if type_name in FLOAT_TYPES or type_name in KEPT_TYPES:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(data, GGMLQuantizationType[type_name])  # F32: a read-only view of the file
        return torch.from_numpy(np.array(values, dtype=np.float32, copy=values.base is not None or
                                         not values.flags.writeable))
    raise refuse(tensor_name, type_name)
