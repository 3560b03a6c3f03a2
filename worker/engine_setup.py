"""Building one engine's parts from the config: device, dtype, weights, KV cache sizing.

KV cache sizing follows the articles' formula (bytes per token = 2 x L x Hkv x D x b, plus
scales for quantized KV); the number of blocks comes from a memory budget, never a constant:

    CPU:   budget = cache.cpu_kv_cache_gib
    CUDA:  budget = gpu_memory_utilization x device memory
                    - memory in use after loading weights - profiled peak activation
    num_blocks = budget // (bytes_per_token x block_size)      (cache.num_blocks overrides)

With parallel.tensor_parallel_size = N > 1 (worker/tp_group.py) this process is rank 0: it
loads its shard while ranks 1..N-1 load theirs in Ray actors, and bytes_per_token counts
this rank's KV heads (max(1, Hkv / N)); every rank gets the same num_blocks, so one block
table addresses all the shards.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kvmesh.deploy.config import ConfigError, KvmeshConfig
from kvmesh.kv.kv_cache_manager import KVCacheManager
from kvmesh.worker.attention import AttentionMetadata, LayerKVCache
from kvmesh.worker.model import LlamaForCausalLM
from kvmesh.worker.model_loader import ensure_hf_dir, load_hf_config, load_state_dict
from kvmesh.kv.capacity import kv_bytes_per_token, num_blocks_for_budget
from kvmesh.worker.model_runner import TORCH_DTYPES, ModelRunner, allocate_kv_caches, kv_storage_dtype

logger = logging.getLogger(__name__)

GIB = 1 << 30


@dataclass(frozen=True)
class MemoryPlan:
    weight_bytes: int
    kv_bytes_per_token: int
    block_size: int
    num_blocks: int
    num_swap_blocks: int
    kv_cache_bytes: int
    peak_activation_bytes: int  # CUDA only (profiled); 0 on CPU

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


@dataclass
class EngineParts:
    runner: ModelRunner
    kv_manager: KVCacheManager
    tokenizer: object
    hf_config: object
    model_name: str
    kv_cache_dtype: str  # the effective KV dtype name (for block hash extra keys)
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    plan: MemoryPlan
    device: torch.device


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


def pick_backend(config: KvmeshConfig, device: torch.device):
    want = config.parallel.attention_backend
    if want == "triton" or (want == "auto" and device.type == "cuda"):
        try:
            from kvmesh.worker.attention_triton import TritonAttentionBackend
        except ImportError as exc:
            if want == "triton":
                raise ConfigError(f"attention_backend=triton but Triton is unavailable: {exc}") from exc
        else:
            return TritonAttentionBackend()
    if want == "torch":
        from kvmesh.worker.attention_torch import TorchAttentionBackend

        return TorchAttentionBackend()
    from kvmesh.worker.attention_cpu import CpuAttentionBackend

    return CpuAttentionBackend()


def _effective_kv_dtype_name(config: KvmeshConfig, dtype: torch.dtype) -> str:
    if config.cache.kv_cache_dtype != "auto":
        return config.cache.kv_cache_dtype
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def _eos_ids(hf_config, tokenizer) -> tuple[int, ...]:
    ids = set()
    eos = getattr(hf_config, "eos_token_id", None)
    for v in (eos if isinstance(eos, (list, tuple)) else [eos]):
        if v is not None:
            ids.add(int(v))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def _plan_memory(config: KvmeshConfig, model, hf_config, device, kv_dtype_name: str,
                 profile_peak) -> MemoryPlan:
    cache_cfg = config.cache
    # The capacity model's formula (kv/capacity.py), the same `kvmesh capacity` prints.
    # model.num_kv_heads: this rank's KV heads (each tensor-parallel rank caches its own).
    per_token = kv_bytes_per_token(hf_config.num_hidden_layers, model.num_kv_heads, model.head_dim,
                                   kv_dtype_name)
    per_block = per_token * cache_cfg.block_size
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(b.numel() * b.element_size() for b in model.buffers())
    peak = 0
    if cache_cfg.num_blocks is not None:
        num_blocks = cache_cfg.num_blocks
    elif device.type == "cuda":
        peak = profile_peak()
        total = torch.cuda.get_device_properties(device).total_memory
        free, _ = torch.cuda.mem_get_info(device)
        in_use = total - free
        budget = int(total * cache_cfg.gpu_memory_utilization) - in_use - peak
        num_blocks = num_blocks_for_budget(budget, cache_cfg.block_size, per_token)
    else:
        num_blocks = num_blocks_for_budget(int(cache_cfg.cpu_kv_cache_gib * GIB), cache_cfg.block_size, per_token)
    if num_blocks < 1:
        raise ConfigError(f"no memory left for the KV cache (one block needs {per_block} bytes)")
    num_swap = num_blocks_for_budget(int(cache_cfg.swap_space_gib * GIB), cache_cfg.block_size, per_token)
    return MemoryPlan(weight_bytes, per_token, cache_cfg.block_size, num_blocks, num_swap,
                      num_blocks * per_block, peak)


@dataclass(frozen=True)
class ModelSpec:
    """What every tensor-parallel rank resolves the same way from the config."""

    hf_dir: Path
    name: str
    hf_config: object
    device: torch.device
    dtype: torch.dtype
    max_model_len: int


def resolve_model(config: KvmeshConfig) -> ModelSpec:
    resolved = ensure_hf_dir(config.model)
    hf_config = load_hf_config(resolved.hf_dir)
    device = pick_device(config)
    if device.type == "cpu":
        # One intra-op thread per CPU the worker is given: OpenMP threads spin-wait, and on a
        # shared box (router, other workers, clients) oversubscribed spinning made matmuls
        # up to 30x slower than one thread (measured on the 2-core CI machines).
        torch.set_num_threads(max(1, int(config.parallel.worker_num_cpus)))
    dtype = pick_dtype(config, device)
    native_len = int(getattr(hf_config, "max_position_embeddings", 2048))
    max_model_len = config.model.max_model_len or native_len
    if max_model_len > native_len:
        raise ConfigError(f"model.max_model_len {max_model_len} exceeds the model's {native_len} positions")
    return ModelSpec(Path(resolved.hf_dir), resolved.name, hf_config, device, dtype, max_model_len)


def with_valid_group_size(config: KvmeshConfig, hf_config) -> KvmeshConfig:
    """int4 modes: the largest supported group size <= quant.group_size that divides every
    projection's input width on every tensor-parallel shard (logged when it differs), so the
    default (128) starts on models whose hidden size it does not divide (SmolLM2: 576)."""
    if not config.quant.weight.startswith("int4"):
        return config
    from kvmesh.quant.primitives import largest_valid_group_size

    tp = config.parallel.tensor_parallel_size
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    widths = [hf_config.hidden_size, hf_config.num_attention_heads * head_dim // tp, hf_config.intermediate_size // tp]
    chosen = largest_valid_group_size(widths, config.quant.group_size)
    if chosen == config.quant.group_size:
        return config
    logger.info("quant.group_size %d does not divide the projection widths %s; using %d",
                config.quant.group_size, widths, chosen)
    return config.replace(quant={"group_size": chosen})


def load_model(config: KvmeshConfig, spec: ModelSpec, coll=None, awq=None) -> LlamaForCausalLM:
    """This rank's model: the whole model at world size 1, its shard under tensor parallelism
    (`coll` from worker/distributed.py). Quantized projections are quantized whole, then cut.

    awq: int4_awq search results (worker/awq_calibration.py); None at world size 1 means
    calibrate this model here (or take the cached results)."""
    model = LlamaForCausalLM(spec.hf_config, spec.max_model_len, coll, config.parallel.vocab_parallel)
    state = load_state_dict(spec.hf_dir)
    sharded_quant = config.quant.weight != "none" and model.coll.world_size > 1
    if sharded_quant:
        state = model.install_quantized_shards(state, config.quant, spec.dtype, awq)
    model.load_hf_state_dict(state)
    model.to(dtype=spec.dtype)
    model.rotary.to(torch.float32)  # rope tables stay fp32, cast per use like HF
    if config.quant.weight != "none" and not sharded_quant:
        from kvmesh.quant.linear import quantize_model

        if config.quant.weight == "int4_awq" and awq is None:
            from kvmesh.worker.awq_calibration import awq_results_for

            model.to(spec.device).eval()  # calibrate where the model will run
            awq = awq_results_for(config, spec, model)
        quantize_model(model, config.quant, awq)
    model = model.to(spec.device).eval()
    model.fuse_projections()  # last: fused weights share the final parameters' storage
    return model


def allocate_rank_caches(config: KvmeshConfig, spec: ModelSpec, model, num_blocks: int, num_swap_blocks: int
                         ) -> tuple[list[LayerKVCache], list[LayerKVCache] | None]:
    """This rank's KV cache (its KV heads) and swap space, same block ids on every rank."""
    storage = kv_storage_dtype(config.cache.kv_cache_dtype, spec.dtype)
    layers, hkv, bs = spec.hf_config.num_hidden_layers, model.num_kv_heads, config.cache.block_size
    kv_caches = allocate_kv_caches(layers, num_blocks, bs, hkv, model.head_dim, storage, spec.device)
    swap_caches: list[LayerKVCache] | None = None
    if num_swap_blocks > 0:
        swap_caches = allocate_kv_caches(layers, num_swap_blocks, bs, hkv, model.head_dim, storage,
                                         torch.device("cpu"), pin=spec.device.type == "cuda")
    return kv_caches, swap_caches


def build_engine_parts(config: KvmeshConfig, worker_id: str = "worker-0") -> EngineParts:
    from kvmesh.worker.tokenizer import load_tokenizer

    spec = resolve_model(config)
    config = with_valid_group_size(config, spec.hf_config)
    hf_config, device, dtype, max_model_len = spec.hf_config, spec.device, spec.dtype, spec.max_model_len
    group = None
    if config.parallel.tensor_parallel_size > 1:
        from kvmesh.worker.tp_group import TensorParallelGroup

        group = TensorParallelGroup(config)
        model = group.start()  # ranks 1..N-1 load their shards in Ray actors while rank 0 loads here
    else:
        model = load_model(config, spec)
    tokenizer = load_tokenizer(config.model)

    storage = kv_storage_dtype(config.cache.kv_cache_dtype, dtype)
    backend = pick_backend(config, device)
    kv_dtype_name = _effective_kv_dtype_name(config, dtype)
    plan = _plan_memory(config, model, hf_config, device, kv_dtype_name,
                        profile_peak=lambda: _profile_peak(model, config, device))
    kv_caches, swap_caches = allocate_rank_caches(config, spec, model, plan.num_blocks, plan.num_swap_blocks)
    if group is None:
        runner = ModelRunner(model, backend, device, kv_caches, swap_caches, plan.block_size, seed=config.model.seed)
    else:
        from kvmesh.worker.tp_group import TensorParallelRunner

        runner = TensorParallelRunner(group, plan, model, backend, device, kv_caches, swap_caches, plan.block_size,
                                      seed=config.model.seed)
    kv_manager = KVCacheManager(plan.num_blocks, plan.block_size,
                                enable_prefix_caching=config.cache.enable_prefix_caching,
                                num_cpu_blocks=plan.num_swap_blocks, worker_id=worker_id)
    logger.info(
        "engine memory: weights %.1f MiB, KV %d bytes/token (%s), %d blocks x %d tokens = %d tokens "
        "(%.1f MiB), swap %d blocks, peak activation %.1f MiB, device %s, dtype %s, backend %s",
        plan.weight_bytes / 2**20, plan.kv_bytes_per_token, storage, plan.num_blocks, plan.block_size,
        plan.kv_capacity_tokens, plan.kv_cache_bytes / 2**20, plan.num_swap_blocks,
        plan.peak_activation_bytes / 2**20, device, dtype, backend.name)
    return EngineParts(runner, kv_manager, tokenizer, hf_config, spec.name, kv_dtype_name, max_model_len,
                       _eos_ids(hf_config, tokenizer), plan, device)


def _profile_peak(model, config: KvmeshConfig, device: torch.device) -> int:
    """Peak extra memory of one forward of max_num_batched_tokens prompt tokens (CUDA)."""
    n = config.scheduler.max_num_batched_tokens
    bs = config.cache.block_size
    nb = -(-n // bs)
    dtype = next(model.parameters()).dtype
    caches = allocate_kv_caches(model.config.num_hidden_layers, nb, bs, model.num_kv_heads, model.head_dim,
                                dtype, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        meta = AttentionMetadata.single_prefill(n, bs, device)
        hidden = model(torch.zeros(n, dtype=torch.long, device=device), torch.arange(n, device=device), caches,
                       meta, pick_backend(config, device))
        model.compute_logits(hidden[-1:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del caches, hidden
    torch.cuda.empty_cache()
    return int(peak)
