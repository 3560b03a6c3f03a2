"""Decode attention read straight from the paged KV cache: a small C kernel for CPU.

The grouped path of attention_cpu.py copies every decode row's K/V blocks into a padded
tensor (index_select) and runs SDPA over it, once per layer per step. At batch 64 that copy
and the SDPA call over it were the largest part of a bf16 decode step, larger than all the
projections (a 6-layer SmolLM2 step, contexts 50-250: 2.1 ms gathering + 1.65 ms SDPA per layer,
measured with thread CPU time, docs/benchmarks.md). Here each decode row reads its K/V where they
lie, block by block through its block table, and nothing is copied:

    for each decode row, for each KV head g (its G = Hq / Hkv query heads share the K/V loads):
        s[j, t] = (q_j . k_t) * scale      t < context, fp32 accumulation
        p[j, t] = exp(s[j, t] - max_t s)   one pass, the whole row's scores kept
        out_j   = sum_t p[j, t] v_t / sum_t p[j, t]

fp32 and bf16 caches (bf16 widened to fp32 on load, the output rounded to nearest-even as
torch does; with bf16 the p that weight V are rounded to bf16, as torch's CPU flash attention
does); quantized caches, prefill chunks and anything the kernel does not take stay on the
grouped path. The numerics are SDPA's up to the order of fp32 sums (and a polynomial exp good
to ~2 ulp): tests hold it to the torch reference within 1e-5 in fp32 and within one bf16
rounding in bf16, and the engine to HF's greedy tokens in fp32 (tests/test_attention_cpu.py,
tests/test_engine_exact.py). In bf16 greedy decoding it agrees with HF fp32 as often as the
SDPA path does, but less often with HF bf16, which runs the same SDPA kernel as the grouped
path and so shares its roundings (docs/benchmarks.md).

The kernel is worker/kernels/cpu/paged_attention.c, built on first use into the CPU kernels'
library (worker/kernels/cpu_build.py) and called through ctypes. Where there is no compiler,
every build fails, the CPU has no AVX2 or $KVMESH_PAGED_DECODE_KERNEL is 0, `load()` returns
None and the caller keeps the grouped path (one log line says why).
With more than one torch thread the rows are split over a small thread pool, one share per thread.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from kvmesh.worker.kernels import cpu_build

class PagedDecodeKernel:
    """The compiled kernel; `attend` runs it for the listed decode rows."""

    def __init__(self, kernels: cpu_build.CpuKernels):
        self._fns = {torch.float32: kernels.paged_decode["float32"], torch.bfloat16: kernels.paged_decode["bfloat16"]}
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0

    @staticmethod
    def takes(query: torch.Tensor, cache) -> bool:
        """Whether the kernel handles this layer: unquantized fp32 / bf16 cache of the query's
        dtype on CPU, head_dim contiguous, whole KV-head groups."""
        k, v = cache.key_cache, cache.value_cache
        return (query.device.type == "cpu" and not cache.quantized and query.dtype in (torch.float32, torch.bfloat16)
                and k.dtype == query.dtype and v.dtype == query.dtype and k.stride() == v.stride()
                and k.stride(-1) == 1 and query.stride(-1) == 1 and query.shape[1] % k.shape[2] == 0)

    def attend(self, query: torch.Tensor, cache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               q_rows: torch.Tensor, reqs: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        """Writes out[q_rows[i]] = attention of query[q_rows[i]] over request reqs[i]'s cached
        context (seq_lens[reqs[i]] tokens through block_tables[reqs[i]]). Index tensors: int64
        q_rows / reqs, int32 block_tables / seq_lens, contiguous, on CPU."""
        fn = self._fns[query.dtype]
        k, v = cache.key_cache, cache.value_cache
        n = q_rows.shape[0]
        args = (query.data_ptr(), query.stride(0), query.stride(1), k.data_ptr(), v.data_ptr(), k.stride(0),
                k.stride(1), k.stride(2), block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
                q_rows.data_ptr(), reqs.data_ptr())
        tail = (out.data_ptr(), out.stride(0), out.stride(1), query.shape[1], k.shape[2], query.shape[2],
                k.shape[1], float(scale))
        threads = min(torch.get_num_threads(), n)
        if threads <= 1:
            failed = fn(*args, 0, n, *tail)
        else:
            bounds = [n * i // threads for i in range(threads + 1)]
            futures = [self._executor(threads).submit(fn, *args, bounds[i], bounds[i + 1], *tail)
                       for i in range(1, threads)]
            failed = fn(*args, bounds[0], bounds[1], *tail) | sum(f.result() for f in futures)
        if failed:
            raise MemoryError("paged decode attention: no memory for its workspace")

    def _executor(self, threads: int) -> ThreadPoolExecutor:
        if self._pool is None or self._pool_size < threads - 1:
            self._pool = ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="kvmesh-attn")
            self._pool_size = threads - 1
        return self._pool


def unavailable_reason() -> str | None:
    if os.environ.get("KVMESH_PAGED_DECODE_KERNEL", "1") == "0":
        return "disabled by KVMESH_PAGED_DECODE_KERNEL=0"
    return cpu_build.unavailable_reason()


def load() -> PagedDecodeKernel | None:
    """The kernel, built on first use; None (logged once) where it is unavailable."""
    if unavailable_reason() is not None:
        return None
    kernels = cpu_build.load()
    return None if kernels is None else _kernel_for(kernels)


@functools.lru_cache(maxsize=None)
def _kernel_for(kernels: cpu_build.CpuKernels) -> PagedDecodeKernel:
    return PagedDecodeKernel(kernels)
