"""Turns a SchedulerOutput into tensors, runs the model, samples.

For each scheduled request the runner feeds tokens
all_token_ids[num_computed_tokens : num_computed_tokens + num_scheduled_tokens] at those
positions, writes their K/V into the request's blocks, and samples a token only for requests
whose scheduled tokens reach the end of what is known (a finished prefill or a decode).
Mid-prompt chunks produce no token.

KV cache memory (per layer, see worker/attention/backend.py for the block layout):

    device:  key/value [num_blocks, block_size, Hkv, D]  (+ fp16 scales when quantized)
    swap:    same shape with num_swap_blocks, pinned CPU memory on CUDA
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvmesh.core.config import ConfigError
from kvmesh.quant.kv_quant import KV_QUANT_DTYPES, KV_SCALE_DTYPE, kv_cache_layout
from kvmesh.quant.kv_quant import kv_storage_dtype as quantized_kv_storage_dtype
from kvmesh.worker.attention.backend import AttentionBackend, AttentionMetadata, LayerKVCache
from kvmesh.worker.kernels.lora_ops import LoraStep
from kvmesh.worker.runner.rejection_sampler import verify
from kvmesh.worker.runner.sampler import SampleResult, SamplingRow, sample

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in KV_QUANT_DTYPES:
        return quantized_kv_storage_dtype(kv_cache_dtype)
    return TORCH_DTYPES[kv_cache_dtype]


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       storage: torch.dtype, device: torch.device, pin: bool = False,
                       initialised: bool = True) -> list[LayerKVCache]:
    """initialised False: the tensors are left as allocated (the swap space, whose blocks are
    always written by a swap-out before a swap-in reads them): in host memory the pages then
    become resident only as blocks are swapped out, not all at start."""
    layout = kv_cache_layout(storage, head_dim)
    caches = []
    fill = (torch.zeros, torch.ones) if initialised else (torch.empty, torch.empty)
    for _ in range(num_layers):
        shape = (num_blocks, block_size, num_kv_heads, layout.stored_head_dim)
        k = fill[0](shape, dtype=storage, device=device, pin_memory=pin)
        v = fill[0](shape, dtype=storage, device=device, pin_memory=pin)
        ks = vs = None
        if layout.scales_per_head:
            # int8 / fp8: one scale per token-head, [.., Hkv]; int4: one per group, [.., Hkv, D/G]
            scale_shape = shape[:3] + ((layout.scales_per_head,) if storage == torch.uint8 else ())
            ks = fill[1](scale_shape, dtype=KV_SCALE_DTYPE, device=device, pin_memory=pin)
            vs = fill[1](scale_shape, dtype=KV_SCALE_DTYPE, device=device, pin_memory=pin)
        caches.append(LayerKVCache(k, v, ks, vs))
    return caches


@dataclass(frozen=True)
class BlockOps:
    """One step's block copies, (source, destination) block ids: plain tuples so the tensor-
    parallel group can ship them to the other ranks, which hold their own KV shards."""

    swap_out: tuple[tuple[int, int], ...] = ()  # (device block, swap block)
    swap_in: tuple[tuple[int, int], ...] = ()  # (swap block, device block)
    copy_blocks: tuple[tuple[int, int], ...] = ()  # (device block, device block), copy-on-write

    @classmethod
    def from_scheduler_output(cls, sched_out) -> "BlockOps":
        return cls(tuple((d, c) for d, c in sched_out.swap_out or ()),
                   tuple((c, d) for c, d in sched_out.swap_in or ()),
                   tuple((s, d) for s, d in sched_out.copy_blocks or ()))

    @property
    def empty(self) -> bool:
        return not (self.swap_out or self.swap_in or self.copy_blocks)


@dataclass(frozen=True)
class StepInputs:
    """Everything a forward needs besides the weights and the cache, as host lists: the flat
    token batch, its paged-attention metadata and which rows get logits. Built once on rank 0
    and sent as is to the other tensor-parallel ranks."""

    input_ids: tuple[int, ...]  # [T]
    positions: tuple[int, ...]  # [T]
    slot_mapping: tuple[int, ...]  # [T], block_id * block_size + offset
    query_lens: tuple[int, ...]  # [B]
    seq_lens: tuple[int, ...]  # [B], cached + new tokens
    block_tables: tuple[tuple[int, ...], ...]  # [B][blocks of request b]
    sample_at: tuple[int, ...]  # flat index of each row that gets logits (k + 1 per speculating request)
    # [B] the LoRA adapter slot of each request (None = base model); () when no request has one
    lora_slots: tuple[int | None, ...] = ()

    @classmethod
    def build(cls, scheduled, block_size: int) -> "StepInputs":
        """scheduled: ScheduledRequest entries (worker/engine_loop/scheduler_output.py) in batch order."""
        bs = block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_at: list[int] = []
        for entry in scheduled:
            blocks = entry.block_ids
            input_ids.extend(entry.token_ids)
            for p in entry.positions:
                positions.append(p)
                slots.append(blocks[p // bs] * bs + p % bs)
            query_lens.append(entry.num_scheduled_tokens)
            seq_lens.append(entry.num_computed_tokens + entry.num_scheduled_tokens)
            if entry.sample:  # the last token, and every drafted position before it
                sample_at.extend(range(len(input_ids) - 1 - len(entry.spec_token_ids), len(input_ids)))
        lora_slots = tuple(e.request.lora_slot for e in scheduled)
        return cls(tuple(input_ids), tuple(positions), tuple(slots), tuple(query_lens), tuple(seq_lens),
                   tuple(tuple(e.block_ids) for e in scheduled), tuple(sample_at),
                   lora_slots if any(s is not None for s in lora_slots) else ())

    def lora_segments(self) -> tuple[tuple[int, int, int], ...]:
        """(slot, first row, past the last row) of each run of token rows with one adapter
        (worker/kernels/lora_ops.py); one per slot when the requests come ordered by slot."""
        segments: list[tuple[int, int, int]] = []
        row = 0
        for slot, n in zip(self.lora_slots, self.query_lens):
            if slot is not None:
                if segments and segments[-1][0] == slot and segments[-1][2] == row:
                    segments[-1] = (slot, segments[-1][1], row + n)
                else:
                    segments.append((slot, row, row + n))
            row += n
        return tuple(segments)

    def block_table_tensor(self) -> torch.Tensor:
        """[B, longest table] int32 on the host, each request's row padded with block 0
        (never read: a request attends only to its seq_len tokens). One tensor creation."""
        width = max(len(b) for b in self.block_tables)
        return torch.tensor([b + (0,) * (width - len(b)) for b in self.block_tables], dtype=torch.int32)


@dataclass(frozen=True)
class StepResult:
    sampled: dict[str, int]  # request_id -> token id (after any accepted drafts)
    logprobs: dict[str, float]  # request_id -> chosen token's logprob (when asked)
    num_tokens: int  # tokens run through the model this step
    # Speculating requests: the drafts the target kept, in order, before `sampled`.
    accepted_drafts: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    # Speculating requests that asked for logprobs: one per accepted draft (`logprobs` has
    # the sampled token's).
    accepted_logprobs: dict[str, tuple[float, ...]] = dataclasses.field(default_factory=dict)


def _copy_blocks(dst_caches: list[LayerKVCache], src_caches: list[LayerKVCache], pairs: list[tuple[int, int]]) -> None:
    if not pairs:
        return
    src_idx = torch.tensor([s for s, _ in pairs], dtype=torch.long)
    dst_idx = torch.tensor([d for _, d in pairs], dtype=torch.long)
    for dst, src in zip(dst_caches, src_caches):
        s_dev, d_dev = src_idx.to(src.key_cache.device), dst_idx.to(dst.key_cache.device)
        dst.key_cache[d_dev] = src.key_cache[s_dev].to(dst.key_cache.device)
        dst.value_cache[d_dev] = src.value_cache[s_dev].to(dst.key_cache.device)
        if dst.quantized:
            dst.key_scale[d_dev] = src.key_scale[s_dev].to(dst.key_cache.device)
            dst.value_scale[d_dev] = src.value_scale[s_dev].to(dst.key_cache.device)


@torch.inference_mode()
def prefill_logits(model, input_ids: torch.Tensor, kv_caches: list[LayerKVCache],
                   backend: AttentionBackend) -> torch.Tensor:
    """One sequence through `model` as a single prefill: input_ids [T] -> logits [T, V] fp32.

    Its K/V go to blocks 0 .. ceil(T / block_size) - 1 of `kv_caches`, overwriting them, so
    the cache must be idle (calibration and teacher-forced evaluation, never while serving)."""
    t, block_size = input_ids.numel(), kv_caches[0].block_size
    if -(-t // block_size) > kv_caches[0].key_cache.shape[0]:
        raise ValueError(f"a {t}-token sequence needs {-(-t // block_size)} KV blocks; the cache has fewer")
    device = kv_caches[0].key_cache.device
    meta = AttentionMetadata.single_prefill(t, block_size, device)
    hidden = model(input_ids.to(device), torch.arange(t, device=device), kv_caches, meta, backend)
    return model.compute_logits(hidden)


def by_adapter_slot(scheduled) -> list:
    """The step's requests ordered by LoRA adapter slot, base requests first (a stable sort):
    each adapter's token rows become one segment of the batch (worker/kernels/lora_ops.py).
    Nothing else depends on the order: results are keyed by request, logits rows follow it."""
    return sorted(scheduled, key=lambda e: -1 if e.request.lora_slot is None else e.request.lora_slot)


def _split_logit_rows(scheduled) -> tuple[list[int], list[int]]:
    """Indices into the step's logits rows (StepInputs.sample_at order) of the plain
    sampling requests and of the speculating ones (k + 1 consecutive rows each)."""
    plain: list[int] = []
    spec: list[int] = []
    row = 0
    for entry in scheduled:
        if not entry.sample:
            continue
        width = 1 + len(entry.spec_token_ids)
        (spec if entry.spec_token_ids else plain).extend(range(row, row + width))
        row += width
    return plain, spec


class ModelRunner:
    def __init__(self, model, backend: AttentionBackend, device: torch.device, kv_caches: list[LayerKVCache],
                 swap_caches: list[LayerKVCache] | None, block_size: int, seed: int = 0):
        self.model = model
        self.backend = backend
        self.device = device
        self.kv_caches = kv_caches
        self.swap_caches = swap_caches
        self.block_size = block_size
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.fault_hook: Callable[[], None] | None = None  # tests inject forward failures here
        self.phase_clock = None  # the engine's StepPhaseClock: prepare / forward / sample laps
        # Decode steps replay captured CUDA graphs when set (worker/runner/cuda_graphs.py; CUDA only).
        self.graph_runner = None
        # LoRA adapter slots (worker/runner/lora_slots.py); None = this worker serves none.
        self.lora_slots = None
        # Why steps skipped the native step / CUDA graphs / compiled decode: reason -> steps.
        self.eager_step_reasons: collections.Counter[str] = collections.Counter()

    @property
    def native_max_tokens(self) -> int:
        """The largest step served as one native call (CpuModelRunner); 0: none is."""
        return 0

    def apply_block_ops(self, sched_out) -> None:
        """Swap-out, swap-in and copy-on-write copies, before the forward that needs them."""
        self.run_block_ops(BlockOps.from_scheduler_output(sched_out))

    def run_block_ops(self, ops: BlockOps) -> None:
        if ops.swap_out:
            _copy_blocks(self.swap_caches, self.kv_caches, list(ops.swap_out))
        if ops.swap_in:
            _copy_blocks(self.kv_caches, self.swap_caches, list(ops.swap_in))
        if ops.copy_blocks:
            _copy_blocks(self.kv_caches, self.kv_caches, list(ops.copy_blocks))

    @torch.inference_mode()
    def execute(self, scheduled, rows_for: Callable[[object], SamplingRow]) -> StepResult:
        """scheduled: ScheduledRequest entries (worker/engine_loop/scheduler_output.py) in batch order."""
        if self.fault_hook is not None:
            self.fault_hook()
        clock = self.phase_clock
        if any(e.request.lora_slot is not None for e in scheduled):
            scheduled = by_adapter_slot(scheduled)
        inputs = StepInputs.build(scheduled, self.block_size)
        if clock is not None:
            clock.lap("prepare")
        logits = self.forward(inputs)
        if clock is not None:
            clock.lap("forward")
        if logits is None:
            return StepResult({}, {}, len(inputs.input_ids))
        plain = [e for e in scheduled if e.sample and not e.spec_token_ids]
        speculating = [e for e in scheduled if e.sample and e.spec_token_ids]
        plain_rows, spec_rows = _split_logit_rows(scheduled)
        sampled: dict[str, int] = {}
        logprobs: dict[str, float] = {}
        if plain:
            plain_logits = logits if not speculating else logits[torch.tensor(plain_rows)]
            result: SampleResult = sample(plain_logits, [rows_for(e.request) for e in plain], self.generator)
            sampled = {e.request_id: t for e, t in zip(plain, result.token_ids)}
            if result.logprobs is not None:
                logprobs = {e.request_id: lp for e, lp in zip(plain, result.logprobs) if e.request.sampling.logprobs}
        accepted: dict[str, tuple[int, ...]] = {}
        accepted_logprobs: dict[str, tuple[float, ...]] = {}
        if speculating:
            verified = verify(logits[torch.tensor(spec_rows)], [e.spec_token_ids for e in speculating],
                              [rows_for(e.request) for e in speculating], self.generator)
            for e, v in zip(speculating, verified):
                sampled[e.request_id] = v.next_token
                accepted[e.request_id] = v.accepted
                if v.logprobs is not None:
                    accepted_logprobs[e.request_id], logprobs[e.request_id] = v.logprobs[:-1], v.logprobs[-1]
        if clock is not None:
            clock.lap("sample")
        return StepResult(sampled, logprobs, len(inputs.input_ids), accepted, accepted_logprobs)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor | None:
        """The model on one step's batch -> fp32 CPU logits [len(sample_at), V], or None when
        no request samples this step (a mid-prompt chunk only): eagerly, or as CUDA graphs
        (CpuModelRunner runs small CPU steps as one native call first). A step with adapter rows
        runs eagerly: only the eager layers add LoRA updates."""
        if inputs.lora_slots:
            self.eager_step_reasons["lora_rows"] += 1
            hidden = self._eager_forward(inputs, self._lora_step(inputs))
        else:
            hidden = None if self.graph_runner is None else self.graph_runner.run(inputs)
            if hidden is None:
                hidden = self._eager_forward(inputs)
        if not inputs.sample_at:
            return None
        return self.model.compute_logits(hidden[torch.tensor(inputs.sample_at, device=self.device)]).cpu()

    def _lora_step(self, inputs: StepInputs) -> LoraStep:
        return LoraStep(self.lora_slots.groups, inputs.lora_segments())

    def _eager_forward(self, inputs: StepInputs, lora: LoraStep | None = None) -> torch.Tensor:
        dev = self.device
        # One tensor creation per field, not one per request: this runs every step.
        table = inputs.block_table_tensor()
        qsl = torch.tensor((0, *itertools.accumulate(inputs.query_lens)), dtype=torch.int32)
        meta = AttentionMetadata(
            query_start_loc=qsl.to(dev), seq_lens=torch.tensor(inputs.seq_lens, dtype=torch.int32, device=dev),
            block_tables=table.to(dev), slot_mapping=torch.tensor(inputs.slot_mapping, dtype=torch.long, device=dev),
            max_query_len=max(inputs.query_lens), max_seq_len=max(inputs.seq_lens),
            query_lens_host=inputs.query_lens, seq_lens_host=inputs.seq_lens)
        return self.model(torch.tensor(inputs.input_ids, dtype=torch.long, device=dev),
                          torch.tensor(inputs.positions, dtype=torch.long, device=dev), self.kv_caches, meta,
                          self.backend, lora)
