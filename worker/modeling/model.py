"""Llama-family decoder over a flat, unpadded token batch with a paged KV cache.

Module and parameter names mirror Hugging Face's LlamaForCausalLM
(`model.layers.N.self_attn.q_proj`, `model.layers.N.mlp.gate_proj`, ...), so a HF
state dict loads as is and weight-only quantization (quant/) finds the projections by name.
RoPE tables come from transformers' own rotary embedding for the config (rope_theta and any
rope scaling), so positions encode exactly as in the reference implementation.

Tensor parallelism (worker/modeling/parallel_layers.py): given a `Collectives` of world size N, each
rank builds the shard-shaped layers, attention runs on its local heads (Hq / N query heads,
max(1, Hkv / N) KV heads) and the block output is all-reduced after o_proj and down_proj.
At world size 1 every layer is the full nn.Linear / nn.Embedding and the all-reduce is a
no-op, so the single-rank forward is the one it always was.

Shapes: T = tokens in the step (all requests, flat), H = hidden size, Hq / Hkv = query / KV
heads (local to this rank under tensor parallelism), D = head_dim, V = vocab.
"""

from __future__ import annotations

import torch
from torch import nn

from kvmesh.worker.modeling import kernel_dispatch as ops  # Triton on CUDA, torch elsewhere: decided there
from kvmesh.worker.modeling.attention import AttentionBackend, AttentionMetadata, LayerKVCache
from kvmesh.worker.modeling.distributed import Collectives, single_rank
from kvmesh.worker.modeling.parallel_layers import (ColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                                           RowParallelLinear, VocabParallelEmbedding, _ShardedLinear,
                                           quantize_sharded)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As HF: normalise in fp32, cast back, then scale (worker/modeling/torch_ops.py).
        return ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (self(x + residual), x + residual): one fused kernel on the Triton path."""
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryTables(nn.Module):
    """cos/sin per position, [max_positions, D] fp32, from transformers' rotary module."""

    def __init__(self, hf_config, max_positions: int):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rope = LlamaRotaryEmbedding(config=hf_config)  # signature differs across versions; config= works in all
        probe = torch.zeros(1, dtype=torch.float32)
        positions = torch.arange(max_positions, dtype=torch.long)[None, :]
        cos, sin = rope(probe, positions)  # [1, P, D]
        self.register_buffer("cos", cos[0].to(torch.float32), persistent=False)
        self.register_buffer("sin", sin[0].to(torch.float32), persistent=False)

    def apply(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, Hq, D], k: [T, Hkv, D], positions: [T]
        cos = self.cos[positions].to(q.dtype)[:, None, :]  # [T, 1, D]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int, coll: Collectives):
        super().__init__()
        self.layer_idx = layer_idx
        self.coll = coll
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim ** -0.5
        bias = bool(getattr(cfg, "attention_bias", False))
        h, d = cfg.hidden_size, self.head_dim
        self.q_proj = QKVParallelLinear(h, cfg.num_attention_heads, d, bias, coll, "query")
        self.k_proj = QKVParallelLinear(h, cfg.num_key_value_heads, d, bias, coll, "KV")
        self.v_proj = QKVParallelLinear(h, cfg.num_key_value_heads, d, bias, coll, "KV")
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, h, bias, coll)
        self.num_heads = self.q_proj.num_local_heads  # this rank's
        self.num_kv_heads = self.k_proj.num_local_heads

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryTables, cache: LayerKVCache,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, -1, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(t, -1, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(t, -1, self.head_dim)
        q, k = rotary.apply(q, k, positions)
        backend.write_kv(cache, k, v, meta.slot_mapping)
        out = backend.attend(q, cache, meta, self.scale)  # [T, Hq, D]
        return self.coll.all_reduce(self.o_proj(out.reshape(t, -1)))


class LlamaMLP(nn.Module):
    def __init__(self, cfg, coll: Collectives):
        super().__init__()
        self.coll = coll
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, bias, coll)
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, bias, coll)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias, coll)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.coll.all_reduce(self.down_proj(ops.silu_mul(self.gate_proj(x), self.up_proj(x))))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, coll: Collectives):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, coll)
        self.mlp = LlamaMLP(cfg, coll)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, rotary, cache, meta, backend):
        attn = self.self_attn(self.input_layernorm(x), positions, rotary, cache, meta, backend)
        normed, x = self.post_attention_layernorm.add_and_norm(attn, x)
        return x + self.mlp(normed)


class LlamaModel(nn.Module):
    def __init__(self, cfg, coll: Collectives, vocab_parallel: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, coll, vocab_parallel)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, coll) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg, max_positions: int, coll: Collectives | None = None, vocab_parallel: bool = True):
        super().__init__()
        self.config = cfg
        self.coll = coll or single_rank()
        self.model = LlamaModel(cfg, self.coll, vocab_parallel)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, self.coll, vocab_parallel)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryTables(cfg, max_positions)

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank caches (all of them at world size 1)."""
        return self.model.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.model.layers[0].self_attn.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKVCache],
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, H] (pre lm_head)."""
        x = self.model.embed_tokens(input_ids)
        for layer, cache in zip(self.model.layers, kv_caches):
            x = layer(x, positions, self.rotary, cache, meta, backend)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, V] in fp32 (sampling and logprobs want fp32)."""
        return self.lm_head.gather_logits(self.lm_head(hidden)).to(torch.float32)

    def load_hf_state_dict(self, state: dict) -> None:
        """Full Hugging Face tensors in; each parameter's weight_loader keeps its own shard."""
        state = dict(state)
        if self.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        params = dict(self.named_parameters())  # a tied lm_head.weight appears once, as embed_tokens'
        missing = [m for m in params if m not in state]
        unexpected = [u for u in state if u not in params and "rotary_emb" not in u]
        if missing or unexpected:
            raise ValueError(f"weights do not match the model: missing={missing[:5]} unexpected={unexpected[:5]}")
        with torch.no_grad():
            for name, param in params.items():
                loader = getattr(param, "weight_loader", None)
                if loader is not None:
                    loader(param, state[name])
                else:
                    param.data.copy_(state[name])

    def install_quantized_shards(self, state: dict, quant_cfg, dtype: torch.dtype, awq=None) -> dict:
        """Tensor parallelism + weight-only quantization: quantize each full projection from
        `state` in `dtype`, keep this rank's shard (the quant layer's own `shard`), and return
        the state without those projections (load the rest with load_hf_state_dict).
        awq: int4_awq search results per module name, computed on the full model."""
        state = dict(state)
        for name, module in list(self.named_modules()):
            if not isinstance(module, _ShardedLinear):
                continue
            weight = state.pop(f"{name}.weight").to(dtype)
            bias = state.pop(f"{name}.bias", None)
            full = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
            full.weight = nn.Parameter(weight, requires_grad=False)
            if bias is not None:
                full.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
            parent, _, child = name.rpartition(".")
            found = None if awq is None else awq.get(name)
            setattr(self.get_submodule(parent), child, quantize_sharded(full, module.shard, quant_cfg, found))
        return state
