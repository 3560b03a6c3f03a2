"""The one place that picks a kernel for the decoder's fused ops and quantized matmuls.

On CUDA the Triton kernels of worker/kernels/triton_ops.py run; everywhere else the torch
definitions of worker/kernels/torch_ops.py (the CPU path, which keeps its own packed int8 / int4
kernels inside quant/linear.py). worker/model/llama.py and quant/linear.py call only these
functions, so a device decision is never repeated in a layer.

`force_triton()` makes every call take the Triton path whatever the device: on a machine
without CUDA that is Triton's interpreter (numpy, very slow), which lets the tests hold the
whole model's Triton path to the torch path on a tiny model. The Triton module is imported
on first use only, so CPU serving never imports triton.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

import torch

from kvmesh.quant import linear as quant_linear
from kvmesh.worker.kernels import torch_ops

_forced = threading.local()  # per thread, so a test forcing Triton leaves other threads alone


@contextlib.contextmanager
def force_triton(enabled: bool = True) -> Iterator[None]:
    """Within the block, use_triton() is `enabled` for every tensor (tests; see module doc)."""
    previous = getattr(_forced, "value", None)
    _forced.value = enabled
    try:
        yield
    finally:
        _forced.value = previous


def use_triton(x: torch.Tensor) -> bool:
    """Triton for CUDA tensors, torch elsewhere, unless force_triton says otherwise."""
    forced = getattr(_forced, "value", None)
    return x.is_cuda if forced is None else forced


def _triton():
    # triton is optional: imported on first use of a Triton path, never on the CPU path
    from kvmesh.worker.kernels import triton_ops

    return triton_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., H] -> RMSNorm(x) * weight in x.dtype (HF's rounding)."""
    if use_triton(x):
        return _triton().rms_norm(x, weight.to(x.dtype), eps)
    return torch_ops.rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (RMSNorm(x + residual) * weight, x + residual), one pass on the Triton path."""
    if use_triton(x):
        return _triton().fused_add_rms_norm(x, residual, weight.to(x.dtype), eps)
    return torch_ops.fused_add_rms_norm(x, residual, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (separate gate and up projections)."""
    if use_triton(gate):
        return _triton().silu_mul(gate, up)
    return torch_ops.silu_mul(gate, up)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a merged gate | up projection output [..., 2I]."""
    if use_triton(gate_up):
        return _triton().silu_and_mul(gate_up)
    return torch_ops.silu_and_mul(gate_up)


def w8a16_matmul(x: torch.Tensor, weight_int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """The Triton W8A16 kernel when this device takes the Triton path, else None (the caller,
    quant/linear.py, keeps its CPU kernels)."""
    if not use_triton(x):
        return None
    return _triton().w8a16_matmul(x, weight_int8, scales.to(x.dtype))


def w4a16_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, mins: torch.Tensor | None = None) -> torch.Tensor | None:
    """The Triton W4A16 kernel when this device takes the Triton path, else None."""
    if not use_triton(x):
        return None
    return _triton().w4a16_matmul(x, packed, scales, zeros, group_size, mins)


quant_linear.install_device_kernels(sys.modules[__name__])  # quant/linear.py's quantized matmuls
