"""The torch reference attention backend: the oracle of the CPU fast path (attention_cpu.py) and the Triton kernels.

Plain torch: gathers each request's K/V through its block table, dequantizes quantized KV,
and calls scaled_dot_product_attention with an explicit causal-offset mask. Decode rows
(one query token each) are batched into one call; prefill chunks go one request at a time
because their query lengths differ. Never modifies its inputs (only `write_kv` writes, and
only into the cache).

Per-layer options (Mistral, Phi-3, Qwen, Gemma): a sliding window (a query at position p
attends to positions p - window < j <= p, HF's sliding_window_overlay) joins the mask, and
logit soft-capping (scores -> cap * tanh(scores / cap), Gemma 2) replaces SDPA by HF's eager
attention arithmetic: scores in the input dtype, capped, masked, softmax in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmesh.quant.kv_quant import dequantize_kv, quantize_kv
from kvmesh.worker.attention.backend import AttentionMetadata, LayerKVCache

_KV_QUANT_KIND = {torch.int8: "int8", torch.uint8: "int4"}  # any other quantized storage is fp8


def _gather_kv(cache: LayerKVCache, block_table: torch.Tensor, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """block_table: [B, nb] -> K, V: [B, nb * block_size, Hkv, D] in out_dtype."""
    b, nb = block_table.shape
    bt = block_table.long()
    k = cache.key_cache[bt]  # [B, nb, bs, Hkv, D] (D / 2 bytes for packed int4)
    v = cache.value_cache[bt]
    if cache.quantized:
        k = dequantize_kv(k, cache.key_scale[bt])
        v = dequantize_kv(v, cache.value_scale[bt])
    bs, hkv, d = k.shape[2], k.shape[3], k.shape[4]
    return k.reshape(b, nb * bs, hkv, d).to(out_dtype), v.reshape(b, nb * bs, hkv, d).to(out_dtype)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """q_pos: [..., Lq, 1], k_pos: [..., 1, Lk] -> bool [..., Lq, Lk], True where the query at
    q_pos attends to the key at k_pos: causal, and within the window when there is one."""
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
              logit_softcap: float | None = None, is_causal: bool = False) -> torch.Tensor:
    """q: [B, Hq, Lq, D], k / v: [B, Hkv, Lk, D], mask: bool broadcastable to [B, Hq, Lq, Lk]
    (True = attend) or None -> [B, Hq, Lq, D]. GQA: query head h reads KV head h // (Hq / Hkv)."""
    if logit_softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / logit_softcap) * logit_softcap
    if is_causal:
        lq, lk = scores.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


class TorchAttentionBackend:
    name = "torch"
    # per-layer options this backend applies (worker/runner/model_setup.py checks at set-up)
    supports_sliding_window = True
    supports_logit_softcap = True

    def write_kv(self, cache: LayerKVCache, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        # key/value: [T, Hkv, D]; the cache viewed as [num_slots, Hkv, stored D]
        k_slots = cache.key_cache.view(-1, *cache.key_cache.shape[2:])
        v_slots = cache.value_cache.view(-1, *cache.value_cache.shape[2:])
        if cache.quantized:
            kind = _KV_QUANT_KIND.get(cache.key_cache.dtype, "fp8")
            qk, sk = quantize_kv(key, kind)
            qv, sv = quantize_kv(value, kind)
            k_slots[slot_mapping] = qk
            v_slots[slot_mapping] = qv
            cache.key_scale.view(-1, *cache.key_scale.shape[2:])[slot_mapping] = sk
            cache.value_scale.view(-1, *cache.value_scale.shape[2:])[slot_mapping] = sv
        else:
            k_slots[slot_mapping] = key.to(k_slots.dtype)
            v_slots[slot_mapping] = value.to(v_slots.dtype)

    def attend(self, query: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata,
               scale: float, sliding_window: int | None = None, logit_softcap: float | None = None) -> torch.Tensor:
        out = torch.empty_like(query)
        query_lens = meta.query_lens_host
        seq_lens = meta.seq_lens_host
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        bs = cache.block_size

        decode_rows = [i for i, n in enumerate(query_lens) if n == 1]
        if decode_rows:
            self._attend_decode(query, cache, meta, scale, decode_rows, starts, out, sliding_window, logit_softcap)
        for i, qlen in enumerate(query_lens):
            if qlen == 1:
                continue
            ctx = seq_lens[i]
            nb = -(-ctx // bs)
            k, v = _gather_kv(cache, meta.block_tables[i:i + 1, :nb], query.dtype)
            k, v = k[0, :ctx], v[0, :ctx]  # [ctx, Hkv, D]
            q = query[starts[i]:starts[i + 1]]  # [qlen, Hq, D]
            # query j sits at position ctx - qlen + j and sees positions <= its own
            mask = visible(torch.arange(ctx - qlen, ctx).unsqueeze(1), torch.arange(ctx).unsqueeze(0),
                           sliding_window)  # [qlen, ctx]
            o = attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                          v.transpose(0, 1).unsqueeze(0), mask, scale, logit_softcap)  # [1, Hq, qlen, D]
            out[starts[i]:starts[i + 1]] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _attend_decode(query, cache, meta, scale, rows, starts, out, sliding_window, logit_softcap) -> None:
        bs = cache.block_size
        seq = torch.tensor([meta.seq_lens_host[i] for i in rows])
        nb = -(-int(seq.max()) // bs)
        idx = torch.tensor(rows)
        k, v = _gather_kv(cache, meta.block_tables[idx, :nb], query.dtype)  # [Bd, L, Hkv, D]
        mask = visible((seq - 1).unsqueeze(1), torch.arange(nb * bs).unsqueeze(0), sliding_window)  # [Bd, L]
        q_idx = torch.tensor([starts[i] for i in rows])
        q = query[q_idx].unsqueeze(2)  # [Bd, Hq, 1, D]
        o = attention(q, k.transpose(1, 2), v.transpose(1, 2), mask[:, None, None, :], scale,
                      logit_softcap)  # [Bd, Hq, 1, D]
        out[q_idx] = o[:, :, 0, :]
