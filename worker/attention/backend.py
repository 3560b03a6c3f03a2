"""The attention backend seam: paged KV cache layout, per-step metadata, the interface.

Memory layout of one layer's paged cache (flash layout, as vLLM's FLASH_ATTN backend):

    key_cache / value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
        block b, slot s of token t:  slot_mapping[t] = b * block_size + s
    quantized KV (int8 / fp8 e4m3) adds per-token, per-head scales beside the blocks:
    key_scale / value_scale: [num_blocks, block_size, num_kv_heads] float16
        dequantized value = stored.to(float32) * scale.to(float32)[..., None]
    int4 KV packs two codes a byte with one fp16 scale per group of G channels:
    key_cache / value_cache: [num_blocks, block_size, num_kv_heads, head_dim // 2] uint8
    key_scale / value_scale: [num_blocks, block_size, num_kv_heads, head_dim // G] float16
        (quant/kv_quant.py defines the codes)

One step's batch is flat and unpadded: B requests contribute T = sum(query_lens) tokens,
decode requests one token each, prefill chunks several. Request i's new tokens are
query[query_start_loc[i]:query_start_loc[i+1]] at positions
seq_lens[i] - query_len_i ... seq_lens[i] - 1; each attends causally to every earlier
token of its own request (cached context plus the chunk itself).

Implementations: `TorchAttentionBackend` (worker/attention/torch_backend.py, the reference and
the oracle of the others), `CpuAttentionBackend` (worker/attention/cpu_backend.py, the CPU
default) and `TritonAttentionBackend` (worker/attention/triton_backend.py, the CUDA default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class LayerKVCache:
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    key_scale: torch.Tensor | None = None  # [num_blocks, block_size, num_kv_heads(, groups)] fp16, quantized KV only
    value_scale: torch.Tensor | None = None  # same

    @property
    def block_size(self) -> int:
        return self.key_cache.shape[1]

    @property
    def quantized(self) -> bool:
        return self.key_scale is not None

    @property
    def packed_int4(self) -> bool:
        return self.key_cache.dtype == torch.uint8

    @property
    def head_dim(self) -> int:
        """Channels per KV head (the packed int4 cache stores two a byte)."""
        return self.key_cache.shape[3] * (2 if self.packed_int4 else 1)


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths (cu_seqlens_q)
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new tokens)
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, unused entries arbitrary
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token
    max_query_len: int
    max_seq_len: int
    # Host copies, so backends can plan without a device sync.
    query_lens_host: tuple[int, ...] = ()
    seq_lens_host: tuple[int, ...] = ()
    # Per-step work a backend plans once and every layer reuses (backend name -> plan); the
    # metadata lives for one step, so the plans do too.
    backend_plans: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def single_prefill(cls, num_tokens: int, block_size: int, device: torch.device) -> "AttentionMetadata":
        """One request's whole prompt in one step, in blocks 0 .. ceil(T / block_size) - 1
        (profiling, calibration and teacher-forced evaluation on an otherwise idle cache)."""
        t, num_blocks = num_tokens, -(-num_tokens // block_size)
        return cls(query_start_loc=torch.tensor([0, t], dtype=torch.int32, device=device),
                   seq_lens=torch.tensor([t], dtype=torch.int32, device=device),
                   block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
                   slot_mapping=torch.arange(t, dtype=torch.long, device=device),
                   max_query_len=t, max_seq_len=t, query_lens_host=(t,), seq_lens_host=(t,))

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def all_decode(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(Protocol):
    name: str

    def write_kv(self, cache: LayerKVCache, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store new K/V ([T, num_kv_heads, head_dim]) at slot_mapping ([T]), quantizing
        when the cache is quantized. Mutates only `cache`."""

    def attend(self, query: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        """query: [T, num_heads, head_dim] -> output [T, num_heads, head_dim].
        GQA: query head h reads KV head h // (num_heads // num_kv_heads). Must not modify
        its inputs. K/V of this step's tokens are already written to the cache."""
