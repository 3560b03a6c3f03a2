"""Decode-step capture on CUDA: one CUDA graph per batch-size bucket, replayed each step.

A decode step of a ~30-layer model launches ~30 x 15 kernels; at small batch the GPU waits on
Python and the launch queue, not on memory. A captured graph replays all of them in one
launch (vLLM's CUDAGraphRunner, gpt-fast's compiled decode).

    buckets        batch sizes captured at start (default 1, 2, 4, 8, 16, 32, 64, 128); a
                   decode batch of B runs in the smallest bucket >= B, larger ones run eagerly
    padding        rows B .. bucket-1 are padding: token 0 at position 0, slot PAD_SLOT (-1,
                   which the Triton write_kv kernels skip, so no cache block is touched),
                   seq_len 0 (the attention kernel sees no key and writes zeros); block-table
                   rows are zero. Their outputs are dropped (`hidden[:B]`).
    static inputs  one set per bucket, sized for the longest sequence (max_model_len): the
                   block table is [bucket, ceil(max_model_len / block_size)], and the
                   attention kernel's split-KV plan is made for max_model_len at capture,
                   then reads each row's real length on device.
    warm-up        each bucket runs once eagerly (Triton compiles and autotunes outside the
                   capture), then is captured; all share one memory pool.
    fallback       only all-decode batches are replayed, only with the Triton attention
                   backend (the torch backend plans on host lists), only on CUDA and at
                   tensor-parallel size 1. Any capture failure logs once and turns graphs off
                   for the engine: the eager forward runs, as with cuda_graphs: false.

The host-side parts (bucket choice, padding, the decision to fall back) are plain torch on
CPU and tested there; capture and replay need a GPU (load_tests/gpu_check.py measures them).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvmesh.worker.attention.backend import AttentionMetadata

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
PAD_SLOT = -1  # slot_mapping of a padding row: write_kv skips it


def select_bucket(batch_size: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding batch_size rows, or None (run eagerly)."""
    if batch_size < 1:
        return None
    fitting = [b for b in buckets if b >= batch_size]
    return min(fitting) if fitting else None


def graph_buckets(max_num_seqs: int, buckets: Sequence[int]) -> list[int]:
    """The buckets captured for a scheduler of max_num_seqs: up to the one holding it (all of
    them when none does)."""
    top = select_bucket(max_num_seqs, buckets) or max(buckets)
    return [b for b in buckets if b <= top]


def validate_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    """Sorted, distinct, positive bucket sizes; ValueError otherwise."""
    if not buckets or any(int(b) != b or b < 1 for b in buckets):
        raise ValueError(f"CUDA-graph buckets must be positive integers, got {list(buckets)}")
    return tuple(sorted(set(int(b) for b in buckets)))


@dataclass(frozen=True)
class PaddedDecode:
    """One decode batch padded to its bucket, as host tensors (copied into a graph's static
    inputs before replay)."""

    batch_size: int  # real rows; rows [batch_size, bucket) are padding
    input_ids: torch.Tensor  # [bucket] int64
    positions: torch.Tensor  # [bucket] int64
    slot_mapping: torch.Tensor  # [bucket] int64, PAD_SLOT on padding rows
    seq_lens: torch.Tensor  # [bucket] int32, 0 on padding rows
    block_tables: torch.Tensor  # [bucket, max_blocks_per_seq] int32, zeros past each row's blocks
    query_start_loc: torch.Tensor  # [bucket + 1] int32: 0, 1, ..., bucket (one token a row)

    @property
    def bucket(self) -> int:
        return self.input_ids.shape[0]


def is_decode_only(inputs) -> bool:
    """Every request feeds one token and samples it (StepInputs of a pure decode step)."""
    n = len(inputs.query_lens)
    return n > 0 and all(q == 1 for q in inputs.query_lens) and len(inputs.sample_at) == n


def pad_decode(inputs, bucket: int, max_blocks_per_seq: int) -> PaddedDecode:
    """StepInputs of a decode-only batch -> the batch padded to `bucket` rows."""
    b = len(inputs.query_lens)
    if not is_decode_only(inputs):
        raise ValueError("only decode-only batches (one sampled token per request) are padded")
    if b > bucket:
        raise ValueError(f"a batch of {b} does not fit bucket {bucket}")
    longest = max(len(blocks) for blocks in inputs.block_tables)
    if longest > max_blocks_per_seq:
        raise ValueError(f"a request holds {longest} blocks, the graphs were sized for {max_blocks_per_seq}")
    input_ids = torch.zeros(bucket, dtype=torch.long)
    positions = torch.zeros(bucket, dtype=torch.long)
    slot_mapping = torch.full((bucket,), PAD_SLOT, dtype=torch.long)
    seq_lens = torch.zeros(bucket, dtype=torch.int32)
    tables = torch.zeros((bucket, max_blocks_per_seq), dtype=torch.int32)
    input_ids[:b] = torch.tensor(inputs.input_ids, dtype=torch.long)
    positions[:b] = torch.tensor(inputs.positions, dtype=torch.long)
    slot_mapping[:b] = torch.tensor(inputs.slot_mapping, dtype=torch.long)
    seq_lens[:b] = torch.tensor(inputs.seq_lens, dtype=torch.int32)
    for i, blocks in enumerate(inputs.block_tables):
        tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    query_start_loc = torch.arange(bucket + 1, dtype=torch.int32)
    return PaddedDecode(b, input_ids, positions, slot_mapping, seq_lens, tables, query_start_loc)


def padded_metadata(padded: PaddedDecode, max_seq_len: int, device: torch.device | None = None) -> AttentionMetadata:
    """Attention metadata of a padded decode batch. max_seq_len is the graph's planning bound
    (max_model_len), not this batch's longest row. Host copies of the lengths exist only for
    host tensors: a graph's static inputs live on the GPU and change every replay, and the
    Triton backend reads lengths on the device only."""
    dev = device or padded.input_ids.device
    on_host = padded.seq_lens.device.type == "cpu"
    return AttentionMetadata(
        query_start_loc=padded.query_start_loc.to(dev), seq_lens=padded.seq_lens.to(dev),
        block_tables=padded.block_tables.to(dev), slot_mapping=padded.slot_mapping.to(dev),
        max_query_len=1, max_seq_len=max_seq_len, query_lens_host=(1,) * padded.bucket,
        seq_lens_host=tuple(padded.seq_lens.tolist()) if on_host else ())


@dataclass
class _Graph:
    graph: object  # torch.cuda.CUDAGraph
    static: PaddedDecode  # device tensors the graph reads
    hidden: torch.Tensor  # [bucket, H] the graph writes


class CudaGraphRunner:
    """Captures and replays the decode forward of `model` (see module doc).

    `enabled` is False (with `disabled_reason`) when graphs cannot run here; `run` then
    always returns None and the caller runs its eager forward."""

    def __init__(self, model, backend, kv_caches, device: torch.device, max_model_len: int, block_size: int,
                 buckets: Sequence[int] = DEFAULT_BUCKETS, tensor_parallel_size: int = 1):
        self.model, self.backend, self.kv_caches, self.device = model, backend, kv_caches, device
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.buckets = validate_buckets(buckets)
        self.graphs: dict[int, _Graph] = {}
        self.disabled_reason = self._why_not(device, backend, tensor_parallel_size)
        self.replays = 0

    @staticmethod
    def _why_not(device: torch.device, backend, tensor_parallel_size: int) -> str | None:
        if getattr(backend, "name", None) != "triton":
            return f"attention backend {getattr(backend, 'name', backend)!r} plans on the host (needs triton)"
        if tensor_parallel_size != 1:
            return "tensor parallelism: collectives are not captured"
        if device.type != "cuda" or not torch.cuda.is_available():
            return "not a CUDA device"
        return None

    @property
    def enabled(self) -> bool:
        return self.disabled_reason is None

    def disable(self, reason: str) -> None:
        if self.enabled:
            logger.warning("CUDA graphs off, decode runs eagerly: %s", reason)
        self.disabled_reason = reason
        self.graphs.clear()

    def _static_for(self, bucket: int) -> PaddedDecode:
        dev = self.device
        return PaddedDecode(
            0, torch.zeros(bucket, dtype=torch.long, device=dev), torch.zeros(bucket, dtype=torch.long, device=dev),
            torch.full((bucket,), PAD_SLOT, dtype=torch.long, device=dev),
            torch.zeros(bucket, dtype=torch.int32, device=dev),
            torch.zeros((bucket, self.max_blocks_per_seq), dtype=torch.int32, device=dev),
            torch.arange(bucket + 1, dtype=torch.int32, device=dev))

    def _forward(self, static: PaddedDecode) -> torch.Tensor:
        meta = padded_metadata(static, self.max_model_len, self.device)
        return self.model(static.input_ids, static.positions, self.kv_caches, meta, self.backend)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first (the pool fits the rest); on any
        failure turn graphs off and leave the engine eager."""
        if not self.enabled:
            logger.info("CUDA graphs not captured: %s", self.disabled_reason)
            return
        pool = None
        try:
            for bucket in sorted(self.buckets, reverse=True):
                static = self._static_for(bucket)
                self._forward(static)  # warm-up: Triton compiles outside the capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = self._forward(static)
                pool = graph.pool()
                self.graphs[bucket] = _Graph(graph, static, hidden)
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 - any capture failure means: run eagerly
            self.disable(f"capture failed: {type(exc).__name__}: {exc}")
            return
        logger.info("captured CUDA graphs for decode batch buckets %s", sorted(self.graphs))

    def run(self, inputs) -> torch.Tensor | None:
        """Final hidden states [B, H] of a decode-only batch through its bucket's graph, or
        None when this batch runs eagerly (not decode-only, too large, graphs off)."""
        if not self.enabled or not is_decode_only(inputs):
            return None
        bucket = select_bucket(len(inputs.query_lens), self.graphs.keys())
        if bucket is None:
            return None
        entry = self.graphs[bucket]
        padded = pad_decode(inputs, bucket, self.max_blocks_per_seq)
        s = entry.static
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables"):
            getattr(s, name).copy_(getattr(padded, name), non_blocking=True)
        entry.graph.replay()
        self.replays += 1
        return entry.hidden[:padded.batch_size]
