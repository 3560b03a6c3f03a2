"""Tenants: who may call, with which limits, and where tenant records are kept.

A tenant is the unit of authentication and quota. Its API keys exist in plain text exactly
once, when `kvmesh tenants add` prints one; everywhere else (config, YAML file, Redis) a key
is a salted hash:

    pbkdf2-sha256:100000$<salt hex>$<digest hex>        scheme$salt$hexdigest

The key itself carries its salt, `kvm.<salt hex>.<secret>`, so a presented key finds its one
candidate hash by salt in O(1) instead of trying every tenant's hashes (PBKDF2 costs ~30 ms
on purpose; the Authenticator caches verified keys so that cost is paid once per key).

    key = generate_api_key()                     # show it once, store only the hash
    tenant = Tenant(id="acme", api_key_hashes=(hash_api_key(key),),
                    limits=TenantLimits(prompt_tokens_per_minute=60_000, max_concurrent_requests=8))
    store = YamlTenantStore("tenants.yaml")      # or RedisTenantStore(url)
    await store.put(tenant)

Tenant records stored by the admin CLI live next to the static ones from the config tree
(`tenants.tenants`); the store wins when both name the same id.

The registry is data that must outlive the store's process: keys are shown once, so a lost
record means re-issuing a customer's key. Every write also sets a marker (Redis key
`kvmesh:tenants:written`; for the YAML store, the file itself). A store read back with no
records AND no marker has been wiped (a Redis restarted without persistence, a FLUSHALL),
which `kvmesh tenants remove` can never produce; the Authenticator (router/auth.py) then
keeps serving the registry it last read and writes it back with `restore`. Backups:
`kvmesh tenants export` / `import` (deploy/cmd_tenants.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import yaml

from kvmesh.core.config import TenantConfig
from kvmesh.core.errors import InvalidRequestError
from kvmesh.core.config import TenantsConfig, _build

logger = logging.getLogger(__name__)

KEY_PREFIX = "kvm"
HASH_SCHEME = "pbkdf2-sha256"
HASH_ITERATIONS = 100_000
_SALT_BYTES = 8  # 16 hex chars: a lookup id as well as the salt
_SECRET_BYTES = 32  # 256 bits of entropy per key

# Redis layout of tenant records: one hash, field = tenant id, value = JSON of the record,
# and a marker every write sets (the hash alone cannot tell "all removed" from "wiped").
REDIS_TENANTS_KEY = "kvmesh:tenants"
REDIS_REGISTRY_MARKER_KEY = "kvmesh:tenants:written"


@dataclass(frozen=True)
class TenantLimits:
    """Per-tenant limits; None = unlimited. Token rates are per minute (token buckets whose
    capacity is one minute's worth and which refill continuously)."""

    prompt_tokens_per_minute: int | None = None
    output_tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    max_concurrent_kv_tokens: int | None = None  # prompt + max_tokens of requests in flight
    max_tokens_ceiling: int | None = None  # largest max_tokens one request may ask for

    def scaled(self, fraction: float) -> "TenantLimits":
        """This share of every limit, at least 1 (a router replica's local share)."""
        def part(v: int | None) -> int | None:
            return None if v is None else max(1, int(v * fraction))
        return TenantLimits(
            prompt_tokens_per_minute=part(self.prompt_tokens_per_minute),
            output_tokens_per_minute=part(self.output_tokens_per_minute),
            max_concurrent_requests=part(self.max_concurrent_requests),
            max_concurrent_kv_tokens=part(self.max_concurrent_kv_tokens),
            max_tokens_ceiling=self.max_tokens_ceiling,  # a per-request ceiling is not shared
        )


@dataclass(frozen=True)
class Tenant:
    id: str
    api_key_hashes: tuple[str, ...] = ()
    priority: int = 0  # lower value = served first
    limits: TenantLimits = field(default_factory=TenantLimits)
    cache_salt: str | None = None  # set = this tenant's prefix cache is isolated

    @classmethod
    def from_config(cls, cfg: TenantConfig) -> "Tenant":
        return cls(
            id=cfg.id, api_key_hashes=tuple(cfg.api_key_hashes), priority=cfg.priority,
            limits=TenantLimits(
                prompt_tokens_per_minute=cfg.prompt_tokens_per_minute,
                output_tokens_per_minute=cfg.output_tokens_per_minute,
                max_concurrent_requests=cfg.max_concurrent_requests,
                max_concurrent_kv_tokens=cfg.max_concurrent_kv_tokens,
                max_tokens_ceiling=cfg.max_tokens_ceiling),
            cache_salt=cfg.cache_salt)

    def to_config(self) -> TenantConfig:
        return TenantConfig(id=self.id, api_key_hashes=self.api_key_hashes, priority=self.priority,
                            cache_salt=self.cache_salt, **dataclasses.asdict(self.limits))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self.to_config())

    @classmethod
    def from_dict(cls, data: dict) -> "Tenant":
        """Validated like the config tree (unknown fields and bad values raise ConfigError)."""
        cfg = _build(TenantConfig, dict(data), f"tenant {data.get('id')!r}")
        TenantsConfig(tenants=(cfg,)).validate()
        return cls.from_config(cfg)


# ---- API keys ----------------------------------------------------------------------------

def generate_api_key() -> str:
    """A new key, `kvm.<salt hex>.<secret>`; hash it with `hash_api_key` before storing."""
    return f"{KEY_PREFIX}.{secrets.token_hex(_SALT_BYTES)}.{secrets.token_urlsafe(_SECRET_BYTES)}"


def key_salt(api_key: str) -> str | None:
    """The salt a well-formed key carries, or None for a malformed one."""
    parts = api_key.split(".")
    if len(parts) != 3 or parts[0] != KEY_PREFIX or len(parts[1]) != 2 * _SALT_BYTES or not parts[2]:
        return None
    return parts[1]


def _digest(api_key: str, salt_hex: str, iterations: int) -> str:
    return hashlib.pbkdf2_hmac("sha256", api_key.encode(), bytes.fromhex(salt_hex), iterations).hex()


def hash_api_key(api_key: str, iterations: int = HASH_ITERATIONS) -> str:
    salt = key_salt(api_key)
    if salt is None:
        raise InvalidRequestError("API keys look like kvm.<16 hex>.<secret>; use generate_api_key()")
    return f"{HASH_SCHEME}:{iterations}${salt}${_digest(api_key, salt, iterations)}"


def parse_key_hash(stored: str) -> tuple[int, str, str]:
    """(iterations, salt hex, digest hex) of a stored hash; InvalidRequestError if malformed."""
    try:
        scheme, salt, digest = stored.split("$")
        name, iterations = scheme.split(":")
        if name != HASH_SCHEME or int(iterations) < 1:
            raise ValueError(scheme)
        bytes.fromhex(salt), bytes.fromhex(digest)
        return int(iterations), salt, digest
    except ValueError:
        raise InvalidRequestError(f"malformed API key hash (want {HASH_SCHEME}:<iterations>$salt$hex)") from None


def verify_api_key(api_key: str, stored: str) -> bool:
    """Constant-time comparison of the key's digest with a stored hash."""
    iterations, salt, digest = parse_key_hash(stored)
    if key_salt(api_key) != salt:
        return False
    return hmac.compare_digest(_digest(api_key, salt, iterations), digest)


# ---- where tenant records live -----------------------------------------------------------

@dataclass(frozen=True)
class StoreContents:
    """One read of a tenant store."""

    tenants: tuple[Tenant, ...]
    ever_written: bool  # False: no registry at all here (a new store, or one that was wiped)


class TenantStore(Protocol):
    """Tenant records the admin CLI manages (async: one may live in Redis)."""

    async def list(self) -> list[Tenant]: ...
    async def read(self) -> StoreContents: ...
    async def get(self, tenant_id: str) -> Tenant | None: ...
    async def put(self, tenant: Tenant) -> None: ...
    async def remove(self, tenant_id: str) -> bool: ...
    async def restore(self, tenants: list[Tenant]) -> int: ...


class YamlTenantStore:
    """A local YAML file `{tenants: [ {id: ..., api_key_hashes: [...], ...}, ... ]}`, the
    same shape as the `tenants.tenants` section of the config tree. Written atomically
    (temp file + rename), readable only by its owner since it holds key hashes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def _read(self) -> dict[str, Tenant]:
        if not self.path.exists():
            return {}
        data = yaml.safe_load(self.path.read_text()) or {}
        return {t["id"]: Tenant.from_dict(t) for t in data.get("tenants", [])}

    @staticmethod
    def render(tenants: list[Tenant]) -> str:
        return yaml.safe_dump({"tenants": [t.to_dict() for t in tenants]}, sort_keys=False)

    def write_all(self, tenants: list[Tenant]) -> None:
        """Replace the file's records with these (an export)."""
        self._write({t.id: t for t in tenants})

    def _write(self, tenants: dict[str, Tenant]) -> None:
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(self.render(list(tenants.values())))
        os.replace(tmp, self.path)

    async def list(self) -> list[Tenant]:
        return list(self._read().values())

    async def read(self) -> StoreContents:
        # exists() before reading: a file removed in between reads as wiped, never as written
        written = self.path.exists()
        return StoreContents(tuple(self._read().values()), ever_written=written)

    async def get(self, tenant_id: str) -> Tenant | None:
        return self._read().get(tenant_id)

    async def restore(self, tenants: list[Tenant]) -> int:
        """Write back the records that are missing (never overwrite one); how many were."""
        current = self._read()
        missing = [t for t in tenants if t.id not in current]
        self._write({**current, **{t.id: t for t in missing}})
        return len(missing)

    async def put(self, tenant: Tenant) -> None:
        tenants = self._read()
        tenants[tenant.id] = tenant
        self._write(tenants)

    async def remove(self, tenant_id: str) -> bool:
        tenants = self._read()
        if tenants.pop(tenant_id, None) is None:
            return False
        self._write(tenants)
        return True


class RedisTenantStore:
    """Tenant records in Redis (hash `kvmesh:tenants`), shared by every router replica."""

    def __init__(self, redis_url: str):
        import redis.asyncio as aioredis
        self._redis = aioredis.Redis.from_url(redis_url, decode_responses=True)

    async def list(self) -> list[Tenant]:
        return list((await self.read()).tenants)

    async def read(self) -> StoreContents:
        async with self._redis.pipeline(transaction=True) as pipe:
            records, marker = await pipe.hgetall(REDIS_TENANTS_KEY).exists(REDIS_REGISTRY_MARKER_KEY).execute()
        tenants = tuple(Tenant.from_dict(json.loads(v)) for _, v in sorted(records.items()))
        # Records without the marker: written before the marker existed; still a registry.
        return StoreContents(tenants, ever_written=bool(marker) or bool(tenants))

    async def get(self, tenant_id: str) -> Tenant | None:
        raw = await self._redis.hget(REDIS_TENANTS_KEY, tenant_id)
        return None if raw is None else Tenant.from_dict(json.loads(raw))

    async def put(self, tenant: Tenant) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            await pipe.hset(REDIS_TENANTS_KEY, tenant.id, json.dumps(tenant.to_dict())) \
                .set(REDIS_REGISTRY_MARKER_KEY, "1").execute()

    async def remove(self, tenant_id: str) -> bool:
        async with self._redis.pipeline(transaction=True) as pipe:
            removed, _ = await pipe.hdel(REDIS_TENANTS_KEY, tenant_id).set(REDIS_REGISTRY_MARKER_KEY, "1").execute()
        return bool(removed)

    async def restore(self, tenants: list[Tenant]) -> int:
        """Write back the records that are missing (HSETNX: a record another replica or the
        CLI wrote meanwhile wins); how many were written."""
        async with self._redis.pipeline(transaction=True) as pipe:
            for t in tenants:
                pipe.hsetnx(REDIS_TENANTS_KEY, t.id, json.dumps(t.to_dict()))
            written = await pipe.set(REDIS_REGISTRY_MARKER_KEY, "1").execute()
        return sum(bool(w) for w in written[:-1])

    async def aclose(self) -> None:
        await self._redis.aclose()


def open_tenant_store(redis_url: str | None, yaml_path: str | Path | None) -> TenantStore | None:
    if redis_url:
        return RedisTenantStore(redis_url)
    if yaml_path:
        return YamlTenantStore(yaml_path)
    return None


def merge_tenants(static: tuple[TenantConfig, ...], stored: dict[str, Tenant]) -> dict[str, Tenant]:
    """Config tenants overlaid with the store's records (the store wins on the same id)."""
    return {**{c.id: Tenant.from_config(c) for c in static}, **stored}


def run_sync(coro):
    """Run a store call from synchronous code (the CLI); never from inside an event loop."""
    return asyncio.run(coro)
