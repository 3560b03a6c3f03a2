"""Measure torch's packed weight-only CPU kernels against dequantize-then-matmul.

    python -m kvmesh.load_tests.bench_quant_kernels [--n 2048 --k 2048 --iters 20]

quant/linear.py chooses, per weight format and activation dtype, the faster path measured
here (the numbers are recorded in its docstring). Not a test: timings depend on the machine.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kvmesh.quant import primitives as P


def _time_ms(fn, iters: int) -> float:
    fn()  # warm-up (first call allocates / packs)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e3


def bench(n: int, k: int, batch_sizes: list[int], iters: int, group_size: int) -> list[dict]:
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.02
    q8, s8 = P.quantize_int8_per_channel(w)
    q4, s4, z4 = P.quantize_int4_groupwise(w, group_size)
    q4_kernel = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4.to(torch.int32), 2)
    packed4 = P.pack_int4(q4)
    rows = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        dense = w.to(dtype)
        s8_d = s8.to(dtype)
        sz = P.tinygemm_scale_and_zero(s4, z4, dtype)
        for m in batch_sizes:
            x = torch.randn(m, k, dtype=dtype)
            timings = {
                "dense": _time_ms(lambda: F.linear(x, dense), iters),
                "int8_kernel": _time_ms(lambda: torch.ops.aten._weight_int8pack_mm(x, q8, s8_d), iters),
                "int8_dequant": _time_ms(lambda: F.linear(x, q8.to(dtype)) * s8_d, iters),
                "int4_kernel": _time_ms(
                    lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, q4_kernel, group_size, sz), iters),
                "int4_dequant": _time_ms(lambda: F.linear(
                    x, P.dequantize_int4_groupwise(P.unpack_int4(packed4), s4, z4, dtype)), iters),
            }
            rows.append({"dtype": str(dtype).removeprefix("torch."), "m": m} | timings)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 128])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--group-size", type=int, default=128)
    args = ap.parse_args()
    print(f"N={args.n} K={args.k} group={args.group_size} threads={torch.get_num_threads()} (ms per matmul)")
    cols = ["dense", "int8_kernel", "int8_dequant", "int4_kernel", "int4_dequant"]
    print(f"{'dtype':<9}{'M':>5}" + "".join(f"{c:>14}" for c in cols))
    for row in bench(args.n, args.k, args.batch_sizes, args.iters, args.group_size):
        print(f"{row['dtype']:<9}{row['m']:>5}" + "".join(f"{row[c]:>14.3f}" for c in cols))


if __name__ == "__main__":
    main()
