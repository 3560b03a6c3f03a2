"""Activation-aware int4 scale search (AWQ-style), next to plain round-to-nearest (RTN).

Input channels that carry large activations matter more to the output, so AWQ scales them
up before quantizing (their weights get finer relative steps) and divides the input by the
same factor, which leaves the float product unchanged:

    y = x @ W^T = (x / s) @ (W * s)^T            s: [K], one factor per input channel
    s(alpha) = mean|x|^alpha / sqrt(max * min)   (normalised so the scales straddle 1)
    alpha* = argmin over a grid in [0, 1] of  || x @ W^T - (x / s) @ Q(W * s)^T ||^2

on calibration activations x. alpha = 0 gives s = 1, i.e. plain RTN, so the chosen alpha is
never worse than RTN on the calibration data.

Where 1/s goes: kept in the quantized layer as `input_inv_scale` (quant/linear.py), one
elementwise multiply per forward. Folding it into the previous op (RMSNorm weight, or v_proj
rows for o_proj) saves that multiply but forces q/k/v and gate/up to share one scale; we
search each projection on its own instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kvmesh.core.config import ConfigError
from kvmesh.quant import primitives as P
from kvmesh.quant.calibration import ActivationStats, projection_linears

ALPHA_GRID = tuple(i / 20 for i in range(21))  # 0.00, 0.05, ..., 1.00, as the AWQ paper
_MIN_MEAN_ABS = 1e-6  # channels that never fire still get a finite scale


@dataclass(frozen=True)
class AwqSearchResult:
    alpha: float
    input_scale: torch.Tensor  # s [K] fp32; the layer stores Q(W * s) and multiplies x by 1/s
    mse: float  # output MSE of the chosen scale on the calibration inputs
    rtn_mse: float  # output MSE of plain RTN (alpha = 0) on the same inputs


def awq_input_scale(mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = mean|x|^alpha, normalised by sqrt(max(s) * min(s)). mean_abs: [K] -> s: [K] fp32."""
    s = mean_abs.float().clamp_min(_MIN_MEAN_ABS).pow(alpha)
    return s / torch.sqrt(s.max() * s.min())


def int4_output_mse(weight: torch.Tensor, inputs: torch.Tensor, group_size: int,
                    input_scale: torch.Tensor | None = None, reference: torch.Tensor | None = None) -> float:
    """MSE between x @ W^T and (x / s) @ Q(W * s)^T. weight: [N, K], inputs: [S, K];
    reference: x @ W^T [S, N] when the caller already has it (the search reuses one)."""
    w = weight.detach().float()
    x = inputs.float()
    if reference is None:
        reference = x @ w.t()
    if input_scale is not None:
        w = w * input_scale[None, :]
        x = x / input_scale[None, :]
    q, scale, zero = P.quantize_int4_groupwise(w, group_size)
    approx = x @ P.dequantize_int4_groupwise(q, scale, zero).t()
    return float((reference - approx).pow(2).mean())


def search_awq_scale(weight: torch.Tensor, inputs: torch.Tensor, mean_abs: torch.Tensor, group_size: int,
                     alphas: tuple[float, ...] = ALPHA_GRID) -> AwqSearchResult:
    """Grid-search alpha for one linear layer.

    weight: [N, K]; inputs: [S, K] sample of calibration activations; mean_abs: [K] mean |x|
    over all calibration tokens (steadier than the sample's own mean)."""
    k = weight.shape[1]
    if inputs.dim() != 2 or inputs.shape[1] != k or mean_abs.shape != (k,):
        raise ConfigError(f"AWQ: inputs [S, {k}] and mean_abs [{k}] expected, "
                          f"got {tuple(inputs.shape)} and {tuple(mean_abs.shape)}")
    if not alphas or inputs.shape[0] == 0:
        raise ConfigError("AWQ: need at least one alpha and one calibration token")
    inputs, mean_abs = inputs.to(weight.device).float(), mean_abs.to(weight.device)  # stats are kept on CPU
    reference = inputs @ weight.detach().float().t()  # [S, N], the same for every alpha
    rtn_mse = int4_output_mse(weight, inputs, group_size, reference=reference)
    best_alpha, best_scale, best_mse = 0.0, torch.ones(k, device=weight.device), rtn_mse
    for alpha in alphas:
        if alpha == 0.0:
            continue  # s = 1: that is RTN, measured above
        scale = awq_input_scale(mean_abs, alpha)
        mse = int4_output_mse(weight, inputs, group_size, scale, reference)
        if mse < best_mse:
            best_alpha, best_scale, best_mse = alpha, scale, mse
    return AwqSearchResult(alpha=best_alpha, input_scale=best_scale, mse=best_mse, rtn_mse=rtn_mse)


def search_model_awq(model: nn.Module, act_stats: Mapping[str, ActivationStats], group_size: int
                     ) -> dict[str, AwqSearchResult]:
    """The AWQ search for every Llama projection of `model`, from its calibration statistics
    (quant.calibration.collect_activation_stats): module name -> result."""
    targets = projection_linears(model)
    if not targets:
        raise ConfigError("AWQ: the model has no nn.Linear Llama projections")
    missing = [name for name, _ in targets if name not in act_stats]
    if missing:
        raise ConfigError(f"AWQ needs calibration statistics for every projection; missing "
                          f"{missing[:3]}{'...' if len(missing) > 3 else ''}")
    return {name: search_awq_scale(linear.weight, act_stats[name].samples, act_stats[name].mean_abs, group_size)
            for name, linear in targets}


# ---- on disk: one safetensors file, input scales as tensors, the rest as JSON metadata ----

def save_awq_results(path: Path, results: Mapping[str, AwqSearchResult]) -> None:
    from safetensors.torch import save_file

    meta = {name: [r.alpha, r.mse, r.rtn_mse] for name, r in results.items()}
    save_file({name: r.input_scale.detach().float().cpu().contiguous() for name, r in results.items()},
              str(path), metadata={"kvmesh_awq": json.dumps(meta)})


def load_awq_results(path: Path) -> dict[str, AwqSearchResult]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {})["kvmesh_awq"])
        return {name: AwqSearchResult(alpha=alpha, input_scale=f.get_tensor(name), mse=mse, rtn_mse=rtn_mse)
                for name, (alpha, mse, rtn_mse) in meta.items()}
