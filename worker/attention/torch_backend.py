"""The torch reference attention backend: the oracle of the CPU fast path (attention_cpu.py) and the Triton kernels.

Plain torch: gathers each request's K/V through its block table, dequantizes quantized KV,
and calls scaled_dot_product_attention with an explicit causal-offset mask. Decode rows
(one query token each) are batched into one call; prefill chunks go one request at a time
because their query lengths differ. Never modifies its inputs (only `write_kv` writes, and
only into the cache).
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


class TorchAttentionBackend:
    name = "torch"

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
               scale: float) -> torch.Tensor:
        out = torch.empty_like(query)
        query_lens = meta.query_lens_host
        seq_lens = meta.seq_lens_host
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        bs = cache.block_size

        decode_rows = [i for i, n in enumerate(query_lens) if n == 1]
        if decode_rows:
            self._attend_decode(query, cache, meta, scale, decode_rows, starts, out)
        for i, qlen in enumerate(query_lens):
            if qlen == 1:
                continue
            ctx = seq_lens[i]
            nb = -(-ctx // bs)
            k, v = _gather_kv(cache, meta.block_tables[i:i + 1, :nb], query.dtype)
            k, v = k[0, :ctx], v[0, :ctx]  # [ctx, Hkv, D]
            q = query[starts[i]:starts[i + 1]]  # [qlen, Hq, D]
            # query j sits at position ctx - qlen + j and sees positions <= its own
            q_pos = torch.arange(ctx - qlen, ctx).unsqueeze(1)
            mask = torch.arange(ctx).unsqueeze(0) <= q_pos  # [qlen, ctx]
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                attn_mask=mask, scale=scale, enable_gqa=True)  # [1, Hq, qlen, D]
            out[starts[i]:starts[i + 1]] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _attend_decode(query, cache, meta, scale, rows, starts, out) -> None:
        bs = cache.block_size
        seq = torch.tensor([meta.seq_lens_host[i] for i in rows])
        nb = -(-int(seq.max()) // bs)
        idx = torch.tensor(rows)
        k, v = _gather_kv(cache, meta.block_tables[idx, :nb], query.dtype)  # [Bd, L, Hkv, D]
        mask = torch.arange(nb * bs).unsqueeze(0) < seq.unsqueeze(1)  # [Bd, L]
        q_idx = torch.tensor([starts[i] for i in rows])
        q = query[q_idx].unsqueeze(2)  # [Bd, Hq, 1, D]
        o = F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :],
            scale=scale, enable_gqa=True)  # [Bd, Hq, 1, D]
        out[q_idx] = o[:, :, 0, :]
