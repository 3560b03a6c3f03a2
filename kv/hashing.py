"""Stable chain hashes over full KV blocks, shared by the workers' prefix cache and the router.

A block's hash covers its parent's hash, its token ids and the extra keys, so equal hashes
mean "same tokens after the same prefix under the same model, KV format and tenant salt":

    prompt tokens:  [t0 .. t15][t16 .. t31][t32 .. t40]      block_size = 16
    hashes:         h0=H(root,  t0..t15, extra)
                    h1=H(h0,    t16..t31, extra)
                    (the partial last block has no hash: it is not shareable yet)

H is BLAKE2b-128 over bytes (never Python's `hash()`, which is salted per process). The
extra keys must include everything that makes blocks non-interchangeable: model and
revision, KV cache dtype / quantization, the tenant's cache salt when isolation is on, and
the LoRA adapter (its K/V differ from the base model's and every other adapter's). The router and the workers must build the same `extra_keys` (see `block_extra_keys`).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes  # 16 bytes

_ROOT = b"kvmesh-prefix-v1"


def block_extra_keys(model: str, revision: str, kv_cache_dtype: str, cache_salt: str | None = None,
                     adapter: str | None = None) -> tuple[str, ...]:
    """The extra keys for one deployment (and tenant, when its cache is isolated; and adapter,
    `adapter_key(name, path)`, when the request runs with one)."""
    keys = (f"model={model}", f"rev={revision}", f"kv={kv_cache_dtype}")
    return keys + ((f"salt={cache_salt}",) if cache_salt else ()) + ((f"lora={adapter}",) if adapter else ())


def adapter_key(name: str, path: str) -> str:
    """An adapter's identity in the cache: re-registering a name with other weights (another
    path) must not reuse the old adapter's blocks."""
    return f"{name}@{path}"


def _extra_bytes(extra_keys: Sequence[str]) -> bytes:
    """The extra keys as hashed after a block's tokens: each length-prefixed, so ("ab", "c")
    and ("a", "bc") differ."""
    return b"".join(struct.pack("<I", len(data)) + data for data in (key.encode() for key in extra_keys))


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> BlockHash:
    h = hashlib.blake2b(parent if parent is not None else _ROOT, digest_size=16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(_extra_bytes(extra_keys))
    return h.digest()


def hash_full_blocks(token_ids: Sequence[int], block_size: int, extra_keys: Sequence[str] = (),
                     start_parent: BlockHash | None = None) -> list[BlockHash]:
    """Chain hashes of every full block of `token_ids` (the partial tail is skipped): the
    same bytes as `hash_block` block by block, with the tokens packed and the extra keys
    encoded once per prompt instead of once per block (the router hashes every prompt it
    routes: a 3.5k-token prompt is ~220 blocks)."""
    num_tokens = len(token_ids) // block_size * block_size
    if num_tokens == 0:
        return []
    packed = struct.pack(f"<{num_tokens}q", *token_ids[:num_tokens])
    extra = _extra_bytes(extra_keys)
    stride = 8 * block_size
    hashes: list[BlockHash] = []
    parent = start_parent if start_parent is not None else _ROOT
    for offset in range(0, len(packed), stride):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(packed[offset:offset + stride])
        h.update(extra)
        parent = h.digest()
        hashes.append(parent)
    return hashes
