"""What one decoder family changes in the one decoder definition (worker/model/llama.py),
read from a Hugging Face config and validated once, at load.

The families kvmesh serves differ from Llama in a handful of switches, not in structure:

| family (model_type)    | what differs from Llama                                                    |
|------------------------|----------------------------------------------------------------------------|
| llama, mistral         | nothing (Mistral: a sliding window on every layer when its config has one) |
| qwen2 (Qwen2 / 2.5)    | q/k/v biases, always (its configs have no attention_bias field)            |
| qwen3                  | RMSNorm over each q and k head before RoPE; head_dim from the config (128) |
| phi3                   | fused qkv_proj / gate_up_proj in the checkpoint (split at load); a window  |
| gemma2                 | embeddings x sqrt(hidden), (1 + w) RMSNorm, GeGLU (tanh GELU), norms before |
|                        | and after attention and MLP, scale query_pre_attn_scalar^-0.5, attention   |
|                        | and final logit soft-capping, sliding-window layers (layer_types)          |
| gemma3_text            | Gemma 2's, minus soft-capping of attention, plus q/k norms and a second    |
|                        | RoPE base for the sliding layers (rope_parameters["sliding_attention"])    |

Anything a config asks for that is not implemented here (a RoPE type whose tables change
with the sequence length, partial rotary, bidirectional attention, a layer type other than
full / sliding attention) is refused with `UnsupportedModelError` naming it: a model served
wrong is worse than one not served.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.core.config import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
# RoPE types whose cos/sin tables are fixed per position, so one precomputed table is exact
# ("dynamic" and "longrope" rescale with the running sequence length: refused).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_GEMMA = ("gemma2", "gemma3_text")
# HF activation names -> ours: the gate's activation in act(gate) * up
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


class UnsupportedModelError(ConfigError):
    """The checkpoint's config asks for something kvmesh does not implement (named in the message)."""


@dataclass(frozen=True)
class Architecture:
    model_type: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # RMSNorm over each q / k head (head_dim wide) before RoPE
    norm_offset: float  # 0: w * norm(x) (Llama); 1: (1 + w) * norm(x), all in fp32 (Gemma)
    embed_scale: float | None  # embeddings multiplied by this (Gemma: sqrt(hidden)), None = 1
    activation: str  # "silu" | "gelu_tanh": act(gate) * up
    sandwich_norms: bool  # Gemma: post-attention, pre- and post-feedforward norms
    attn_scale: float  # softmax scale of q . k
    attn_logit_softcap: float | None  # scores -> cap * tanh(scores / cap) before the mask
    final_logit_softcap: float | None  # logits -> cap * tanh(logits / cap)
    sliding_windows: tuple[int | None, ...]  # per layer: a query at p sees positions > p - window
    local_rope_layers: tuple[bool, ...]  # per layer: RoPE from the config's sliding-attention base
    fused_checkpoint: bool  # Phi-3: qkv_proj / gate_up_proj stored fused, split at load

    @property
    def windowed(self) -> bool:
        return any(w is not None for w in self.sliding_windows)

    def llama_shaped_refusal(self) -> str | None:
        """Why a path that implements only Llama's layer (the native C step, the compiled
        stack) cannot run this model, naming the first feature it lacks; None = it can."""
        wants = [("q/k/v or o biases", self.qkv_bias or self.o_bias or self.mlp_bias),
                 ("q/k head norms", self.qk_norm), ("(1 + w) RMSNorm", self.norm_offset != 0.0),
                 ("scaled embeddings", self.embed_scale is not None),
                 (f"{self.activation} activation", self.activation != "silu"),
                 ("pre/post feedforward norms", self.sandwich_norms),
                 ("attention logit soft-capping", self.attn_logit_softcap is not None),
                 ("final logit soft-capping", self.final_logit_softcap is not None),
                 ("sliding-window attention", self.windowed), ("a second RoPE base", any(self.local_rope_layers))]
        missing = [name for name, present in wants if present]
        return f"{self.model_type}: {', '.join(missing)}" if missing else None

    @classmethod
    def from_hf_config(cls, cfg, max_positions: int) -> "Architecture":
        """Validated switches for `cfg`; raises UnsupportedModelError naming what is not served.
        max_positions: the served context; a window at least that long never applies."""
        model_type = getattr(cfg, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            hint = " (the multimodal Gemma 3: serve its text model, model_type gemma3_text)" \
                if model_type == "gemma3" else ""
            raise UnsupportedModelError(f"unsupported model_type {model_type!r}{hint}: kvmesh serves "
                                        f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        gemma = model_type in _GEMMA
        layers = int(cfg.num_hidden_layers)
        if getattr(cfg, "use_bidirectional_attention", False):
            raise UnsupportedModelError(f"{model_type}: bidirectional attention (kvmesh decodes causally)")
        act_name = getattr(cfg, "hidden_activation", None) if gemma else None
        act_name = act_name or getattr(cfg, "hidden_act", "silu")
        if act_name not in _ACTIVATIONS:
            raise UnsupportedModelError(f"{model_type}: activation {act_name!r} (served: {', '.join(_ACTIVATIONS)})")
        windows = _sliding_windows(cfg, model_type, layers, max_positions)
        local_rope = tuple(model_type == "gemma3_text" and t == "sliding_attention" for t in _layer_types(cfg, layers))
        _check_rope(cfg, model_type)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        return cls(
            model_type=model_type,
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            norm_offset=1.0 if gemma else 0.0,
            embed_scale=float(cfg.hidden_size) ** 0.5 if gemma else None,
            activation=_ACTIVATIONS[act_name],
            sandwich_norms=gemma,
            attn_scale=float(cfg.query_pre_attn_scalar) ** -0.5 if gemma else head_dim ** -0.5,
            # Gemma 3's attention takes no soft-capping (HF passes none to its kernels)
            attn_logit_softcap=_positive(cfg, "attn_logit_softcapping") if model_type == "gemma2" else None,
            final_logit_softcap=_positive(cfg, "final_logit_softcapping") if gemma else None,
            sliding_windows=windows,
            local_rope_layers=local_rope,
            fused_checkpoint=model_type == "phi3")


def _positive(cfg, name: str) -> float | None:
    value = getattr(cfg, name, None)
    if value is None:
        return None
    if not value > 0:
        raise UnsupportedModelError(f"{name} must be > 0 or null, got {value!r}")
    return float(value)


def _layer_types(cfg, layers: int) -> list[str]:
    types = getattr(cfg, "layer_types", None)
    return list(types) if types is not None else ["full_attention"] * layers


def _sliding_windows(cfg, model_type: str, layers: int, max_positions: int) -> tuple[int | None, ...]:
    """Per layer: HF's layer_types where the config has them (Qwen2/3, Gemma), else the one
    sliding_window on every layer (Mistral, Phi-3); a window >= max_positions is None."""
    window = getattr(cfg, "sliding_window", None)
    if model_type == "llama":  # HF's Llama has no window, whatever the config carries
        return (None,) * layers
    if getattr(cfg, "layer_types", None) is not None:
        types = _layer_types(cfg, layers)
        if len(types) != layers:
            raise UnsupportedModelError(f"{model_type}: layer_types lists {len(types)} layers, the model has {layers}")
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise UnsupportedModelError(f"{model_type}: layer type(s) {unknown} (served: full_attention, "
                                        "sliding_attention)")
        if "sliding_attention" in types and window is None:
            raise UnsupportedModelError(f"{model_type}: sliding_attention layers without a sliding_window")
        per_layer = [window if t == "sliding_attention" else None for t in types]
    else:
        per_layer = [window] * layers
    for w in per_layer:
        if w is not None and (not isinstance(w, int) or w < 1):
            raise UnsupportedModelError(f"{model_type}: sliding_window {w!r} (a positive token count expected)")
    return tuple(None if w is None or w >= max_positions else w for w in per_layer)


def _check_rope(cfg, model_type: str) -> None:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    per_type = params.values() if model_type == "gemma3_text" else [params]
    for p in per_type:
        p = p or {}
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type not in STATIC_ROPE_TYPES:
            raise UnsupportedModelError(f"{model_type}: rope type {rope_type!r} (served: {', '.join(STATIC_ROPE_TYPES)})")
        factor = p.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        if factor is not None and float(factor) != 1.0:
            raise UnsupportedModelError(f"{model_type}: partial_rotary_factor {factor} (RoPE over whole heads only)")
