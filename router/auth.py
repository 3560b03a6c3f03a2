"""Authentication: API key -> Tenant, before any other work on a request.

    auth = Authenticator.from_config(config.tenants)  # store from tenants.redis_url / tenants_file
    await auth.start()                            # load store records, then reload every
                                                  #   tenants.tenant_refresh_s (`kvmesh tenants add`
                                                  #   lands within one tick)
    tenant = auth.authenticate(api_key)           # raises UnauthenticatedError; sync, no I/O

Lower level: `Authenticator(config.tenants, store)`, `await auth.refresh()`,
`auth.start_refresh(interval_s)`, `auth.stop_refresh()`.

The last registry read is kept, never dropped by a bad read: while the store is unreachable
the replica serves it (`on_stale_change(True)`), and a store that comes back WIPED (no
records and no write marker, router/tenants.py) gets it written back (`on_restore(n)`, an
ERROR log), so an empty Redis after a restart locks nobody out and replicas that start
later find the registry again. Removing every tenant with `kvmesh tenants remove` leaves
the marker, so it is never mistaken for a wipe.

Open mode (`tenants.auth_required: false`, the embedded default): a request without a key,
or with a key no tenant owns, runs as the default tenant; this is logged once at WARNING so
nobody ships it by accident. A key that does match a tenant still selects that tenant.

Verification cost: PBKDF2 runs once per distinct key per process; afterwards the key is
found in a bounded cache keyed by SHA-256 of the key (never the key itself). The cache is
dropped whenever the tenant set changes, so a removed key stops working at the next
refresh. Keys are never logged: only tenant ids and a short fingerprint of the salt.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from typing import Callable

from kvmesh.core.config import TenantsConfig
from kvmesh.router.tenants import (Tenant, TenantStore, key_salt, merge_tenants, open_tenant_store, parse_key_hash,
                                   verify_api_key)
from kvmesh.core.errors import UnauthenticatedError

logger = logging.getLogger(__name__)

_VERIFIED_CACHE_SIZE = 10_000


class Authenticator:
    def __init__(self, tenants_config: TenantsConfig, store: TenantStore | None = None,
                 on_stale_change: Callable[[bool], None] | None = None,
                 on_restore: Callable[[int], None] | None = None):
        self._config = tenants_config
        self._store = store
        self._stored: dict[str, Tenant] = {}  # the store's records as last read (or restored)
        self._stale = False
        self._on_stale_change = on_stale_change
        self._on_restore = on_restore
        self._by_salt: dict[str, tuple[str, str]] = {}  # salt hex -> (tenant id, stored hash)
        self._tenants: dict[str, Tenant] = {}
        # sha256(key) -> tenant id; a fast index over keys that already passed PBKDF2.
        self._verified: OrderedDict[bytes, str] = OrderedDict()
        self._warned_open = False
        self._refresh_task: asyncio.Task | None = None
        self._install({c.id: Tenant.from_config(c) for c in tenants_config.tenants})

    @classmethod
    def from_config(cls, tenants_config: TenantsConfig, **callbacks) -> "Authenticator":
        """Config tenants plus the store `kvmesh tenants` writes (Redis, else tenants_file);
        callbacks: on_stale_change, on_restore (see __init__)."""
        return cls(tenants_config, open_tenant_store(tenants_config.redis_url, tenants_config.tenants_file),
                   **callbacks)

    async def start(self) -> None:
        """First load of the store's tenants, then a periodic reload. A store that is down at
        start is not fatal: config tenants serve, and the reload keeps trying."""
        if self._store is None:
            return
        try:
            await self.refresh()
        except Exception as exc:
            logger.warning("tenant store unreachable at start (%s); serving config tenants only",
                           type(exc).__name__)
        self.start_refresh(self._config.tenant_refresh_s)

    # ---- tenant set ----------------------------------------------------------------------

    @property
    def tenants(self) -> dict[str, Tenant]:
        return dict(self._tenants)

    def _install(self, tenants: dict[str, Tenant]) -> None:
        if not self._config.auth_required and self._config.default_tenant not in tenants:
            tenants[self._config.default_tenant] = Tenant(id=self._config.default_tenant)
        by_salt = {}
        for tenant in tenants.values():
            for stored in tenant.api_key_hashes:
                _, salt, _ = parse_key_hash(stored)
                by_salt[salt] = (tenant.id, stored)
        if tenants != self._tenants:
            self._verified.clear()
        self._tenants, self._by_salt = tenants, by_salt

    @property
    def stale(self) -> bool:
        """True while the last refresh failed and the last known registry is served."""
        return self._stale

    def _set_stale(self, stale: bool) -> None:
        if stale != self._stale:
            self._stale = stale
            if self._on_stale_change is not None:
                self._on_stale_change(stale)

    async def refresh(self) -> None:
        """Reload tenant records from the store (config tenants + store overlay). Raises what
        the store raised, after flagging the registry stale; the tenant set is unchanged."""
        if self._store is None:
            return
        try:
            contents = await self._store.read()
            if not contents.ever_written and self._stored:
                await self._restore()
            else:
                self._stored = {t.id: t for t in contents.tenants}
        except Exception:
            self._set_stale(True)
            raise
        self._install(merge_tenants(self._config.tenants, self._stored))
        self._set_stale(False)

    async def _restore(self) -> None:
        """The store came back wiped: keep serving what we knew and write it back."""
        logger.error("tenant store holds no registry (restarted without persistence, or flushed); "
                     "serving the %d tenants last read and writing them back", len(self._stored))
        written = await self._store.restore(list(self._stored.values()))
        logger.error("tenant store: %d of %d tenant records restored", written, len(self._stored))
        if self._on_restore is not None:
            self._on_restore(written)

    def start_refresh(self, interval_s: float) -> asyncio.Task:
        async def loop() -> None:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    await self.refresh()
                except Exception as exc:  # the store is down: keep serving the last tenant set
                    logger.warning("tenant refresh failed, keeping %d known tenants: %s",
                                   len(self._tenants), type(exc).__name__)
        self._refresh_task = asyncio.get_running_loop().create_task(loop())
        return self._refresh_task

    def stop_refresh(self) -> None:
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            self._refresh_task = None

    # ---- per request ---------------------------------------------------------------------

    def authenticate(self, api_key: str | None) -> Tenant:
        """The caller's tenant. `api_key` is the bare key (strip "Bearer " before calling)."""
        tenant_id = self._lookup(api_key) if api_key else None
        if tenant_id is not None:
            return self._tenants[tenant_id]
        if self._config.auth_required:
            raise UnauthenticatedError("missing API key" if not api_key else "invalid API key")
        if not self._warned_open:
            self._warned_open = True
            logger.warning("authentication is OFF (tenants.auth_required=false): unauthenticated "
                           "requests run as tenant %r; set auth_required for any shared deployment",
                           self._config.default_tenant)
        return self._tenants[self._config.default_tenant]

    def _lookup(self, api_key: str) -> str | None:
        fingerprint = hashlib.sha256(api_key.encode()).digest()
        tenant_id = self._verified.get(fingerprint)
        if tenant_id is not None and tenant_id in self._tenants:
            self._verified.move_to_end(fingerprint)
            return tenant_id
        salt = key_salt(api_key)
        candidate = self._by_salt.get(salt) if salt else None
        if candidate is None or not verify_api_key(api_key, candidate[1]):
            logger.debug("rejected an API key (salt prefix %s)", (salt or "malformed")[:4])
            return None
        self._verified[fingerprint] = candidate[0]
        if len(self._verified) > _VERIFIED_CACHE_SIZE:
            self._verified.popitem(last=False)
        return candidate[0]


def bearer_token(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header (HTTP) or metadata value (gRPC)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None
