"""How long a client command takes to reach its first request, against the in-process command.

    python -m kvmesh.load_tests.bench_cli_start [--rounds 5]

Each round starts two fresh interpreters, alternating: one imports what `kvmesh generate
--server` needs before it sends (the CLI parser and the gRPC client), the other what the
in-process `kvmesh generate` needs before it loads a model (the parser, the engine, the
tokenizer). Prints each round's seconds and the median ratio. The client path must stay free
of torch and the engine (tests/test_cli_client_imports.py checks the modules; this measures
the time, which only means something on a quiet machine).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

PARSER = "from kvmesh.deploy.cli import build_parser; build_parser()"
CLIENT = PARSER + "; import kvmesh.router.client"
IN_PROCESS = PARSER + "; import kvmesh.worker.engine_api"


def start_s(code: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-P", "-c", code], check=True)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    ratios = []
    for round_no in range(1, args.rounds + 1):
        client_s, in_process_s = start_s(CLIENT), start_s(IN_PROCESS)
        ratios.append(in_process_s / client_s)
        print(f"round {round_no}: client {client_s:.2f} s, in-process {in_process_s:.2f} s, "
              f"ratio {ratios[-1]:.2f}", flush=True)
    print(f"median: the client path starts {statistics.median(ratios):.2f}x faster than the in-process one")


if __name__ == "__main__":
    main()
