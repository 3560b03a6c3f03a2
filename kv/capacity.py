"""The capacity model: how many KV tokens and requests fit on a device, before loading anything.

Pure arithmetic on a model's shape (no torch), reproducing the articles' worked numbers:

    KV bytes per token = 2 x L x h_kv x d x b          (K and V; KV heads, not query heads)
      + 2 x L x h_kv x 2                               (int8/fp8 only: fp16 scale per token
                                                        per KV head, stored beside the blocks)
    int4: 2 x L x h_kv x (d / 2 + 2 x d / G)           (two codes a byte, an fp16 scale per
                                                        group of G channels: the largest power
                                                        of two dividing d, at most 32)
    L=32, h_kv=8, d=128: int4 36,864 B/token = 3.56x fewer than fp16's 131,072
    L=32, h_kv=8, d=128, fp16 -> 131,072 B/token (128.0 KiB); 4,096 tokens -> 0.500 GiB

    KV budget = device_gib x utilization - weights_gib - reserved_gib
    24 x 1.0 - 13.04 - 2 = 8.96 GiB -> 8.96 GiB // 128 KiB = 73,400 tokens
                                    -> 8.96 GiB // (0.5 GiB per 4,096-token request) = 17

`utilization` is the share of the device the server may plan to use at all (vLLM's
gpu_memory_utilization, our cache.gpu_memory_utilization). The articles' rough plan uses the
whole device and models the margin as `reserved_gib` (utilization 1.0 reproduces their 8.96
GiB); their production advice "plan to at most ~80%" is utilization 0.8 on top of that.

Block-granular allocation: a request of S tokens holds K x ceil(S / K) slots (K = block
size), so the pool is counted in whole blocks: num_blocks = budget // (K x bytes_per_token).

GiB = 2**30 bytes. Budgets given in GiB are read as the decimal numbers typed (13.04 is
13.04, not the nearest binary float) so the worked examples come out exactly.

The engine sizes its real cache with `kv_bytes_per_token` and `num_blocks_for_budget`;
its allocated tensors must match `kv_bytes_per_token` byte for byte (tests/test_capacity.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from kvmesh.core.config import ConfigError

log = logging.getLogger(__name__)

GIB = 2**30
KIB = 2**10

# Bytes per stored KV element.
KV_DTYPE_BYTES = {"fp32": Fraction(4), "fp16": Fraction(2), "bf16": Fraction(2), "fp8": Fraction(1),
                  "int8": Fraction(1), "int4": Fraction(1, 2)}
QUANTIZED_KV_DTYPES = ("fp8", "int8", "int4")
KV_SCALE_BYTES = 2  # fp16 scale per token per KV head (int4: per group), for K and for V (quant/kv_quant.py)
# int4 KV scale group: the largest power of two dividing head_dim, at most this (quant/
# kv_quant.py's rule, restated so this module stays torch-free; tests hold the two equal).
KV_INT4_GROUP_SIZE = 32

# Bytes per weight element; int4 packs two per byte.
WEIGHT_DTYPE_BYTES = {"fp32": Fraction(4), "fp16": Fraction(2), "bf16": Fraction(2),
                      "int8": Fraction(1), "int4": Fraction(1, 2)}
QUANTIZED_WEIGHT_DTYPES = ("int8", "int4")
# Quantization metadata (int8 per-channel scales, int4 group scales and zero points) is kept
# in the 16-bit serving dtype, as quant/linear.py stores it next to bf16/fp16 activations.
WEIGHT_METADATA_BYTES = 2
# Unquantized tensors of a quantized model (embeddings, lm_head, norms) stay 16-bit.
UNQUANTIZED_WEIGHT_BYTES = 2
# quant.weight gguf (a GGUF served in its own quantization, quant/gguf_layouts.py): bytes per
# group of 32 weights in kvmesh's layers, (codes, metadata): Q8_0 int8 codes + an fp16 scale;
# Q4_0 nibbles + fp16 scale and zero; Q4_1 + an fp16 min; Q4_K fp32 scale and min (the
# products of its super-block and sub-block scales) + an fp16 zero. Restated here so this
# module stays torch-free; tests/test_gguf_kept.py holds it to a loaded model's bytes.
GGUF_KEPT_GROUP_BYTES = {"Q8_0": (32, 2), "Q4_0": (16, 4), "Q4_1": (16, 6), "Q4_K": (16, 10)}
GGUF_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# A Q8_0 token table is kept as its int8 codes + one fp32 scale a group (the native step reads
# fp32 scales in place; quant/int8_group_table.py), for the embedding and a tied head alike.
GGUF_KEPT_TABLE_GROUP_BYTES = {"Q8_0": (32, 4)}


@dataclass(frozen=True)
class ModelShape:
    """What the capacity model needs to know about a decoder-only (Llama-family) model.

    Optional fields refine the weight estimate: with hidden, intermediate, heads and vocab
    known, the projection matrices are counted exactly (so quantization metadata and the
    unquantized embeddings are exact); with only `num_params`, every parameter is treated
    as quantizable and per-channel rows are approximated as num_params / hidden_size.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int | None = None
    num_heads: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    tie_word_embeddings: bool = False
    num_params: int | None = None
    source: str = "flags"
    # A GGUF's projections as quant.weight gguf keeps them: (params, code bytes, metadata
    # bytes), or the first tensor whose type it cannot keep (then --weight-dtype gguf refuses)
    gguf_projections: tuple[int, int, int] | str | None = None

    def validate(self) -> "ModelShape":
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("hidden_size", "num_heads", "intermediate_size", "vocab_size", "num_params"):
            value = getattr(self, name)
            _require(value is None or value >= 1, f"{name} must be >= 1, got {value}")
        if self.num_heads is not None:
            _require(self.num_heads % self.num_kv_heads == 0,
                     f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        return self

    @property
    def linear_shapes(self) -> list[tuple[int, int]] | None:
        """(out_features, in_features) of every quantizable projection, or None if unknown."""
        h, heads, inter = self.hidden_size, self.num_heads, self.intermediate_size
        if h is None or heads is None or inter is None:
            return None
        q_dim, kv_dim = heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = [(q_dim, h), (kv_dim, h), (kv_dim, h), (h, q_dim),  # q k v o
                     (inter, h), (inter, h), (h, inter)]  # gate up down
        return per_layer * self.num_layers

    @property
    def total_params(self) -> int | None:
        """num_params if given, else counted from the Llama layout (linears, embeddings, norms)."""
        if self.num_params is not None:
            return self.num_params
        shapes = self.linear_shapes
        if shapes is None or self.vocab_size is None:
            return None
        h = self.hidden_size
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        norms = (2 * self.num_layers + 1) * h
        return sum(o * i for o, i in shapes) + embeddings + norms


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


# ---- the per-token and per-request arithmetic -------------------------------------------


def kv_int4_scale_groups(head_dim: int) -> int:
    """fp16 scales per int4 token-head: d / G, G the largest power of two dividing d, <= 32."""
    _require(head_dim >= 2 and head_dim % 2 == 0, f"int4 KV needs an even head dim, got {head_dim}")
    return head_dim // min(KV_INT4_GROUP_SIZE, head_dim & -head_dim)


def kv_scale_bytes_per_token(num_layers: int, num_kv_heads: int, kv_dtype: str, head_dim: int | None = None) -> int:
    """Bytes of fp16 K and V scales per token: 2 x L x h_kv x 2 for int8/fp8,
    2 x L x h_kv x (d / G) x 2 for int4 (needs head_dim), else 0."""
    _require(kv_dtype in KV_DTYPE_BYTES, f"kv dtype must be one of {list(KV_DTYPE_BYTES)}, got {kv_dtype!r}")
    if kv_dtype not in QUANTIZED_KV_DTYPES:
        return 0
    scales_per_head = 1
    if kv_dtype == "int4":
        _require(head_dim is not None, "int4 KV scale bytes depend on the head dim")
        scales_per_head = kv_int4_scale_groups(head_dim)
    return 2 * num_layers * num_kv_heads * scales_per_head * KV_SCALE_BYTES


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    """KV cache bytes one token occupies across all layers: 2 x L x h_kv x d x b, plus the
    per-token per-head fp16 scales when the cache is quantized (int8 / fp8; per group for int4,
    whose two-codes-a-byte payload needs an even d)."""
    _require(kv_dtype in KV_DTYPE_BYTES, f"kv dtype must be one of {list(KV_DTYPE_BYTES)}, got {kv_dtype!r}")
    _require(num_layers >= 1 and num_kv_heads >= 1 and head_dim >= 1,
             f"layers, kv heads and head dim must be >= 1, got {num_layers}, {num_kv_heads}, {head_dim}")
    scales = kv_scale_bytes_per_token(num_layers, num_kv_heads, kv_dtype, head_dim)  # validates int4's d
    payload = 2 * num_layers * num_kv_heads * head_dim * KV_DTYPE_BYTES[kv_dtype]
    return int(payload) + scales


def block_granular_tokens(num_tokens: int, block_size: int) -> int:
    """Slots a request of `num_tokens` holds under paged allocation: K x ceil(S / K)."""
    _require(block_size >= 1, f"block size must be >= 1, got {block_size}")
    return block_size * math.ceil(num_tokens / block_size)


def num_blocks_for_budget(budget_bytes: int, block_size: int, bytes_per_token: int) -> int:
    """Whole KV blocks that fit in `budget_bytes` (0 when the budget is negative or tiny)."""
    _require(block_size >= 1 and bytes_per_token >= 1, "block size and bytes per token must be >= 1")
    return max(0, int(budget_bytes)) // (block_size * bytes_per_token)


@dataclass(frozen=True)
class WeightEstimate:
    quantized_params: int
    unquantized_params: int
    payload_bytes: int  # the weights themselves (int4: half a byte each)
    metadata_bytes: int  # int8 per-channel scales; int4 group scales + zero points

    @property
    def total_bytes(self) -> int:
        return self.payload_bytes + self.metadata_bytes


def estimate_weight_bytes(shape: ModelShape, weight_dtype: str, group_size: int = 128) -> WeightEstimate:
    """Weight memory: params x bytes (fp16 2, int8 1, int4 0.5) plus quantization metadata.

    int8: one scale per output channel; int4: a scale and a zero point per group of
    `group_size` input weights. Embeddings, lm_head and norms stay 16-bit when the shape
    says how many there are."""
    if weight_dtype == "gguf":
        return _gguf_kept_weight_bytes(shape)
    _require(weight_dtype in WEIGHT_DTYPE_BYTES,
             f"weight dtype must be one of {list(WEIGHT_DTYPE_BYTES) + ['gguf']}, got {weight_dtype!r}")
    _require(group_size >= 1, f"group size must be >= 1, got {group_size}")
    total = shape.total_params
    _require(total is not None, "cannot size the weights: give --params, a model with a full config, "
                                "or --weights-gib")
    per_elem = WEIGHT_DTYPE_BYTES[weight_dtype]
    if weight_dtype not in QUANTIZED_WEIGHT_DTYPES:
        return WeightEstimate(0, total, math.ceil(total * per_elem), 0)
    shapes = shape.linear_shapes
    if shapes is not None and sum(o * i for o, i in shapes) <= total:
        quantized = sum(o * i for o, i in shapes)
        rows = sum(o for o, _ in shapes)
        for out_f, in_f in shapes:
            _require(weight_dtype != "int4" or in_f % group_size == 0,
                     f"group size {group_size} does not divide in_features {in_f}")
    else:  # only a parameter count: all of it quantized, rows ~ params / hidden
        quantized = total
        rows = math.ceil(total / shape.hidden_size) if shape.hidden_size else 0
        log.debug("weight estimate from a bare parameter count: metadata is approximate")
    if weight_dtype == "int8":
        metadata = rows * WEIGHT_METADATA_BYTES
    else:
        metadata = math.ceil(quantized / group_size) * 2 * WEIGHT_METADATA_BYTES  # scale + zero
    unquantized = total - quantized
    payload = math.ceil(quantized * per_elem) + unquantized * UNQUANTIZED_WEIGHT_BYTES
    return WeightEstimate(quantized, unquantized, payload, metadata)


def _gguf_kept_weight_bytes(shape: ModelShape) -> WeightEstimate:
    """quant.weight gguf: the projections (and a Q8_0 token table) in the file's own types, the rest 16-bit."""
    kept = shape.gguf_projections
    _require(kept is not None, "weight dtype gguf needs a .gguf model (--model FILE.gguf)")
    _require(not isinstance(kept, str), f"weight dtype gguf: {kept}")
    params, codes, metadata = kept
    total = shape.total_params
    _require(total is not None and total >= params, "cannot size the weights: the GGUF's parameter count is unknown")
    return WeightEstimate(params, total - params, codes + (total - params) * UNQUANTIZED_WEIGHT_BYTES, metadata)


def _gguf_projections(tensors) -> tuple[int, int, int] | str:
    params = codes = metadata = 0
    for t in tensors:
        parts = t.name.split(".")
        if t.name == "token_embd.weight" and t.tensor_type.name in GGUF_KEPT_TABLE_GROUP_BYTES:
            n = int(t.n_elements)
            code, meta = GGUF_KEPT_TABLE_GROUP_BYTES[t.tensor_type.name]
            params, codes, metadata = params + n, codes + n // 32 * code, metadata + n // 32 * meta
            continue
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in GGUF_PROJECTIONS or parts[3] != "weight":
            continue
        n, kind = int(t.n_elements), t.tensor_type.name
        params += n
        if kind in GGUF_KEPT_GROUP_BYTES:
            code, meta = GGUF_KEPT_GROUP_BYTES[kind]
            codes, metadata = codes + n // 32 * code, metadata + n // 32 * meta
        elif kind in ("F32", "F16", "BF16"):
            codes += n * UNQUANTIZED_WEIGHT_BYTES
        else:
            return f"tensor {t.name!r} is {kind}, which quant.weight gguf cannot keep"
    return params, codes, metadata


# ---- the plan -----------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceBudget:
    device_gib: float
    reserved_gib: float = 0.0  # activations, workspace, runtime, fragmentation margin
    utilization: float = 1.0  # share of the device the plan may use (see module docstring)
    weights_gib: float | None = None  # None = estimate from the model shape

    def validate(self) -> "DeviceBudget":
        _require(self.device_gib > 0, f"device GiB must be > 0, got {self.device_gib}")
        _require(self.reserved_gib >= 0, f"reserved GiB must be >= 0, got {self.reserved_gib}")
        _require(0 < self.utilization <= 1, f"utilization must be in (0, 1], got {self.utilization}")
        _require(self.weights_gib is None or self.weights_gib >= 0,
                 f"weights GiB must be >= 0, got {self.weights_gib}")
        return self


@dataclass(frozen=True)
class CapacityPlan:
    kv_dtype: str
    weight_dtype: str
    block_size: int
    context_tokens: int
    kv_bytes_per_token: int
    kv_scale_bytes_per_token: int
    kv_bytes_per_request: int  # at context_tokens, token-granular
    kv_bytes_per_request_blocks: int  # at context_tokens, whole blocks
    weight_bytes: int
    weight_metadata_bytes: int
    weights_gib: float  # as planned (given, or weight_bytes / GiB)
    device_gib: float
    reserved_gib: float
    utilization: float
    kv_budget_gib: float  # device x utilization - weights - reserved, as typed
    kv_budget_bytes: int  # floor(kv_budget_gib x GiB)
    max_kv_tokens: int  # budget // bytes per token (the articles' "total KV tokens")
    num_blocks: int
    max_kv_tokens_blocks: int  # num_blocks x block_size
    max_requests_at_context: int  # budget // per-request bytes (the articles' count)
    max_requests_at_context_blocks: int  # num_blocks // blocks per request

    @property
    def kv_gib_per_request(self) -> float:
        return self.kv_bytes_per_request / GIB

    def to_dict(self) -> dict:
        data = {k: getattr(self, k) for k in self.__dataclass_fields__}
        data.update(kv_gib_per_request=self.kv_gib_per_request,
                    kv_kib_per_token=self.kv_bytes_per_token / KIB)
        return data


def _exact(value: float) -> Fraction:
    """The decimal number as typed: 13.04 -> 1304/100, not the binary float's expansion."""
    return Fraction(repr(float(value)))


def plan_capacity(shape: ModelShape, budget: DeviceBudget, *, kv_dtype: str = "fp16",
                  weight_dtype: str = "fp16", group_size: int = 128, context_tokens: int = 4096,
                  block_size: int = 16) -> CapacityPlan:
    shape.validate()
    budget.validate()
    _require(context_tokens >= 1, f"context must be >= 1 token, got {context_tokens}")
    _require(block_size >= 1, f"block size must be >= 1, got {block_size}")
    per_token = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, kv_dtype)
    scales = kv_scale_bytes_per_token(shape.num_layers, shape.num_kv_heads, kv_dtype, shape.head_dim)
    if budget.weights_gib is not None:
        weights = None
        weights_gib = _exact(budget.weights_gib)
    else:
        weights = estimate_weight_bytes(shape, weight_dtype, group_size)
        weights_gib = Fraction(weights.total_bytes, GIB)
    planned_gib = _exact(budget.device_gib) * _exact(budget.utilization)
    kv_budget_gib = planned_gib - weights_gib - _exact(budget.reserved_gib)
    _require(kv_budget_gib > 0,
             f"no memory left for the KV cache: device {budget.device_gib} GiB x utilization "
             f"{budget.utilization} - weights {float(weights_gib):.2f} GiB - reserved "
             f"{budget.reserved_gib} GiB = {float(kv_budget_gib):.2f} GiB")
    kv_budget = math.floor(kv_budget_gib * GIB)
    per_request = per_token * context_tokens
    blocks_per_request = block_granular_tokens(context_tokens, block_size) // block_size
    num_blocks = num_blocks_for_budget(kv_budget, block_size, per_token)
    return CapacityPlan(
        kv_dtype=kv_dtype, weight_dtype=weight_dtype, block_size=block_size,
        context_tokens=context_tokens, kv_bytes_per_token=per_token, kv_scale_bytes_per_token=scales,
        kv_bytes_per_request=per_request,
        kv_bytes_per_request_blocks=blocks_per_request * block_size * per_token,
        weight_bytes=weights.total_bytes if weights else math.floor(weights_gib * GIB),
        weight_metadata_bytes=weights.metadata_bytes if weights else 0,
        weights_gib=float(weights_gib), device_gib=budget.device_gib, reserved_gib=budget.reserved_gib,
        utilization=budget.utilization, kv_budget_gib=float(kv_budget_gib), kv_budget_bytes=kv_budget,
        max_kv_tokens=kv_budget // per_token, num_blocks=num_blocks,
        max_kv_tokens_blocks=num_blocks * block_size,
        max_requests_at_context=kv_budget // per_request,
        max_requests_at_context_blocks=num_blocks // blocks_per_request)


# ---- reading a model's shape ----------------------------------------------------------------


def shape_from_hf_config(config: dict, source: str = "config.json") -> ModelShape:
    """Llama-family HF config.json fields -> ModelShape (head_dim defaults to hidden / heads)."""
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        layers = int(config["num_hidden_layers"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: missing or bad field {exc}") from None
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter = config.get("intermediate_size")
    vocab = config.get("vocab_size")
    return ModelShape(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, hidden_size=hidden,
                      num_heads=heads, intermediate_size=int(inter) if inter else None,
                      vocab_size=int(vocab) if vocab else None,
                      tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                      source=source).validate()


def shape_from_gguf(path: str | os.PathLike) -> ModelShape:
    """GGUF metadata ({arch}.block_count, head_count_kv, ...) and tensor sizes -> ModelShape."""
    import gguf  # the GGUF reader; imported here so plain flag use never needs it

    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable GGUF file ({exc})") from None

    def field(key: str):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    arch = field("general.architecture")
    _require(arch is not None, f"{path}: GGUF metadata has no general.architecture")
    layers, heads = field(f"{arch}.block_count"), field(f"{arch}.attention.head_count")
    hidden = field(f"{arch}.embedding_length")
    _require(None not in (layers, heads, hidden), f"{path}: GGUF metadata lacks {arch}.block_count/"
                                                  f"attention.head_count/embedding_length")
    kv_heads = field(f"{arch}.attention.head_count_kv") or heads
    head_dim = field(f"{arch}.attention.key_length") or hidden // heads
    vocab = field(f"{arch}.vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in reader.fields:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    names = {t.name for t in reader.tensors}
    return ModelShape(num_layers=int(layers), num_kv_heads=int(kv_heads), head_dim=int(head_dim),
                      hidden_size=int(hidden), num_heads=int(heads),
                      intermediate_size=int(field(f"{arch}.feed_forward_length") or 0) or None,
                      vocab_size=int(vocab) if vocab else None,
                      tie_word_embeddings="output.weight" not in names,
                      num_params=int(sum(int(t.n_elements) for t in reader.tensors)),
                      source=str(path), gguf_projections=_gguf_projections(reader.tensors)).validate()


def load_model_shape(path: str | os.PathLike) -> ModelShape:
    """A HF model folder (config.json), a config.json itself, or a .gguf file."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return shape_from_gguf(p)
    config_path = p / "config.json" if p.is_dir() else p
    _require(config_path.is_file(), f"{path}: expected a .gguf file or a folder with config.json")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{config_path}: cannot read JSON ({exc})") from None
    _require(isinstance(config, dict), f"{config_path}: top level must be an object")
    return shape_from_hf_config(config, source=str(config_path))
