"""`kvmesh adapters add|list|remove`: register LoRA adapters the cluster serves.

    kvmesh adapters add acme-support /shared/adapters/acme-support --tenant acme
        -> checks the folder is a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors)
    kvmesh adapters list [--json]
    kvmesh adapters remove acme-support

Records go to the YAML file `--file`, or `lora.adapters_file` of `--config`, or
./kvmesh-adapters.yaml; routers read it within `tenants.tenant_refresh_s`. The path must be
readable by every worker (a shared volume): workers load an adapter when a request first
needs it. Clients then ask for model "<base>:acme-support" (HTTP) or set
GenerateRequest.adapter (gRPC). Exit codes: 0 done, 1 no such adapter / already exists,
2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys

# Function-level imports: each `kvmesh` command imports only what it runs, so the CLI starts
# (and `--help` answers) without loading torch, Ray or transformers.

DEFAULT_ADAPTERS_FILE = "kvmesh-adapters.yaml"
EXIT_NOT_FOUND = 1
EXIT_BAD_INPUT = 2


def register(subparsers) -> None:
    p = subparsers.add_parser("adapters", help="register, list or remove LoRA adapters")
    p.add_argument("--file", help=f"the adapters YAML file (default {DEFAULT_ADAPTERS_FILE})")
    p.add_argument("--config", help="kvmesh YAML config: its lora.adapters_file")
    sub = p.add_subparsers(dest="adapters_command", metavar="ACTION")
    sub.required = True
    add = sub.add_parser("add", help="register a PEFT LoRA adapter folder under a name")
    add.add_argument("name")
    add.add_argument("path", help="the adapter folder, readable by every worker")
    add.add_argument("--tenant", help="only this tenant may use it (default: every tenant)")
    listing = sub.add_parser("list", help="show registered adapters")
    listing.add_argument("--json", action="store_true")
    remove = sub.add_parser("remove", help="unregister an adapter (new requests for it get NOT_FOUND)")
    remove.add_argument("name")
    p.set_defaults(func=run)


def _file(args: argparse.Namespace) -> str:
    from kvmesh.core.config import KvmeshConfig

    configured = KvmeshConfig.from_yaml(args.config).lora.adapters_file if args.config else None
    return args.file or configured or DEFAULT_ADAPTERS_FILE


def _check_folder(path: str) -> str | None:
    """Why `path` is not an adapter we can serve (None: it looks like one). Shapes are checked
    against the model by the worker that loads it."""
    import os

    from kvmesh.worker.model.lora_weights import CONFIG_FILE, WEIGHTS_FILE

    missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if not os.path.isfile(os.path.join(path, f))]
    if missing:
        return f"{path} is not a PEFT adapter folder (missing {', '.join(missing)})"
    with open(os.path.join(path, CONFIG_FILE)) as fh:
        peft_type = json.load(fh).get("peft_type", "LORA")
    return None if peft_type == "LORA" else f"{path} is a {peft_type} adapter; only LoRA is served"


def run(args: argparse.Namespace) -> int:
    import os

    from kvmesh.core.config import AdapterConfig, ConfigError
    from kvmesh.router.adapters import read_adapters_file, write_adapters_file

    try:
        path = _file(args)
        adapters = {a.name: a for a in read_adapters_file(path)}
        action = args.adapters_command
        if action == "list":
            rows = [{"name": a.name, "path": a.path, "tenant": a.tenant} for a in sorted(adapters.values(),
                                                                                       key=lambda a: a.name)]
            if args.json:
                print(json.dumps(rows, indent=2))
            for row in [] if args.json else rows:
                print(f"{row['name']}  {row['path']}  tenant={row['tenant'] or '(any)'}")
            return 0
        if action == "remove":
            if adapters.pop(args.name, None) is None:
                print(f"kvmesh adapters: no adapter {args.name!r}", file=sys.stderr)
                return EXIT_NOT_FOUND
            write_adapters_file(path, list(adapters.values()))
            print(f"removed adapter {args.name}")
            return 0
        if args.name in adapters:
            print(f"kvmesh adapters: adapter {args.name!r} exists (remove it first)", file=sys.stderr)
            return EXIT_NOT_FOUND
        adapter = AdapterConfig(args.name, os.path.abspath(args.path), args.tenant)
        adapter.validate()
        problem = _check_folder(adapter.path)
        if problem:
            print(f"kvmesh adapters: {problem}", file=sys.stderr)
            return EXIT_BAD_INPUT
        write_adapters_file(path, [*adapters.values(), adapter])
        print(f"added adapter {adapter.name} ({adapter.path}) for {adapter.tenant or 'every tenant'}")
        return 0
    except (ConfigError, OSError, ValueError) as exc:
        print(f"kvmesh adapters: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
