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

import ctypes
import logging
from dataclasses import dataclass

import torch

from kvmesh.core.config import ConfigError, KvmeshConfig
from kvmesh.kv.kv_cache_manager import KVCacheManager
from kvmesh.kv.capacity import kv_bytes_per_token, num_blocks_for_budget
from kvmesh.kv.device_plan import (SAMPLER_BYTES_PER_LOGIT, DeviceParts, DevicePlan, graph_static_bytes, plan_device,
                                   scaled_activation_bytes)
from kvmesh.worker.attention.backend import AttentionMetadata
from kvmesh.worker.runner.cpu_model_runner import CpuModelRunner
from kvmesh.worker.runner.model_runner import ModelRunner, allocate_kv_caches, kv_storage_dtype
from kvmesh.worker.runner.model_setup import (allocate_rank_caches, load_model, pick_backend, require_backend_features,
                                             resolve_model, with_valid_group_size)
from kvmesh.worker.model.tokenizer import load_tokenizer
from kvmesh.worker.runner.tp_group import TensorParallelGroup, TensorParallelRunner
from kvmesh.worker.engine_loop.self_draft import DraftModel, load_draft
from kvmesh.worker.runner.host_tier_store import HostTierStore
from kvmesh.worker.runner.lora_slots import AdapterSlots

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
    num_draft_blocks: int = 0  # the self-draft's KV pool (speculative.method self_draft)
    device: DevicePlan | None = None  # every allocation the plan counts (kv/device_plan.py)

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
    # which forward serves small steps ("native amx" | "native avx512_bf16" | "native fma" |
    # "compiled" | "eager") and why: the start log line and kvmesh_model_info carry both
    forward_path: str = "eager"
    forward_path_reason: str = ""
    draft: DraftModel | None = None  # speculative.method self_draft: its model (its pool: plan.num_draft_blocks)
    weight_quant: str = "none"  # quant.weight as served (auto resolved)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def _effective_kv_dtype_name(config: KvmeshConfig, dtype: torch.dtype) -> str:
    if config.cache.kv_cache_dtype != "auto":
        return config.cache.kv_cache_dtype
    return _dtype_name(dtype)


def _eos_ids(hf_config, tokenizer) -> tuple[int, ...]:
    ids = set()
    eos = getattr(hf_config, "eos_token_id", None)
    for v in (eos if isinstance(eos, (list, tuple)) else [eos]):
        if v is not None:
            ids.add(int(v))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def _tensor_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(b.numel() * b.element_size() for b in model.buffers())


def _plan_memory(config: KvmeshConfig, model, hf_config, device, kv_dtype_name: str,
                 profile_peak, max_model_len: int, draft: DraftModel | None = None,
                 tensor_parallel: bool = False) -> MemoryPlan:
    """Every device allocation of the engine (kv/device_plan.py's picture) counted before the
    KV pools are sized: CUDA budget = gpu_memory_utilization x device memory; CPU budget =
    cache.cpu_kv_cache_gib for the KV pools alone (host RAM holds the rest)."""
    cache_cfg = config.cache
    # The capacity model's formula (kv/capacity.py), the same `kvmesh capacity` prints.
    # model.num_kv_heads: this rank's KV heads (each tensor-parallel rank caches its own).
    per_token = kv_bytes_per_token(hf_config.num_hidden_layers, model.num_kv_heads, model.head_dim,
                                   kv_dtype_name)
    per_block = per_token * cache_cfg.block_size
    weight_bytes = _tensor_bytes(model)
    draft_weight_bytes = _tensor_bytes(draft.model) if draft is not None else 0
    draft_per_block = 0
    if draft is not None:  # the self-draft caches K and V in its model dtype, all heads (rank 0)
        draft_per_block = cache_cfg.block_size * kv_bytes_per_token(
            hf_config.num_hidden_layers, draft.model.num_kv_heads, draft.model.head_dim, _dtype_name(draft.spec.dtype))
    draft_blocks = config.speculative.draft_num_blocks
    if device.type == "cuda":
        peak = profile_peak()
        total = torch.cuda.get_device_properties(device).total_memory
        free, _ = torch.cuda.mem_get_info(device)
        parts = DeviceParts(
            runtime_bytes=max(0, total - free - weight_bytes - draft_weight_bytes),  # in use besides the weights
            weight_bytes=weight_bytes, draft_weight_bytes=draft_weight_bytes, activation_bytes=peak,
            cuda_graph_bytes=_graph_bytes(config, hf_config, next(model.parameters()).element_size(), peak,
                                          max_model_len, tensor_parallel),
            sampler_bytes=_sampler_bytes(config, hf_config),
            lora_slot_bytes=0 if tensor_parallel or not config.lora.max_loras else AdapterSlots.max_bytes(
                hf_config, config.lora.max_loras, config.lora.max_rank, next(model.parameters()).dtype))
        dplan = plan_device(int(total * cache_cfg.gpu_memory_utilization), parts, per_block,
                            draft_kv_bytes_per_block=draft_per_block, draft_num_blocks=draft_blocks,
                            num_blocks=cache_cfg.num_blocks)
    else:
        # Host RAM holds everything: cache.cpu_kv_cache_gib sizes the KV pools alone, and the
        # other parts ride on top of it so the plan (and kvmesh_memory_planned_bytes) still
        # reports each one: weights, the step's workspace (estimated), the sampler.
        peak = 0
        parts = DeviceParts(weight_bytes=weight_bytes, draft_weight_bytes=draft_weight_bytes,
                            activation_bytes=_cpu_workspace_bytes(config, model),
                            sampler_bytes=_sampler_bytes(config, hf_config))
        dplan = plan_device(int(cache_cfg.cpu_kv_cache_gib * GIB) + parts.total_bytes, parts, per_block,
                            draft_kv_bytes_per_block=draft_per_block, draft_num_blocks=draft_blocks,
                            num_blocks=cache_cfg.num_blocks, must_fit=cache_cfg.num_blocks is None)
    num_blocks = dplan.num_blocks
    num_swap = num_blocks_for_budget(int(cache_cfg.swap_space_gib * GIB), cache_cfg.block_size, per_token)
    num_tier = cache_cfg.host_tier_num_blocks
    if num_tier is None:
        num_tier = num_blocks_for_budget(int(cache_cfg.host_tier_gib * GIB), cache_cfg.block_size, per_token)
    return MemoryPlan(weight_bytes, per_token, cache_cfg.block_size, num_blocks, num_swap,
                      num_blocks * per_block, peak, num_tier if cache_cfg.enable_prefix_caching else 0,
                      dplan.num_draft_blocks, dplan)


def _cpu_workspace_bytes(config: KvmeshConfig, model) -> int:
    """An estimate of a CPU step's largest live temporaries at max_num_batched_tokens T: the
    residual stream and norm outputs (3 T H), the merged q|k|v (T (Hq + 2 Hkv) D) and the
    attention output (T Hq D), gate|up and the activation (3 T I), in the model dtype; plus
    the float weight a quantized projection without a packed kernel dequantizes per call (the
    largest one, gate|up: 2 I H, fp32)."""
    cfg = model.config
    t, h, d = config.scheduler.max_num_batched_tokens, cfg.hidden_size, model.head_dim
    inter = cfg.intermediate_size // model.coll.world_size
    heads = model.model.layers[0].self_attn.num_heads
    elem = next(model.parameters()).element_size()
    stream = t * (3 * h + (2 * heads + 2 * model.num_kv_heads) * d + 3 * inter) * elem
    quantized = config.quant.weight != "none"
    return stream + (2 * inter * h * 4 if quantized else 0)


def _graph_bytes(config: KvmeshConfig, hf_config, dtype_bytes: int, peak: int, max_model_len: int,
                 tensor_parallel: bool) -> int:
    """The decode CUDA graphs' pool (a forward of the largest bucket's tokens, scaled from the
    profiled peak) and their static inputs; 0 when build_graph_runner will not capture."""
    if not config.parallel.cuda_graphs or tensor_parallel:
        return 0
    from kvmesh.worker.runner.cuda_graphs import DEFAULT_BUCKETS, graph_buckets  # CUDA only, as build_graph_runner

    buckets = graph_buckets(config.scheduler.max_num_seqs, DEFAULT_BUCKETS)
    max_blocks = -(-max_model_len // config.cache.block_size)
    return (graph_static_bytes(buckets, max_blocks, hf_config.hidden_size, dtype_bytes)
            + scaled_activation_bytes(peak, config.scheduler.max_num_batched_tokens, max(buckets)))


def _sampler_bytes(config: KvmeshConfig, hf_config) -> int:
    """Logits and sampler temporaries of the largest sampled batch: every running sequence,
    each with its speculative drafts scored too."""
    rows = config.scheduler.max_num_seqs
    if config.speculative.method != "none":
        rows *= 1 + config.speculative.num_tokens
    return rows * hf_config.vocab_size * SAMPLER_BYTES_PER_LOGIT


def _return_freed_heap() -> None:
    """Hands the heap the load freed back to the OS (glibc's malloc_trim): the load's
    temporaries (file reads, dequantized copies, the LM head's exactness check) stay in glibc's
    arenas otherwise and count in the worker's RSS for its life (~65 MiB for the embedded GGUF).
    A no-op where the C library has no malloc_trim."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def build_engine_parts(config: KvmeshConfig, worker_id: str = "worker-0") -> EngineParts:
    spec = resolve_model(config)  # quant.weight auto -> what this machine serves best exactly, in the spec
    config = config.replace(quant={"weight": spec.weight_quant})
    config = with_valid_group_size(config, spec.hf_config)
    require_backend_features(spec.arch, pick_backend(config, spec.device))  # before any weight loads
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
    # The self-draft loads before the plan: its weights and KV pool are part of the budget.
    draft = load_draft(config) if config.speculative.method == "self_draft" else None
    plan = _plan_memory(config, model, hf_config, device, kv_dtype_name,
                        profile_peak=lambda: _profile_peak(model, config, device), max_model_len=max_model_len,
                        draft=draft, tensor_parallel=group is not None)
    kv_caches, swap_caches = allocate_rank_caches(config, spec, model, plan.num_blocks, plan.num_swap_blocks)
    if group is None:
        if device.type == "cpu":
            runner = CpuModelRunner(model, backend, kv_caches, swap_caches, plan.block_size, seed=config.model.seed,
                                    native_max_tokens=config.model.cpu_native_max_tokens,
                                    int4_int8_activations=config.quant.int4_activations == "int8",
                                    max_step_tokens=config.scheduler.max_num_batched_tokens)
        else:
            runner = ModelRunner(model, backend, device, kv_caches, swap_caches, plan.block_size,
                                 seed=config.model.seed)
        if config.parallel.cuda_graphs and device.type == "cuda":
            reserved_before = torch.cuda.memory_reserved(device)
            runner.graph_runner = build_graph_runner(config, model, backend, kv_caches, device, max_model_len,
                                                     plan.block_size)
            used = torch.cuda.memory_reserved(device) - reserved_before
            if used > plan.device.parts.cuda_graph_bytes:  # the estimate is what kept the plan honest
                logger.warning("CUDA graphs took %.1f MiB, the memory plan counted %.1f MiB",
                               used / 2**20, plan.device.parts.cuda_graph_bytes / 2**20)
    else:
        runner = TensorParallelRunner(group, plan, model, backend, device, kv_caches, swap_caches, plan.block_size,
                                      seed=config.model.seed)
    path, path_reason = _forward_path(runner, model, device)
    if group is None and config.lora.max_loras:
        # Slot stacks are allocated per projection on the first adapter that targets it.
        runner.lora_slots = AdapterSlots(hf_config, config.lora.max_loras, config.lora.max_rank, dtype, device)
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
    logger.info("device plan (budget %.1f MiB): %s", plan.device.budget_bytes / 2**20,
                ", ".join(f"{part} {nbytes / 2**20:.1f} MiB" for part, nbytes in plan.device.split().items()))
    if device.type == "cpu":
        _return_freed_heap()
    logger.info("serving %s (%s), weights %s: forward %s (%s)", spec.name, spec.arch.model_type,
                config.quant.weight, path, path_reason)
    return EngineParts(runner, kv_manager, tokenizer, hf_config, spec.name, kv_dtype_name, max_model_len,
                       _eos_ids(hf_config, tokenizer), plan, device, tier_store, path, path_reason, draft,
                       config.quant.weight)


def build_graph_runner(config: KvmeshConfig, model, backend, kv_caches, device, max_model_len: int,
                       block_size: int):
    """The decode CUDA-graph runner, captured now for the buckets up to the one holding
    scheduler.max_num_seqs (it falls back to eager by itself when it cannot capture)."""
    # CUDA only: the CPU path never loads the graph runner
    from kvmesh.worker.runner.cuda_graphs import DEFAULT_BUCKETS, CudaGraphRunner, graph_buckets

    graphs = CudaGraphRunner(model, backend, kv_caches, device, max_model_len, block_size,
                             buckets=graph_buckets(config.scheduler.max_num_seqs, DEFAULT_BUCKETS),
                             tensor_parallel_size=config.parallel.tensor_parallel_size)
    graphs.capture()
    return graphs


def _forward_path(runner, model, device: torch.device) -> tuple[str, str]:
    """(which forward serves small steps, why): what the start line and kvmesh_model_info say.
    On CPU the runner chose (worker/runner/cpu_model_runner.py): "native <path>", path the native
    step's projections (amx | avx512_bf16 | fma | avx2 | int4_avx2 | int4_avx2_a8) and the reason
    naming its build, size and numerics (token-exact or not), or eager / compiled with the native
    step's refusal."""
    if isinstance(runner, CpuModelRunner):
        step = runner.cpu_step
        if step.path != "torch":
            return (f"native {step.path}",
                    f"the {step.variant} build, steps of <= {step.max_tokens} tokens, {step.numerics}")
        not_native = step.reason
    else:
        not_native = "tensor parallelism" if isinstance(runner, TensorParallelRunner) else f"device {device.type}"
    return ("compiled" if model.compiled is not None else "eager"), f"native step not taken: {not_native}"


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
