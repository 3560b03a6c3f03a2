"""The tenant registry outlives its store: a real redis-server killed, restarted empty, and
the routers' Authenticators (router/auth.py) that must neither lock tenants out nor mistake a
deliberate removal for a wipe; `kvmesh tenants export/import` as the backup path."""

import asyncio

import pytest
from test_auth import printed_keys, run_cli

from kvmesh.core.config import TenantsConfig
from kvmesh.deploy import cmd_tenants
from kvmesh.core.errors import UnauthenticatedError
from kvmesh.router.auth import Authenticator
from kvmesh.router.tenants import RedisTenantStore, Tenant, YamlTenantStore


class Flags:
    """The callbacks the router wires to its metrics, recorded."""

    def __init__(self):
        self.stale: list[bool] = []
        self.restored: list[int] = []

    def authenticator(self, store) -> Authenticator:
        return Authenticator(TenantsConfig(auth_required=True), store,
                             on_stale_change=self.stale.append, on_restore=self.restored.append)


def _add(redis_url: str, tenant_id: str, capsys) -> str:
    assert run_cli(["tenants", "--redis-url", redis_url, "add", tenant_id, "--output-tpm", "1000"]) == 0
    [key] = printed_keys(capsys.readouterr().out)
    return key


def test_a_store_restarted_empty_gets_the_registry_back_and_nobody_is_locked_out(redis_server, capsys):
    redis_server.flushall()
    keys = {t: _add(redis_server.url, t, capsys) for t in ("acme", "beta")}

    async def scenario():
        flags_a, flags_b = Flags(), Flags()
        replica_a = flags_a.authenticator(RedisTenantStore(redis_server.url))
        replica_b = flags_b.authenticator(RedisTenantStore(redis_server.url))
        for replica in (replica_a, replica_b):
            await replica.refresh()
            assert replica.authenticate(keys["acme"]).id == "acme"

        redis_server.kill()
        with pytest.raises(Exception):
            await replica_a.refresh()
        assert replica_a.stale and flags_a.stale == [True]
        assert replica_a.authenticate(keys["beta"]).id == "beta"  # the last registry serves

        redis_server.restart(empty=True)
        await replica_a.refresh()
        assert flags_a.stale == [True, False] and flags_a.restored == [2]
        assert {t.id for t in await RedisTenantStore(redis_server.url).list()} == {"acme", "beta"}
        # The other replica finds the records already back: nothing to restore, nothing lost.
        await replica_b.refresh()
        assert flags_b.restored == [] and replica_b.authenticate(keys["beta"]).id == "beta"
        # A replica that starts only now (it never saw the registry) finds it in the store.
        late = Flags().authenticator(RedisTenantStore(redis_server.url))
        await late.refresh()
        assert late.authenticate(keys["acme"]).id == "acme"

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_removing_every_tenant_is_not_mistaken_for_a_wipe(redis_server, capsys):
    redis_server.flushall()
    key = _add(redis_server.url, "gone", capsys)

    async def scenario():
        flags = Flags()
        replica = flags.authenticator(RedisTenantStore(redis_server.url))
        await replica.refresh()
        assert replica.authenticate(key).id == "gone"
        assert await RedisTenantStore(redis_server.url).remove("gone")  # as `kvmesh tenants remove`
        await replica.refresh()
        with pytest.raises(UnauthenticatedError):
            replica.authenticate(key)
        assert flags.restored == [] and await RedisTenantStore(redis_server.url).list() == []

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_export_then_import_into_an_empty_store(redis_server, capsys, tmp_path):
    redis_server.flushall()
    key = _add(redis_server.url, "acme", capsys)
    backup = tmp_path / "backup.yaml"
    assert run_cli(["tenants", "--redis-url", redis_server.url, "export", "--out", str(backup)]) == 0
    assert backup.stat().st_mode & 0o077 == 0
    assert key.split(".")[2] not in backup.read_text() and "pbkdf2" in backup.read_text()
    assert run_cli(["tenants", "--redis-url", redis_server.url, "export"]) == 0
    assert "acme" in capsys.readouterr().out

    redis_server.restart(empty=True)
    assert run_cli(["tenants", "--redis-url", redis_server.url, "import", str(backup)]) == 0
    assert "imported 1 of 1" in capsys.readouterr().out
    assert run_cli(["tenants", "--redis-url", redis_server.url, "import", str(backup), "--missing-only"]) == 0
    assert "imported 0 of 1" in capsys.readouterr().out
    assert run_cli(["tenants", "--redis-url", redis_server.url, "import", str(tmp_path / "nope.yaml")]) \
        == cmd_tenants.EXIT_NOT_FOUND

    async def scenario():
        replica = Authenticator(TenantsConfig(auth_required=True), RedisTenantStore(redis_server.url))
        await replica.refresh()
        assert replica.authenticate(key).id == "acme"

    asyncio.run(scenario())


def test_a_deleted_tenants_file_is_written_back(tmp_path):
    path = tmp_path / "tenants.yaml"

    async def scenario():
        store = YamlTenantStore(path)
        await store.put(Tenant(id="acme"))
        flags = Flags()
        replica = flags.authenticator(store)
        await replica.refresh()
        path.unlink()
        await replica.refresh()
        assert "acme" in replica.tenants and flags.restored == [1]
        assert [t.id for t in await store.list()] == ["acme"]

    asyncio.run(scenario())
