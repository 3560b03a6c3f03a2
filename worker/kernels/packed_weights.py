"""bf16 linear weights kept in oneDNN's blocked layout on CPU, reordered once at load.

`F.linear` on a bf16 CPU tensor hands oneDNN a plain row-major weight, which oneDNN reorders
into its blocked (AMX / AVX-512 BF16) layout on every call; for a decode step that is one
reorder per projection per layer per step. Reordering once (`mkldnn._reorder_linear_weight`)
and calling `mkldnn._linear_pointwise` skips it: on this project's 2-core Sapphire Rapids
machine a 30-layer stack of SmolLM2's projections ran 1.3-2.2x faster at M = 1 and 1.1-1.7x at
M = 64, and the LM head 1.5-1.8x (/tmp measurements recorded in docs/benchmarks.md). The
result is bit-identical to F.linear (same oneDNN kernel, same blocking), which
tests/test_packed_weights.py holds it to.

Only bf16 on CPU is packed: fp32 goes through MKL's sgemm (the token-exact path against HF
stays untouched), CUDA through cuBLAS / Triton. The packed copy is a second copy of the
weight (the parameter stays, for the state dict, weight loaders and tensor-parallel shards),
so it describes the weight only while that parameter is the one it was built from:
`matches` checks identity of storage and dtype, and callers fall back to F.linear otherwise.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedWeight:
    """One [out, in] bf16 weight in oneDNN's layout; `linear(x, bias)` = F.linear(x, weight, bias)."""

    def __init__(self, weight: torch.Tensor, packed: torch.Tensor):
        self.source_ptr = weight.data_ptr()
        self.source_shape = tuple(weight.shape)
        self.packed = packed

    @classmethod
    def pack(cls, weight: torch.Tensor) -> "PackedWeight | None":
        """None where packing does not apply (not bf16 on CPU) or this torch refuses it."""
        if not can_pack(weight):
            return None
        try:
            with torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        except RuntimeError as exc:  # an oneDNN build without this reorder: plain F.linear
            logger.debug("no oneDNN prepacking for a %s weight: %s", tuple(weight.shape), exc)
            return None
        return cls(weight, packed)

    def matches(self, weight: torch.Tensor) -> bool:
        return weight.data_ptr() == self.source_ptr and tuple(weight.shape) == self.source_shape \
            and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.dim() != 2:
            raise ValueError(f"packed bf16 weight applied to a {x.dtype} input of {x.dim()} dims")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None
           ) -> torch.Tensor:
    """F.linear(x, weight, bias), through `packed` when it still describes `weight` and x is a
    2-D bf16 batch (the decoder's flat token batch)."""
    if packed is not None and x.dtype == torch.bfloat16 and x.dim() == 2 and packed.matches(weight):
        return packed.linear(x, bias)
    return F.linear(x, weight, bias)
