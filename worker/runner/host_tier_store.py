"""The bytes of the host tier (kv/host_tier.py keeps the books): one host block per tier slot,
the same layout as the device cache, so a copy is a row copy per layer and tensor.

    host:  key/value [num_tier_slots, block_size, Hkv, D]  (+ scales when quantized), per layer

Every stored block gets a content checksum (CRC-32 over its bytes in every layer, K then V
then the scales), taken from the host copy once it has landed; the tier serves a slot only
while its bytes still give that checksum, and the same checksum travels with a block that
leaves this worker. Copies run on the engine's step thread, before the forward that needs
them: on a CPU deployment there is no other engine to overlap with.
"""

from __future__ import annotations

import time
import zlib

import torch

from kvmesh.worker.attention.backend import LayerKVCache
from kvmesh.worker.runner.model_runner import _copy_blocks, allocate_kv_caches


def cache_tensors(caches: list[LayerKVCache]) -> list[torch.Tensor]:
    """Every tensor of a cache, in one fixed order: per layer K, V, then the scales when quantized.
    Each is [num_blocks, ...]: row i of all of them is block i's KV."""
    tensors = []
    for layer in caches:
        tensors += [layer.key_cache, layer.value_cache]
        if layer.quantized:
            tensors += [layer.key_scale, layer.value_scale]
    return tensors


def rows_checksum(tensors: list[torch.Tensor], row: int) -> int:
    """CRC-32 of row `row` of every tensor, in order (one block's bytes)."""
    crc = 0
    for tensor in tensors:
        crc = zlib.crc32(tensor[row].contiguous().view(torch.uint8).numpy(), crc)
    return crc


def block_checksum(caches: list[LayerKVCache], block: int) -> int:
    """CRC-32 of one block's bytes across layers (K, V, then scales when quantized)."""
    return rows_checksum(cache_tensors(caches), block)


class HostTierStore:
    def __init__(self, num_layers: int, num_slots: int, block_size: int, num_kv_heads: int, head_dim: int,
                 storage: torch.dtype, pin: bool = False):
        self.caches = allocate_kv_caches(num_layers, num_slots, block_size, num_kv_heads, head_dim, storage,
                                         torch.device("cpu"), pin=pin)
        self.bytes_per_block = sum(t[0].numel() * t.element_size() for layer in self.caches
                                   for t in (layer.key_cache, layer.value_cache, layer.key_scale, layer.value_scale)
                                   if t is not None)
        self.num_bytes_stored = 0
        self.num_bytes_loaded = 0
        self.store_time_s = 0.0
        self.load_time_s = 0.0

    def store(self, device_caches: list[LayerKVCache], copies) -> list[tuple[int, bytes, int]]:
        """Copy (device block, slot, block hash) rows to host; returns (slot, hash, checksum)."""
        if not copies:
            return []
        started = time.perf_counter()
        _copy_blocks(self.caches, device_caches, [(block, slot) for block, slot, _ in copies])
        confirmed = [(slot, block_hash, block_checksum(self.caches, slot)) for _, slot, block_hash in copies]
        self.store_time_s += time.perf_counter() - started
        self.num_bytes_stored += len(copies) * self.bytes_per_block
        return confirmed

    def load(self, device_caches: list[LayerKVCache], copies) -> None:
        """Copy (slot, device block) rows back into the device cache."""
        if not copies:
            return
        started = time.perf_counter()
        _copy_blocks(device_caches, self.caches, list(copies))
        self.load_time_s += time.perf_counter() - started
        self.num_bytes_loaded += len(copies) * self.bytes_per_block

    def holds_checksum(self, slot: int, checksum: int) -> bool:
        return block_checksum(self.caches, slot) == checksum
