"""torch.compile (inductor, CPU C++ codegen) of the decoder stack, `model.compile: decode`.

A 135M-parameter model at batch 1 spends a large share of each step on small elementwise ops
(RMSNorm's fp32 round trip, residual adds, RoPE, SiLU-and-mul: ~20 torch ops per layer, each
a Python call and a dispatcher round trip). Inductor fuses each chain between two projections
into one generated C++ loop.

Measured (docs/benchmarks.md, "Forward paths on CPU"): on the 2-core CI machine with torch 2.13
it does not pay for bf16: about parity at batch 1 (0.96-1.08x eager), 0.78-0.86x at batch 64 (the
per-call cost of 30 compiled-region calls and 150 Python custom-op calls per step eats the
fused-away ops), so `model.compile` defaults to off; it stays as the opt-in path and the A/B (`bench_engine --modes bf16,bf16-compiled`).

What the compiler sees: the layers' norms, residual adds, RoPE and SiLU-mul. What it does
not: the projections and the paged attention, which are opaque custom ops (`kvmesh::
opaque_linear`, `kvmesh::paged_attention`) whose implementations are exactly the eager ones
(prepacked oneDNN bf16, merged int8/int4 kernels, the CPU attention plan over the block
table). So the GEMM kernels and the attention numerics do not change, the KV cache stays
outside the graph, and the only numeric difference to eager is inductor's fusion of the
elementwise chains (fp32 reductions in another order: tests/test_compiled_forward.py checks
the greedy tokens are identical to eager's in fp32).

Shapes: one graph serves every layer (the layer index is a tensor argument) and the token
count T is dynamic (one graph for T >= 2, plus torch's specialised T = 1 graph), so both are compiled once, at engine start (`warm_up`), and no step pads. Steps with
more than `max_tokens` tokens (long prefill chunks) run eagerly: the elementwise share of a
long prefill is small and a compile per new shape is not wanted there.

Applies at tensor-parallel world size 1 with the weights final (after quantization and
fuse_projections: the projections are bound once, here). Where compilation is unavailable
(no C++ compiler, torch without inductor, an op inductor refuses) the model stays eager and
one warning says why.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

# The eager definitions, traced as they are: the compiled layer rounds exactly as eager does.
from kvmesh.worker.kernels.torch_ops import fused_add_rms_norm, rms_norm, silu_and_mul

logger = logging.getLogger(__name__)

_step = threading.local()  # the running step's context, set around each compiled call

QKV, O, GATE_UP, DOWN = range(4)  # a layer's projections, in the order they are bound


@dataclass(frozen=True)
class _StepContext:
    projections: list  # [layers * 4] eager callables: layer i's QKV at 4 * i, ...
    kv_caches: list | None
    meta: object
    backend: object  # None during warm-up: attention returns zeros and writes nothing


# The layer index travels as a 0-dim tensor, not an int: dynamo specialises on int arguments
# (one graph per layer), never on a tensor's value, so all layers share one compiled graph.
@torch.library.custom_op("kvmesh::opaque_linear", mutates_args=())
def opaque_linear(x: torch.Tensor, layer: torch.Tensor, which: int, out_features: int) -> torch.Tensor:
    """Layer `layer`'s projection `which`, the eager callable the model's own forward would
    run (prepacked bf16, merged q/k/v or gate/up, int8 / int4), hidden from the compiler."""
    return _step.context.projections[4 * int(layer) + which](x)


@opaque_linear.register_fake
def _(x: torch.Tensor, layer: torch.Tensor, which: int, out_features: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


@torch.library.custom_op("kvmesh::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Writes k, v into the layer's paged cache and attends, through the step's backend.
    The cache write is invisible to the compiler; nothing else in the graph reads the cache."""
    ctx: _StepContext = _step.context
    if ctx.backend is None:
        return torch.zeros_like(q)
    cache = ctx.kv_caches[int(layer)]
    ctx.backend.write_kv(cache, k, v, ctx.meta.slot_mapping)
    return ctx.backend.attend(q, cache, ctx.meta, scale)


@paged_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q)


@dataclass(frozen=True)
class _Shape:
    """What every layer shares (one graph serves them all): sizes and constants."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int  # this rank's gate (= up) width
    eps: float
    scale: float


def _projection(fused, linear) -> Callable[[torch.Tensor], torch.Tensor]:
    return fused if fused is not None and fused.usable((linear,)) else linear


def _merged(fused, members) -> Callable[[torch.Tensor], torch.Tensor]:
    if fused is not None and fused.usable(members):
        return fused
    return lambda x: torch.cat([lin(x) for lin in members], dim=-1)


def _layer(shape: _Shape, x: torch.Tensor, residual: torch.Tensor, layer: torch.Tensor, input_norm: torch.Tensor,
           post_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer, rounding as the eager LlamaDecoderLayer: (previous MLP output x,
    residual stream) -> (this layer's MLP output, its residual stream). Layer 0 gets
    residual = 0 (x + 0 == x exactly)."""
    t, nq, nkv, d = x.shape[0], shape.num_heads, shape.num_kv_heads, shape.head_dim
    h, residual = fused_add_rms_norm(x, residual, input_norm, shape.eps)
    qkv = opaque_linear(h, layer, QKV, (nq + 2 * nkv) * d).view(t, nq + 2 * nkv, d)
    qk = qkv[:, :nq + nkv]
    qk = qk * cos + qk.roll(d // 2, dims=-1) * sin  # RotaryTables.rotate
    attn = paged_attention(qk[:, :nq], qk[:, nq:], qkv[:, nq + nkv:], layer, shape.scale)
    residual = opaque_linear(attn.reshape(t, nq * d), layer, O, shape.hidden) + residual
    h = rms_norm(residual, post_norm, shape.eps)
    act = silu_and_mul(opaque_linear(h, layer, GATE_UP, 2 * shape.intermediate))
    return opaque_linear(act, layer, DOWN, shape.hidden), residual


def _final_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return fused_add_rms_norm(x, residual, weight, eps)[0]


class CompiledDecoder:
    """The decoder layers (one compiled graph shared by all of them) and the final norm."""

    def __init__(self, model, max_tokens: int):
        self.max_tokens = max_tokens
        first = model.model.layers[0]
        self.shape = _Shape(first.self_attn.num_heads, first.self_attn.num_kv_heads, first.self_attn.head_dim,
                            first.input_layernorm.weight.shape[0], first.mlp.gate_proj.weight.shape[0],
                            first.input_layernorm.eps, first.self_attn.scale)
        self.projections: list[Callable[[torch.Tensor], torch.Tensor]] = []
        self.norms = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.projections += [_merged(attn.qkv, (attn.q_proj, attn.k_proj, attn.v_proj)),
                                 _projection(attn.o, attn.o_proj),
                                 _merged(mlp.gate_up, (mlp.gate_proj, mlp.up_proj)),
                                 _projection(mlp.down, mlp.down_proj)]
            self.norms.append((layer.input_layernorm.weight, layer.post_attention_layernorm.weight))
        self.layer_ids = [torch.tensor(i) for i in range(len(self.norms))]
        self.final_norm, self.final_eps = model.model.norm.weight, model.model.norm.eps
        # The per-call cost of a compiled region is what decides here (module doc): a C++ wrapper
        # instead of inductor's Python one, and no per-call size / stride asserts on the custom
        # ops' outputs (their shapes are the fake implementations'). Measured batch 1 bf16:
        # 0.6x eager with the defaults, 0.96-1.08x with these (docs/benchmarks.md).
        options = {"cpp_wrapper": True, "size_asserts": False}
        self._layer = torch.compile(_layer, dynamic=True, fullgraph=True, options=options)
        self._final = torch.compile(_final_norm, dynamic=True, fullgraph=True, options=options)
        self.steps_run = 0  # forwards that took the compiled path (tests, benchmarks)

    def applies(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_tokens

    def run(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], kv_caches, meta, backend
            ) -> torch.Tensor:
        """x: [T, H] embeddings, cos_sin: [T, 1, D] each -> final hidden [T, H]."""
        cos, sin = cos_sin
        residual = torch.zeros_like(x)
        previous = getattr(_step, "context", None)  # a nested run (none today) gets its own back
        _step.context = _StepContext(self.projections, kv_caches, meta, backend)
        try:
            for layer, (input_norm, post_norm) in zip(self.layer_ids, self.norms):
                x, residual = self._layer(self.shape, x, residual, layer, input_norm, post_norm, cos, sin)
        finally:
            _step.context = previous
        self.steps_run += 1
        return self._final(x, residual, self.final_norm, self.final_eps)

    def warm_up(self, model) -> None:
        """Compiles the T = 1 and the dynamic T graphs (attention stubbed, the cache untouched)."""
        for t in (1, 2):
            ids = torch.zeros(t, dtype=torch.long, device=self.final_norm.device)
            x = model.model.embed_tokens(ids)
            cos_sin = model.rotary.for_positions(torch.arange(t, device=ids.device), x.dtype)
            self.run(x, cos_sin, None, None, None)


def compile_unavailable_reason(model) -> str | None:
    """Why the decoder cannot be compiled here, or None."""
    if model.coll.world_size != 1:
        return "tensor parallelism (the all-reduce stays eager)"
    refusal = model.arch.llama_shaped_refusal()
    if refusal is not None:  # the compiled layer is Llama's layer
        return f"the compiled layer is Llama's, the model has {refusal}"
    device = model.model.norm.weight.device
    if device.type != "cpu":
        return f"device {device.type} (CUDA decode uses CUDA graphs)"
    if not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        return "no C++ compiler on PATH (inductor's CPU backend needs one)"
    if importlib.util.find_spec("torch._inductor") is None:  # torch builds without it exist
        return "torch without inductor"
    return None


def install(model, max_tokens: int) -> CompiledDecoder | None:
    """Compiles and warms the decoder; None (eager, one warning saying why) where it cannot."""
    reason = compile_unavailable_reason(model)
    if reason is None:
        try:
            compiled = CompiledDecoder(model, max_tokens)
            with torch.inference_mode():
                compiled.warm_up(model)
            logger.info("model.compile decode: decoder stack compiled (inductor) for steps of <= %d tokens",
                        max_tokens)
            return compiled
        except Exception as exc:  # an inductor / compiler failure must leave a working eager model
            reason = f"compilation failed: {type(exc).__name__}: {exc}"
    logger.warning("model.compile decode: running eagerly: %s", reason)
    return None
