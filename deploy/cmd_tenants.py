"""`kvmesh tenants add|list|set|remove`: manage tenants and their API keys.

    kvmesh tenants add acme --prompt-tpm 60000 --output-tpm 30000 --max-concurrent-requests 8
        -> prints the new API key ONCE (only its salted hash is stored)
    kvmesh tenants set acme --max-tokens 1024 --prompt-tpm none --add-key
    kvmesh tenants list [--json]
    kvmesh tenants remove acme
    kvmesh tenants export --out tenants-backup.yaml   # every record, key hashes included
    kvmesh tenants import tenants-backup.yaml         # write them into this store

Where records go: Redis (`--redis-url`, or `tenants.redis_url` of `--config`), shared by all
router replicas; else the YAML file (`--file`, or `tenants.tenants_file` of `--config`, or
./kvmesh-tenants.yaml). Routers pick changes up within `tenants.tenant_refresh_s`.
Exit codes: 0 done, 1 no such tenant / already exists, 2 bad input.

Export/import is the registry's backup and restore path (the file has the shape of
`tenants.tenants_file`, so it can also serve as one, or become a Kubernetes Secret): run an
export after every change, and an import after a Redis that lost its data (routers that
were running write back what they last read by themselves; router/auth.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

# Function-level imports: each `kvmesh` command imports only what it runs, so the CLI starts
# (and `--help` answers) without loading torch, Ray or transformers.

DEFAULT_TENANTS_FILE = "kvmesh-tenants.yaml"
EXIT_NOT_FOUND = 1
EXIT_BAD_INPUT = 2

# flag -> TenantLimits field
_LIMIT_FLAGS = {
    "prompt_tpm": "prompt_tokens_per_minute",
    "output_tpm": "output_tokens_per_minute",
    "max_concurrent_requests": "max_concurrent_requests",
    "max_concurrent_kv_tokens": "max_concurrent_kv_tokens",
    "max_tokens": "max_tokens_ceiling",
}


UNLIMITED = "none"  # a flag's value meaning "remove this limit"; an absent flag is None = unchanged


def _limit(text: str) -> int | str:
    """A positive integer, or `none` for unlimited."""
    if text.lower() == UNLIMITED:
        return UNLIMITED
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1 (or 'none')")
    return value


def register(subparsers) -> None:
    p = subparsers.add_parser("tenants", help="add, list, change or remove tenants and API keys")
    p.add_argument("--redis-url", help="store tenants in this Redis (shared by all router replicas)")
    p.add_argument("--file", help=f"store tenants in this YAML file (default {DEFAULT_TENANTS_FILE})")
    p.add_argument("--config", help="kvmesh YAML config: its tenants.redis_url / tenants.tenants_file")
    sub = p.add_subparsers(dest="tenants_command", metavar="ACTION")
    sub.required = True

    def with_limits(q: argparse.ArgumentParser) -> None:
        q.add_argument("--priority", type=int, help="lower = served first (default 0)")
        q.add_argument("--prompt-tpm", type=_limit, help="prompt tokens per minute ('none' = unlimited)")
        q.add_argument("--output-tpm", type=_limit, help="output tokens per minute")
        q.add_argument("--max-concurrent-requests", type=_limit, help="requests in flight at once")
        q.add_argument("--max-concurrent-kv-tokens", type=_limit, help="prompt + max_tokens in flight at once")
        q.add_argument("--max-tokens", type=_limit, help="ceiling on one request's max_tokens")
        q.add_argument("--cache-salt", help="isolate this tenant's prefix cache ('none' = shared)")

    add = sub.add_parser("add", help="create a tenant and print its first API key")
    add.add_argument("tenant_id")
    with_limits(add)
    change = sub.add_parser("set", help="change a tenant's limits, or give it another key")
    change.add_argument("tenant_id")
    with_limits(change)
    change.add_argument("--add-key", action="store_true", help="issue one more API key (printed once)")
    change.add_argument("--revoke-keys", action="store_true", help="remove all existing keys first")
    listing = sub.add_parser("list", help="show tenants and limits (never keys)")
    listing.add_argument("--json", action="store_true")
    remove = sub.add_parser("remove", help="delete a tenant (its keys stop working)")
    remove.add_argument("tenant_id")
    export = sub.add_parser("export", help="write every tenant record (key hashes, never keys) as YAML")
    export.add_argument("--out", help="file to write (mode 0600); default stdout")
    imp = sub.add_parser("import", help="write the records of an export into this store")
    imp.add_argument("path", help="a file written by `kvmesh tenants export`")
    imp.add_argument("--missing-only", action="store_true",
                     help="keep records the store already has (default: the file's version wins)")
    p.set_defaults(func=run)


def _store(args: argparse.Namespace):
    from kvmesh.core.config import KvmeshConfig
    from kvmesh.router.tenants import RedisTenantStore, YamlTenantStore

    tenants_cfg = KvmeshConfig.from_yaml(args.config).tenants if args.config else None
    redis_url = args.redis_url or (tenants_cfg.redis_url if tenants_cfg else None)
    if redis_url:
        return RedisTenantStore(redis_url)
    return YamlTenantStore(args.file or (tenants_cfg and tenants_cfg.tenants_file) or DEFAULT_TENANTS_FILE)


def _apply(tenant, args: argparse.Namespace):
    from kvmesh.router.tenants import Tenant

    limits = {field: None if getattr(args, flag) == UNLIMITED else getattr(args, flag)
              for flag, field in _LIMIT_FLAGS.items() if getattr(args, flag) is not None}
    changes = {"limits": dataclasses.replace(tenant.limits, **limits)}
    if args.priority is not None:
        changes["priority"] = args.priority
    if args.cache_salt is not None:
        changes["cache_salt"] = None if args.cache_salt.lower() == UNLIMITED else args.cache_salt
    updated = dataclasses.replace(tenant, **changes)
    return Tenant.from_dict(updated.to_dict())  # validated like the config tree


def _describe(tenant) -> dict:
    return {"id": tenant.id, "priority": tenant.priority, "num_api_keys": len(tenant.api_key_hashes),
            "cache_isolated": tenant.cache_salt is not None, **dataclasses.asdict(tenant.limits)}


def _line(tenant) -> str:
    """One line per tenant: id, priority, key count, and only the limits that are set."""
    d = _describe(tenant)
    limits = ", ".join(f"{k}={v}" for k, v in d.items() if k not in ("id", "priority") and v is not None)
    return f"{tenant.id}  priority={tenant.priority}  {limits}"


async def _run(args: argparse.Namespace, store) -> int:
    from kvmesh.router.tenants import Tenant, generate_api_key, hash_api_key

    action = args.tenants_command
    if action in ("export", "import"):
        return await _export_or_import(args, store)
    if action == "list":
        tenants = sorted(await store.list(), key=lambda t: t.id)
        if args.json:
            print(json.dumps([_describe(t) for t in tenants], indent=2))
        for t in [] if args.json else tenants:
            print(_line(t))
        return 0
    existing = await store.get(args.tenant_id)
    if action == "remove":
        if not await store.remove(args.tenant_id):
            print(f"kvmesh tenants: no tenant {args.tenant_id!r}", file=sys.stderr)
            return EXIT_NOT_FOUND
        print(f"removed tenant {args.tenant_id}")
        return 0
    if action == "add" and existing is not None:
        print(f"kvmesh tenants: tenant {args.tenant_id!r} exists (use `set`)", file=sys.stderr)
        return EXIT_NOT_FOUND
    if action == "set" and existing is None:
        print(f"kvmesh tenants: no tenant {args.tenant_id!r} (use `add`)", file=sys.stderr)
        return EXIT_NOT_FOUND
    tenant = _apply(existing or Tenant(id=args.tenant_id), args)
    new_key = None
    if action == "add" or args.add_key:
        new_key = generate_api_key()
        kept = () if action == "set" and args.revoke_keys else tenant.api_key_hashes
        tenant = dataclasses.replace(tenant, api_key_hashes=(*kept, hash_api_key(new_key)))
    elif args.revoke_keys:
        tenant = dataclasses.replace(tenant, api_key_hashes=())
    await store.put(tenant)
    print(f"{'added' if action == 'add' else 'updated'} tenant {_line(tenant)}")
    if new_key is not None:
        print(f"API key (shown once, store it now): {new_key}")
    return 0


async def _export_or_import(args: argparse.Namespace, store) -> int:
    from kvmesh.router.tenants import YamlTenantStore

    if args.tenants_command == "export":
        tenants = sorted(await store.list(), key=lambda t: t.id)
        if args.out:
            YamlTenantStore(args.out).write_all(tenants)
            print(f"exported {len(tenants)} tenants to {args.out}")
        else:
            print(YamlTenantStore.render(tenants), end="")
        return 0
    source = YamlTenantStore(args.path)
    if not source.path.exists():
        print(f"kvmesh tenants: no file {args.path}", file=sys.stderr)
        return EXIT_NOT_FOUND
    tenants = await source.list()
    if args.missing_only:
        written = await store.restore(tenants)
    else:
        for tenant in tenants:
            await store.put(tenant)
        written = len(tenants)
    print(f"imported {written} of {len(tenants)} tenants from {args.path}")
    return 0


def run(args: argparse.Namespace) -> int:
    import asyncio

    from kvmesh.core.config import ConfigError
    from kvmesh.core.errors import InvalidRequestError

    try:
        store = _store(args)
    except ConfigError as exc:
        print(f"kvmesh tenants: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT

    async def run_and_close() -> int:
        try:
            return await _run(args, store)
        finally:
            if hasattr(store, "aclose"):
                await store.aclose()

    try:
        return asyncio.run(run_and_close())
    except (ConfigError, InvalidRequestError) as exc:
        print(f"kvmesh tenants: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
