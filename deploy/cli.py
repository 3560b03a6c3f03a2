"""`kvmesh` command line. Each subcommand lives in its own module `kvmesh.deploy.cmd_<name>`
exposing `register(subparsers)`, which adds its parser and sets `func(args) -> int`.
Modules are imported lazily-ish: only to build the parser, and they keep heavy imports
(torch, ray) inside their `func`, so `kvmesh --help` stays fast."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMAND_MODULES = [
    "generate",
    "capacity",
    "quant_report",
    "serve_config",
    "tenants",
    "adapters",
    "stats",
    "trace",
    "load",
    "serve",
    "drain",
    "chat",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh", description="kvmesh: multi-tenant LLM serving on Ray")
    parser.add_argument("--log-level", default="WARNING", help="logging level for stderr (default WARNING)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(f"kvmesh.deploy.cmd_{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
