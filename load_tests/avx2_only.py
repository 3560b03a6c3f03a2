"""Runs a benchmark module as kvmesh runs on an AVX2-only CPU (its avx2 kernel build, no native
bf16: model.dtype auto is fp32), on a CPU that has AVX-512: the AVX2 machines' lines reproduced
on a newer host. Nothing else changes (threads, memory, the module's own arguments).

    python -m kvmesh.load_tests.avx2_only kvmesh.load_tests.bench_gguf --batch 1 ...
"""

from __future__ import annotations

import runpy
import sys

from kvmesh.worker.kernels import cpu_build
from kvmesh.worker.runner import model_setup


def main() -> None:
    avx2_flags = frozenset(cpu_build.AVX2.cpu_flags)
    cpu_build.cpu_flags = lambda: avx2_flags  # the variants this CPU "runs": the avx2 build only
    model_setup.cpu_has_native_bf16 = lambda: False
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
