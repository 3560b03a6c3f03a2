"""The CPU attention fast path: varlen attention over the paged cache, planned once per step.

The reference backend (worker/attention/torch_backend.py, the oracle this one is tested against)
gathers every decode row's blocks up to the longest context of the batch, in every layer,
and rebuilds its index and mask tensors each time: per step it does
layers x batch x longest-context work. Here:

  * The step's plan (which cache slots each query reads, and the masks) is built ONCE per
    step, by the first layer, from the metadata's host copies, and reused by every layer:
    `AttentionMetadata.backend_plans` carries it for the life of the step's metadata.
  * Decode rows are sorted by context length and cut into groups whose padded size stays
    within `PAD_RATIO` of the tokens they really attend, so the gathered K/V and the SDPA
    work grow with the attended tokens, not with batch x longest context. Each group is one
    block-granular gather of its rows' own blocks (contiguous copies, no per-token index)
    and one scaled_dot_product_attention call.
  * A prefill chunk reads exactly its context's blocks; a chunk with no cached context uses
    SDPA's own causal path instead of an explicit mask.
  * Where the compiled kernel of worker/kernels/cpu_paged_attention.py is available (a C
    compiler, AVX2 / AVX-512) and the cache is unquantized fp32 / bf16, all decode rows of a
    layer run in ONE kernel call that reads K/V in place through the block tables: no gather,
    no padding, no SDPA call per group. The grouped path above remains for the rest (quantized
    KV, no compiler) and is what the kernel is tested against, with the torch reference.

Numerics are those of the reference: same dtype, same SDPA, padding masked out; the engine's
exactness prompts give identical tokens with either backend (tests/test_attention_cpu.py).

A layer with a sliding window gets a plan of its own (its masks also hide what lies before the
window), and a windowed or soft-capped layer runs the grouped path and the reference's
arithmetic (torch_backend.attention): the C decode kernel implements neither.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.worker.kernels import cpu_paged_attention
from kvmesh.worker.attention.backend import AttentionMetadata, LayerKVCache
from kvmesh.quant.kv_quant import dequantize_kv
from kvmesh.worker.attention.torch_backend import TorchAttentionBackend, attention, visible

# A decode group may pad up to this factor over the tokens its rows attend. Lower means less
# wasted work but more groups (one gather + one SDPA call per group per layer).
PAD_RATIO = 1.25


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows that share one padded SDPA call."""

    query_rows: torch.Tensor  # [n] long, flat index of each row's query token
    blocks: torch.Tensor  # [n, nb] long, the rows' cache blocks (padding -> the row's first block)
    mask: torch.Tensor | None  # [n, 1, 1, nb * block_size] bool, True = attend; None = attend all


@dataclass(frozen=True)
class PrefillChunk:
    """One request's chunk of several query tokens."""

    query_start: int
    query_end: int
    blocks: torch.Tensor  # [nb] long
    context: int  # tokens attended (the first `context` slots of `blocks`)
    mask: torch.Tensor | None  # [qlen, context] bool; None = plain causal (no cached context)


@dataclass(frozen=True)
class KernelDecodeRows:
    """All decode rows of the step, for one paged-kernel call per layer."""

    query_rows: torch.Tensor  # [n] long, flat index of each row's query token
    requests: torch.Tensor  # [n] long, the row's request (index into seq_lens / block_tables)
    seq_lens: torch.Tensor  # [B] int32, contiguous
    block_tables: torch.Tensor  # [B, W] int32, contiguous


@dataclass(frozen=True)
class CpuAttentionPlan:
    decode_groups: tuple[DecodeGroup, ...]
    prefills: tuple[PrefillChunk, ...]
    kernel_rows: KernelDecodeRows | None = None  # set instead of decode_groups when the kernel runs them


def group_decode_rows(seq_lens: list[tuple[int, int]], pad_ratio: float = PAD_RATIO) -> list[list[tuple[int, int]]]:
    """(row, context length) pairs -> groups, each sorted by length, whose padded size
    (rows x longest) is at most pad_ratio x the sum of their lengths."""
    groups: list[list[tuple[int, int]]] = []
    total = 0
    for row, n in sorted(seq_lens, key=lambda rn: rn[1]):
        if groups and (len(groups[-1]) + 1) * n <= pad_ratio * (total + n):
            groups[-1].append((row, n))
            total += n
        else:
            groups.append([(row, n)])
            total = n
    return groups


def build_plan(meta: AttentionMetadata, block_size: int, kernel_decode: bool = False,
               sliding_window: int | None = None) -> CpuAttentionPlan:
    """K/V are read whole blocks at a time (one contiguous block_size x Hkv x D copy per
    block, far cheaper than a per-token gather); the masks hide the tail of a row's last block
    and the padding blocks, which re-read the row's own first block (always written), and with
    a sliding window the positions before it.
    kernel_decode: the decode rows go to the paged kernel as one list instead of groups."""
    dev = meta.block_tables.device
    tables = meta.block_tables
    starts = [0]
    for n in meta.query_lens_host:
        starts.append(starts[-1] + n)
    decode = [(i, ctx) for i, (q, ctx) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)) if q == 1]
    groups = []
    kernel_rows = None
    if kernel_decode and decode:
        kernel_rows = KernelDecodeRows(torch.tensor([starts[i] for i, _ in decode], dtype=torch.long),
                                       torch.tensor([i for i, _ in decode], dtype=torch.long),
                                       meta.seq_lens.to(torch.int32).contiguous(),
                                       tables.to(torch.int32).contiguous())
        decode = []
    for members in group_decode_rows(decode):
        rows = torch.tensor([i for i, _ in members], dtype=torch.long, device=dev)
        lens = torch.tensor([n for _, n in members], dtype=torch.long, device=dev)
        nb = -(-members[-1][1] // block_size)
        owned = torch.arange(nb, device=dev)[None, :] * block_size < lens[:, None]  # [n, nb]
        blocks = tables[rows, :nb].long()
        blocks = torch.where(owned, blocks, blocks[:, :1])  # unused table entries may be anything
        mask = None
        if any(n != nb * block_size or (sliding_window is not None and n > sliding_window) for _, n in members):
            mask = visible(lens[:, None] - 1, torch.arange(nb * block_size, device=dev)[None, :],
                           sliding_window)[:, None, None, :]
        query_rows = torch.tensor([starts[i] for i, _ in members], dtype=torch.long, device=dev)
        groups.append(DecodeGroup(query_rows, blocks, mask))
    prefills = []
    for i, (qlen, ctx) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        if qlen == 1:
            continue
        blocks = tables[i, :-(-ctx // block_size)].long()
        mask = None
        if ctx != qlen or (sliding_window is not None and ctx > sliding_window):
            # query j sits at position ctx - qlen + j and sees positions <= its own (in the window)
            mask = visible(torch.arange(ctx - qlen, ctx, device=dev)[:, None], torch.arange(ctx, device=dev)[None, :],
                           sliding_window)
        prefills.append(PrefillChunk(starts[i], starts[i + 1], blocks, ctx, mask))
    return CpuAttentionPlan(tuple(groups), tuple(prefills), kernel_rows)


def read_blocks(cache: LayerKVCache, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks: [..., nb] -> K, V: [..., nb * block_size, Hkv, D] in dtype (dequantized when the
    cache is quantized)."""
    bs, hkv = cache.key_cache.shape[1:3]
    lead = blocks.shape[:-1]
    flat = blocks.reshape(-1)
    k = cache.key_cache.index_select(0, flat)  # [n * nb, bs, Hkv, D] (D / 2 bytes for packed int4)
    v = cache.value_cache.index_select(0, flat)
    if cache.quantized:  # the one definition of the KV codes (int8, fp8, packed int4)
        k = dequantize_kv(k, cache.key_scale.index_select(0, flat))
        v = dequantize_kv(v, cache.value_scale.index_select(0, flat))
    shape = (*lead, blocks.shape[-1] * bs, hkv, k.shape[-1])
    return k.reshape(shape).to(dtype), v.reshape(shape).to(dtype)


class CpuAttentionBackend(TorchAttentionBackend):
    """write_kv is the reference's; attend runs the per-step plan (see the module doc)."""

    name = "cpu"

    def __init__(self, use_kernel: bool = True, kernel: "cpu_paged_attention.PagedDecodeKernel | None" = None):
        """kernel: this one instead of the one built for this CPU (tests: each instruction set)."""
        self.use_kernel = use_kernel
        self._kernel = kernel
        self._kernel_loaded = kernel is not None

    def kernel(self) -> "cpu_paged_attention.PagedDecodeKernel | None":
        """The paged decode kernel, loaded (built) on first use; None where unavailable or off."""
        if self.use_kernel and not self._kernel_loaded:
            self._kernel, self._kernel_loaded = cpu_paged_attention.load(), True
        return self._kernel

    def attend(self, query: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata,
               scale: float, sliding_window: int | None = None, logit_softcap: float | None = None) -> torch.Tensor:
        # one plan per kind of layer: the first layer of each kind plans the step for the others
        # (same cache kind in every layer); the kernel takes neither windows nor soft-capping
        key = self.name if sliding_window is None and logit_softcap is None else \
            (self.name, sliding_window, logit_softcap is not None)
        plan = meta.backend_plans.get(key)
        if plan is None:
            kernel = self.kernel() if key == self.name else None
            use = kernel is not None and kernel.takes(query, cache) and query.device == meta.block_tables.device
            plan = meta.backend_plans[key] = build_plan(meta, cache.block_size, kernel_decode=use,
                                                        sliding_window=sliding_window)
        out = torch.empty_like(query)
        rows = plan.kernel_rows
        if rows is not None:
            self._kernel.attend(query, cache, rows.block_tables, rows.seq_lens, rows.query_rows, rows.requests,
                                out, scale)
        for g in plan.decode_groups:
            k, v = read_blocks(cache, g.blocks, query.dtype)  # [n, nb * bs, Hkv, D]
            q = query[g.query_rows].unsqueeze(2)  # [n, Hq, 1, D]
            o = attention(q, k.transpose(1, 2), v.transpose(1, 2), g.mask, scale, logit_softcap)  # [n, Hq, 1, D]
            out[g.query_rows] = o[:, :, 0, :]
        for p in plan.prefills:
            k, v = read_blocks(cache, p.blocks, query.dtype)
            k, v = k[:p.context], v[:p.context]  # [ctx, Hkv, D]
            q = query[p.query_start:p.query_end]  # [qlen, Hq, D]
            o = attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                          v.transpose(0, 1).unsqueeze(0), p.mask, scale, logit_softcap,
                          is_causal=p.mask is None)  # [1, Hq, qlen, D]
            out[p.query_start:p.query_end] = o[0].transpose(0, 1)
        return out
