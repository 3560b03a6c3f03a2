"""The decoder over a flat, unpadded token batch with a paged KV cache: Llama, and the
families that differ from it in a few switches (Mistral, Qwen2/2.5, Qwen3, Phi-3, Gemma 2,
Gemma 3 text), read from the HF config by worker/model/architecture.py, which lists them.

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

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.worker.kernels import dispatch as ops  # Triton on CUDA, torch elsewhere: decided there
from kvmesh.worker.attention.backend import AttentionBackend, AttentionMetadata, LayerKVCache
from kvmesh.worker.model.architecture import Architecture
from kvmesh.worker.parallel.distributed import Collectives, single_rank
from kvmesh.quant.linear import merge_output_rows
from kvmesh.worker.kernels import packed_weights
from kvmesh.worker.kernels.lora_ops import LoraStep
from kvmesh.worker.parallel.layers import (ColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                                           RowParallelLinear, VocabParallelEmbedding, _ShardedLinear,
                                           quantize_sharded)


class RMSNorm(nn.Module):
    """offset 0: Llama's w * norm(x); offset 1: Gemma's (1 + w) * norm(x), scaled in fp32
    before the cast back (HF's Gemma RMSNorm, whose checkpoints store w around 0)."""

    def __init__(self, hidden_size: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size) if offset == 0.0 else torch.zeros(hidden_size))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset == 0.0:
            # As HF: normalise in fp32, cast back, then scale (worker/kernels/torch_ops.py).
            return ops.rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (self.offset + self.weight.float())).type_as(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): one fused kernel on the Triton path."""
        if self.offset == 0.0:
            return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        summed = x + residual
        return self.forward(summed), summed


class RotaryTables(nn.Module):
    """cos/sin per position, [max_positions, D] fp32, from transformers' rotary module.

    HF rotates as x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1). Here the
    sign is folded into the table once (sin_signed = cat(-sin1, sin2)) and rotate_half becomes
    a roll: roll(x) * sin_signed = cat(x2 * -sin1, x1 * sin2), the same products bit for bit
    (IEEE negation is exact), in 4 ops instead of 7, for q and k heads together."""

    def __init__(self, hf_config, max_positions: int, layer_type: str | None = None):
        """layer_type: Gemma 3's RoPE per layer type ("sliding_attention" has its own base)."""
        super().__init__()
        probe = torch.zeros(1, dtype=torch.float32)
        positions = torch.arange(max_positions, dtype=torch.long)[None, :]
        if layer_type is None:
            cos, sin = llama_rope_tables(hf_config, positions)  # [1, P, D]
        else:
            from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding  # as above

            cos, sin = Gemma3RotaryEmbedding(hf_config)(probe, positions, layer_type)
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


def llama_rope_tables(hf_config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' LlamaRotaryEmbedding(config)(x, positions) in fp32 for the static RoPE
    types, computed as it does (tests/test_model_families.py holds the two equal bit for bit)
    from transformers' RoPE parameter functions alone: importing a model module pulls in
    transformers' generation code, torch._dynamo and triton, ~140 MiB of a CPU worker's
    resident memory that serving never uses."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # transformers: load time only

    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
        dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        inv_freq, scaling = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
    freqs = positions[..., None].float() * inv_freq.float()  # one product each: matmul over K = 1 is the same
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


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
    def __init__(self, cfg, layer_idx: int, coll: Collectives, arch: Architecture):
        super().__init__()
        self.layer_idx = layer_idx
        self.coll = coll
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = arch.attn_scale
        self.sliding_window = arch.sliding_windows[layer_idx]
        self.logit_softcap = arch.attn_logit_softcap
        h, d = cfg.hidden_size, self.head_dim
        self.q_proj = QKVParallelLinear(h, cfg.num_attention_heads, d, arch.qkv_bias, coll, "query")
        self.k_proj = QKVParallelLinear(h, cfg.num_key_value_heads, d, arch.qkv_bias, coll, "KV")
        self.v_proj = QKVParallelLinear(h, cfg.num_key_value_heads, d, arch.qkv_bias, coll, "KV")
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, h, arch.o_bias, coll)
        if arch.qk_norm:  # Qwen3, Gemma 3: each q / k head normalised before RoPE
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, arch.norm_offset)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, arch.norm_offset)
        else:
            self.q_norm = self.k_norm = None
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
            lora.add(self.layer_idx, "qkv", x,
                     qkv.split([nq * self.head_dim, nkv * self.head_dim, nkv * self.head_dim], dim=-1))
        qkv = qkv.view(t, nq + 2 * nkv, self.head_dim)  # q | k | v heads
        qk = qkv[:, :nq + nkv]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :nq]), self.k_norm(qk[:, nq:])), dim=1)
        qk = RotaryTables.rotate(qk, cos_sin)  # q and k heads in one pass
        q, k, v = qk[:, :nq], qk[:, nq:], qkv[:, nq + nkv:]  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        backend.write_kv(cache, k, v, meta.slot_mapping)
        out = backend.attend(q, cache, meta, self.scale, sliding_window=self.sliding_window,
                             logit_softcap=self.logit_softcap).reshape(t, -1)  # [T, Hq * D]
        y = _run_projection(self.o, self.o_proj, out)
        if lora is not None:
            lora.add(self.layer_idx, "o_proj", out, (y,))
        return self.coll.all_reduce(y)


class LlamaMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (act = SiLU), or Gemma's GeGLU (tanh GELU)."""

    def __init__(self, cfg, coll: Collectives, arch: Architecture, layer_idx: int = 0):
        super().__init__()
        self.coll = coll
        self.layer_idx = layer_idx
        self.gelu = arch.activation == "gelu_tanh"
        bias = arch.mlp_bias
        self.gate_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, bias, coll)
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, bias, coll)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias, coll)
        self.gate_up: FusedLinears | FusedQuantLinears | None = None  # set by fuse_projections
        self.down: FusedLinears | None = None  # down_proj alone, prepacked (fuse_projections)

    @staticmethod
    def _gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh") * up  # HF's gelu_pytorch_tanh

    def forward(self, x: torch.Tensor, lora: LoraStep | None = None) -> torch.Tensor:
        pair = (self.gate_proj, self.up_proj)
        if self.gate_up is not None and self.gate_up.usable(pair):
            gate_up = self.gate_up(x)
            if lora is not None:
                lora.add(self.layer_idx, "gate_up", x, gate_up.chunk(2, dim=-1))
            act = self._gelu_mul(*gate_up.chunk(2, dim=-1)) if self.gelu else ops.silu_and_mul(gate_up)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
            if lora is not None:
                lora.add(self.layer_idx, "gate_up", x, (gate, up))
            act = self._gelu_mul(gate, up) if self.gelu else ops.silu_mul(gate, up)
        y = _run_projection(self.down, self.down_proj, act)
        if lora is not None:
            lora.add(self.layer_idx, "down_proj", act, (y,))
        return self.coll.all_reduce(y)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int, coll: Collectives, arch: Architecture):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, coll, arch)
        self.mlp = LlamaMLP(cfg, coll, arch, layer_idx)
        h, eps, offset = cfg.hidden_size, cfg.rms_norm_eps, arch.norm_offset
        self.input_layernorm = RMSNorm(h, eps, offset)
        self.post_attention_layernorm = RMSNorm(h, eps, offset)
        self.sandwich = arch.sandwich_norms
        if self.sandwich:  # Gemma: norm each block's output too, then add it to the stream
            self.pre_feedforward_layernorm = RMSNorm(h, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(h, eps, offset)

    def forward(self, x, residual, cos_sin, cache, meta, backend, lora=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's MLP output, the residual stream before it); the
        residual add is fused into the next RMSNorm, rounding as HF's x = x + f(norm(x))."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, cos_sin, cache, meta, backend, lora)
        if self.sandwich:  # stream += post_attn(attn); stream += post_ff(mlp(pre_ff(stream)))
            residual = residual + self.post_attention_layernorm(h)
            return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(residual), lora)), residual
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h, lora), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg, coll: Collectives, vocab_parallel: bool, arch: Architecture):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, coll, vocab_parallel)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, coll, arch) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, arch.norm_offset)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg, max_positions: int, coll: Collectives | None = None, vocab_parallel: bool = True,
                 meta_weights: bool = False):
        """meta_weights: the layers' parameters on the meta device (no memory), for a loader
        that installs every weight itself (worker/model/gguf_loader.py: no float copy of
        projections it keeps quantized); the RoPE tables are computed either way."""
        super().__init__()
        self.config = cfg
        self.arch = Architecture.from_hf_config(cfg, max_positions)  # refuses what it does not serve
        self.coll = coll or single_rank()
        with torch.device("meta") if meta_weights else contextlib.nullcontext():
            self.model = LlamaModel(cfg, self.coll, vocab_parallel, self.arch)
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, self.coll, vocab_parallel)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        per_type = self.arch.model_type == "gemma3_text"  # RoPE parameters per layer type
        self.rotary = RotaryTables(cfg, max_positions, "full_attention" if per_type else None)
        # Gemma 3's sliding layers rotate with their own base; None elsewhere
        self.rotary_local = RotaryTables(cfg, max_positions, "sliding_attention") \
            if any(self.arch.local_rope_layers) else None
        # Gemma: embeddings x sqrt(hidden), that factor first rounded to the model dtype as HF does
        # (bf16: sqrt(2304) = 48.0 exactly, sqrt(3072) 55.43 -> 55.5); a 0-dim fp32 buffer cast by .to()
        self.register_buffer("embed_scale", None if self.arch.embed_scale is None
                             else torch.tensor(self.arch.embed_scale, dtype=torch.float32), persistent=False)
        # model.compile decode: the layer stack as one inductor-compiled function for steps it
        # applies to (worker/runner/compiled_forward.py, installed by model_setup); None = eager
        self.compiled = None

    def cast_to(self, dtype: torch.dtype) -> "LlamaForCausalLM":
        """Parameters and buffers to the model dtype; the RoPE tables stay fp32 (cast per use, like HF)."""
        self.to(dtype=dtype)
        for tables in (self.rotary, self.rotary_local):
            if tables is not None:
                tables.to(torch.float32)
        return self

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
        if self.embed_scale is not None:
            x = x * self.embed_scale.to(x.dtype)
        cos_sin = self.rotary.for_positions(positions, x.dtype)
        if lora is None and self.compiled is not None and self.compiled.applies(x.shape[0]):
            return self.compiled.run(x, cos_sin, kv_caches, meta, backend)
        local = cos_sin if self.rotary_local is None else self.rotary_local.for_positions(positions, x.dtype)
        residual = None
        for layer, cache, is_local in zip(self.model.layers, kv_caches, self.arch.local_rope_layers):
            x, residual = layer(x, residual, local if is_local else cos_sin, cache, meta, backend, lora)
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
        if prepack and isinstance(self.lm_head, ParallelLMHead):  # a kept int8 table has no float weight
            self.lm_head.packed = packed_weights.PackedWeight.pack(self.lm_head.weight)
        return fused

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> logits [N, V] in fp32 (sampling and logprobs want fp32); Gemma's
        final soft-capping in the model dtype, as HF applies it."""
        logits = self.lm_head.gather_logits(self.lm_head(hidden))
        cap = self.arch.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.to(torch.float32)

    def load_hf_state_dict(self, state: dict) -> None:
        """Full Hugging Face tensors in; each parameter's weight_loader keeps its own shard."""
        state = self.split_fused_checkpoint(state)
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

    def split_fused_checkpoint(self, state: dict) -> dict:
        """A copy of `state` with Phi-3's fused projections as the q/k/v and gate/up tensors
        this model holds (views of the stored rows, no copy): qkv_proj rows are q | k | v,
        gate_up_proj rows gate | up (HF's Phi3 chunks them so)."""
        state = dict(state)
        if not self.arch.fused_checkpoint:
            return state
        cfg = self.config
        d = self.head_dim  # the same on every rank (ranks hold whole heads)
        sizes = (cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.num_key_value_heads * d)
        for name in [n for n in state if n.endswith((".qkv_proj.weight", ".qkv_proj.bias", ".gate_up_proj.weight"))]:
            fused = state.pop(name)
            prefix, _, kind = name.rpartition(".")
            prefix = prefix.rpartition(".")[0]
            if ".qkv_proj." in name:
                parts = dict(zip(("q_proj", "k_proj", "v_proj"), fused.split(sizes)))
            else:
                parts = dict(zip(("gate_proj", "up_proj"), fused.chunk(2)))
            for proj, tensor in parts.items():
                state[f"{prefix}.{proj}.{kind}"] = tensor
        return state

    def install_quantized_shards(self, state: dict, quant_cfg, dtype: torch.dtype, awq=None) -> dict:
        """Tensor parallelism + weight-only quantization: quantize each full projection from
        `state` in `dtype`, keep this rank's shard (the quant layer's own `shard`), and return
        the state without those projections (load the rest with load_hf_state_dict).
        awq: int4_awq search results per module name, computed on the full model."""
        state = self.split_fused_checkpoint(state)
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
