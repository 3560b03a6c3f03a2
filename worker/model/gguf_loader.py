"""A GGUF file served in its own quantization (quant.weight: gguf).

The model is built with its layer weights on the meta device (no memory), then every tensor
comes from the file through gguf's memory-mapped reader: each projection straight into the
quantized layer that holds its type exactly (quant/gguf_layouts.py: Q8_0 -> int8 groups,
Q4_0 / Q4_1 / Q4_K -> int4 groups with their scales and mins as stored), a Q8_0 token table
as its int8 groups (the embedding and the tied LM head, quant/int8_group_table.py),
the norms and other tables in the model dtype. No float copy of a kept projection exists
at any point, and the file's mapping is dropped once loaded.

Tensor names follow gguf's own HF -> GGUF map (gguf.get_tensor_name_map, as transformers and
vLLM use it). llama.cpp's converter permutes the Llama q / k rows for its RoPE layout; they
are permuted back here by whole rows, which moves quantized blocks without touching them
(transformers' LlamaTensorProcessor does the same on the dequantized floats). Architectures
other than llama are refused by name: their tensor fix-ups (Gemma's norm offset, Phi-3's
fused qkv) are not implemented for kept tensors.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kvmesh.quant import gguf_layouts
from kvmesh.worker.model.architecture import UnsupportedModelError
from kvmesh.quant.int8_group_table import Int8GroupEmbedding, Int8GroupLMHead
from kvmesh.worker.model.llama import LlamaForCausalLM
from kvmesh.worker.parallel.distributed import Collectives
from kvmesh.worker.parallel.layers import _ShardedLinear

logger = logging.getLogger(__name__)

KEPT_ARCHITECTURES = ("llama",)  # GGUF general.architecture values served quantized


def _string_field(reader, key: str) -> str | None:
    field = reader.fields.get(key)
    return None if field is None else bytes(field.parts[field.data[0]]).decode()


def int4_layers_only(path: Path) -> bool:
    """The file is of an architecture kept quantized and every matrix of its decoder blocks is a
    4-bit type (int4 groups): a model whose layers the native step can run as int4 with bf16
    products (quant.weight auto's rule for bf16 models, worker/runner/model_setup.py)."""
    import gguf  # the GGUF reader: only for .gguf models

    reader = gguf.GGUFReader(str(path))
    if _string_field(reader, "general.architecture") not in KEPT_ARCHITECTURES:
        return False
    types = {t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2}
    return bool(types) and types <= set(gguf_layouts.INT4_TYPES)


def _unpermute_rows(raw: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q / k row permutation (rows [h, d/2, 2] -> [h, 2, d/2]) on raw rows."""
    rows = raw.shape[0]
    half = rows // num_heads // 2
    return raw.reshape(num_heads, half, 2, *raw.shape[1:]).swapaxes(1, 2).reshape(raw.shape)


class GgufTensors:
    """The file's tensors by HF parameter name."""

    def __init__(self, path: Path, num_layers: int):
        import gguf

        self.reader = gguf.GGUFReader(str(path))
        self.architecture = _string_field(self.reader, "general.architecture")
        if self.architecture not in KEPT_ARCHITECTURES:
            raise UnsupportedModelError(
                f"quant.weight gguf serves GGUF architectures {', '.join(KEPT_ARCHITECTURES)}; {path.name} is "
                f"{self.architecture!r} (serve it with quant.weight: none, which dequantizes it at load)")
        arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == self.architecture)
        self.names = gguf.get_tensor_name_map(arch, num_layers)
        self.by_name = {t.name: t for t in self.reader.tensors}
        self.path = path

    def get(self, hf_name: str):
        module, _, kind = hf_name.rpartition(".")
        gguf_name = self.names.get_name(module)
        tensor = None if gguf_name is None else self.by_name.get(f"{gguf_name}.{kind}")
        if tensor is None:
            raise UnsupportedModelError(f"{self.path.name} has no tensor for {hf_name} "
                                        f"(looked for {gguf_name}.{kind})")
        return tensor

    def rows(self, hf_name: str, hf_config) -> tuple[str, str, np.ndarray]:
        """(gguf name, type name, [N, row bytes or K] rows in HF order) of a projection."""
        tensor = self.get(hf_name)
        raw = tensor.data
        if hf_name.endswith("q_proj.weight"):
            raw = _unpermute_rows(raw, hf_config.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            raw = _unpermute_rows(raw, hf_config.num_key_value_heads)
        return tensor.name, tensor.tensor_type.name, raw

    def float_tensor(self, hf_name: str) -> torch.Tensor:
        tensor = self.get(hf_name)
        return gguf_layouts.float_tensor(tensor.name, tensor.tensor_type.name, tensor.data)


def _install_projection(model: LlamaForCausalLM, name: str, module: _ShardedLinear, tensors: GgufTensors,
                        dtype: torch.dtype) -> bool:
    """One projection from the file: its quantized layer (this rank's shard of it), or for a
    float tensor its weight in the model dtype. True when the layer kept its quantization."""
    gguf_name, type_name, raw = tensors.rows(f"{name}.weight", model.config)
    bias = tensors.float_tensor(f"{name}.bias").to(dtype) if module.bias is not None else None
    if type_name in gguf_layouts.FLOAT_TYPES:
        weight = gguf_layouts.float_tensor(gguf_name, type_name, raw).to(dtype)
        _materialize(module, "weight", weight)
        if bias is not None:
            _materialize(module, "bias", bias)
        return False
    shard = module.shard
    full_shape = (module.out_features * (shard.num_shards if shard.dim == 0 else 1),
                  module.in_features * (shard.num_shards if shard.dim == 1 else 1))
    layer = gguf_layouts.quantized_linear(gguf_name, type_name, raw, raw.shape[0], bias)
    if (layer.out_features, layer.in_features) != full_shape:
        raise UnsupportedModelError(f"{gguf_name} is [{layer.out_features}, {layer.in_features}], "
                                    f"{name} needs {list(full_shape)}")
    if shard.num_shards > 1:
        layer = layer.shard(shard.dim, shard.index, shard.num_shards)
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, layer)
    return True


def _materialize(module: nn.Module, attr: str, full: torch.Tensor) -> None:
    """Replace a meta parameter with a real one holding this rank's part of `full`."""
    old = getattr(module, attr)
    new = nn.Parameter(torch.empty(old.shape, dtype=full.dtype), requires_grad=False)
    loader = getattr(old, "weight_loader", None)
    with torch.no_grad():
        if loader is not None:
            new.weight_loader = loader
            loader(new, full)
        else:
            new.copy_(full)
    setattr(module, attr, new)


def _keep_q8_0_table(model: LlamaForCausalLM, tensors: GgufTensors, dtype: torch.dtype) -> bool:
    """A Q8_0 token table stays its int8 groups (quant/int8_group_table.py): the
    embedding, and the LM head when tied, with no float copy (the embedded model's fp32 table
    was 113 MB of a ~500 MB worker). A vocabulary-parallel table keeps the float form."""
    embed = model.model.embed_tokens
    tensor = tensors.get("model.embed_tokens.weight")
    if tensor.tensor_type.name != "Q8_0" or embed.shard.num_shards != 1:
        return False
    vocab = model.config.vocab_size
    codes, scales = gguf_layouts.q8_0_groups(tensor.data, vocab)
    if tuple(codes.shape) != (embed.num_embeddings, embed.embedding_dim):
        raise UnsupportedModelError(f"{tensor.name} is {list(codes.shape)}, the model needs "
                                    f"[{embed.num_embeddings}, {embed.embedding_dim}]")
    model.model.embed_tokens = table = Int8GroupEmbedding(codes, scales, dtype)
    if model.tie_word_embeddings:
        model.lm_head = Int8GroupLMHead(table, vocab)
    return True


def load_gguf_model(path: Path, hf_config, max_model_len: int, dtype: torch.dtype, coll: Collectives | None = None,
                    vocab_parallel: bool = True) -> LlamaForCausalLM:
    tensors = GgufTensors(path, hf_config.num_hidden_layers)
    model = LlamaForCausalLM(hf_config, max_model_len, coll, vocab_parallel, meta_weights=True)
    model.cast_to(dtype)  # the real buffers; the quantized layers installed below keep the file's dtypes
    kept: dict[str, int] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, _ShardedLinear):
            if _install_projection(model, name, module, tensors, dtype):
                type_name = tensors.get(f"{name}.weight").tensor_type.name
                kept[type_name] = kept.get(type_name, 0) + 1
    table = _keep_q8_0_table(model, tensors, dtype)
    for name, param in list(model.named_parameters()):  # norms, embeddings, float projections left
        if param.is_meta:
            owner, _, attr = name.rpartition(".")
            _materialize(model.get_submodule(owner), attr, tensors.float_tensor(name).to(dtype))
    if model.tie_word_embeddings and not table:  # the table was replaced above; the head reads the same rows
        model.lm_head.weight = model.model.embed_tokens.weight
    del tensors  # closes the file's memory map
    logger.info("GGUF %s kept quantized: %s projections%s", path.name,
                ", ".join(f"{n} {t}" for t, n in sorted(kept.items())) or "no",
                ", the token table as its Q8_0 groups" + (" (also the LM head)" if model.tie_word_embeddings else "")
                if table else "")
    return model
