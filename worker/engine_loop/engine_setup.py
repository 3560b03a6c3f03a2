"""Building one engine's parts from the config: the model runner (one rank or a tensor-parallel
group), the tokenizer, KV cache sizing.

KV cache sizing follows the articles' formula (bytes per token = 2 x L x Hkv x D x b, plus
scales for quantized KV); the number of blocks comes from a memory budget, never a constant:

    CPU:   budget = cache.cpu_kv_cache_gib
    CUDA:  budget = gpu_memory_utilization x device memory
                    - memory in use after loading weights - profiled peak activation
    num_blocks = budget // (bytes_per_token x block_size)      (cache.num_blocks overrides)

With parallel.tensor_parallel_size = N > 1 (worker/runner/tp_group.py) this process is rank 0: it
loads its shard while ranks 1..N-1 load theirs in Ray actors, and bytes_per_token counts
this rank's KV heads (max(1, Hkv / N)); every rank gets the same num_blocks, so one block
table addresses all the shards.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvmesh.core.config import ConfigError, KvmeshConfig
from kvmesh.kv.kv_cache_manager import KVCacheManager
from kvmesh.kv.capacity import kv_bytes_per_token, num_blocks_for_budget
from kvmesh.worker.attention.backend import AttentionMetadata
from kvmesh.worker.runner.cpu_model_runner import CpuModelRunner, CpuStepPath
from kvmesh.worker.runner.model_runner import ModelRunner, allocate_kv_caches, kv_storage_dtype
from kvmesh.worker.runner.model_setup import (allocate_rank_caches, load_model, pick_backend, resolve_model,
                                                with_valid_group_size)
from kvmesh.worker.model.tokenizer import load_tokenizer
from kvmesh.worker.runner.tp_group import TensorParallelGroup, TensorParallelRunner
from kvmesh.worker.runner.host_tier_store import HostTierStore

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
    num_host_tier_blocks: int = 0  # host tier slots (cache.host_tier_*; 0 = no tier)

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
    host_tier_store: HostTierStore | None = None  # the host tier's bytes (kv_manager.host_tier: its books)
    cpu_step: CpuStepPath | None = None  # what serves small CPU steps (worker/runner/cpu_model_runner.py); None on GPUs


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
    num_tier = cache_cfg.host_tier_num_blocks
    if num_tier is None:
        num_tier = num_blocks_for_budget(int(cache_cfg.host_tier_gib * GIB), cache_cfg.block_size, per_token)
    return MemoryPlan(weight_bytes, per_token, cache_cfg.block_size, num_blocks, num_swap,
                      num_blocks * per_block, peak, num_tier if cache_cfg.enable_prefix_caching else 0)


def build_engine_parts(config: KvmeshConfig, worker_id: str = "worker-0") -> EngineParts:
    spec = resolve_model(config)
    config = with_valid_group_size(config, spec.hf_config)
    hf_config, device, dtype, max_model_len = spec.hf_config, spec.device, spec.dtype, spec.max_model_len
    group = None
    if config.parallel.tensor_parallel_size > 1:
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
        if device.type == "cpu":
            runner = CpuModelRunner(model, backend, kv_caches, swap_caches, plan.block_size, seed=config.model.seed,
                                    native_max_tokens=config.model.cpu_native_max_tokens)
        else:
            runner = ModelRunner(model, backend, device, kv_caches, swap_caches, plan.block_size,
                                 seed=config.model.seed)
        if config.parallel.cuda_graphs and device.type == "cuda":
            runner.graph_runner = build_graph_runner(config, model, backend, kv_caches, device, max_model_len,
                                                     plan.block_size)
    else:
        runner = TensorParallelRunner(group, plan, model, backend, device, kv_caches, swap_caches, plan.block_size,
                                      seed=config.model.seed)
    if group is not None and plan.num_host_tier_blocks:
        raise ConfigError("cache.host_tier_* needs parallel.tensor_parallel_size = 1 (the tier copies rank 0's KV only)")
    kv_manager = KVCacheManager(plan.num_blocks, plan.block_size,
                                enable_prefix_caching=config.cache.enable_prefix_caching,
                                num_cpu_blocks=plan.num_swap_blocks, worker_id=worker_id,
                                num_host_tier_blocks=plan.num_host_tier_blocks)
    tier_store = None
    if plan.num_host_tier_blocks:
        tier_store = HostTierStore(hf_config.num_hidden_layers, plan.num_host_tier_blocks, plan.block_size,
                                   model.num_kv_heads, model.head_dim, storage, pin=device.type == "cuda")
        kv_manager.host_tier.verify = tier_store.holds_checksum
    logger.info(
        "engine memory: weights %.1f MiB, KV %d bytes/token (%s), %d blocks x %d tokens = %d tokens "
        "(%.1f MiB), swap %d blocks, peak activation %.1f MiB, device %s, dtype %s, backend %s",
        plan.weight_bytes / 2**20, plan.kv_bytes_per_token, storage, plan.num_blocks, plan.block_size,
        plan.kv_capacity_tokens, plan.kv_cache_bytes / 2**20, plan.num_swap_blocks,
        plan.peak_activation_bytes / 2**20, device, dtype, backend.name)
    cpu_step = None
    if device.type == "cpu":
        cpu_step = runner.cpu_step if isinstance(runner, CpuModelRunner) else CpuStepPath("torch", "tensor parallelism")
    return EngineParts(runner, kv_manager, tokenizer, hf_config, spec.name, kv_dtype_name, max_model_len,
                       _eos_ids(hf_config, tokenizer), plan, device, tier_store, cpu_step)


def build_graph_runner(config: KvmeshConfig, model, backend, kv_caches, device, max_model_len: int,
                       block_size: int):
    """The decode CUDA-graph runner, captured now for the buckets up to the one holding
    scheduler.max_num_seqs (it falls back to eager by itself when it cannot capture)."""
    # CUDA only: the CPU path never loads the graph runner
    from kvmesh.worker.runner.cuda_graphs import DEFAULT_BUCKETS, CudaGraphRunner, select_bucket

    top = select_bucket(config.scheduler.max_num_seqs, DEFAULT_BUCKETS) or max(DEFAULT_BUCKETS)
    graphs = CudaGraphRunner(model, backend, kv_caches, device, max_model_len, block_size,
                             buckets=[b for b in DEFAULT_BUCKETS if b <= top],
                             tensor_parallel_size=config.parallel.tensor_parallel_size)
    graphs.capture()
    return graphs


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
