"""API keys, the Authenticator, tenant stores and `kvmesh tenants` (YAML file and real Redis)."""

import argparse
import asyncio
import logging
import re

import pytest

from kvmesh.deploy import cmd_tenants
from kvmesh.core.config import KvmeshConfig, TenantConfig, TenantsConfig
from kvmesh.router import auth as auth_module
from kvmesh.router.auth import Authenticator, bearer_token
from kvmesh.router.tenants import (RedisTenantStore, Tenant, TenantLimits, YamlTenantStore, generate_api_key,
                                   hash_api_key, verify_api_key)
from kvmesh.core.errors import InvalidRequestError, UnauthenticatedError

KEY_LINE = re.compile(r"API key \(shown once, store it now\): (\S+)")


def run_cli(argv: list[str]) -> int:
    """`kvmesh tenants ...` as the CLI wires it (only this module's parser)."""
    parser = argparse.ArgumentParser(prog="kvmesh")
    cmd_tenants.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def printed_keys(text: str) -> list[str]:
    return KEY_LINE.findall(text)


def test_key_hash_format_and_verification():
    key = generate_api_key()
    stored = hash_api_key(key)
    scheme, salt, digest = stored.split("$")
    assert scheme.startswith("pbkdf2-sha256:") and len(salt) == 16 and len(digest) == 64
    assert key not in stored and key.split(".")[2] not in stored
    assert verify_api_key(key, stored)
    assert not verify_api_key(key[:-1] + ("A" if key[-1] != "A" else "B"), stored)
    assert not verify_api_key(generate_api_key(), stored)
    with pytest.raises(InvalidRequestError):
        hash_api_key("sk-not-a-kvmesh-key")
    with pytest.raises(InvalidRequestError):
        verify_api_key(key, "md5$00$00")


def test_auth_required_rejects_missing_unknown_and_malformed_keys():
    key = generate_api_key()
    cfg = TenantsConfig(auth_required=True, tenants=(TenantConfig(id="acme", api_key_hashes=(hash_api_key(key),),
                                                                  priority=2, max_tokens_ceiling=64),))
    auth = Authenticator(cfg)
    tenant = auth.authenticate(key)
    assert tenant.id == "acme" and tenant.priority == 2 and tenant.limits.max_tokens_ceiling == 64
    for bad in (None, "", "kvm.0011223344556677.nope", generate_api_key(), "garbage"):
        with pytest.raises(UnauthenticatedError):
            auth.authenticate(bad)
    assert "default" not in auth.tenants  # no implicit tenant when auth is required


def test_verified_keys_are_cached_by_fingerprint(monkeypatch):
    key = generate_api_key()
    auth = Authenticator(TenantsConfig(auth_required=True,
                                       tenants=(TenantConfig(id="acme", api_key_hashes=(hash_api_key(key),)),)))
    calls = []
    real_verify = auth_module.verify_api_key

    def counting_verify(api_key, stored):  # a spy around the real PBKDF2 check
        calls.append(1)
        return real_verify(api_key, stored)

    monkeypatch.setattr(auth_module, "verify_api_key", counting_verify)
    for _ in range(5):
        assert auth.authenticate(key).id == "acme"
    assert len(calls) == 1


def test_open_mode_default_tenant_warns_once(caplog):
    key = generate_api_key()
    cfg = TenantsConfig(auth_required=False, tenants=(TenantConfig(id="acme", api_key_hashes=(hash_api_key(key),)),))
    auth = Authenticator(cfg)
    with caplog.at_level(logging.WARNING, logger="kvmesh.router.auth"):
        assert auth.authenticate(None).id == "default"
        assert auth.authenticate(generate_api_key()).id == "default"
        assert auth.authenticate(None).id == "default"
        assert auth.authenticate(key).id == "acme"  # a real key still selects its tenant
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "authentication is OFF" in warnings[0].getMessage()


def test_bearer_token():
    assert bearer_token("Bearer kvm.abc.def") == "kvm.abc.def"
    assert bearer_token("bearer   kvm.abc.def ") == "kvm.abc.def"
    assert bearer_token("Basic dXNlcg==") is None
    assert bearer_token(None) is None and bearer_token("Bearer ") is None


def test_cli_yaml_store_add_authenticate_set_remove(tmp_path, capsys, caplog):
    path = str(tmp_path / "tenants.yaml")
    caplog.set_level(logging.DEBUG)
    assert run_cli(["tenants", "--file", path, "add", "acme", "--prompt-tpm", "6000",
                    "--max-concurrent-requests", "4", "--cache-salt", "acme-salt"]) == 0
    out = capsys.readouterr().out
    [key] = printed_keys(out)
    assert out.count(key) == 1  # printed exactly once
    assert run_cli(["tenants", "--file", path, "add", "acme"]) == cmd_tenants.EXIT_NOT_FOUND
    assert key not in (tmp_path / "tenants.yaml").read_text()
    assert (tmp_path / "tenants.yaml").stat().st_mode & 0o077 == 0

    auth = Authenticator(TenantsConfig(auth_required=True), YamlTenantStore(path))
    with pytest.raises(UnauthenticatedError):
        auth.authenticate(key)  # not loaded yet
    asyncio.run(auth.refresh())
    tenant = auth.authenticate(key)
    assert tenant.limits == TenantLimits(prompt_tokens_per_minute=6000, max_concurrent_requests=4)
    assert tenant.cache_salt == "acme-salt"

    assert run_cli(["tenants", "--file", path, "set", "acme", "--prompt-tpm", "none", "--max-tokens", "512",
                    "--add-key"]) == 0
    [second_key] = printed_keys(capsys.readouterr().out)
    asyncio.run(auth.refresh())
    assert auth.authenticate(second_key).limits == TenantLimits(max_concurrent_requests=4, max_tokens_ceiling=512)
    assert auth.authenticate(key).id == "acme"  # the first key still works

    assert run_cli(["tenants", "--file", path, "list"]) == 0
    listing = capsys.readouterr().out
    assert "acme" in listing and "max_tokens_ceiling=512" in listing and "pbkdf2" not in listing

    assert run_cli(["tenants", "--file", path, "remove", "acme"]) == 0
    assert run_cli(["tenants", "--file", path, "remove", "acme"]) == cmd_tenants.EXIT_NOT_FOUND
    asyncio.run(auth.refresh())
    with pytest.raises(UnauthenticatedError):
        auth.authenticate(key)  # the verified-key cache was dropped with the tenant

    logged = "\n".join(r.getMessage() for r in caplog.records)
    for secret in (key, second_key, key.split(".")[2], second_key.split(".")[2]):
        assert secret not in logged


def test_bad_limit_value_is_rejected(tmp_path):
    with pytest.raises(SystemExit):
        run_cli(["tenants", "--file", str(tmp_path / "t.yaml"), "add", "acme", "--max-tokens", "0"])


def test_cli_redis_store_and_refresh_task(redis_server, capsys):
    redis_server.flushall()
    assert run_cli(["tenants", "--redis-url", redis_server.url, "add", "beta", "--output-tpm", "1000"]) == 0
    [key] = printed_keys(capsys.readouterr().out)

    async def scenario():
        store = RedisTenantStore(redis_server.url)
        raw = await store._redis.hget("kvmesh:tenants", "beta")
        assert key not in raw and key.split(".")[2] not in raw
        auth = Authenticator(TenantsConfig(auth_required=True), store)
        auth.start_refresh(interval_s=0.05)
        while "beta" not in auth.tenants:
            await asyncio.sleep(0.01)
        assert auth.authenticate(key).limits.output_tokens_per_minute == 1000
        await store.remove("beta")
        while "beta" in auth.tenants:
            await asyncio.sleep(0.01)
        with pytest.raises(UnauthenticatedError):
            auth.authenticate(key)
        auth.stop_refresh()
        await store.aclose()

    asyncio.run(scenario())


def test_config_tenants_round_trip_through_the_config_tree(tmp_path):
    key = generate_api_key()
    cfg = KvmeshConfig.from_dict({"tenants": {"auth_required": True, "tenants": [
        {"id": "acme", "api_key_hashes": [hash_api_key(key)], "max_concurrent_kv_tokens": 4096}]}})
    tenant = Authenticator(cfg.tenants).authenticate(f"{key}")
    assert tenant == Tenant.from_config(cfg.tenants.tenants[0])
    assert Tenant.from_dict(tenant.to_dict()) == tenant


def test_from_config_loads_the_tenants_file_and_keeps_it_fresh(tmp_path, capsys):
    path = str(tmp_path / "tenants.yaml")
    assert run_cli(["tenants", "--file", path, "add", "acme"]) == 0
    [key] = printed_keys(capsys.readouterr().out)

    async def scenario():
        auth = Authenticator.from_config(TenantsConfig(auth_required=True, tenants_file=path, tenant_refresh_s=0.05))
        await auth.start()
        assert auth.authenticate(key).id == "acme"
        await YamlTenantStore(path).put(Tenant(id="later"))
        while "later" not in auth.tenants:
            await asyncio.sleep(0.01)
        auth.stop_refresh()

    asyncio.run(asyncio.wait_for(scenario(), 30))
