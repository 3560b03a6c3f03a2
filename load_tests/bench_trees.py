"""One bench_engine A/B across two source trees: the same mode's batch-1 and batch-64 decode
in a base checkout and in this one, alternated process by process (base, this, this, base,
...), so load drifts on a shared machine hit both sides alike. For a change that cannot be
switched by config inside one process (a kernel rebuilt from other sources, a refactor), where
`bench_engine --ab` cannot compare.

    git worktree add --detach /tmp/base main && python -m venv --system-site-packages /tmp/base/.venv \\
        && /tmp/base/.venv/bin/pip install -q --no-deps -e /tmp/base
    python -m kvmesh.load_tests.bench_trees --base /tmp/base --mode bf16 --rounds 4

Each tree runs `<tree>/.venv/bin/python -P -m kvmesh.load_tests.bench_engine --ab MODE
--rounds 1` (its own code: the venv's editable install); this tree is the one whose venv runs
this module. Prints the medians per tree and this tree's ratio to the base.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

FIGURES = ("batch1_decode_tok_s", "big_batch_decode_tok_s", "big_batch_step_ms")


def run_once(tree: Path, mode: str, extra: list[str]) -> dict:
    """One bench_engine --ab round of `mode` in `tree`: its [ab] line as a dict."""
    cmd = [str(tree / ".venv" / "bin" / "python"), "-P", "-m", "kvmesh.load_tests.bench_engine", "--ab", mode,
           "--rounds", "1", *extra]
    done = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, check=False)
    lines = [line for line in done.stderr.splitlines() if line.startswith("[ab] ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{' '.join(cmd)} in {tree} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1][len("[ab] "):])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, required=True, help="the other checkout (with its own .venv)")
    p.add_argument("--this", type=Path, default=Path(__file__).resolve().parents[1], help="default: this checkout")
    p.add_argument("--mode", default="bf16", help="a bench_engine mode (default bf16)")
    p.add_argument("--rounds", type=int, default=4, help="processes per tree (default 4)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: more bench_engine flags")
    args = p.parse_args(argv)
    extra = [a for a in args.bench_args if a != "--"]
    trees = {"base": args.base.resolve(), "this": args.this.resolve()}
    results: dict[str, list[dict]] = {"base": [], "this": []}
    for i in range(args.rounds):
        order = ("base", "this") if i % 2 == 0 else ("this", "base")
        for name in order:
            results[name].append(run_once(trees[name], args.mode, extra))
            print(f"[trees] {name} {json.dumps(results[name][-1])}", file=sys.stderr, flush=True)
    med = {name: {f: statistics.median(r[f] for r in rs) for f in FIGURES} for name, rs in results.items()}
    big = results["base"][0]["big_batch"]
    print(f"{args.mode}, median of {args.rounds} processes per tree, alternated")
    print(f"| tree | batch-1 decode tok/s | batch-{big} decode tok/s | batch-{big} step ms |")
    print("|---|---|---|---|")
    for name in ("base", "this"):
        m = med[name]
        print(f"| {name} ({trees[name]}) | {m['batch1_decode_tok_s']:.1f} | {m['big_batch_decode_tok_s']:.1f} "
              f"| {m['big_batch_step_ms']:.1f} |")
    ratio = {f: med["this"][f] / med["base"][f] for f in FIGURES}
    print(f"this / base: batch-1 {ratio['batch1_decode_tok_s']:.3f}x, batch-{big} "
          f"{ratio['big_batch_decode_tok_s']:.3f}x tok/s, batch-{big} step {ratio['big_batch_step_ms']:.3f}x ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
