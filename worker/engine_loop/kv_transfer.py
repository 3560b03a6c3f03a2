"""Prefix KV between workers: the holder exports the blocks of a prompt's prefix it has (device
pool or host tier), the puller checks each against its own hashes and checksums and stores the
good ones in its host tier, where the request's admission then finds them (kv/host_tier.py).

    holder:  export_prefix(tokens, extra_keys, first_block) -> PrefixExport
               keys      [(block hash, tokens), ...]         the blocks it has, in chain order
               checksums [crc, ...]                          over each block's bytes
               tensors   per layer K, V (+ scales): [num_blocks, block_size, Hkv, D]
    puller:  import_prefix(export, tokens, extra_keys) -> blocks stored
               block i is kept only if its hash is the puller's own chain hash of the same
               tokens under ITS extra keys (model, KV dtype, the request's tenant salt), its
               tokens are the prompt's, and its bytes give the checksum: a block from another
               tenant, another model or KV format, or damaged in transit is never stored.

Both run on the engine's step thread (under AsyncEngine's lock); the puller's actor makes the
Ray call in between (worker/runtime/prefix_pull.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.kv.hashing import hash_full_blocks
from kvmesh.kv.prefix_cache import CachedBlockKey
from kvmesh.worker.runner.host_tier_store import cache_tensors, rows_checksum


@dataclass(frozen=True)
class PrefixExport:
    first_block: int  # index in the prompt's block chain of the first exported block
    block_hashes: tuple[bytes, ...]
    checksums: tuple[int, ...]
    tensors: tuple[torch.Tensor, ...]  # cache_tensors order, each [num_blocks, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def _keys(token_ids: list[int], block_size: int, extra_keys: tuple[str, ...], max_blocks: int) -> list[CachedBlockKey]:
    hashes = hash_full_blocks(token_ids, block_size, extra_keys)[:max_blocks]
    return [CachedBlockKey(h, hashes[i - 1] if i else None, tuple(token_ids[i * block_size:(i + 1) * block_size]),
                           tuple(extra_keys)) for i, h in enumerate(hashes)]


def shareable_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks a prompt can take from a cache (its last token is always computed)."""
    return max(0, (num_tokens - 1) // block_size)


def local_prefix_blocks(engine, token_ids: list[int], extra_keys: tuple[str, ...]) -> int:
    """Leading blocks of the prompt this engine has already, in its pool or its tier."""
    kv = engine.scheduler.kv
    count = 0
    for key in _keys(token_ids, engine.block_size, extra_keys, shareable_blocks(len(token_ids), engine.block_size)):
        if kv.pool.lookup(key) is None and (kv.host_tier is None or kv.host_tier.lookup(key) is None):
            break
        count += 1
    return count


def export_prefix(engine, token_ids: list[int], extra_keys: tuple[str, ...], first_block: int) -> PrefixExport:
    """The blocks from `first_block` on that this engine holds, up to its first miss."""
    kv, store = engine.scheduler.kv, engine.parts.host_tier_store
    device = cache_tensors(engine.runner.kv_caches)
    host = cache_tensors(store.caches) if store is not None else []
    keys = _keys(token_ids, engine.block_size, extra_keys, shareable_blocks(len(token_ids), engine.block_size))
    rows: list[list[torch.Tensor]] = []  # per block: its row of every cache tensor
    hashes: list[bytes] = []
    for key in keys[first_block:]:
        block = kv.pool.lookup(key)
        if block is not None:
            row = [t[block].to("cpu", copy=True) for t in device]
        else:
            found = kv.host_tier.lookup(key) if kv.host_tier is not None else None
            if found is None:
                break
            row = [t[found[0]].clone() for t in host]
        rows.append(row)
        hashes.append(key.block_hash)
    if not rows:
        return PrefixExport(first_block, (), (), ())
    tensors = tuple(torch.stack([row[i] for row in rows]) for i in range(len(rows[0])))
    return PrefixExport(first_block, tuple(hashes), tuple(rows_checksum(list(tensors), j) for j in range(len(rows))),
                        tensors)


@dataclass(frozen=True)
class ImportResult:
    num_stored: int  # blocks now in this worker's tier (copied in)
    num_present: int  # blocks it had already
    num_refused: int  # wrong hash, tokens, shape or checksum


def import_prefix(engine, export: PrefixExport, token_ids: list[int], extra_keys: tuple[str, ...]) -> ImportResult:
    """Store the export's blocks that check out in this engine's host tier (stops at the first
    that does not: the ones after it would not be reachable by a prefix match)."""
    kv, store = engine.scheduler.kv, engine.parts.host_tier_store
    if kv.host_tier is None or store is None or not export.num_blocks:
        return ImportResult(0, 0, export.num_blocks)
    host = cache_tensors(store.caches)
    if len(host) != len(export.tensors) or any(h.shape[1:] != t.shape[1:] or h.dtype != t.dtype
                                               for h, t in zip(host, export.tensors)):
        return ImportResult(0, 0, export.num_blocks)  # another model or KV format
    keys = _keys(token_ids, engine.block_size, extra_keys, shareable_blocks(len(token_ids), engine.block_size))
    stored = present = 0
    for j, block_hash in enumerate(export.block_hashes):
        index = export.first_block + j
        if (index >= len(keys) or keys[index].block_hash != block_hash
                or rows_checksum(list(export.tensors), j) != export.checksums[j]):
            kv.host_tier.num_checksum_failures += 1
            return ImportResult(stored, present, export.num_blocks - stored - present)
        slot = kv.host_tier.store(keys[index])
        if slot is None:
            present += 1
            continue
        for h, t in zip(host, export.tensors):
            h[slot].copy_(t[j])
        kv.host_tier.confirm(slot, block_hash, export.checksums[j])
        stored += 1
    return ImportResult(stored, present, 0)
