"""Weight-only quantized linear layers (W8A16, W4A16) that replace nn.Linear at load time.

`quantize_model(model, QuantConfig, awq)` installs them: the mode always comes from
configuration (quant.weight: none | int8 | int4 | int4_awq), never from a file name. Only
nn.Linear modules whose last name component is a Llama projection (q_proj, k_proj, v_proj,
o_proj, gate_proj, up_proj, down_proj) are replaced; lm_head and the embeddings stay. All
checks run before the first replacement, so a bad group size or missing calibration fails at
start with the model intact.

Stored state (buffers, so state_dict / .to(device) carry it):

    Int8WeightOnlyLinear   weight_int8 [N, K] int8      scales [N]            (per output row)
    Int4WeightOnlyLinear   qweight     [N, K/2] uint8   scales, zeros [N, K/G] (per row, per group)
                           (two int4 per byte along K, see primitives.pack_int4)
                           optional mins [N, K/G]: a float offset added after the scaling
                           (GGUF Q4_1 / Q4_K store w = d * q + m; quant/gguf_layouts.py)
    Int8GroupWeightOnlyLinear  weight_int8 [N, K] int8  scales [N, K/G]       (GGUF Q8_0: G = 32)
    both, optional         input_inv_scale [K]  activation-aware (AWQ) scales kept in the layer:
                           the stored weight is Q(W * s) and forward computes Q(W * s) @ (x / s)

Scales and zeros live in the dtype of the weight they replaced (bf16/fp16 on GPU, fp32 in the
exactness tests): kv/capacity.py counts them at 2 bytes each for a 16-bit model. Layers built
from a GGUF file keep the file's numbers instead (fp16 scales and mins, Q4_K's fp32 products).

Compute path, chosen per device and activation dtype from load_tests/bench_quant_kernels.py
on this project's 2-core CPU (N = K = 2048, group 128, ms per matmul, M = 1 / 16 / 128 rows):

    bf16  int8: packed kernel 0.16 / 1.5 / 11.8  vs dequantize+matmul 1.2 / 6.8 / 51
          int4: packed kernel 0.30 / 1.6 / 12.4  vs dequantize+matmul 28 / 32 / 79
    fp32  int8: packed kernel 8.0 / 33 / 272     vs dequantize+matmul 8.0 / 3.5 / 11.6
          int4: packed kernel 16 / 67 / 531      vs dequantize+matmul 51 / 27 / 31
    fp16  both: the packed kernels lose at every M (2.4-600 ms vs 1.9-64 ms)

so CPU + bf16 activations use torch.ops.aten._weight_int8pack_mm and
_weight_int4pack_mm_for_cpu; other CPU cases (fp32, fp16, shapes the int4 kernel rejects:
N % 16 != 0) dequantize and call F.linear. On CUDA the weights are never dequantized: the
Triton W8A16 / W4A16 kernels (worker/kernels/triton_ops.py) read the int8 / packed int4 codes and
their scales straight from these buffers; worker/kernels/dispatch.py decides, and its
force_triton() lets the interpreter tests take the same path on CPU. `dequantized_weight`
stays as the test oracle.

Tensor parallelism (`shard(dim, rank, world_size)`):
    dim 0, column-parallel: rank r keeps output rows [r*N/W, (r+1)*N/W) with their scales
           (and int4 zeros); outputs are concatenated along the last dim.
    dim 1, row-parallel: rank r keeps input columns [r*K/W, (r+1)*K/W): int8 columns, or for
           int4 whole groups (K/W must be a multiple of G) = a contiguous slice of packed bytes
           and of the group scale/zero columns; outputs are summed; the bias stays on rank 0.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.core.config import ConfigError, QuantConfig
from kvmesh.quant import primitives as P
from kvmesh.quant.awq import AwqSearchResult
from kvmesh.quant.calibration import projection_linears

log = logging.getLogger(__name__)

# Device kernels for the quantized matmuls (Triton on CUDA). quant/ sits below worker/, which
# owns the kernels and the device policy (worker/kernels/dispatch.py): the worker installs
# that dispatch here when it loads, so quant never imports worker. Its w8a16_matmul /
# w4a16_matmul return None where the device takes the torch paths below; uninstalled (quant
# used on its own), the torch paths always run.
_device_kernels = None


def install_device_kernels(kernels) -> None:
    """Called once by worker/kernels/dispatch.py with itself."""
    global _device_kernels
    _device_kernels = kernels


_INT4_KERNEL_INNER_K_TILES = 2  # torch's CPU int4 packing parameter (2, 4 or 8 all work)


def _split_range(size: int, rank: int, world_size: int, what: str, multiple: int = 1) -> slice:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"bad shard rank {rank} of world size {world_size}")
    if size % world_size or (size // world_size) % multiple:
        raise ConfigError(f"cannot split {what} {size} into {world_size} shards"
                          + (f" of whole {multiple}-wide groups" if multiple > 1 else ""))
    part = size // world_size
    return slice(rank * part, (rank + 1) * part)


class _WeightOnlyLinear(nn.Module):
    """Shared plumbing: bias, the optional AWQ input scale, shape checks, sharding of both."""

    in_features: int
    out_features: int

    def _init_common(self, in_features: int, out_features: int, bias: torch.Tensor | None,
                     input_scale: torch.Tensor | None) -> None:
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        inv = None if input_scale is None else (1.0 / input_scale.detach().float())
        self.register_buffer("input_inv_scale", inv)

    def _prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ConfigError(f"{type(self).__name__}: input has {x.shape[-1]} features, expected {self.in_features}")
        if self.input_inv_scale is not None:
            x = x * self.input_inv_scale.to(x.dtype)
        return x

    def _finish(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _shard_common(self, dim: int, rank: int, world_size: int, k_multiple: int
                      ) -> tuple[slice, torch.Tensor | None, torch.Tensor | None]:
        """Returns the row or column slice and the bias / input scale the shard keeps."""
        input_scale = None if self.input_inv_scale is None else 1.0 / self.input_inv_scale
        if dim == 0:
            rows = _split_range(self.out_features, rank, world_size, "out_features")
            bias = None if self.bias is None else self.bias[rows]
            return rows, bias, input_scale
        if dim == 1:
            cols = _split_range(self.in_features, rank, world_size, "in_features", k_multiple)
            bias = self.bias if rank == 0 else None  # the sum of shards adds it exactly once
            return cols, bias, None if input_scale is None else input_scale[cols]
        raise ConfigError(f"shard dim must be 0 (column-parallel) or 1 (row-parallel), got {dim}")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, awq={self.input_inv_scale is not None}")


class Int8WeightOnlyLinear(_WeightOnlyLinear):
    """W8A16: int8 weight, one symmetric scale per output channel."""

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 input_scale: torch.Tensor | None = None):
        super().__init__()
        out_features, in_features = weight_int8.shape
        self._init_common(in_features, out_features, bias, input_scale)
        self.register_buffer("weight_int8", weight_int8)  # [N, K] int8
        self.register_buffer("scales", scales)  # [N], the replaced weight's dtype

    @classmethod
    def from_linear(cls, linear: nn.Linear, input_scale: torch.Tensor | None = None) -> "Int8WeightOnlyLinear":
        w = linear.weight.detach()
        if input_scale is not None:
            input_scale = input_scale.to(w.device)
            w = w.float() * input_scale.float()[None, :]
        q, scale = P.quantize_int8_per_channel(w)
        return cls(q, scale.to(linear.weight.dtype), linear.bias, input_scale)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight this layer applies to its (AWQ-scaled) input: [N, K]."""
        return P.dequantize_int8_per_channel(self.weight_int8, self.scales, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._prepare_input(x)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        y = None if _device_kernels is None else _device_kernels.w8a16_matmul(x2, self.weight_int8, self.scales)
        if y is not None:
            return self._finish(y.reshape(*lead, self.out_features))
        scales = self.scales.to(x.dtype)
        if x.device.type == "cpu" and x.dtype == torch.bfloat16:
            y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.weight_int8, scales)
        else:  # scale after the matmul: one [M, N] multiply instead of an [N, K] one
            y = F.linear(x2, self.weight_int8.to(x.dtype)) * scales
        return self._finish(y.reshape(*lead, self.out_features))

    def shard(self, dim: int, rank: int, world_size: int) -> "Int8WeightOnlyLinear":
        part, bias, input_scale = self._shard_common(dim, rank, world_size, 1)
        if dim == 0:
            return Int8WeightOnlyLinear(self.weight_int8[part].clone(), self.scales[part].clone(), bias, input_scale)
        return Int8WeightOnlyLinear(self.weight_int8[:, part].clone(), self.scales.clone(), bias, input_scale)


class Int4WeightOnlyLinear(_WeightOnlyLinear):
    """W4A16: int4 weight packed two per byte, asymmetric scale + zero per group of G inputs."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
                 mins: torch.Tensor | None = None):
        super().__init__()
        out_features, half_k = qweight.shape
        in_features = half_k * 2
        P.check_group_size(in_features, group_size)
        if scales.shape != (out_features, in_features // group_size) or zeros.shape != scales.shape \
                or (mins is not None and mins.shape != scales.shape):
            raise ConfigError(f"int4 scales/zeros/mins must be [{out_features}, {in_features // group_size}], "
                              f"got {tuple(scales.shape)} / {tuple(zeros.shape)} / "
                              f"{None if mins is None else tuple(mins.shape)}")
        self._init_common(in_features, out_features, bias, input_scale)
        self.group_size = group_size
        self.register_buffer("qweight", qweight)  # [N, K/2] uint8
        self.register_buffer("scales", scales)  # [N, K/G]
        self.register_buffer("zeros", zeros)  # [N, K/G], integers 0..15
        self.register_buffer("mins", mins)  # [N, K/G] float offsets, or None (w = (q - zero) * scale)
        # torch's CPU kernel wants its own packing: built on the first bf16 CPU forward.
        # It is a second copy of the int4 weight (K/2 bytes per row), not part of the state.
        self._kernel_operands: tuple[torch.Tensor, torch.Tensor] | None = None
        self._kernel_unsupported = out_features % 16 != 0  # the kernel needs N % 16 == 0
        # 8 where qweight's bytes are laid out in 8-row panels (primitives.interleave_int4_rows),
        # in place, for the native step's int4 x int8 kernel (cpu_native_step.set_int4_panels);
        # this layer then reads its codes through plain_qweight
        self.panel_rows = 0
        # Where set, a function of this layer giving its weight as the bf16 values of
        # dequantized_weight(bf16) (the CPU kernels' dequantization, ~100x torch's); bf16 forwards then
        # run F.linear on it, the float model's GEMM, instead of torch's int4 kernel. Set where the
        # native step runs the layer as those bf16 weights (cpu_native_step, int4_bf16), so its
        # eager steps (longer prefills) compute the same sums.
        self.bf16_dense = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int,
                    input_scale: torch.Tensor | None = None) -> "Int4WeightOnlyLinear":
        w = linear.weight.detach()
        if input_scale is not None:
            input_scale = input_scale.to(w.device)
            w = w.float() * input_scale.float()[None, :]
        q, scale, zero = P.quantize_int4_groupwise(w, group_size)
        dtype = linear.weight.dtype
        return cls(P.pack_int4(q), scale.to(dtype), zero.to(dtype), group_size, linear.bias, input_scale)

    def plain_qweight(self) -> torch.Tensor:
        """The codes in pack_int4's layout (a copy where they are laid out in panels)."""
        return P.deinterleave_int4_rows(self.qweight) if self.panel_rows else self.qweight

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight this layer applies to its (AWQ-scaled) input: [N, K]."""
        return P.dequantize_int4_groupwise(P.unpack_int4(self.plain_qweight()), self.scales, self.zeros, dtype,
                                           self.mins)

    def _kernel_path(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self._kernel_unsupported:
            return None
        if self._kernel_operands is None:
            q = P.unpack_int4(self.plain_qweight()).to(torch.int32)
            try:
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INT4_KERNEL_INNER_K_TILES)
            except RuntimeError as exc:  # a shape this torch's kernel rejects: dequantize instead
                log.debug("int4 CPU kernel unavailable for [%d, %d]: %s", self.out_features, self.in_features, exc)
                self._kernel_unsupported = True
                return None
            sz = P.tinygemm_scale_and_zero(self.scales, self.zeros, torch.bfloat16, self.mins)
            self._kernel_operands = (packed, sz)
        return self._kernel_operands

    def _apply(self, fn, recurse=True):
        self._kernel_operands = None  # device / dtype moves invalidate the kernel's copy
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._prepare_input(x)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        y = (None if _device_kernels is None
             else _device_kernels.w4a16_matmul(x2, self.plain_qweight(), self.scales, self.zeros, self.group_size, self.mins))
        if y is not None:
            return self._finish(y.reshape(*lead, self.out_features))
        cpu_bf16 = x.device.type == "cpu" and x.dtype == torch.bfloat16
        if cpu_bf16 and self.bf16_dense is not None:
            return self._finish(F.linear(x2, self.bf16_dense(self)).reshape(*lead, self.out_features))
        operands = self._kernel_path() if cpu_bf16 else None
        if operands is not None:
            packed, scale_and_zero = operands
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), packed, self.group_size, scale_and_zero)
        else:
            y = F.linear(x2, self.dequantized_weight(x.dtype))
        return self._finish(y.reshape(*lead, self.out_features))

    def shard(self, dim: int, rank: int, world_size: int) -> "Int4WeightOnlyLinear":
        part, bias, input_scale = self._shard_common(dim, rank, world_size, self.group_size)
        mins, qweight = self.mins, self.plain_qweight()
        if dim == 0:
            return Int4WeightOnlyLinear(qweight[part].clone(), self.scales[part].clone(),
                                        self.zeros[part].clone(), self.group_size, bias, input_scale,
                                        None if mins is None else mins[part].clone())
        g = self.group_size
        packed_cols = slice(part.start // 2, part.stop // 2)  # two int4 per byte along K
        group_cols = slice(part.start // g, part.stop // g)
        return Int4WeightOnlyLinear(qweight[:, packed_cols].clone(), self.scales[:, group_cols].clone(),
                                    self.zeros[:, group_cols].clone(), g, bias, input_scale,
                                    None if mins is None else mins[:, group_cols].clone())


class Int8GroupWeightOnlyLinear(_WeightOnlyLinear):
    """W8A16 with one symmetric scale per group of G inputs (GGUF Q8_0 kept as stored: G = 32,
    fp16 scales). No packed CPU kernel takes group scales, so every path dequantizes (exactly,
    in fp32) and runs F.linear; the native C step and the Triton W8A16 kernel take per-row
    scales only and leave this layer to the eager path."""

    def __init__(self, weight_int8: torch.Tensor, scales: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        out_features, in_features = weight_int8.shape
        if group_size <= 0 or in_features % group_size or scales.shape != (out_features, in_features // group_size):
            raise ConfigError(f"int8 group scales must be [{out_features}, in_features {in_features} / group "
                              f"{group_size}], got {tuple(scales.shape)}")
        self._init_common(in_features, out_features, bias, None)
        self.group_size = group_size
        self.register_buffer("weight_int8", weight_int8)  # [N, K] int8
        self.register_buffer("scales", scales)  # [N, K/G]

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return P.dequantize_int8_groupwise(self.weight_int8, self.scales, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._prepare_input(x)
        return self._finish(F.linear(x, self.dequantized_weight(x.dtype)))

    def shard(self, dim: int, rank: int, world_size: int) -> "Int8GroupWeightOnlyLinear":
        part, bias, _ = self._shard_common(dim, rank, world_size, self.group_size)
        if dim == 0:
            return Int8GroupWeightOnlyLinear(self.weight_int8[part].clone(), self.scales[part].clone(),
                                             self.group_size, bias)
        g = self.group_size
        return Int8GroupWeightOnlyLinear(self.weight_int8[:, part].clone(),
                                         self.scales[:, part.start // g:part.stop // g].clone(), g, bias)


# Per-output-row buffers of each layer type: what `merge_output_rows` concatenates.
_ROW_BUFFERS = {Int8WeightOnlyLinear: ("weight_int8", "scales"), Int4WeightOnlyLinear: ("qweight", "scales", "zeros"),
                Int8GroupWeightOnlyLinear: ("weight_int8", "scales")}


def merge_output_rows(layers: list[nn.Module]) -> _WeightOnlyLinear | None:
    """One quantized layer computing every layer of `layers` on the same input, outputs
    concatenated in order (merged QKV / gate-up: one packed-kernel call instead of several).
    Each member's row buffers become views of the merged layer's, so no weight is stored twice
    and the members still compute exactly what they did. None when the layers are not all
    of one quantized type with the same input width, group size, bias presence and AWQ scale."""
    first = layers[0]
    kind = type(first)
    if kind not in _ROW_BUFFERS or len(layers) < 2 or any(type(lay) is not kind for lay in layers):
        return None
    same = all(lay.in_features == first.in_features and (lay.bias is None) == (first.bias is None)
               and getattr(lay, "group_size", None) == getattr(first, "group_size", None)
               and (lay.input_inv_scale is None) == (first.input_inv_scale is None)
               and (lay.input_inv_scale is None or torch.equal(lay.input_inv_scale, first.input_inv_scale))
               and (getattr(lay, "mins", None) is None) == (getattr(first, "mins", None) is None)
               and lay.scales.dtype == first.scales.dtype  # GGUF layers keep their file's scale dtype
               and not getattr(lay, "panel_rows", 0)  # codes in pack_int4's layout (not the native step's panels)
               for lay in layers)
    if not same:
        return None
    has_mins = getattr(first, "mins", None) is not None
    names = _ROW_BUFFERS[kind] + (() if first.bias is None else ("bias",)) + (("mins",) if has_mins else ())
    cat = {n: torch.cat([getattr(lay, n) for lay in layers]) for n in names}
    if kind is Int8WeightOnlyLinear:
        merged = Int8WeightOnlyLinear(cat["weight_int8"], cat["scales"], cat.get("bias"))
    elif kind is Int8GroupWeightOnlyLinear:
        merged = Int8GroupWeightOnlyLinear(cat["weight_int8"], cat["scales"], first.group_size, cat.get("bias"))
    else:
        merged = Int4WeightOnlyLinear(cat["qweight"], cat["scales"], cat["zeros"], first.group_size, cat.get("bias"),
                                      mins=cat.get("mins"))
    merged.input_inv_scale = first.input_inv_scale  # the exact stored reciprocal, not recomputed
    start = 0
    for lay in layers:
        rows = slice(start, start + lay.out_features)
        for n in names:
            setattr(lay, n, getattr(merged, n)[rows])
        start += lay.out_features
    return merged


# ---- installing the layers in a model ----------------------------------------------------


@dataclass(frozen=True)
class QuantReport:
    mode: str
    group_size: int | None  # int4 modes only
    replaced: tuple[str, ...]  # module names, in model order
    weight_bytes_before: int  # of the replaced layers' float weights
    weight_bytes_after: int  # their quantized weights + scales/zeros (+ AWQ input scales)
    awq_alphas: tuple[tuple[str, float], ...] = ()  # int4_awq: chosen alpha per layer

    @property
    def compression(self) -> float:
        return self.weight_bytes_before / self.weight_bytes_after if self.weight_bytes_after else 1.0


def _buffer_bytes(module: nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers())


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def quantize_model(model: nn.Module, cfg: QuantConfig,
                   awq: Mapping[str, AwqSearchResult] | None = None) -> QuantReport:
    """Quantize `model` in place as `cfg` says; returns what was replaced and the bytes saved.

    awq: the AWQ search result per module name (quant.awq.search_model_awq, on this model's
    calibration statistics), required for int4_awq and ignored otherwise."""
    cfg.validate()
    if cfg.weight == "auto":  # a machine-dependent choice the engine makes before it loads the model
        raise ConfigError("quant.weight auto is resolved before the model loads "
                          "(worker/runner/model_setup.py resolve_weight_quant)")
    if cfg.weight == "none":
        return QuantReport("none", None, (), 0, 0)
    targets = projection_linears(model)
    if not targets:
        raise ConfigError(f"quant.weight={cfg.weight}: the model has no nn.Linear Llama projections")
    if cfg.weight.startswith("int4"):
        for name, linear in targets:
            try:
                P.check_group_size(linear.in_features, cfg.group_size)
            except ConfigError as exc:
                raise ConfigError(f"quant.group_size: {name}: {exc}") from None
    if cfg.weight == "int4_awq":
        missing = [name for name, _ in targets if awq is None or name not in awq]
        if missing:
            raise ConfigError(f"quant.weight=int4_awq needs AWQ scales from calibration for every projection; "
                              f"missing {missing[:3]}{'...' if len(missing) > 3 else ''} "
                              f"(run quant.awq.search_model_awq on calibration statistics first)")
    before = after = 0
    alphas: list[tuple[str, float]] = []
    for name, linear in targets:
        if cfg.weight == "int8":
            new = Int8WeightOnlyLinear.from_linear(linear)
        elif cfg.weight == "int4":
            new = Int4WeightOnlyLinear.from_linear(linear, cfg.group_size)
        else:
            found = awq[name]
            new = Int4WeightOnlyLinear.from_linear(linear, cfg.group_size, input_scale=found.input_scale)
            alphas.append((name, found.alpha))
        before += linear.weight.numel() * linear.weight.element_size()
        after += _buffer_bytes(new) - (0 if new.bias is None else new.bias.numel() * new.bias.element_size())
        _set_submodule(model, name, new.to(linear.weight.device))
    report = QuantReport(cfg.weight, cfg.group_size if cfg.weight.startswith("int4") else None,
                         tuple(name for name, _ in targets), before, after, tuple(alphas))
    log.info("quantized %d projections to %s: %.1f MiB -> %.1f MiB", len(targets), cfg.weight,
             before / 2**20, after / 2**20)
    return report
