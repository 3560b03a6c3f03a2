"""A small step on CPU as ONE native call: every layer, the attention and the LM head.

At batch 1 a decode step of SmolLM2 reads ~107 MB of int8 (or ~214 MB of bf16) projection
weights, which one core streams in ~9 ms (~17 ms); eager torch spends as long again on ~20
small ops per layer (norms, residual adds, RoPE, SiLU-mul, views, the KV write), each a Python
call and a dispatcher round trip, and oneDNN's bf16 GEMM reaches only 5-7 GB/s at one row
(docs/benchmarks.md). llama.cpp's 80 tok/s at batch 1 on the same 2 cores is its whole graph in
C. The native step (worker/kernels/cpu/native_step.c and projections.c, built by cpu_build.py,
described to C by cpu_abi.ModelDescriptor) does the same for the steps it takes: the model's
own weights (read in place;
on a CPU with AMX, bf16 weights from one copy laid out for its tiles at load) and the model's
own paged KV cache (written and read through the block tables,
so larger steps, preemption, prefix caching and swapping keep running in torch on the same
cache), one C call per step:

    per layer, SPMD over an OpenMP team (torch's own threads), a barrier between the phases:
      RMSNorm -> QKV rows (this thread's share) | RoPE + K/V into the cache (this thread's
      tokens) | paged attention of this thread's tokens (cpu/paged_attention.c)
      | O rows | residual + RMSNorm -> gate/up rows + SiLU-mul | down rows
    final residual + RMSNorm -> LM head rows (this thread's share of the vocabulary) for the
    tokens that sample -> fp32 logits

A step is up to `max_tokens` tokens of any shape: decode rows, a prefill chunk (each token
attends causally to its request through its own position), speculative verify rows. The
projections read each weight row once per step, in place, for all its tokens: on a CPU with
AMX, bf16 weights go through AMX tiles (16 tokens times a 16-row weight block per instruction,
so up to 64 tokens cost about what reading the weights costs); otherwise GEMVs (fp32 FMA, int8
and bf16 widened in registers, bf16 pairs by VDPBF16PS where the CPU has it; AVX2 + FMA in the
avx2 build, for CPUs without AVX-512), memory-bound at a
handful of tokens, where the packed GEMMs are not yet efficient. Steps past max_tokens run
eagerly (oneDNN / AMX GEMMs); steps past 64 tokens give the projections 64 tokens a call. Weights it takes: plain fp32 / bf16 (the fused QKV and gate-up weights, o, down, the LM head) and
weight-only int8 with one scale per row (quant.weight: int8, and the self-draft's int8 head),
and int4 groups as stored (quant.weight: int4, GGUF Q4_0 / Q4_1 / Q4_K kept): by one AVX2
kernel in every build, int4 x int8 activations per 32-input block (llama.cpp's Q4_1 x Q8_1
scheme; int8_activations, what int4 models run) or each weight dequantized in registers as
the eager layer does (fp32 activations: token-exact, the tests' reference); steps of 8 tokens
and more (int4_gemm_min_rows) take those fp32-activation int4 layers and a Q8_0 LM head through
a batched GEMM (cpu/int4_gemm_avx2.c: weight panels dequantized once a call, FMA-bound tiles
over every token; 1.9x the per-row kernels at 64 decode rows on an AVX2 EPYC). In a bf16 model
on a CPU with VDPBF16PS (quant.weight gguf, model.dtype bf16) int4 layers and a Q8_0 LM head
run as that model's bf16 products instead (int4_bf16: each 4-row group dequantized to the bf16
values the file dequantized at load holds, then the bf16 GEMV: its logits bit for bit, from the
int4 bytes), and their eager layers multiply the same bf16 weights.
Not taken (eager runs every step, one log line says why): AWQ input scales, biases, int8-group
layers (GGUF Q8_0), quantized KV, tensor parallelism, non-CPU devices, widths not a multiple
of 16, no C compiler.

Numerics: activations stay fp32 through the whole step (eager rounds each op's output to the
model dtype), K/V are rounded to the cache dtype as they are stored, and the attention reads
the cache dtype as the eager kernel does. bf16 weights on a CPU with AVX512_BF16 take each
projection's input rounded to bf16 (VDPBF16PS or AMX, fp32 sums), as oneDNN's bf16 GEMMs do.
In fp32 the step is the eager one up to the order of fp32 sums (tests/test_cpu_native_step.py:
logits within 1e-5, greedy tokens identical with chunked prefill and preemption); in bf16 it is closer to the fp32 model than eager bf16 is.
On by default (`model.cpu_native_max_tokens`: auto = for 16-bit models steps of up to 64
tokens with AMX, every step of the scheduler's budget for a bf16 model's bf16 or int4 weights with
VDPBF16PS and no AMX (its tokens 64 a projection call; prompt chunks of long attention eager:
PREFILL_ATTENTION_PAIRS_MAX), else 12 a thread up to 24; fp32 float weights 12 a thread up to 24;
fp32 int4 64: see max_tokens_for; 0 = every step eager, the reference path), and for the
self-draft's small steps (worker/engine_loop/self_draft.py), where only acceptance can change.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass, field

import torch

from kvmesh.core.config import CPU_NATIVE_MAX_TOKENS
from kvmesh.quant.int8_group_table import Int8GroupEmbedding, Int8GroupLMHead
from kvmesh.quant.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear
from kvmesh.quant.primitives import (INT4_PANEL_ROWS, deinterleave_int4_rows, int8_groups_if_exact,
                                     interleave_int4_rows, quantize_int8_per_channel)
from kvmesh.worker.kernels import cpu_abi, cpu_build

logger = logging.getLogger(__name__)

_W_F32, _W_BF16, _W_I8, _W_I4, _W_I8G = (cpu_abi.WEIGHT_KINDS[k] for k in ("W_F32", "W_BF16", "W_I8", "W_I4", "W_I8G"))
_META_DTYPES = {torch.float32: cpu_abi.META_DTYPES["META_F32"], torch.bfloat16: cpu_abi.META_DTYPES["META_BF16"],
                torch.float16: cpu_abi.META_DTYPES["META_F16"]}
_STEP_NOT_BUILT = cpu_abi.STEP_ANSWERS["KVMESH_STEP_NOT_BUILT"]
_FEATURE_DPBF16 = cpu_abi.FEATURES["KVMESH_FEATURE_DPBF16"]
_FEATURE_AMX = cpu_abi.FEATURES["KVMESH_FEATURE_AMX"]
_FEATURE_AMX_INT8 = cpu_abi.FEATURES["KVMESH_FEATURE_AMX_INT8"]
_FEATURE_NATIVE_STEP = cpu_abi.FEATURES["KVMESH_FEATURE_NATIVE_STEP"]
_FEATURE_AVX512 = cpu_abi.FEATURES["KVMESH_FEATURE_AVX512"]
# kvmesh_native_step_check's answers
CHECK_FAILURES = {1: "a width not a multiple of 16", 2: "query heads not a multiple of KV heads",
                  3: "an unknown weight kind", 4: "a dtype flag other than 0 / 1",
                  5: "no embedding, final norm, RoPE table or LM head (or its scales)", 6: "no layers",
                  7: "a layer without a norm, weight or cache", 8: "int8 / int4 scales missing (or float ones given)",
                  9: "int4 groups not a multiple of 32 dividing every width (or an unknown scale dtype)",
                  10: "int4 zeros missing (or given for other kinds)",
                  11: "bf16 products for int4 layers outside a bf16 int4 model of widths a multiple of 32 "
                      "(or a build without VDPBF16PS)"}


class NotTaken(Exception):
    """The model or cache has something the native step does not implement (the message says
    what); the eager forward serves every step then."""


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _float_kind(dtype: torch.dtype) -> int:
    if dtype == torch.float32:
        return _W_F32
    if dtype == torch.bfloat16:
        return _W_BF16
    raise NotTaken(f"weights in {dtype}")


@dataclass(frozen=True)
class Projection:
    """One projection as the native step reads it, in place: [N, K] weight (int4: the packed
    codes [N, K/2]), per-row int8 scales or int4 group scales, and int4's zeros / mins."""

    kind: int
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    group: int = 0

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.weight, self.scales, self.zeros, self.mins) if t is not None]


def _int4(layer: Int4WeightOnlyLinear) -> Projection:
    if layer.bias is not None or layer.input_inv_scale is not None:
        raise NotTaken("int4 projection with a bias or AWQ input scales")
    for t in (layer.scales, layer.zeros) + (() if layer.mins is None else (layer.mins,)):
        if t.dtype not in _META_DTYPES:
            raise NotTaken(f"int4 scales / zeros / mins in {t.dtype}")
    return Projection(_W_I4, layer.qweight, layer.scales, layer.zeros, layer.mins, layer.group_size)


def _projection(fused, members: tuple, dtype: torch.dtype) -> Projection:
    """One projection (a fused group, or one linear), read in place; NotTaken for anything but
    plain float, per-row int8 and group int4."""
    if fused is not None and fused.usable(members):
        layer = getattr(fused, "merged", None)
        if layer is None:  # FusedLinears: the concatenated float weight
            if fused.bias is not None:
                raise NotTaken("a projection with a bias")
            return Projection(_float_kind(fused.weight.dtype), fused.weight)
    elif len(members) == 1:
        layer = members[0]
    else:
        raise NotTaken("unfused q/k/v or gate/up projections")
    if isinstance(layer, Int4WeightOnlyLinear):
        return _int4(layer)
    if isinstance(layer, Int8WeightOnlyLinear):
        if layer.bias is not None or layer.input_inv_scale is not None:
            raise NotTaken("int8 projection with a bias or AWQ input scales")
        if layer.scales.dtype != dtype:
            raise NotTaken(f"int8 scales in {layer.scales.dtype}, model in {dtype}")
        return Projection(_W_I8, layer.weight_int8, layer.scales)
    weight = getattr(layer, "weight", None)
    if not isinstance(layer, torch.nn.Linear) or weight is None or layer.bias is not None:
        raise NotTaken(f"projection {type(layer).__name__}")
    if layer._forward_hooks or layer._forward_pre_hooks:
        raise NotTaken("a hooked projection")
    return Projection(_float_kind(weight.dtype), weight)


def _lm_head(head, dtype: torch.dtype) -> Projection:
    """The LM head's rows: the model's float head, an int8 head (the self-draft's,
    worker/engine_loop/self_draft.py, keeps its weight-only int8 layer as `linear`), or a kept
    GGUF Q8_0 table's groups, read in place."""
    if isinstance(head, Int8GroupLMHead):
        return Projection(_W_I8G, head.table.codes, head.table.scales)
    inner = getattr(head, "linear", None)
    if isinstance(inner, Int8WeightOnlyLinear):
        return _projection(None, (inner,), dtype)
    weight = getattr(head, "weight", None)
    if weight is None or getattr(head, "bias", None) is not None:
        raise NotTaken(f"LM head {type(head).__name__}")
    if weight.dtype != dtype:
        raise NotTaken(f"LM head in {weight.dtype}, model in {dtype}")
    return Projection(_float_kind(weight.dtype), weight)


def amx_packed(weight: torch.Tensor) -> torch.Tensor | None:
    """A [N, K] bf16 weight's whole 16-row blocks in gemm_bf16_amx_packed's layout, [N/16]
    [K/32][16 pairs][16 rows][2] (a second copy: the model keeps its own for eager steps),
    or None where that kernel does not apply."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or k % 32 or n < 16:
        return None
    blocks = n // 16
    with torch.no_grad():
        return weight[:blocks * 16].view(blocks, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


HEAD_PANEL_ROWS = 16  # int4_panels.c's kvmesh_gemv_i8_panels


def int8_row_panels(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] (K % 4 == 0) in kvmesh_gemv_i8_panels' layout, [ceil(N/16)][K/4][16
    rows][4]: row n's codes 4c .. 4c + 3 at panel n // 16, chunk c, slot n % 16; rows past N zero.
    A Q8_0 table's fp32 group scales [N, K/32] go through the same call as [ceil(N/16)][K/32][16]
    (chunks of one value)."""
    n, k = codes.shape
    padded = torch.cat([codes, codes.new_zeros(-n % HEAD_PANEL_ROWS, k)])
    per = 4 if codes.dtype == torch.int8 else 1
    return padded.view(-1, HEAD_PANEL_ROWS, k // per, per).permute(0, 2, 1, 3).contiguous()


def _layer_fields(layer, cache, dtype: torch.dtype,
                  strides: tuple) -> tuple[dict[str, int], list[torch.Tensor], dict[str, Projection],
                                           list[torch.Tensor | None]]:
    """One layer's LayerDescriptor fields but the packed copies (norms, the four projections'
    weights, scales, zeros and mins, its K/V cache), the tensors behind them, its four
    projections by field prefix (qkv, o, gate_up, down: one kind and int4 layout), and the four
    projection weights the AMX kernel could take packed (None where not bf16)."""
    attn, mlp = layer.self_attn, layer.mlp
    if cache.quantized or cache.key_cache.dtype != dtype or cache.value_cache.dtype != dtype:
        raise NotTaken(f"KV cache in {cache.key_cache.dtype}{' (quantized)' if cache.quantized else ''}")
    if cache.key_cache.stride() != strides or cache.value_cache.stride() != strides or strides[-1] != 1:
        raise NotTaken("KV cache layers of different layouts")
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if any(n.dtype != dtype or not n.is_contiguous() for n in norms):
        raise NotTaken("norm weights in another dtype")
    projections = {"qkv": _projection(attn.qkv, (attn.q_proj, attn.k_proj, attn.v_proj), dtype),
                   "o": _projection(attn.o, (attn.o_proj,), dtype),
                   "gate_up": _projection(mlp.gate_up, (mlp.gate_proj, mlp.up_proj), dtype),
                   "down": _projection(mlp.down, (mlp.down_proj,), dtype)}
    if len({_layout(p) for p in projections.values()}) != 1:
        raise NotTaken("projections of mixed kinds (or int4 groups / scale dtypes)")
    fields = {"input_norm": _ptr(norms[0]), "post_attention_norm": _ptr(norms[1]),
              "key_cache": _ptr(cache.key_cache), "value_cache": _ptr(cache.value_cache)}
    tensors = [*norms, cache.key_cache, cache.value_cache]
    for name, p in projections.items():
        if not all(t.is_contiguous() for t in p.tensors()):
            raise NotTaken("a non-contiguous projection weight")
        fields.update({f"{name}_weight": _ptr(p.weight), f"{name}_scales": _ptr(p.scales),
                       f"{name}_zeros": _ptr(p.zeros), f"{name}_mins": _ptr(p.mins)})
        tensors += p.tensors()
    return fields, tensors, projections, [p.weight if p.kind == _W_BF16 else None for p in projections.values()]


def _layout(p: Projection) -> tuple:
    """What must be the same for every projection the step runs: the kind, and for int4 the
    group and the scale / zero / min dtypes."""
    if p.kind != _W_I4:
        return (p.kind,)
    return (p.kind, p.group, p.scales.dtype, p.zeros.dtype, None if p.mins is None else p.mins.dtype)


_PACKED_FIELDS = ("qkv_packed", "o_packed", "gate_up_packed", "down_packed")


@dataclass
class ModelDescription:
    """What the native step reads, as the C structs: `model` points at `layers`, and both at
    the tensors in `keep`, which must live as long as they do."""

    model: cpu_abi.ModelDescriptor
    layers: ctypes.Array
    keep: list[torch.Tensor]
    weight_kind: int
    amx_packed_bytes: int
    int8_head_bytes: int = 0  # the step's int8 copy of a float LM head (per row, or a Q8_0 table's groups)
    int4_layers: list = field(default_factory=list)  # an int4 model's decoder layers (their codes' layout: set_int4_panels)
    int4_projections: list = field(default_factory=list)  # their projections, a dict by field prefix a layer
    int4_meta: list = field(default_factory=list)  # the projections' kernel metadata (set_int4_kernel_meta)
    q8_0_head: Int8GroupLMHead | None = None  # the model's head where the step reads it as its Q8_0 table


def describe(model, kv_caches: list, int8_activations: bool = False,
             pack_for_amx: bool = False, bf16_products: bool = False) -> ModelDescription:
    """The model and its KV caches as the native step's descriptor; NotTaken (the reason)
    for what the step does not implement. pack_for_amx: bf16 weights also get a copy laid out
    for the AMX kernel (made only after every check has passed: packing is ~0.1 s and a
    weights' worth of memory). bf16_products: the kernels have VDPBF16PS; a bf16 int4 model
    without int8 activations then runs its int4 layers and a Q8_0 head as the bf16 model's
    products (int4_bf16: each 4-row group dequantized to its bf16 values, the bf16 GEMV over
    them; NativeDecoder then has its eager int4 layers dequantize to the same values)."""
    if model.coll.world_size != 1:
        raise NotTaken("tensor parallelism")
    refusal = model.arch.llama_shaped_refusal()
    if refusal is not None:  # the C step implements Llama's layer only
        raise NotTaken(refusal)
    cfg = model.config
    table = model.model.embed_tokens
    if isinstance(table, Int8GroupEmbedding):  # a kept GGUF Q8_0 table: codes and scales in place
        embed, embed_scales, dtype = table.codes, table.scales, table.dtype
    else:
        embed, embed_scales = table.weight, None
        dtype = embed.dtype
    if embed.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        raise NotTaken(f"model on {embed.device.type} in {dtype}")
    attn0 = model.model.layers[0].self_attn
    hidden, hq, hkv, d = cfg.hidden_size, attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
    inter = model.model.layers[0].mlp.gate_proj.out_features
    if any(n % 16 for n in (hidden, inter, hq * d, d)) or hq % hkv:
        raise NotTaken(f"widths hidden {hidden}, intermediate {inter}, heads {hq}x{d} (multiples of 16 needed)")
    k0 = kv_caches[0].key_cache
    strides = k0.stride()
    keep: list[torch.Tensor] = []
    layers: list[dict[str, int]] = []
    to_pack: list[torch.Tensor | None] = []  # four a layer, then the LM head
    layouts: dict[tuple, Projection] = {}
    int4_projections: list[dict[str, Projection]] = []  # a layer's, for their kernel metadata
    for layer, cache in zip(model.model.layers, kv_caches, strict=True):
        fields, tensors, projections, bf16_weights = _layer_fields(layer, cache, dtype, strides)
        layers.append(fields)
        keep += tensors
        to_pack += bf16_weights
        layouts.setdefault(_layout(projections["qkv"]), projections["qkv"])
        int4_projections.append(projections)
    if len(layouts) != 1:
        raise NotTaken("projections of mixed kinds (or int4 groups / scale dtypes)")
    (first,) = layouts.values()
    head = _lm_head(model.lm_head, dtype)
    head_copy_bytes = 0
    head_panels = None
    if first.kind == _W_I4 and int8_activations and head.kind not in (_W_I8, _W_I8G):
        # The quantized step's LM head: the float head (SmolLM2's is the tied embedding, 113 MB
        # in fp32, twice its int4 layers' bytes) read as int8 rows with one scale each, a copy
        # made once: at batch 1 the head's bytes, not the int4 layers', were the step's largest
        # read. Its codes only in 16-row panels, read against the final hidden state quantized
        # per 32-input block, as the int4 layers (int4_panels.c): read a row at a time with fp32
        # activations it streamed at ~half the int4 panels' rate (docs/benchmarks.md).
        codes, scales = quantize_int8_per_channel(head.weight)
        head = Projection(_W_I8, codes, scales.to(dtype))
        head_panels = int8_row_panels(codes)
        head_copy_bytes = head_panels.nbytes + head.scales.nbytes
    elif head.kind == _W_F32 and first.kind in (_W_F32, _W_I4):
        # An fp32 head that is an int8 table with one scale a 32-input group (a GGUF Q8_0
        # embedding, as the embedded model's is, dequantized at load): read as its codes and
        # scales, the same weights bit for bit at ~0.27x the bytes (the head was ~40 % of a
        # batch-1 step's read). The fp32 table stays for the embedding and eager steps.
        groups = int8_groups_if_exact(head.weight)
        if groups is not None:
            head = Projection(_W_I8G, *groups)
            head_copy_bytes = sum(t.nbytes for t in groups)
    if first.kind == _W_I4 and int8_activations and head.kind == _W_I8G:
        # A Q8_0 table head (the embedded GGUF's) read by the int4 x int8 step in panels too: a
        # copy of its codes and fp32 group scales (the table itself stays the embedding)
        head_panels = int8_row_panels(head.weight)
        head = Projection(_W_I8G, head.weight, int8_row_panels(head.scales.float()))
        head_copy_bytes += head_panels.nbytes + head.scales.nbytes
    lm_kind, lm, lm_scales = head.kind, head.weight, head.scales
    final_norm = model.model.norm.weight
    cos, sin = model.rotary.cos, model.rotary.sin_signed
    scale_tensors = tuple(t for t in (lm_scales, embed_scales) if t is not None)
    for t in (embed, lm, final_norm, cos, sin) + scale_tensors:
        if not t.is_contiguous():
            raise NotTaken("a non-contiguous embedding, LM head or table")
    if final_norm.dtype != dtype or cos.dtype != torch.float32 or lm.shape[1] != hidden:
        raise NotTaken("final norm or RoPE tables in another dtype, or an LM head of another width")
    if head_panels is not None and lm_kind == _W_I8:  # the panels are the only copy kept: the step reads no rows of it
        lm = head_panels
    elif head_panels is not None:
        keep.append(head_panels)
    keep += [embed, lm, final_norm, cos, sin, *scale_tensors]
    to_pack.append(lm if lm_kind == _W_BF16 else None)
    packed = [amx_packed(w) if w is not None and pack_for_amx else None for w in to_pack]
    keep += [t for t in packed if t is not None]
    array = (cpu_abi.LayerDescriptor * len(layers))()
    for i, fields in enumerate(layers):
        fields.update(zip(_PACKED_FIELDS, map(_ptr, packed[4 * i:4 * i + 4])))
        for name, value in fields.items():
            setattr(array[i], name, value)
    weight_kind = first.kind
    panels = weight_kind == _W_I4 and int8_activations
    int4_bf16 = weight_kind == _W_I4 and dtype == torch.bfloat16 and bf16_products and not int8_activations
    if weight_kind == _W_I4:  # last: nothing is re-laid out for a model the step then refuses
        set_int4_panels(model.model.layers, panels)
    int4 = {} if weight_kind != _W_I4 else {
        "int4_group": first.group, "int4_scale_dtype": _META_DTYPES[first.scales.dtype],
        "int4_zero_dtype": _META_DTYPES[first.zeros.dtype],
        "int4_min_dtype": _META_DTYPES[first.mins.dtype] if first.mins is not None else 0}
    descriptor = cpu_abi.ModelDescriptor(**int4,
        num_layers=len(layers), hidden=hidden, intermediate=inter, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
        weight_kind=weight_kind, bf16=int(dtype == torch.bfloat16), block_size=k0.shape[1],
        cache_block_stride=strides[0], cache_slot_stride=strides[1], cache_head_stride=strides[2],
        vocab=head.weight.shape[0], lm_head_kind=lm_kind, int8_activations=int(int8_activations),
        # fp32-activation int4 layers in the factorised form (fewer instructions a weight; the
        # same weights, fp32 sums in another order: the embedded model keeps HF's tokens,
        # tests/test_engine_exact.py); NativeDecoder.int4_factored = False is the bit-exact form
        int4_factored=int(weight_kind == _W_I4 and not int8_activations and not int4_bf16),
        int4_interleaved=int(panels), int4_bf16=int(int4_bf16),
        rms_norm_eps=float(cfg.rms_norm_eps), embed=_ptr(embed), embed_scales=_ptr(embed_scales),
        final_norm=_ptr(final_norm), rope_cos=_ptr(cos),
        rope_sin=_ptr(sin), lm_head_weight=_ptr(lm), lm_head_scales=_ptr(lm_scales), lm_head_packed=_ptr(head_panels if head_panels is not None else packed[-1]),
        layers=ctypes.addressof(array))
    description = ModelDescription(descriptor, array, keep, weight_kind, sum(t.nbytes for t in packed if t is not None),
                                   head_copy_bytes, list(model.model.layers) if weight_kind == _W_I4 else [],
                                   int4_projections if weight_kind == _W_I4 else [])
    set_int4_kernel_meta(description)
    if lm_kind == _W_I8G and isinstance(model.lm_head, Int8GroupLMHead):
        description.q8_0_head = model.lm_head
    return description


def int4_kernel_meta(p: Projection, panels: bool) -> torch.Tensor | None:
    """An int4 projection's metadata as its fp32-activation kernels use it (kvmesh_int4.meta),
    made once so a step does not regroup it a call: fp32 [N, 2G], row n's group scales then
    offsets, the values int4_fma_meta computes a call (the offset the min where the zero is 0,
    else -zero x scale where that product is exact), so the same results. None where the
    kernel regroups a call: a group that folds neither way (those rows go one at a time),
    codes in 8-row panels (int4 x int8: there the kernel is read-bound, and fp32 metadata
    reads more bytes than the stored fp16 it replaces cost to regroup), and groups over 32
    inputs (regrouping is 1/4 or less of group 32's share of a row; 8 bytes a group instead of
    the stored 4 in bf16 would cost more)."""
    if panels or p.group > 32:
        return None
    s, z = p.scales.float(), p.zeros.float()
    m = p.mins.float() if p.mins is not None else torch.zeros_like(s)
    prod = z * s
    exact = z.double() * s.double() == prod.double()
    if not bool(((z == 0) | ((m == 0) & (z == torch.round(z)) & exact)).all()):
        return None
    return torch.cat([s, torch.where(z == 0, m, 0.0 - prod)], dim=1).contiguous()


def set_int4_kernel_meta(description: ModelDescription) -> None:
    """Each int4 projection's kernel metadata (int4_kernel_meta) for its codes' current layout,
    in the layer descriptor's *_packed field (the copy laid out for the kernel, as a bf16
    weight's AMX copy; int4 has no other), kept with the description."""
    if description.weight_kind != _W_I4:
        return
    panels = bool(description.model.int4_interleaved)
    description.int4_meta = []
    for fields, projections in zip(description.layers, description.int4_projections, strict=True):
        for name, p in projections.items():
            meta = int4_kernel_meta(p, panels)
            setattr(fields, f"{name}_packed", _ptr(meta))
            if meta is not None:
                description.int4_meta.append(meta)


def _int4_linears(layer) -> list[Int4WeightOnlyLinear]:
    """A decoder layer's int4 layers: its modules and the merged layers of its fused groups
    (FusedQuantLinears, plain attributes of the attention and MLP blocks)."""
    found = [m for m in layer.modules() if isinstance(m, Int4WeightOnlyLinear)]
    for block in (layer.self_attn, layer.mlp):
        found += [merged for value in vars(block).values()
                  if isinstance(merged := getattr(value, "merged", None), Int4WeightOnlyLinear)]
    return found


def set_int4_panels(layers, on: bool) -> None:
    """Every int4 layer of the decoder layers with its codes in 8-row panels (on: what the
    int4 x int8 kernel reads, int4_panels.c) or in pack_int4's layout (off: the fp32-activation
    kernels'), permuted in place: the layers keep one copy of their bytes, and read them through
    plain_qweight (the eager steps). A fused layer's members view its rows: each storage is
    permuted once, through the layer holding all of it, and every layer on it marked."""
    rows = INT4_PANEL_ROWS if on else 0
    with torch.no_grad():
        for layer in layers:
            int4 = [m for m in _int4_linears(layer) if m.panel_rows != rows]
            owners: dict[int, Int4WeightOnlyLinear] = {}
            for m in int4:
                key = m.qweight.untyped_storage().data_ptr()
                if key not in owners or m.qweight.numel() > owners[key].qweight.numel():
                    owners[key] = m
            for m in owners.values():
                q = m.qweight
                q.copy_((interleave_int4_rows(q) if on else deinterleave_int4_rows(q)).clone())
            for m in int4:
                m.panel_rows = rows


class Bf16Dense:
    """An int4 layer's weight as the bf16 values the int4_bf16 step multiplies (Int4WeightOnlyLinear.
    bf16_dense): the kernels' kvmesh_int4_to_bf16, else quant's own dequantization (the same values);
    a Q8_0 head's rows alike (q8_0_rows)."""

    def __init__(self, kernels: cpu_build.CpuKernels):
        self._to_bf16 = kernels.int4_to_bf16
        self._i8g_to_bf16 = kernels.i8g_to_bf16

    def q8_0_rows(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """A Q8_0 head's rows (int8 codes [N, K], fp32 scales [N, K/32], contiguous) as the bf16
        values code * scale (Int8GroupLMHead.bf16_rows)."""
        out = torch.empty(codes.shape, dtype=torch.bfloat16)
        if not self._i8g_to_bf16(_ptr(codes), _ptr(scales), codes.shape[0], codes.shape[1], _ptr(out),
                                 torch.get_num_threads()):
            out.copy_((codes.view(codes.shape[0], -1, 32).float() * scales[..., None]).view(codes.shape))
        return out

    def __call__(self, layer: Int4WeightOnlyLinear) -> torch.Tensor:
        out = torch.empty(layer.out_features, layer.in_features, dtype=torch.bfloat16)
        meta = [t for t in (layer.scales, layer.zeros, layer.mins) if t is not None]
        plain = not layer.panel_rows and layer.qweight.is_contiguous() and all(
            t.is_contiguous() and t.dtype in _META_DTYPES for t in meta)
        if plain and self._to_bf16(_ptr(layer.qweight), *(_ptr(t) for t in (layer.scales, layer.zeros, layer.mins)),
                                   layer.group_size, *(_META_DTYPES[t.dtype] for t in meta), *[0] * (3 - len(meta)),
                                   layer.out_features, layer.in_features, _ptr(out), torch.get_num_threads()):
            return out
        return layer.dequantized_weight(torch.bfloat16)


def _int4_path(model) -> str:
    """What an int4 model's layers run on (NativeDecoder.path): int4 groups dequantized in AVX2
    registers against int8 or fp32 activations, or to bf16 for VDPBF16PS (int4_bf16)."""
    return "int4_avx2_a8" if model.int8_activations else "int4_avx512_bf16" if model.int4_bf16 else "int4_avx2"


class NativeDecoder:
    """The compiled step for one model and its KV caches. `run(inputs)` -> fp32 logits of the
    step's sampling rows for a step of at most `max_tokens` tokens, else None (run eagerly)."""

    def __init__(self, kernels: cpu_build.CpuKernels, description: ModelDescription, max_tokens: int,
                 gather_logits, int8_activations: bool = False):
        self._step = kernels.native_step
        self._kernels = kernels
        self._description = description  # the descriptor and every tensor it points into
        self._model = ctypes.pointer(description.model)
        self._batch = cpu_abi.StepBatch()
        self._batch_ptr = ctypes.pointer(self._batch)
        self._gather_logits = gather_logits  # the head's own trim of padded vocabulary rows
        self.vocab = description.model.vocab
        self.max_tokens = max_tokens
        # prompt tokens' attention the step takes (PREFILL_ATTENTION_PAIRS_MAX; benchmarks move it)
        self.prefill_attention_pairs_max = PREFILL_ATTENTION_PAIRS_MAX
        self._rows = torch.arange(0, dtype=torch.long)
        self.steps_run = 0  # steps this decoder served (tests and benchmarks read it)
        # The logits are written into this buffer, rows [0, S), and returned as a view valid
        # until the next step (as CUDA graphs' static outputs are): a fresh [64, 49152] fp32
        # tensor a step cost ~6 ms of first-touch page faults (a third of the LM head's time).
        # Sized by the rows that sample (a power of two from 8 up), not the step's tokens: a
        # 512-token prefill step samples one row a request (max_tokens rows: 100 MB at 512).
        self._logits = torch.empty(0, self.vocab, dtype=torch.float32)
        self.variant = kernels.variant.name  # the library's instruction set (cpu_build.VARIANTS)
        kind = description.weight_kind
        # int8 weights as int8 x int8 AMX products (the self-draft's layers)
        self.int8_amx = int8_activations and bool(kernels.features & _FEATURE_AMX_INT8) and kind == _W_I8
        self.amx_packed_bytes = description.amx_packed_bytes  # bf16 weights re-laid for AMX tiles
        self.int8_head_bytes = description.int8_head_bytes
        self._int4_layers = description.int4_layers
        self._bf16_dense = Bf16Dense(kernels)
        self._mark_bf16_dense()
        # one int4 layer of the model, whose panel_rows says the codes' layout at each step
        self._int4_probe = next((m for layer in self._int4_layers for m in _int4_linears(layer)), None)
        self.head_q8_0 = description.model.lm_head_kind == _W_I8G  # the head as a Q8_0 table's exact groups
        # what the layers' projections run on: AMX tiles, VDPBF16PS, AVX-512 FMAs ("fma", fp32 or
        # widened), AVX2 FMAs ("avx2", the avx2 build), int4 groups dequantized in AVX2 registers,
        # or int4 groups dequantized to bf16 for VDPBF16PS (a bf16 model's, int4_bf16)
        self.path = (_int4_path(description.model) if kind == _W_I4 else
                     "amx" if self.amx_packed_bytes or self.int8_amx else
                     "avx512_bf16" if kind == _W_BF16 and kernels.features & _FEATURE_DPBF16 else
                     "fma" if kernels.features & _FEATURE_AVX512 else "avx2")

    @classmethod
    def build(cls, model, kv_caches: list, max_tokens: int, int8_activations: bool = False,
              kernels: cpu_build.CpuKernels | None = None) -> "NativeDecoder":
        """Raises NotTaken (the reason) where the native step does not apply. int8_activations:
        int8 layer weights may run as int8 x int8 AMX products, each token's activations
        quantized per row (the self-draft: a draft only has to guess right, and it then reads
        its weights at the bf16 path's rate; the LM head keeps fp32 activations). kernels: the
        library to run (tests: each variant), else the one cpu_build chose for this CPU."""
        reason = unavailable_reason()
        if reason is not None:
            raise NotTaken(reason)
        kernels = kernels or cpu_build.load()
        if kernels is None:
            raise NotTaken(f"no CPU kernels ({cpu_build.load_failure()})")
        if not kernels.features & _FEATURE_NATIVE_STEP:
            raise NotTaken(f"the {kernels.variant.name} build has no native step")
        description = describe(model, kv_caches, int8_activations, pack_for_amx=bool(kernels.features & _FEATURE_AMX),
                               bf16_products=bool(kernels.features & _FEATURE_DPBF16))
        failure = kernels.native_step_check(ctypes.pointer(description.model))
        if failure:
            raise NotTaken(f"the native step refused the model: {CHECK_FAILURES.get(failure, failure)}")
        return cls(kernels, description, max_tokens, model.lm_head.gather_logits, int8_activations)

    @property
    def logits_rows(self) -> int:
        """Rows of the logits buffer (it grows with the rows a step samples, not its tokens)."""
        return self._logits.shape[0]

    @property
    def int4_factored(self) -> bool:
        return bool(self._description.model.int4_factored)

    @int4_factored.setter
    def int4_factored(self, on: bool) -> None:
        """fp32-activation int4 layers computed per group as scale x (sum of code x input) +
        offset x (sum of inputs) (True) or each weight dequantized bit for bit as eager's (False)."""
        self._description.model.int4_factored = int(on)

    @property
    def int4_bf16(self) -> bool:
        return bool(self._description.model.int4_bf16)

    @int4_bf16.setter
    def int4_bf16(self, on: bool) -> None:
        """A bf16 model's int4 layers (and a Q8_0 head) as the bf16 model's products (True: each
        4-row group dequantized to bf16 for VDPBF16PS, eager layers on the same bf16 weights) or
        with fp32 activations (False: kvmesh_gemv_int4's forms, torch's int4 kernel eagerly)."""
        model = self._description.model
        was = model.int4_bf16
        model.int4_bf16 = int(on)
        if on and self._kernels.native_step_check(ctypes.pointer(model)):
            model.int4_bf16 = was
            raise ValueError("bf16 products are for a bf16 int4 model's plain rows on a CPU with VDPBF16PS")
        model.int4_factored = int(not on and not model.int8_activations) if self._int4_layers else 0
        self._mark_bf16_dense()
        if self._int4_layers:
            self.path = _int4_path(model)

    def _mark_bf16_dense(self) -> None:
        """The int4 layers' eager forward on the bf16 weights this step multiplies (int4_bf16), or
        torch's int4 kernel (not)."""
        on = bool(self._description.model.int4_bf16)
        for layer in self._int4_layers:
            for m in _int4_linears(layer):
                m.bf16_dense = self._bf16_dense if on else None
        if self._description.q8_0_head is not None:
            self._description.q8_0_head.bf16_rows = self._bf16_dense.q8_0_rows if on else None

    @property
    def int4_interleaved(self) -> bool:
        return bool(self._description.model.int4_interleaved)

    @int4_interleaved.setter
    def int4_interleaved(self, on: bool) -> None:
        """int4 x int8 layers over codes in 8-row panels (True, the default: int4_panels.c) or one
        row at a time over pack_int4's layout (False), the codes permuted in place to match."""
        if not self._description.model.int8_activations or not self._int4_layers:
            raise ValueError("int4 panels are the int8-activation int4 step's layout")
        set_int4_panels(self._int4_layers, on)
        self._description.model.int4_interleaved = int(on)
        set_int4_kernel_meta(self._description)

    @property
    def int4_gemm_min_rows(self) -> int:
        return self._kernels.gemm_min_rows()

    @int4_gemm_min_rows.setter
    def int4_gemm_min_rows(self, rows: int) -> None:
        """Steps of at least `rows` tokens run the int4 layers (fp32 activations) and a Q8_0 LM
        head through the batched kernels (cpu/int4_gemm_avx2.c: a panel of weight rows dequantized
        once, FMA-bound tiles over every token), fewer through the per-row ones. One setting for
        every decoder of the process (the library's); benchmarks and tests move it."""
        self._kernels.set_gemm_min_rows(rows)

    def run(self, inputs) -> torch.Tensor | None:
        """inputs: the step's StepInputs (worker/runner/model_runner.py) -> fp32 logits
        [len(sample_at), vocab] (no rows for a mid-prompt chunk; a view of the decoder's own
        buffer, overwritten by its next step), or None when the step has more than max_tokens
        tokens."""
        n = len(inputs.input_ids)
        if n > self.max_tokens or prefill_attention_pairs(inputs.query_lens, inputs.seq_lens) \
                > self.prefill_attention_pairs_max:
            return None
        if self._int4_probe is not None and bool(self._int4_probe.panel_rows) != self.int4_interleaved:
            raise RuntimeError("another native decoder re-laid out this model's int4 codes")
        positions = torch.tensor(inputs.positions, dtype=torch.long)
        seq_lens = (positions + 1).to(torch.int32)  # each token attends to its request up to itself
        tables = inputs.block_table_tensor()
        width = tables.shape[1]
        if n != len(inputs.query_lens):  # a request with several tokens: its table once per token
            owner = torch.repeat_interleave(torch.arange(len(inputs.query_lens)), torch.tensor(inputs.query_lens))
            tables = tables[owner]
        tokens = torch.tensor(inputs.input_ids, dtype=torch.long)
        slots = torch.tensor(inputs.slot_mapping, dtype=torch.long)
        sample_rows = torch.tensor(inputs.sample_at, dtype=torch.long)
        if self._logits.shape[0] < len(inputs.sample_at):
            self._logits = torch.empty(max(8, 1 << (len(inputs.sample_at) - 1).bit_length()), self.vocab,
                                       dtype=torch.float32)
        if len(self._rows) < n:
            self._rows = torch.arange(n, dtype=torch.long)
        logits = self._logits[:len(inputs.sample_at)]
        b = self._batch
        b.num_tokens, b.tokens, b.positions, b.slots = n, tokens.data_ptr(), positions.data_ptr(), slots.data_ptr()
        b.block_tables, b.block_table_width, b.seq_lens = tables.data_ptr(), width, seq_lens.data_ptr()
        b.rows, b.sample_rows, b.num_samples = self._rows.data_ptr(), sample_rows.data_ptr(), len(inputs.sample_at)
        b.num_threads, b.logits = torch.get_num_threads(), logits.data_ptr()
        failed = self._step(self._model, self._batch_ptr)
        if failed == _STEP_NOT_BUILT:
            raise RuntimeError("native step: the library was built without it")
        if failed:
            raise MemoryError("native step: no memory for its workspace")
        self.steps_run += 1
        return self._gather_logits(logits)


# The native step's attention is the paged decode kernel run once a token (cpu/paged_attention.c):
# each token of a prompt chunk reads its request's K/V again, where eager's flash attention reads
# a block of K/V once for a block of queries (SmolLM2 bf16, 2 threads, Zen 4: ~0.73 ms against
# ~0.57 ms a thousand pairs). A step whose prompt tokens attend to more (token, context) pairs
# than this runs eagerly: past it the attention costs more than the native projections save (a
# 512-token chunk at context 0, 131k pairs: 0.82x eager's time; at 1024, 656k: 1.03x; this is
# the chunk at 512, 393k; docs/engine.md, "The native step"; load_tests/bench_prefill_step.py).
PREFILL_ATTENTION_PAIRS_MAX = 512 * 512 + 512 * 513 // 2


def prefill_attention_pairs(query_lens, seq_lens) -> int:
    """The (token, context) pairs of a step's prompt tokens: a request with q > 1 tokens this step
    and L after it attends q x (L - q) + q (q + 1) / 2 (decode rows, q = 1, are not counted: eager
    runs them through the same kernel)."""
    return sum(q * (n - q) + q * (q + 1) // 2 for q, n in zip(query_lens, seq_lens) if q > 1)


def unavailable_reason() -> str | None:
    """Why the native step cannot run here, without building anything; None where it may."""
    if os.environ.get("KVMESH_NATIVE_DECODE", "1") == "0":
        return "disabled by KVMESH_NATIVE_DECODE=0"
    return cpu_build.unavailable_reason()


# model.cpu_native_max_tokens auto for 16-bit models: native steps up to where the eager
# forward's GEMMs catch up (bf16, SmolLM2, docs/benchmarks.md, "Forward paths on CPU"). With AMX the
# native projections are AMX tiles too and win at every size it takes (2 threads: 2.3x at 16
# tokens, 1.6x at 64; 1 thread 1.3x at 64): the largest step, 64. VDPBF16PS GEMVs on a CPU
# without AMX tiles (Zen 4) race eager GEMMs without AMX too, and stay ahead to the largest step
# (2 threads: 1.27x at 32 tokens, 1.22x at 64; 1 thread: 1.03x, 1.22x): 64 as well. Otherwise (FMA GEMVs, or VDPBF16PS
# against eager's AMX GEMMs) they are ahead to about 12 tokens per thread (1 thread: 1.36x at 8,
# 1.07x at 12, 0.87x at 16; 2 threads: 1.35x at 16, 1.10x at 24, 0.92x at 32), measured to 2
# threads, so no more than GEMV_MAX_TOKENS_CAP past them.
GEMV_TOKENS_PER_THREAD = 12
GEMV_MAX_TOKENS_CAP = 24


def amx_available() -> bool:
    """The CPU kernels built with their AMX path and Linux granted the tile state."""
    kernels = cpu_build.load() if unavailable_reason() is None else None
    return kernels is not None and bool(kernels.features & _FEATURE_AMX)


def avx512_build() -> bool:
    """This CPU's kernels are an AVX-512 build: fp32 projections run on AVX-512 FMAs ("fma"),
    not the avx2 build's ("avx2")."""
    kernels = cpu_build.load() if unavailable_reason() is None else None
    return kernels is not None and bool(kernels.features & _FEATURE_AVX512)


def dpbf16_without_amx() -> bool:
    """The CPU kernels' bf16 GEMVs are VDPBF16PS on a CPU with no AMX tiles at all (so eager's
    oneDNN GEMMs have none either)."""
    kernels = cpu_build.load() if unavailable_reason() is None else None
    return (kernels is not None and bool(kernels.features & _FEATURE_DPBF16)
            and "amx_tile" not in cpu_build.cpu_flags())


def auto_max_tokens(threads: int) -> int:
    if amx_available() or dpbf16_without_amx():
        return CPU_NATIVE_MAX_TOKENS
    return min(GEMV_MAX_TOKENS_CAP, GEMV_TOKENS_PER_THREAD * max(1, threads))


def quantized_weights(model) -> str | None:
    """"int4" / "int8" where the model's projections are weight-only quantized, else None."""
    kinds = {type(m) for m in model.modules()}
    return "int4" if Int4WeightOnlyLinear in kinds else "int8" if Int8WeightOnlyLinear in kinds else None


def max_tokens_for(configured: int | None, dtype: torch.dtype, threads: int, quantized: str | None = None,
                   int8_activations: bool = False, max_step_tokens: int = CPU_NATIVE_MAX_TOKENS) -> int:
    """model.cpu_native_max_tokens resolved: auto (None) is auto_max_tokens(threads) for
    16-bit models and fp32 int8 models. fp32 float weights run fp32 GEMVs whatever the CPU (AMX
    tiles are bf16): 12 tokens a thread, at most 24; in fp32 the step is token-exact (the eager
    forward up to the order of fp32 sums: tests/test_engine_exact.py, HF's tokens on the
    embedded model), 1.4x eager at batch 1 and 4.3x at batch 8 on an AVX2 EPYC
    (docs/benchmarks.md). fp32 int4 to the largest step: their eager forward dequantizes every
    weight on every call (int4 at batch 1: 0.05x the float model, docs/quantization.md), and a
    64-token native step costs less than dequantizing the weights once. A bf16 model's bf16 or
    int4 weights on a CPU with VDPBF16PS and no AMX (Zen 4: avx512_bf16, int4_avx512_bf16) take
    every step up to the scheduler's max_num_batched_tokens (max_step_tokens): the projections go
    64 tokens a call and stayed ahead of eager's oneDNN GEMMs at a 512-token prefill step
    (docs/engine.md, "The native step"), where eager's non-GEMM half (SDPA, norms, RoPE, copies)
    is as long as its GEMMs."""
    if configured is not None:
        return configured
    if dtype == torch.float32 and quantized == "int4":
        return CPU_NATIVE_MAX_TOKENS
    if dtype == torch.float32 and quantized is None:
        return min(GEMV_MAX_TOKENS_CAP, GEMV_TOKENS_PER_THREAD * max(1, threads))
    if dtype == torch.bfloat16 and quantized in (None, "int4") and not int8_activations and dpbf16_without_amx():
        return max(CPU_NATIVE_MAX_TOKENS, max_step_tokens)
    return auto_max_tokens(threads)
