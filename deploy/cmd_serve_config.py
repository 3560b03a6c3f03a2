"""`kvmesh serve-config`: print the Ray Serve config file that deploys a KvmeshConfig.

    kvmesh serve-config --config kvmesh.yaml --set scheduler.max_num_seqs=32 > serve.yaml
    serve deploy serve.yaml            # or paste it into a RayService's serveConfigV2

--config takes a KvmeshConfig YAML, or an existing Serve file (its kvmesh app's args are
read back, so the command also round-trips and re-validates a Serve file).

Exit codes: 0 file printed, 2 bad input (message on stderr).
"""

from __future__ import annotations

import argparse
import sys

# Function-level imports: each `kvmesh` command imports only what it runs, so the CLI starts
# (and `--help` answers) without loading torch, Ray or transformers.

EXIT_BAD_INPUT = 2


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve-config", help="print a Ray Serve config file (serve deploy / serveConfigV2) for a config",
        description="Builds the Serve config whose kvmesh application carries the whole KvmeshConfig "
                    "as args, validated by Ray's ServeDeploySchema and by kvmesh's loader.")
    p.add_argument("--config", help="KvmeshConfig YAML, or a Serve config YAML to re-validate")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one config field (value parsed as YAML), repeatable: "
                        "--set parallel.tensor_parallel_size=2 --set router.host=0.0.0.0")
    serve = p.add_argument_group("Serve plumbing (not part of the KvmeshConfig)")
    serve.add_argument("--app-name", default="kvmesh", help="Serve application name (default kvmesh)")
    p.add_argument("--output", "-o", help="write here instead of stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvmesh.core.config import ConfigError

    try:
        text = _render(args)
    except ConfigError as exc:
        print(f"kvmesh serve-config: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.output:
        with open(args.output, "w") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)
    return 0


def _render(args: argparse.Namespace) -> str:
    from kvmesh.core.config import KvmeshConfig, apply_overrides
    from kvmesh.deploy.serve_config import ServeOptions, build_serve_config, serve_config_yaml

    config = _load_config(args.config) if args.config else KvmeshConfig()
    config = apply_overrides(config, args.overrides)
    # No Serve proxies: the router replicas serve HTTP and gRPC themselves (deploy/serve_config.py).
    options = ServeOptions(app_name=args.app_name)
    return serve_config_yaml(build_serve_config(config, options))


def _load_config(path: str):
    import yaml

    from kvmesh.core.config import ConfigError, KvmeshConfig
    from kvmesh.deploy.serve_config import kvmesh_config_from_serve_config

    try:
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if isinstance(data, dict) and "applications" in data:
        return kvmesh_config_from_serve_config(data)
    return KvmeshConfig.from_dict(data)
