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


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> BlockHash:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else _ROOT)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    for key in extra_keys:
        data = key.encode()
        h.update(struct.pack("<I", len(data)))  # length-prefixed: ("ab","c") != ("a","bc")
        h.update(data)
    return h.digest()


def hash_full_blocks(token_ids: Sequence[int], block_size: int, extra_keys: Sequence[str] = (),
                     start_parent: BlockHash | None = None) -> list[BlockHash]:
    """Chain hashes of every full block of `token_ids` (the partial tail is skipped)."""
    hashes: list[BlockHash] = []
    parent = start_parent
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size], extra_keys)
        hashes.append(parent)
    return hashes
