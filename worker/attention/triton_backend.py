"""Triton paged attention: one kernel for a mixed batch of decode tokens and prefill chunks.

The design follows vLLM's unified Triton attention (one launch, no prefill/decode split):

    grid = (num_q_blocks, num_kv_heads, num_segments)
    num_q_blocks = T // BLOCK_Q + num_reqs   an upper bound; request i owns the program ids
                   [query_start_loc[i] // BLOCK_Q + i, ...), found by binary search, and the
                   spare ids return at once.
    num_segments = 1, or for batches too small to fill the GPU (decode at low batch) up to
                   16 slices of each request's keys, merged by a second kernel from fp32
                   partial (max, sum, unnormalised output) triples: split-KV, as vLLM's
                   3-D variant and FlashDecoding do.

One program takes BLOCK_Q consecutive query tokens of one request and all the query heads
that share one KV head (GQA): its BLOCK_M = BLOCK_Q * queries_per_kv rows are

    row m -> token  q_block * BLOCK_Q + m // queries_per_kv,  head kv_head * qpk + m % qpk

so each K/V tile is loaded once for every query head that reads it, with no copy or
repeat_interleave. The program walks the request's keys TILE_N tokens at a time; each key's
physical slot comes from the block table (block_tables[i, pos // block_size]), so a tile
may span several cache blocks and the block size may be smaller than tl.dot's minimum of
16. Quantized K/V (int8 / fp8 e4m3) are dequantized in registers with their per-token,
per-head fp16 scales; packed int4 K/V unpack each channel's nibble from byte d // 2 and
scale it by its group's fp16 scale (quant/kv_quant.py's layout). Softmax is online (running max and sum, exp2 with log2(e) folded
into the scale), accumulation fp32.

Causality: a request's new tokens sit at positions context_len ... seq_len - 1, where
context_len = seq_len - query_len; query token j sees keys 0 ... context_len + j.
A layer with a sliding window W also hides keys at positions <= p - W from the query at p,
and logit soft-capping maps each scaled score to cap * tanh(score / cap) before the mask
(both constexpr-gated, so the plain kernel is unchanged; torch_backend.py is the reference).

write_kv is a second kernel, one program per new token: it writes K and V of all KV heads
at slot_mapping[t] (a negative slot marks a padding row of a captured decode batch and is
skipped), and for a quantized cache stores round(x / scale) with
scale = fp16(clamp(absmax / 127 (int8) or absmax / 448 (fp8), 2**-14, 65504)) per head,
bit for bit as quant/kv_quant.py's quantize_kv defines it. Packed int4 has its own write
kernel, one program per (token, KV head): each group of G channels is loaded as its even and
odd halves, so the two codes of a byte sit in the same lane and pack without a shuffle.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

# write_kv must match quant/kv_quant.py bit for bit: the same scale bounds and dtype.
from kvmesh.quant.kv_quant import (FP8_E4M3_MAX, INT4_MAX, INT4_ZERO, INT8_MAX, KV_SCALE_DTYPE, MAX_KV_SCALE,
                                   MIN_KV_SCALE, kv_int4_group_size)
from kvmesh.worker.attention.backend import AttentionMetadata, LayerKVCache
from kvmesh.core.errors import InvalidRequestError
# triton_ops turns on the interpreter when there is no CUDA, before the kernels below exist.
from kvmesh.worker.kernels.triton_ops import compute_dtype, dot_precision, round_half_even, round_to, tl, triton

logger = logging.getLogger(__name__)

_LOG2_E = 1.4426950408889634
MIN_SCALE = tl.constexpr(MIN_KV_SCALE)  # read inside the write kernel
MAX_SCALE = tl.constexpr(MAX_KV_SCALE)
INT4_MAX_C = tl.constexpr(INT4_MAX)
INT4_ZERO_C = tl.constexpr(float(INT4_ZERO))
_FP8 = getattr(torch, "float8_e4m3fn", None)
_QUANT_MAX = {torch.int8: INT8_MAX, torch.uint8: INT4_MAX, **({_FP8: FP8_E4M3_MAX} if _FP8 is not None else {})}


@triton.jit
def _find_request(
    query_start_loc_ptr,  # [num_reqs + 1] int32
    q_block_id, num_reqs, BLOCK_Q: tl.constexpr,
):
    """The request whose q-block ids contain q_block_id: the last i with
    query_start_loc[i] // BLOCK_Q + i <= q_block_id (binary search)."""
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _load_kv_tile(
    cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    scale_ptr,  # [num_blocks, block_size, num_kv_heads] fp16, read only when QUANTIZED
    block_ids,  # [TILE_N] int64 physical block of each key
    pos,  # [TILE_N] key positions in the request
    kv_head, offs_d,
    valid,  # [TILE_N] keys that exist (masked-off keys load 0)
    stride_block, stride_slot, stride_head, stride_scale_block, stride_scale_slot, stride_scale_head,
    BLOCK_SIZE: tl.constexpr, QUANTIZED: tl.constexpr, COMPUTE: tl.constexpr, HEAD_DIM: tl.constexpr,
    INT4: tl.constexpr, INT4_GROUP: tl.constexpr,
):
    """-> [TILE_N, HEAD_DIM_PADDED] K or V of the keys at positions `pos`, in COMPUTE."""
    slot = pos % BLOCK_SIZE
    row = block_ids * stride_block + slot * stride_slot + kv_head * stride_head  # int64
    mask = valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    scale_row = block_ids * stride_scale_block + slot * stride_scale_slot + kv_head * stride_scale_head
    if INT4:  # channel d is nibble d % 2 of byte d // 2; its scale is its group's
        byte = tl.load(cache_ptr + row[:, None] + (offs_d // 2)[None, :], mask=mask, other=0)
        nibble = (byte >> ((offs_d % 2) * 4).to(tl.uint8)[None, :]) & 0xF
        scale = tl.load(scale_ptr + scale_row[:, None] + (offs_d // INT4_GROUP)[None, :], mask=mask,
                        other=0.0).to(tl.float32)  # [TILE_N, HEAD_DIM_PADDED]
        tile = (nibble.to(tl.float32) - 8.0) * scale
    else:
        tile = tl.load(cache_ptr + row[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        if QUANTIZED:
            scale = tl.load(scale_ptr + scale_row, mask=valid, other=0.0).to(tl.float32)  # [TILE_N]
            tile = tile * scale[:, None]
    return tile.to(COMPUTE)


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, num_heads, head_dim] query dtype; written when NUM_SEGMENTS == 1
    partial_out_ptr,  # [T, num_heads, NUM_SEGMENTS, HEAD_DIM_PADDED] fp32, unnormalised; split only
    partial_max_ptr,  # [T, num_heads, NUM_SEGMENTS] fp32 running max of scores (log2 units); split only
    partial_sum_ptr,  # [T, num_heads, NUM_SEGMENTS] fp32 softmax denominators; split only
    query_ptr,  # [T, num_heads, head_dim], unit stride along head_dim
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] model dtype, int8 or fp8
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], same strides as keys
    key_scale_ptr,  # [num_blocks, block_size, num_kv_heads] fp16; read only when QUANTIZED
    value_scale_ptr,  # same
    block_tables_ptr,  # [num_reqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_reqs] int32, tokens in the cache after this step
    query_start_loc_ptr,  # [num_reqs + 1] int32, cumulative query lengths
    scale_log2e,  # softmax scale * log2(e): scores go through exp2
    window,  # WINDOWED: a query at position p sees keys at positions > p - window
    softcap,  # SOFTCAP: scores -> softcap * tanh(scores / softcap) before the mask
    num_reqs, num_heads,
    tiles_per_segment,  # key tiles each program along grid axis 2 walks
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_kv_block, stride_kv_slot, stride_kv_head,
    stride_scale_block, stride_scale_slot, stride_scale_head,
    stride_bt_req,
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    QUANTIZED: tl.constexpr, COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INT4: tl.constexpr, INT4_GROUP: tl.constexpr,  # packed int4 K/V with a scale per INT4_GROUP channels
    NUM_SEGMENTS: tl.constexpr,  # power of two; > 1 splits each request's keys across programs
    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,  # per-layer options (torch_backend.py's reference)
):
    q_block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    req = _find_request(query_start_loc_ptr, q_block_id, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block = q_block_id - (q_start // BLOCK_Q + req)  # index of this block within the request
    if q_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    q_local = offs_m // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    q_pos = q_block * BLOCK_Q + q_local  # [BLOCK_M] token index within the request's chunk
    row_valid = (q_local < BLOCK_Q) & (q_pos < query_len)
    d_valid = offs_d < HEAD_DIM
    tok = (q_start + q_pos).to(tl.int64)
    q = tl.load(query_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
                mask=row_valid[:, None] & d_valid[None, :], other=0.0).to(COMPUTE)  # [BLOCK_M, D]

    # Keys this block can see end at the causal limit of its last valid token (exclusive).
    key_end = context_len + tl.minimum((q_block + 1) * BLOCK_Q, query_len)
    key_limit = context_len + q_pos  # [BLOCK_M] last key position each row may see
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM_PADDED), tl.float32)
    block_table = block_tables_ptr + req * stride_bt_req
    tile_begin = segment * tiles_per_segment
    tile_end = tl.minimum(tl.cdiv(key_end, TILE_N), tile_begin + tiles_per_segment)
    for tile in range(tile_begin, tile_end):
        pos = tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N] key positions
        n_valid = pos < key_end
        block_ids = tl.load(block_table + pos // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        k = _load_kv_tile(key_cache_ptr, key_scale_ptr, block_ids, pos, kv_head, offs_d, n_valid,
                          stride_kv_block, stride_kv_slot, stride_kv_head, stride_scale_block,
                          stride_scale_slot, stride_scale_head, BLOCK_SIZE, QUANTIZED, COMPUTE, HEAD_DIM,
                          INT4, INT4_GROUP)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e  # [BLOCK_M, TILE_N]
        if SOFTCAP:  # on the scaled scores; tanh(x) = 1 - 2 / (e^2x + 1), e^2x as exp2 (inf -> 1, 0 -> -1)
            x = s / (softcap * 1.4426950408889634)  # scores / cap
            s = softcap * 1.4426950408889634 * (1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0))
        visible = (pos[None, :] <= key_limit[:, None]) & row_valid[:, None] & n_valid[None, :]
        if WINDOWED:
            visible = visible & (pos[None, :] > key_limit[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no key yet keeps max -inf; subtract 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_kv_tile(value_cache_ptr, value_scale_ptr, block_ids, pos, kv_head, offs_d, n_valid,
                          stride_kv_block, stride_kv_slot, stride_kv_head, stride_scale_block,
                          stride_scale_slot, stride_scale_head, BLOCK_SIZE, QUANTIZED, COMPUTE, HEAD_DIM,
                          INT4, INT4_GROUP)
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
                 round_to(out, out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])
    else:  # an empty segment stores max -inf, sum 0: the merge weighs it 0
        part = (tok * num_heads + head) * NUM_SEGMENTS + segment  # [BLOCK_M]
        tl.store(partial_max_ptr + part, m_i, mask=row_valid)
        tl.store(partial_sum_ptr + part, l_i, mask=row_valid)
        tl.store(partial_out_ptr + part[:, None] * HEAD_DIM_PADDED + offs_d[None, :], acc, mask=row_valid[:, None])


@triton.jit
def _merge_segments_kernel(
    out_ptr,  # [T, num_heads, head_dim] query dtype
    partial_out_ptr,  # [T, num_heads, NUM_SEGMENTS, HEAD_DIM_PADDED] fp32
    partial_max_ptr,  # [T, num_heads, NUM_SEGMENTS] fp32, log2 units
    partial_sum_ptr,  # [T, num_heads, NUM_SEGMENTS] fp32
    num_heads, stride_o_tok, stride_o_head,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
):
    """Combine split-KV partial softmaxes: rescale each to the global max, sum, normalise."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = tok * num_heads + head
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    seg_max = tl.load(partial_max_ptr + row * NUM_SEGMENTS + offs_s)
    seg_sum = tl.load(partial_sum_ptr + row * NUM_SEGMENTS + offs_s)
    global_max = tl.max(seg_max, axis=0)
    weight = tl.exp2(seg_max - tl.where(global_max > float("-inf"), global_max, 0.0))  # [NUM_SEGMENTS]
    acc = tl.load(partial_out_ptr + (row * NUM_SEGMENTS + offs_s)[:, None] * HEAD_DIM_PADDED + offs_d[None, :])
    total = tl.sum(seg_sum * weight, axis=0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + tok * stride_o_tok + head * stride_o_head + offs_d, round_to(out, out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@triton.jit
def _store_kv_heads(
    x_ptr,  # [T, num_kv_heads, head_dim] new keys or values
    cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    scale_ptr,  # [num_blocks, block_size, num_kv_heads] fp16, written only when QUANTIZED
    tok,
    cache_row, scale_row,  # element offsets of the destination slot in cache and scales
    offs_h, offs_d, head_valid, mask, stride_x_tok, stride_x_head, stride_cache_head,
    QUANT_MAX: tl.constexpr, QUANTIZED: tl.constexpr, IS_INT8: tl.constexpr,
):
    """Write x[tok, :, :] ([HEADS_PADDED, HEAD_DIM_PADDED]) to one cache slot."""
    x = tl.load(x_ptr + tok * stride_x_tok + offs_h[:, None] * stride_x_head + offs_d[None, :],
                mask=mask, other=0.0).to(tl.float32)
    dst = cache_ptr + cache_row + offs_h[:, None] * stride_cache_head + offs_d[None, :]
    if QUANTIZED:
        # Correctly rounded divisions, so the stored codes match torch's bit for bit: the
        # scale is clamped and rounded to fp16 first, and x is divided by that stored value.
        scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), QUANT_MAX)  # [HEADS_PADDED] fp32
        scale = round_to(tl.minimum(tl.maximum(scale, MIN_SCALE), MAX_SCALE), scale_ptr.dtype.element_ty)
        y = tl.math.div_rn(x, scale.to(tl.float32)[:, None])
        y = tl.minimum(tl.maximum(y, -QUANT_MAX), QUANT_MAX)
        if IS_INT8:
            y = round_half_even(y)  # |y| <= 127
        tl.store(dst, round_to(y, cache_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + scale_row + offs_h, scale, mask=head_valid)
    else:
        tl.store(dst, round_to(x, cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, num_kv_heads, head_dim] new keys
    value_ptr,  # [T, num_kv_heads, head_dim] new values
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # same shape and strides
    key_scale_ptr,  # [num_blocks, block_size, num_kv_heads] fp16; written only when QUANTIZED
    value_scale_ptr,  # same
    slot_mapping_ptr,  # [T] int64, slot = block_id * block_size + offset
    num_kv_heads,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_scale_block, stride_scale_slot,
    HEAD_DIM: tl.constexpr, HEADS_PADDED: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, QUANT_MAX: tl.constexpr, QUANTIZED: tl.constexpr, IS_INT8: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:  # a padding row of a captured decode batch (worker/runner/cuda_graphs.py): no slot
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PADDED)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    head_valid = offs_h < num_kv_heads
    mask = head_valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    cache_row = block_id * stride_cache_block + offset * stride_cache_slot
    scale_row = block_id * stride_scale_block + offset * stride_scale_slot
    _store_kv_heads(key_ptr, key_cache_ptr, key_scale_ptr, tok, cache_row, scale_row, offs_h, offs_d,
                    head_valid, mask, stride_k_tok, stride_k_head, stride_cache_head, QUANT_MAX, QUANTIZED, IS_INT8)
    _store_kv_heads(value_ptr, value_cache_ptr, value_scale_ptr, tok, cache_row, scale_row, offs_h,
                    offs_d, head_valid, mask, stride_v_tok, stride_v_head, stride_cache_head, QUANT_MAX, QUANTIZED,
                    IS_INT8)


@triton.jit
def _store_kv_int4_head(
    x_ptr,  # [T, num_kv_heads, head_dim] new keys or values
    cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim // 2] uint8
    scale_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim // GROUP] fp16
    x_row, cache_row, scale_row,  # element offsets of this token-head in x, cache and scales
    GROUP: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUPS_PADDED: tl.constexpr,
):
    """Quantize one token-head group-wise to int4 and store it packed, as _quantize_kv_int4."""
    offs_g = tl.arange(0, GROUPS_PADDED)
    offs_j = tl.arange(0, GROUP // 2)  # byte j of a group holds channels 2j (low) and 2j + 1 (high)
    valid = (offs_g < NUM_GROUPS)[:, None] & (offs_j < GROUP // 2)[None, :]
    channel = offs_g[:, None] * GROUP + 2 * offs_j[None, :]  # [GROUPS_PADDED, GROUP // 2] even channels
    even = tl.load(x_ptr + x_row + channel, mask=valid, other=0.0).to(tl.float32)
    odd = tl.load(x_ptr + x_row + channel + 1, mask=valid, other=0.0).to(tl.float32)
    absmax = tl.maximum(tl.max(tl.abs(even), axis=1), tl.max(tl.abs(odd), axis=1))  # [GROUPS_PADDED]
    scale = tl.math.div_rn(absmax, INT4_MAX_C)
    scale = round_to(tl.minimum(tl.maximum(scale, MIN_SCALE), MAX_SCALE), scale_ptr.dtype.element_ty)
    scale32 = scale.to(tl.float32)[:, None]
    lo = round_half_even(tl.minimum(tl.maximum(tl.math.div_rn(even, scale32), -INT4_MAX_C), INT4_MAX_C))
    hi = round_half_even(tl.minimum(tl.maximum(tl.math.div_rn(odd, scale32), -INT4_MAX_C), INT4_MAX_C))
    lo_nibble = (lo + INT4_ZERO_C).to(tl.int32)
    hi_nibble = (hi + INT4_ZERO_C).to(tl.int32)
    packed = (lo_nibble | (hi_nibble << 4)).to(tl.uint8)
    tl.store(cache_ptr + cache_row + offs_g[:, None] * (GROUP // 2) + offs_j[None, :], packed, mask=valid)
    tl.store(scale_ptr + scale_row + offs_g, scale, mask=offs_g < NUM_GROUPS)


@triton.jit
def _write_kv_int4_kernel(
    key_ptr, value_ptr,  # [T, num_kv_heads, head_dim]
    key_cache_ptr, value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim // 2] uint8
    key_scale_ptr, value_scale_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim // GROUP] fp16
    slot_mapping_ptr,  # [T] int64
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_scale_block, stride_scale_slot, stride_scale_head,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, NUM_GROUPS: tl.constexpr, GROUPS_PADDED: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:  # a padding row (see _write_kv_kernel)
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    cache_row = block_id * stride_cache_block + offset * stride_cache_slot + head * stride_cache_head
    scale_row = block_id * stride_scale_block + offset * stride_scale_slot + head * stride_scale_head
    _store_kv_int4_head(key_ptr, key_cache_ptr, key_scale_ptr, tok * stride_k_tok + head * stride_k_head,
                        cache_row, scale_row, GROUP, NUM_GROUPS, GROUPS_PADDED)
    _store_kv_int4_head(value_ptr, value_cache_ptr, value_scale_ptr, tok * stride_v_tok + head * stride_v_head,
                        cache_row, scale_row, GROUP, NUM_GROUPS, GROUPS_PADDED)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise InvalidRequestError(message)


def _check_cache(cache: LayerKVCache) -> None:
    kc, vc = cache.key_cache, cache.value_cache
    _require(kc.dim() == 4 and kc.shape == vc.shape and kc.stride() == vc.stride() and kc.dtype == vc.dtype,
             "key_cache and value_cache must share shape [num_blocks, block_size, num_kv_heads, head_dim], "
             "strides and dtype")
    _require(kc.stride(-1) == 1, "KV cache head_dim must have unit stride")
    if cache.quantized:
        _require(kc.dtype in _QUANT_MAX, f"quantized KV cache must be int8, fp8 e4m3 or packed int4, got {kc.dtype}")
        _require(kc.dtype != _FP8 or kc.device.type != "cuda" or torch.cuda.get_device_capability(kc.device) >= (8, 9),
                 "an fp8 e4m3 KV cache needs a GPU of compute capability 8.9 or newer (Triton's fp8e4nv)")
        ks, vs = cache.key_scale, cache.value_scale
        scale_shape = kc.shape[:3]
        if cache.packed_int4:
            scale_shape = (*scale_shape, cache.head_dim // kv_int4_group_size(cache.head_dim))
        _require(vs is not None and ks.shape == vs.shape == scale_shape and ks.stride() == vs.stride()
                 and ks.dtype == vs.dtype == KV_SCALE_DTYPE and ks.stride(-1) == 1,
                 f"key_scale/value_scale must be fp16 {list(scale_shape)} with equal strides")
    else:
        _require(kc.dtype in (torch.float32, torch.float16, torch.bfloat16),
                 f"an int8/fp8 KV cache needs key_scale and value_scale; got dtype {kc.dtype} without scales")


def _scale_strides(cache: LayerKVCache) -> tuple[int, int, int]:
    """(block, slot, head) strides of the scales; int8 / fp8 scales have one per head."""
    if not cache.quantized:
        return 0, 0, 0
    ks = cache.key_scale
    return ks.stride(0), ks.stride(1), ks.stride(2)


def _int4_group(cache: LayerKVCache) -> int:
    """The int4 scale group (a constexpr; 1 when the cache is not packed int4)."""
    return kv_int4_group_size(cache.head_dim) if cache.packed_int4 else 1


@dataclass(frozen=True)
class AttentionLaunchPlan:
    block_m: int  # rows per program: block_q tokens x queries_per_kv heads
    block_q: int  # query tokens per program
    num_q_blocks: int  # grid axis 0 (an upper bound; spare programs exit at once)
    num_segments: int  # grid axis 2: key segments per request (split-KV when > 1)
    tiles_per_segment: int  # key tiles of tile_tokens each program walks


def _default_min_programs(device: torch.device) -> int:
    """Two programs per SM keep a GPU's memory system busy; the interpreter gains nothing."""
    if device.type != "cuda":
        return 0
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


class TritonAttentionBackend:
    """AttentionBackend on Triton kernels (worker/attention/backend.py); the CUDA default.

    tile_tokens: keys per inner-loop step (>= 16 for tl.dot, independent of block size).
    min_programs: when a batch yields fewer (q-block, kv-head) programs than this (small
        decode batches), each request's keys are split across up to max_segments programs
        and merged after (split-KV, "flash decoding"). None = 2 x SM count on CUDA, off on CPU.
    """

    name = "triton"
    # per-layer options this backend applies (worker/runner/model_setup.py checks at set-up)
    supports_sliding_window = True
    supports_logit_softcap = True

    def __init__(self, tile_tokens: int = 32, min_programs: int | None = None, max_segments: int = 16):
        _require(tile_tokens >= 16 and tile_tokens & (tile_tokens - 1) == 0,
                 f"tile_tokens must be a power of two >= 16, got {tile_tokens}")
        _require(max_segments >= 1 and max_segments & (max_segments - 1) == 0,
                 f"max_segments must be a power of two >= 1, got {max_segments}")
        _require(min_programs is None or min_programs >= 0, "min_programs must be >= 0")
        self.tile_tokens = tile_tokens
        self.min_programs = min_programs
        self.max_segments = max_segments

    def plan(self, num_tokens: int, num_heads: int, num_kv_heads: int, meta: AttentionMetadata,
             device: torch.device) -> AttentionLaunchPlan:
        """The attention kernel's tiling and grid for one batch (host arithmetic only)."""
        queries_per_kv = num_heads // num_kv_heads
        # Rows per program: >= 16 for tl.dot; BLOCK_Q tokens x queries_per_kv heads fill them.
        block_m = max(16, triton.next_power_of_2(queries_per_kv))
        block_q = block_m // queries_per_kv
        num_q_blocks = num_tokens // block_q + meta.num_reqs
        min_programs = _default_min_programs(device) if self.min_programs is None else self.min_programs
        num_tiles = triton.cdiv(meta.max_seq_len, self.tile_tokens)
        segments = 1
        while (segments < self.max_segments and num_q_blocks * num_kv_heads * segments < min_programs
               and segments * 2 <= num_tiles):
            segments *= 2
        # Unsplit, one program walks all its keys whatever max_seq_len says.
        tiles_per_segment = triton.cdiv(num_tiles, segments) if segments > 1 else 2 ** 30
        return AttentionLaunchPlan(block_m, block_q, num_q_blocks, segments, tiles_per_segment)

    def write_kv(self, cache: LayerKVCache, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        _check_cache(cache)
        kc = cache.key_cache
        _, block_size, num_kv_heads, _ = kc.shape
        head_dim = cache.head_dim
        expected = (slot_mapping.shape[0], num_kv_heads, head_dim)
        _require(tuple(key.shape) == expected and tuple(value.shape) == expected,
                 f"key/value must be {list(expected)}, got {list(key.shape)} and {list(value.shape)}")
        _require(slot_mapping.dtype in (torch.int32, torch.int64), "slot_mapping must be int32 or int64")
        _require(key.device == kc.device == slot_mapping.device, "key, cache and slot_mapping on one device")
        if key.shape[0] == 0:
            return
        key = key if key.stride(-1) == 1 else key.contiguous()
        value = value if value.stride(-1) == 1 else value.contiguous()
        key_scale = cache.key_scale if cache.quantized else kc  # placeholder, never read
        value_scale = cache.value_scale if cache.quantized else kc
        if cache.packed_int4:
            group = _int4_group(cache)
            _write_kv_int4_kernel[(key.shape[0], num_kv_heads)](
                key, value, kc, cache.value_cache, key_scale, value_scale, slot_mapping.contiguous(),
                key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                kc.stride(0), kc.stride(1), kc.stride(2), *_scale_strides(cache),
                BLOCK_SIZE=block_size, GROUP=group, NUM_GROUPS=head_dim // group,
                GROUPS_PADDED=triton.next_power_of_2(head_dim // group))
            return
        _write_kv_kernel[(key.shape[0],)](
            key, value, kc, cache.value_cache, key_scale, value_scale, slot_mapping.contiguous(),
            num_kv_heads, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            kc.stride(0), kc.stride(1), kc.stride(2), *_scale_strides(cache)[:2],
            HEAD_DIM=head_dim, HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
            HEAD_DIM_PADDED=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
            QUANT_MAX=_QUANT_MAX.get(kc.dtype, 0.0), QUANTIZED=cache.quantized,
            IS_INT8=kc.dtype == torch.int8)

    def attend(self, query: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata,
               scale: float, sliding_window: int | None = None, logit_softcap: float | None = None) -> torch.Tensor:
        _require(sliding_window is None or sliding_window >= 1, f"sliding_window must be >= 1, got {sliding_window}")
        _require(logit_softcap is None or logit_softcap > 0, f"logit_softcap must be > 0, got {logit_softcap}")
        _check_cache(cache)
        kc = cache.key_cache
        _, block_size, num_kv_heads, _ = kc.shape
        head_dim = cache.head_dim
        _require(query.dim() == 3 and query.shape[2] == head_dim,
                 f"query must be [T, num_heads, {head_dim}], got {list(query.shape)}")
        num_tokens, num_heads = query.shape[0], query.shape[1]
        _require(num_heads % num_kv_heads == 0,
                 f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        _require(query.device == kc.device == meta.block_tables.device, "query, cache and metadata on one device")
        _require(math.isfinite(scale) and scale > 0, f"softmax scale must be a positive number, got {scale}")
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if num_tokens == 0:
            return out
        query = query if query.stride(-1) == 1 else query.contiguous()
        plan = self.plan(num_tokens, num_heads, num_kv_heads, meta, query.device)
        segments = plan.num_segments
        head_dim_padded = max(16, triton.next_power_of_2(head_dim))
        if segments > 1:
            partial_out = torch.empty((num_tokens, num_heads, segments, head_dim_padded),
                                      dtype=torch.float32, device=query.device)
            partial_max = torch.empty((num_tokens, num_heads, segments), dtype=torch.float32, device=query.device)
            partial_sum = torch.empty_like(partial_max)
        else:
            partial_out = partial_max = partial_sum = out  # placeholders, never touched
        key_scale = cache.key_scale if cache.quantized else kc  # placeholder, never read
        value_scale = cache.value_scale if cache.quantized else kc
        _paged_attention_kernel[(plan.num_q_blocks, num_kv_heads, segments)](
            out, partial_out, partial_max, partial_sum, query, kc, cache.value_cache, key_scale, value_scale,
            meta.block_tables, meta.seq_lens, meta.query_start_loc, float(scale) * _LOG2_E, int(sliding_window or 0),
            float(logit_softcap or 1.0), meta.num_reqs,
            num_heads, plan.tiles_per_segment, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            kc.stride(0), kc.stride(1), kc.stride(2), *_scale_strides(cache), meta.block_tables.stride(0),
            QUERIES_PER_KV=num_heads // num_kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded,
            BLOCK_SIZE=block_size, BLOCK_Q=plan.block_q, BLOCK_M=plan.block_m, TILE_N=self.tile_tokens,
            QUANTIZED=cache.quantized, COMPUTE=compute_dtype(query.dtype), DOT_PRECISION=dot_precision(query.dtype),
            INT4=cache.packed_int4, INT4_GROUP=_int4_group(cache), NUM_SEGMENTS=segments,
            WINDOWED=sliding_window is not None, SOFTCAP=logit_softcap is not None)
        if segments > 1:
            _merge_segments_kernel[(num_tokens, num_heads)](
                out, partial_out, partial_max, partial_sum, num_heads, out.stride(0), out.stride(1),
                HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded, NUM_SEGMENTS=segments)
        return out
