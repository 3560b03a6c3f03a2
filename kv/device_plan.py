"""Everything an engine holds on its device, and the KV pools sized from what is left.

    device x gpu_memory_utilization  (the plan's budget: the articles' "plan to <= ~80%")
    ├── runtime            CUDA context, allocator, anything already in use before loading
    ├── weights            the served model (this rank's shard)
    ├── draft weights      speculative.method self_draft: its int8/int4 copy (rank 0 only)
    ├── activations        the profiled peak of one forward of max_num_batched_tokens
    ├── CUDA graphs        the captured decode graphs' private pool + their static inputs
    ├── sampler            logits and the sampler's temporaries for the largest sampled batch
    ├── LoRA slots         lora.max_loras adapter slots at lora.max_rank on every projection
    ├── KV pool            num_blocks x bytes per block                       <- sized here
    └── draft KV pool      num_draft_blocks x the draft's bytes per block     <- sized here

Every part except the two pools is known (measured or estimated) before the pools are sized,
so the sum of all parts never exceeds the budget: the articles' "memory looks free but the
allocation fails" cannot come from the engine's own later allocations. The self-draft's pool
holds as many blocks as the target's unless speculative.draft_num_blocks says otherwise; with
both pools sized together, each block of the target has its draft block.

Pure arithmetic (no torch): the engine (worker/engine_loop/engine_setup.py) fills the parts
from its device, tests fill them with made-up sizes, and the memory metrics export `split()`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from kvmesh.core.config import ConfigError

# Bytes per logit the sampler holds at its peak (worker/runner/sampler.py): fp32 logits,
# log-softmax, probabilities, sorted probabilities and their cumulative sum (5 x 4), the
# sort order (int64, 8) and two boolean masks (2).
SAMPLER_BYTES_PER_LOGIT = 30


@dataclass(frozen=True)
class DeviceParts:
    """Bytes of each part known before the KV pools are sized (see the module picture)."""

    runtime_bytes: int = 0
    weight_bytes: int = 0
    draft_weight_bytes: int = 0
    activation_bytes: int = 0
    cuda_graph_bytes: int = 0
    sampler_bytes: int = 0
    lora_slot_bytes: int = 0  # worker/runner/lora_slots.py AdapterSlots.max_bytes: allocated as adapters arrive

    @property
    def total_bytes(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True)
class DevicePlan:
    budget_bytes: int  # device x utilization
    parts: DeviceParts
    kv_bytes_per_block: int
    draft_kv_bytes_per_block: int  # 0 = no self-draft pool
    num_blocks: int
    num_draft_blocks: int

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_blocks * self.kv_bytes_per_block

    @property
    def draft_kv_pool_bytes(self) -> int:
        return self.num_draft_blocks * self.draft_kv_bytes_per_block

    @property
    def total_bytes(self) -> int:
        return self.parts.total_bytes + self.kv_pool_bytes + self.draft_kv_pool_bytes

    def split(self) -> dict[str, int]:
        """part -> bytes, every allocation the plan counts (the memory metrics' `part` label)."""
        p = self.parts
        return {"runtime": p.runtime_bytes, "weights": p.weight_bytes, "draft_weights": p.draft_weight_bytes,
                "activations": p.activation_bytes, "cuda_graphs": p.cuda_graph_bytes, "sampler": p.sampler_bytes,
                "lora_slots": p.lora_slot_bytes,
                "kv_pool": self.kv_pool_bytes, "draft_kv_pool": self.draft_kv_pool_bytes}


def plan_device(budget_bytes: int, parts: DeviceParts, kv_bytes_per_block: int, *,
                draft_kv_bytes_per_block: int = 0, draft_num_blocks: int | None = None,
                num_blocks: int | None = None, must_fit: bool = True) -> DevicePlan:
    """Size the KV pool (and the self-draft's) from what the other parts leave of the budget.

    draft_kv_bytes_per_block > 0: a self-draft pool of `draft_num_blocks` blocks, or None = as
    many as the target's (both sized together). num_blocks given (cache.num_blocks): the
    pools must fit next to the other parts, or ConfigError says by how much they do not
    (must_fit False: an explicit size is taken as given, as on CPU where host RAM is the limit)."""
    if kv_bytes_per_block < 1 or budget_bytes < 0:
        raise ValueError("kv_bytes_per_block must be >= 1 and budget_bytes >= 0")
    drafting = draft_kv_bytes_per_block > 0
    left = budget_bytes - parts.total_bytes
    if num_blocks is None:
        if drafting and draft_num_blocks is None:
            num_blocks = max(0, left) // (kv_bytes_per_block + draft_kv_bytes_per_block)
        else:
            fixed_draft = (draft_num_blocks or 0) * draft_kv_bytes_per_block if drafting else 0
            num_blocks = max(0, left - fixed_draft) // kv_bytes_per_block
    num_draft = (num_blocks if draft_num_blocks is None else draft_num_blocks) if drafting else 0
    plan = DevicePlan(budget_bytes, parts, kv_bytes_per_block, draft_kv_bytes_per_block, num_blocks, num_draft)
    if plan.num_blocks < 1 or (drafting and plan.num_draft_blocks < 1):
        raise ConfigError(f"no memory left for the KV cache: {_describe(plan)}")
    if must_fit and plan.total_bytes > budget_bytes:
        raise ConfigError(f"the KV pools do not fit the device budget by {plan.total_bytes - budget_bytes} bytes: "
                          f"{_describe(plan)} (lower cache.num_blocks / speculative.draft_num_blocks, or raise "
                          f"cache.gpu_memory_utilization)")
    return plan


def _describe(plan: DevicePlan) -> str:
    parts = ", ".join(f"{name} {nbytes / 2**20:.1f} MiB" for name, nbytes in plan.split().items() if nbytes)
    return f"budget {plan.budget_bytes / 2**20:.1f} MiB; {parts}"


def graph_static_bytes(buckets: list[int], max_blocks_per_seq: int, hidden_size: int, dtype_bytes: int) -> int:
    """The captured decode graphs' static inputs and outputs, one set per bucket
    (worker/runner/cuda_graphs.py PaddedDecode): ids, positions, slots (int64), sequence
    lengths and query starts (int32), the block table (int32) and the hidden output."""
    return sum(b * (3 * 8 + 4) + (b + 1) * 4 + b * max_blocks_per_seq * 4 + b * hidden_size * dtype_bytes
               for b in buckets)


def scaled_activation_bytes(peak_bytes: int, profiled_tokens: int, tokens: int) -> int:
    """Activations of a forward of `tokens`, from the profiled peak of `profiled_tokens`
    (activations grow linearly with the token count; rounded up, never below zero)."""
    if profiled_tokens < 1:
        return 0
    return math.ceil(max(0, peak_bytes) * min(tokens, profiled_tokens) / profiled_tokens)
