"""One rank's model from the config: device, dtype, attention backend, weights, KV cache.

Every tensor-parallel rank resolves the model the same way (`resolve_model`), loads its
shard (`load_model`) and allocates its KV cache (`allocate_rank_caches`); rank 0 then builds
the engine around its runner (worker/engine_loop/engine_setup.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kvmesh.core.config import ConfigError, KvmeshConfig
from kvmesh.quant.linear import quantize_model
from kvmesh.quant.primitives import largest_valid_group_size
from kvmesh.worker.runner.awq_calibration import awq_results_for
from kvmesh.worker.attention.backend import LayerKVCache
from kvmesh.worker.attention.cpu_backend import CpuAttentionBackend
from kvmesh.worker.attention.torch_backend import TorchAttentionBackend
from kvmesh.worker.runner import compiled_forward
from kvmesh.worker.model.architecture import Architecture, UnsupportedModelError
from kvmesh.worker.model.llama import LlamaForCausalLM
from kvmesh.worker.model.gguf_loader import int4_layers_only, load_gguf_model
from kvmesh.worker.model.loader import ensure_config_dir, ensure_hf_dir, load_hf_config, load_state_dict
from kvmesh.worker.model.loader import resolve_model as resolve_hf_source
from kvmesh.worker.kernels import cpu_native_step
from kvmesh.worker.runner.model_runner import TORCH_DTYPES, allocate_kv_caches, kv_storage_dtype

logger = logging.getLogger(__name__)


def pick_device(config: KvmeshConfig) -> torch.device:
    want = config.parallel.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("parallel.device=cuda but torch sees no CUDA device")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def cpu_has_native_bf16() -> bool:
    """True when torch reports native bf16 matmul instructions on this CPU (AVX-512 BF16 or
    AMX tiles): there oneDNN runs bf16 GEMMs at 3x the fp32 rate (docs/benchmarks.md). Without
    them bf16 is emulated through fp32 and only loses precision."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch >= 2.3 names them so
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def pick_dtype(config: KvmeshConfig, device: torch.device) -> torch.dtype:
    """model.dtype auto: bf16 on CUDA and on CPUs with native bf16 matmuls, fp32 otherwise.
    The token-exact tests ask for fp32 explicitly."""
    if config.model.dtype != "auto":
        return TORCH_DTYPES[config.model.dtype]
    if device.type == "cuda":
        chosen, why = torch.bfloat16, "CUDA"
    elif cpu_has_native_bf16():
        chosen, why = torch.bfloat16, "the CPU has native bf16 matmuls (AVX-512 BF16 / AMX)"
    else:
        chosen, why = torch.float32, "the CPU has no native bf16 matmuls"
    logger.info("model.dtype auto -> %s: %s", chosen, why)
    return chosen


def require_backend_features(arch: Architecture, backend) -> None:
    """Refuses, at set-up, a backend that would skip a layer option the model needs."""
    wants = [("sliding-window attention", arch.windowed, "supports_sliding_window"),
             ("attention logit soft-capping", arch.attn_logit_softcap is not None, "supports_logit_softcap")]
    for what, needed, flag in wants:
        if needed and not getattr(backend, flag, False):
            raise UnsupportedModelError(f"{arch.model_type} needs {what}, which the {backend.name} attention backend "
                                        "does not apply (parallel.attention_backend: torch or cpu do)")


def pick_backend(config: KvmeshConfig, device: torch.device):
    want = config.parallel.attention_backend
    if want == "triton" or (want == "auto" and device.type == "cuda"):
        try:
            from kvmesh.worker.attention.triton_backend import TritonAttentionBackend  # triton is optional
        except ImportError as exc:
            if want == "triton":
                raise ConfigError(f"attention_backend=triton but Triton is unavailable: {exc}") from exc
        else:
            return TritonAttentionBackend()
    if want == "torch":
        return TorchAttentionBackend()
    return CpuAttentionBackend(use_kernel=config.model.cpu_decode_kernel)


@dataclass(frozen=True)
class ModelSpec:
    """What every tensor-parallel rank resolves the same way from the config."""

    hf_dir: Path
    name: str
    hf_config: object
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    arch: Architecture  # the family's switches, validated
    gguf_path: Path | None = None  # quant.weight gguf: the file whose tensors load as stored (hf_dir: its config)
    weight_quant: str = "none"  # quant.weight as resolved here (auto -> gguf or none): what load_model loads


def resolve_weight_quant(config: KvmeshConfig) -> KvmeshConfig:
    """quant.weight auto resolved (every other value as given): gguf for a .gguf model (the
    embedded one included) where the native step runs on a CPU and reads the file's int4 at
    least as fast as a float copy:
    - in fp32: its int4 layers dequantize each weight in registers (greedy tokens those of the
      dequantized model, HF's) and read the file's ~4.5 bits a weight instead of fp32's 32
      (docs/benchmarks.md: the faster exact mode);
    - in bf16 on a CPU with VDPBF16PS and no AMX, a file whose decoder layers are all 4-bit:
      each weight dequantized to bf16 and the bf16 model's products (int4_bf16: the bf16 copy's
      logits bit for bit), batch-1 decode 1.55x the bf16 copy and the seed-shaped run level
      with it on Zen 4 (docs/benchmarks.md), a third of its weight bytes. With AMX the bf16
      copy's tiles are faster at every batch.
    none elsewhere (CUDA, HF folders, tensor parallelism, other bf16 CPUs or files)."""
    if config.quant.weight != "auto":
        return config
    chosen, why = "none", "not a .gguf model"
    gguf_path = resolve_hf_source(config.model).gguf_path
    if gguf_path is not None:
        device = pick_device(config)
        dtype = pick_dtype(config, device)
        native = cpu_native_step.unavailable_reason()
        if config.parallel.tensor_parallel_size > 1:
            why = "tensor parallelism"
        elif device.type != "cpu":
            why = f"the model runs on {device.type}"
        elif native is not None:
            why = f"no native step ({native})"
        elif dtype == torch.float32:
            chosen, why = "gguf", "a .gguf model on a CPU in fp32: its own int4, exact in the native step"
        elif dtype != torch.bfloat16 or not cpu_native_step.dpbf16_without_amx():
            why = f"the model runs in {dtype} on a CPU without VDPBF16PS, or with AMX (the bf16 copy is faster there)"
        elif not int4_layers_only(gguf_path):
            why = "a bf16 model whose .gguf decoder layers are not all 4-bit"
        else:
            chosen, why = "gguf", "a .gguf model of 4-bit layers in bf16 on a VDPBF16PS CPU: its own int4, bf16 products"
    logger.info("quant.weight auto -> %s (%s)", chosen, why)
    return config.replace(quant={"weight": chosen})


def resolve_model(config: KvmeshConfig) -> ModelSpec:
    """The model's source, config, device, dtype and architecture; quant.weight auto resolved
    here (once: the spec carries it, load_model loads what it says)."""
    config = resolve_weight_quant(config)
    gguf_kept = config.quant.weight == "gguf"
    resolved = ensure_config_dir(config.model) if gguf_kept else ensure_hf_dir(config.model)
    hf_config = load_hf_config(resolved.hf_dir)
    device = pick_device(config)
    if device.type == "cpu":
        # One intra-op thread per CPU the worker is given: OpenMP threads spin-wait, and on a
        # shared box (router, other workers, clients) oversubscribed spinning made matmuls
        # up to 30x slower than one thread (measured on the 2-core CI machines).
        torch.set_num_threads(config.parallel.engine_threads())
    dtype = pick_dtype(config, device)
    native_len = int(getattr(hf_config, "max_position_embeddings", 2048))
    max_model_len = config.model.max_model_len or native_len
    if max_model_len > native_len:
        raise ConfigError(f"model.max_model_len {max_model_len} exceeds the model's {native_len} positions")
    arch = Architecture.from_hf_config(hf_config, max_model_len)  # refuses what is not served, before any weight loads
    return ModelSpec(Path(resolved.hf_dir), resolved.name, hf_config, device, dtype, max_model_len, arch,
                     resolved.gguf_path if gguf_kept else None, config.quant.weight)


def load_model(config: KvmeshConfig, spec: ModelSpec, coll=None, awq=None) -> LlamaForCausalLM:
    """This rank's model: the whole model at world size 1, its shard under tensor parallelism
    (`coll` from worker/parallel/distributed.py). Quantized projections are quantized whole, then cut;
    quant.weight gguf loads the file's own quantized tensors (worker/model/gguf_loader.py).

    awq: int4_awq search results (worker/runner/awq_calibration.py); None at world size 1 means
    calibrate this model here (or take the cached results)."""
    if config.quant.weight != spec.weight_quant:  # auto, resolved once by resolve_model
        config = config.replace(quant={"weight": spec.weight_quant})
    if config.quant.weight == "gguf":
        model = load_gguf_model(spec.gguf_path, spec.hf_config, spec.max_model_len, spec.dtype, coll,
                                config.parallel.vocab_parallel)
    else:
        model = _load_checkpoint(config, spec, coll, awq)
    model = model.to(spec.device).eval()
    # last: fused weights share the final parameters' storage, packed ones copy it
    model.fuse_projections(prepack=config.model.cpu_prepack_weights)
    if config.model.compile == "decode":  # after the fusion: it binds the final projections
        model.compiled = compiled_forward.install(model, config.scheduler.max_num_seqs)
    return model


def _load_checkpoint(config: KvmeshConfig, spec: ModelSpec, coll, awq) -> LlamaForCausalLM:
    """The HF folder's float weights, quantized as quant.weight says."""
    model = LlamaForCausalLM(spec.hf_config, spec.max_model_len, coll, config.parallel.vocab_parallel)
    state = load_state_dict(spec.hf_dir)
    sharded_quant = config.quant.weight != "none" and model.coll.world_size > 1
    if sharded_quant:
        state = model.install_quantized_shards(state, config.quant, spec.dtype, awq)
    model.load_hf_state_dict(state)
    del state  # the float tensors now live in the model (or were quantized): no second copy
    model.cast_to(spec.dtype)
    if config.quant.weight != "none" and not sharded_quant:
        if config.quant.weight == "int4_awq" and awq is None:
            model.to(spec.device).eval()  # calibrate where the model will run
            awq = awq_results_for(config, spec, pick_backend(config, spec.device), lambda: model)
        quantize_model(model, config.quant, awq)
    return model


def with_valid_group_size(config: KvmeshConfig, hf_config) -> KvmeshConfig:
    """int4 modes: the largest supported group size <= quant.group_size that divides every
    projection's input width on every tensor-parallel shard (logged when it differs), so the
    default (128) starts on models whose hidden size it does not divide (SmolLM2: 576)."""
    if not config.quant.weight.startswith("int4"):
        return config
    tp = config.parallel.tensor_parallel_size
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    widths = [hf_config.hidden_size, hf_config.num_attention_heads * head_dim // tp, hf_config.intermediate_size // tp]
    chosen = largest_valid_group_size(widths, config.quant.group_size)
    if chosen == config.quant.group_size:
        return config
    logger.info("quant.group_size %d does not divide the projection widths %s; using %d",
                config.quant.group_size, widths, chosen)
    return config.replace(quant={"group_size": chosen})


def allocate_rank_caches(config: KvmeshConfig, spec: ModelSpec, model, num_blocks: int, num_swap_blocks: int
                         ) -> tuple[list[LayerKVCache], list[LayerKVCache] | None]:
    """This rank's KV cache (its KV heads) and swap space, same block ids on every rank."""
    storage = kv_storage_dtype(config.cache.kv_cache_dtype, spec.dtype)
    layers, hkv, bs = spec.hf_config.num_hidden_layers, model.num_kv_heads, config.cache.block_size
    kv_caches = allocate_kv_caches(layers, num_blocks, bs, hkv, model.head_dim, storage, spec.device)
    swap_caches: list[LayerKVCache] | None = None
    if num_swap_blocks > 0:
        # resident only as blocks are swapped out (cache.swap_space_gib is a ceiling, not RSS at start)
        swap_caches = allocate_kv_caches(layers, num_swap_blocks, bs, hkv, model.head_dim, storage,
                                         torch.device("cpu"), pin=spec.device.type == "cuda", initialised=False)
    return kv_caches, swap_caches
