"""kvmesh's in-process engine against OpenVINO GenAI's ContinuousBatchingPipeline on the same
requests, as ratios of one run, the sides alternating.

    python -m kvmesh.load_tests.openvino_peer          # once: the OpenVINO venv's IRs (see there)
    python -m kvmesh.load_tests.bench_openvino --rounds 2 --irs int8 --modes default
    python -m kvmesh.load_tests.bench_openvino --rounds 2 --irs fp16,int8,int4 \
        --modes default,dequantized,int4-int8-activations
    python -m kvmesh.load_tests.bench_openvino --quick --rounds 2 --irs int8   # a smoke run

The workload: the seed-shaped run (64 requests, the articles' length shape x0.25, all at t=0,
exact output lengths with EOS ignored, greedy; load_tests/workloads.py synthetic kind, seed 0),
the SAME token ids on both sides. kvmesh: an Engine in this process on the config `kvmesh serve`
deploys on this machine (load_tests/bench_served.py `serve_config`: every field its default),
plus the candidate modes named by --modes (overrides of that config). OpenVINO: a child process
of the OpenVINO environment's interpreter (load_tests/openvino_child.py, JSON lines) running a
ContinuousBatchingPipeline on each IR: its defaults, except a KV cache sized to hold the run
(as kvmesh's default pool) and the engine's thread count. Each round builds every side fresh
(an engine / a pipeline), warms it with the same two requests, and runs the sides one after
the other, the order reversed every other round, so the machine's drift hits all alike.

Per side: output tok/s and E2E P50 / P99 per round and their medians; then kvmesh's default
mode over the best IR (the IR with the highest median tok/s): the median of the per-round
throughput ratios (above 1: kvmesh ahead), and of the per-round E2E P99 ratios (below 1:
kvmesh's tail finishes sooner).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from kvmesh.core.config import KvmeshConfig
from kvmesh.load_tests import openvino_child
from kvmesh.load_tests.bench_engine import EngineRunFigures, run_figures
from kvmesh.load_tests.bench_served import (WARMUP_REQUESTS, paired_ratio_line, run_in_process, seed_shaped_requests,
                                           serve_config)
from kvmesh.load_tests.openvino_peer import DEFAULT_OV_PYTHON, FORMATS, ir_dir
from kvmesh.load_tests.workloads import WorkloadRequest

# kvmesh's candidate modes: overrides of the `kvmesh serve` config (the default: every field its own)
KVMESH_MODES = {"default": (),
                # the GGUF dequantized at load, in the dtype auto picks (fp32, or bf16 where native)
                "dequantized": ("quant.weight=none",),
                # the GGUF's int4 kept, fp32 activations (token-exact): the default where the CPU
                # has no native bf16, a candidate where it has (auto picks bf16 there)
                "exact-int4": ("model.dtype=fp32",),
                # the GGUF's int4 kept in a bf16 model: on a VDPBF16PS CPU the dequantized bf16
                # model's products bit for bit, each weight dequantized to bf16 per step (int4_bf16)
                "int4-bf16": ("model.dtype=bf16", "quant.weight=gguf"),
                # llama.cpp's scheme, not token-exact (fp32: where auto picks bf16 the GGUF is dequantized)
                "int4-int8-activations": ("model.dtype=fp32", "quant.int4_activations=int8"),
                # steps past 24 tokens eager (auto where the GEMVs are FMAs): the largest native step's A/B
                "native-steps-24": ("model.cpu_native_max_tokens=24",)}
# OpenVINO's KV cache (GB, its scheduler's cache_size): kvmesh's default pool is 1 GiB and the
# seed run needs ~0.25 GB of it in fp16, so both sides hold the whole run
OV_CACHE_SIZE_GB = 1


@dataclass(frozen=True)
class SideRound:
    side: str  # "kvmesh <mode>" | "openvino <ir format>"
    round: int
    run: EngineRunFigures


def child_setup(requests: list[WorkloadRequest], threads: int) -> openvino_child.ChildSetup:
    """The OpenVINO side's requests: the same token ids and exact output lengths as kvmesh's."""
    return openvino_child.ChildSetup(tuple((r.prompt_token_ids, r.output_tokens) for r in requests), threads,
                                     OV_CACHE_SIZE_GB, WARMUP_REQUESTS)


class OpenVinoPeer:
    """The ContinuousBatchingPipeline in a child of the OpenVINO interpreter (openvino_child.py)."""

    def __init__(self, ov_python: str, setup: openvino_child.ChildSetup):
        self.expected_tokens = sum(n for _, n in setup.requests)
        self.proc = subprocess.Popen([ov_python, openvino_child.__file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.version = self._ask(openvino_child.encode_setup(setup))["openvino_genai"]

    def _ask(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"the OpenVINO child exited (code {self.proc.wait()}): see its stderr above")
        data = json.loads(reply)
        if "error" in data:
            raise RuntimeError(f"the OpenVINO child: {data['error']}")
        return data

    def run(self, ir: Path) -> EngineRunFigures:
        data = self._ask(json.dumps({"ir": str(ir)}))
        if data["output_tokens"] != self.expected_tokens:
            raise RuntimeError(f"OpenVINO produced {data['output_tokens']} tokens, asked {self.expected_tokens}")
        return run_figures(data["finish_s"], data["output_tokens"], data["wall_s"])

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def kvmesh_configs(modes: list[str]) -> dict[str, KvmeshConfig]:
    return {f"kvmesh {mode}": serve_config(None, KVMESH_MODES[mode]) for mode in modes}


def run(rounds: int, modes: list[str], irs: dict[str, Path], ov_python: str, quick: bool = False) -> list[SideRound]:
    configs = kvmesh_configs(modes)
    default = configs.get("kvmesh default") or next(iter(configs.values()))
    requests = seed_shaped_requests(default, quick)
    peer = OpenVinoPeer(ov_python, child_setup(requests, default.parallel.engine_threads()))
    print(f"openvino_genai {peer.version}; {len(requests)} requests, {sum(r.output_tokens for r in requests)} "
          "output tokens", file=sys.stderr, flush=True)
    sides = {**{name: (lambda r, c=c: run_in_process(c, requests, r).run) for name, c in configs.items()},
             **{f"openvino {fmt}": (lambda r, p=path: peer.run(p)) for fmt, path in irs.items()}}
    out: list[SideRound] = []
    try:
        for round_ in range(rounds):
            order = list(sides) if round_ % 2 == 0 else list(sides)[::-1]
            for name in order:
                out.append(SideRound(name, round_, sides[name](round_)))
                print(f"[round {round_}] {json.dumps(asdict(out[-1]))}", file=sys.stderr, flush=True)
    finally:
        peer.close()
    return out


def format_report(figures: list[SideRound], config: KvmeshConfig) -> str:
    p = config.parallel
    lines = [f"kvmesh: `kvmesh serve` defaults in-process, {p.num_workers} worker x {p.engine_threads()} threads; "
             f"OpenVINO: ContinuousBatchingPipeline, {p.engine_threads()} threads, KV cache {OV_CACHE_SIZE_GB} GB",
             "| side | output tok/s (median) | E2E P50 s | E2E P99 s | tok/s by round |", "|---|---|---|---|---|"]
    by_side: dict[str, list[SideRound]] = {}
    for f in figures:
        by_side.setdefault(f.side, []).append(f)
    med = {side: statistics.median(f.run.output_tok_s for f in fs) for side, fs in by_side.items()}
    for side, fs in by_side.items():
        lines.append(f"| {side} | {med[side]:.1f} | {statistics.median(f.run.e2e_p50_s for f in fs):.1f} | "
                     f"{statistics.median(f.run.e2e_p99_s for f in fs):.1f} | "
                     f"{', '.join(f'{f.run.output_tok_s:.1f}' for f in fs)} |")
    ov_sides = [s for s in by_side if s.startswith("openvino ")]
    kv_sides = [s for s in by_side if s.startswith("kvmesh ")]
    if not ov_sides or not kv_sides:
        return "\n".join(lines)
    best_ov = max(ov_sides, key=med.get)
    lines.append("")
    for side in kv_sides:  # below 1 on E2E P99: kvmesh's tail finishes sooner
        lines.append(paired_ratio_line(f"{side} / {best_ov} (the best IR)",
                                       [(a.run, b.run) for a, b in zip(by_side[side], by_side[best_ov])]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[SideRound]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="rounds of every side, the order reversed every other")
    p.add_argument("--modes", default="default", help="kvmesh modes: " + ", ".join(KVMESH_MODES))
    p.add_argument("--irs", default="int8", help="OpenVINO IRs by weight format (openvino_peer.py built them): "
                                                 + ", ".join(FORMATS))
    p.add_argument("--ov-python", default=DEFAULT_OV_PYTHON, help="the OpenVINO GenAI environment's interpreter")
    p.add_argument("--cache-dir", type=Path, help="where openvino_peer.py put the IRs (default: its default)")
    p.add_argument("--quick", action="store_true", help="6 tiny requests: a smoke run")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if not set(modes) <= set(KVMESH_MODES):
        p.error(f"--modes {args.modes}: modes are {', '.join(KVMESH_MODES)}")
    irs = {fmt: ir_dir(fmt, args.cache_dir) for fmt in args.irs.split(",")}
    missing = [str(path) for path in irs.values() if not (path / "openvino_model.xml").exists()]
    if missing:
        p.error(f"no IR at {', '.join(missing)}: build it with python -m kvmesh.load_tests.openvino_peer")
    if not Path(args.ov_python).exists():
        p.error(f"--ov-python {args.ov_python}: no such interpreter (load_tests/openvino_peer.py says how to make it)")
    figures = run(args.rounds, modes, irs, args.ov_python, args.quick)
    print(format_report(figures, serve_config(None)))  # each round's figures went to stderr as JSON lines
    return figures


if __name__ == "__main__":
    main()
