"""Llama-family decoder over a flat, unpadded token batch with a paged KV cache.

Module and parameter names mirror Hugging Face's LlamaForCausalLM
(`model.layers.N.self_attn.q_proj`, `model.layers.N.mlp.gate_proj`, ...), so a HF
state dict loads as is and weight-only quantization (quant/) finds the projections by name.
RoPE tables come from transformers' own rotary embedding for the config (rope_theta and any
rope scaling), so positions encode exactly as in the reference implementation.

Tensor parallelism (worker/parallel/layers.py): given a `Collectives` of world size N, each
rank builds the shard-shaped layers, attention runs on its local heads (Hq / N query heads,
max(1, Hkv / N) KV heads) and the block output is all-reduced after o_proj and down_proj.
At world size 1 every layer is the full nn.Linear / nn.Embedding and the all-reduce is a
no-op, so the single-rank forward is the one it always was.

Shapes: T = tokens in the step (all requests, flat), H = hidden size, Hq / Hkv = query / KV
heads (local to this rank under tensor parallelism), D = head_dim, V = vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.worker.kernels import dispatch as ops  # Triton on CUDA, torch elsewhere: decided there
from kvmesh.worker.attention.backend import AttentionBackend, AttentionMetadata, LayerKVCache
from kvmesh.worker.parallel.distributed import Collectives, single_rank
from kvmesh.quant.linear import merge_output_rows
from kvmesh.worker.kernels import packed_weights
from kvmesh.worker.kernels.lora_ops import LoraStep
from kvmesh.worker.parallel.layers import (ColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                                           RowParallelLinear, VocabParallelEmbedding, _ShardedLinear,
                                           quantize_sharded)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As HF: normalise in fp32, cast back, then scale (worker/kernels/torch_ops.py).
        return ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): one fused kernel on the Triton path."""
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class RotaryTables(nn.Module):
    """cos/sin per position, [max_positions, D] fp32, from transformers' rotary module.

    HF rotates as x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1). Here the
    sign is folded into the table once (sin_signed = cat(-sin1, sin2)) and rotate_half becomes
    a roll: roll(x) * sin_signed = cat(x2 * -sin1, x1 * sin2), the same products bit for bit
    (IEEE negation is exact), in 4 ops instead of 7, for q and k heads together."""

    def __init__(self, hf_config, max_positions: int):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rope = LlamaRotaryEmbedding(config=hf_config)  # signature differs across versions; config= works in all
        probe = torch.zeros(1, dtype=torch.float32)
        positions = torch.arange(max_positions, dtype=torch.long)[None, :]
        cos, sin = rope(probe, positions)  # [1, P, D]
        half = sin.shape[-1] // 2
        sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        self.register_buffer("cos", cos[0].to(torch.float32), persistent=False)
        self.register_buffer("sin_signed", sin_signed[0].to(torch.float32), persistent=False)

    def for_positions(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> (cos, sin_signed) [T, 1, D] in dtype; looked up once per step, used by every layer."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin_signed[positions].to(dtype)[:, None, :]

    @staticmethod
    def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [T, heads, D] (q and k heads side by side) -> rotated, a new contiguous tensor."""
        cos, sin_signed = cos_sin
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed


class FusedLinears:
    """Float projections of the same input run as ONE GEMM (merged QKV, merged gate-up), with
    the merged weight optionally prepacked for oneDNN (bf16 on CPU, see packed_weights.py).

    The weights are concatenated once and each member's parameter becomes a view of its rows
    of the concatenation, so parameter names, the state dict, weight loaders and tensor-
    parallel shards stay exactly as they were (each rank fuses its own shards). A group of
    one member keeps the member's own weight (it exists for the prepacking). `usable` says
    whether the fusion still describes the members: a member replaced (quantization), moved
    or recast (`.to()` gives new storage) or hooked (calibration) makes the caller run the
    members one by one, as before."""

    def __init__(self, linears: list[nn.Linear], prepack: bool = False):
        self.members = tuple(linears)
        self.sizes = [lin.out_features for lin in linears]
        with torch.no_grad():
            if len(linears) == 1:
                self.weight, self.bias = linears[0].weight.detach(), linears[0].bias
                self.bias = None if self.bias is None else self.bias.detach()
            else:
                self.weight = torch.cat([lin.weight.detach() for lin in linears])
                has_bias = [lin.bias is not None for lin in linears]
                self.bias = torch.cat([lin.bias.detach() for lin in linears]) if all(has_bias) else None
                start = 0
                for lin, n in zip(linears, self.sizes):
                    lin.weight.data = self.weight[start:start + n]
                    if self.bias is not None:
                        lin.bias.data = self.bias[start:start + n]
                    start += n
        self.packed = packed_weights.PackedWeight.pack(self.weight) if prepack else None

    @staticmethod
    def fusable(linears: list[nn.Module]) -> bool:
        first = linears[0]
        return all(type(lin) is type(first) and isinstance(lin, nn.Linear) for lin in linears) and \
            len({(lin.weight.dtype, lin.weight.device, lin.in_features, lin.bias is None) for lin in linears}) == 1

    def usable(self, linears: tuple[nn.Module, ...]) -> bool:
        return all(a is b and not (a._forward_hooks or a._forward_pre_hooks) for a, b in zip(linears, self.members)) \
            and linears[0].weight.data_ptr() == self.weight.data_ptr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return packed_weights.linear(x, self.weight, self.bias, self.packed)


class FusedQuantLinears:
    """Weight-only quantized projections of the same input (int8 / int4) run as ONE packed-
    kernel call: quant.linear.merge_output_rows concatenates their rows and makes the members'
    buffers views of the merged layer's, so nothing is stored twice. Same interface as
    FusedLinears (members, usable, call)."""

    def __init__(self, merged: nn.Module, linears: list[nn.Module]):
        self.members = tuple(linears)
        self.merged = merged

    @classmethod
    def build(cls, linears: list[nn.Module]) -> "FusedQuantLinears | None":
        merged = merge_output_rows(linears)
        return None if merged is None else cls(merged, linears)

    def usable(self, linears: tuple[nn.Module, ...]) -> bool:
        return all(a is b and not (a._forward_hooks or a._forward_pre_hooks) for a, b in zip(linears, self.members)) \
            and linears[0].scales.data_ptr() == self.merged.scales.data_ptr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.merged(x)


def _run_projection(fused: FusedLinears | None, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One projection, through its prepacked FusedLinears while that still describes it."""
    return fused(x) if fused is not None and fused.usable((linear,)) else linear(x)


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
        self.qkv: FusedLinears | FusedQuantLinears | None = None  # set by fuse_projections once the weights are final
        self.o: FusedLinears | None = None  # o_proj alone, prepacked (fuse_projections)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], cache: LayerKVCache,
                meta: AttentionMetadata, backend: AttentionBackend, lora: LoraStep | None = None) -> torch.Tensor:
        t, nq, nkv = x.shape[0], self.num_heads, self.num_kv_heads
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if self.qkv is not None and self.qkv.usable(projections):
            qkv = self.qkv(x)
        else:  # unfused (hooked, replaced): one concatenation, so the rest is the same
            qkv = torch.cat([lin(x) for lin in projections], dim=-1)
        if lora is not None:  # the base GEMM ran once for every row; each adapter row adds its update
            lora.add_fused(self.layer_idx, ("q_proj", "k_proj", "v_proj"),
                           [nq * self.head_dim, nkv * self.head_dim, nkv * self.head_dim], x, qkv)
        qkv = qkv.view(t, nq + 2 * nkv, self.head_dim)  # q | k | v heads
        qk = RotaryTables.rotate(qkv[:, :nq + nkv], cos_sin)  # q and k heads in one pass
        q, k, v = qk[:, :nq], qk[:, nq:], qkv[:, nq + nkv:]  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        backend.write_kv(cache, k, v, meta.slot_mapping)
        out = backend.attend(q, cache, meta, self.scale).reshape(t, -1)  # [T, Hq * D]
        y = _run_projection(self.o, self.o_proj, out)
        if lora is not None:
            lora.add(self.layer_idx, "o_proj", out, y)
        return self.coll.all_reduce(y)


class LlamaMLP(nn.Module):
    def __init__(self, cfg, coll: Collectives, layer_idx: int = 0):
        super().__init__()
        self.coll = coll
        self.layer_idx = layer_idx
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, bias, coll)
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, bias, coll)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias, coll)
        self.gate_up: FusedLinears | FusedQuantLinears | None = None  # set by fuse_projections
        self.down: FusedLinears | None = None  # down_proj alone, prepacked (fuse_projections)

    def forward(self, x: torch.Tensor, lora: LoraStep | None = None) -> torch.Tensor:
        pair = (self.gate_proj, self.up_proj)
        if self.gate_up is not None and self.gate_up.usable(pair):
            gate_up = self.gate_up(x)
            if lora is not None:
                half = gate_up.shape[-1] // 2
                lora.add_fused(self.layer_idx, ("gate_proj", "up_proj"), [half, half], x, gate_up)
            act = ops.silu_and_mul(gate_up)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
            if lora is not None:
                lora.add(self.layer_idx, "gate_proj", x, gate)
                lora.add(self.layer_idx, "up_proj", x, up)
            act = ops.silu_mul(gate, up)
        y = _run_projection(self.down, self.down_proj, act)
        if lora is not None:
            lora.add(self.layer_idx, "down_proj", act, y)
        return self.coll.all_reduce(y)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, coll: Collectives):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, coll)
        self.mlp = LlamaMLP(cfg, coll, layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos_sin, cache, meta, backend, lora=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's MLP output, the residual stream before it); the
        residual add is fused into the next RMSNorm, rounding as HF's x = x + f(norm(x))."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, cos_sin, cache, meta, backend, lora)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h, lora), residual


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
        # model.compile decode: the layer stack as one inductor-compiled function for steps it
        # applies to (worker/runner/compiled_forward.py, installed by model_setup); None = eager
        self.compiled = None

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank caches (all of them at world size 1)."""
        return self.model.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.model.layers[0].self_attn.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKVCache],
                meta: AttentionMetadata, backend: AttentionBackend, lora: LoraStep | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, H] (pre lm_head). `lora`: the
        step's adapter rows (worker/kernels/lora_ops.py); such a step always runs eagerly."""
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.rotary.for_positions(positions, x.dtype)
        if lora is None and self.compiled is not None and self.compiled.applies(x.shape[0]):
            return self.compiled.run(x, cos_sin, kv_caches, meta, backend)
        residual = None
        for layer, cache in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, cos_sin, cache, meta, backend, lora)
        return self.model.norm.add_forward(x, residual)[0]

    def fuse_projections(self, prepack: bool = True) -> int:
        """Merge each layer's q/k/v and gate/up projections into one GEMM each (float: see
        FusedLinears; int8 / int4: FusedQuantLinears). With `prepack`, bf16 CPU weights
        (the merged ones, o_proj, down_proj and the LM head) also get their oneDNN layout
        (packed_weights.py). Call once the weights are final (after loading, quantization and
        the last `.to()`). Returns how many groups fused."""
        fused = 0
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for owner, attr, group in ((attn, "qkv", [attn.q_proj, attn.k_proj, attn.v_proj]),
                                       (mlp, "gate_up", [mlp.gate_proj, mlp.up_proj])):
                merged = FusedLinears(group, prepack) if FusedLinears.fusable(group) else FusedQuantLinears.build(group)
                if merged is not None:
                    setattr(owner, attr, merged)
                    fused += 1
            for owner, attr, lin in ((attn, "o", attn.o_proj), (mlp, "down", mlp.down_proj)):
                if prepack and FusedLinears.fusable([lin]) and packed_weights.can_pack(lin.weight):
                    setattr(owner, attr, FusedLinears([lin], prepack))
        if prepack:
            self.lm_head.packed = packed_weights.PackedWeight.pack(self.lm_head.weight)
        return fused

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
