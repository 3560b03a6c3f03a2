"""The CPU kernels as built (worker/kernels/cpu/*.c, worker/kernels/cpu_build.py): every
instruction-set variant compiles with -Wall -Werror on any x86 machine with a C compiler
(whether or not this CPU can run it), a flag the compiler refuses fails the build (and the
start falls back with a WARNING), the variant picked follows the CPU's flags, and the structs
Python passes are the ones the C code reads. Running each variant against the torch reference
is in tests/test_attention_cpu.py (the paged attention) and tests/test_cpu_native_step.py (the
native step), for every variant this CPU runs."""

from __future__ import annotations

import ctypes
import logging
import platform
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvmesh.core.config import KvmeshConfig
from kvmesh.worker.engine_loop.engine import Engine
from kvmesh.worker.kernels import cpu_abi, cpu_build, cpu_native_step

needs_compiler = pytest.mark.skipif(cpu_build.compiler() is None or platform.machine() not in ("x86_64", "AMD64"),
                                    reason="no C compiler for x86-64 here")


@needs_compiler
def test_every_variant_compiles_with_warnings_as_errors():
    """All four, two compilers at a time (a cold build of the AVX-512 ones takes ~20-40 s each
    on 2 cores; cached by source hash afterwards)."""
    assert "-Wall" in cpu_build.COMMON_FLAGS and "-Werror" in cpu_build.COMMON_FLAGS
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {v.name: pool.submit(cpu_build.compile_variant, v) for v in cpu_build.VARIANTS}
    failures = {}
    for name, future in futures.items():
        try:
            assert future.result().is_file()
        except cpu_build.BuildError as exc:
            failures[name] = str(exc)
    assert not failures, f"variants that did not build: {failures}"


@needs_compiler
def test_a_flag_the_compiler_refuses_fails_the_build(monkeypatch, tmp_path, caplog):
    """The forced failure: BuildError with the compiler's own message; at start every
    variant's failure is a WARNING and the torch path runs (the reason kept for the log line
    and kvmesh_model_info)."""
    monkeypatch.setenv("KVMESH_KERNEL_CACHE", str(tmp_path))
    with pytest.raises(cpu_build.BuildError, match="-mno-such-instruction-set"):
        cpu_build.compile_variant(cpu_build.AVX2, extra_flags=("-mno-such-instruction-set",))
    if cpu_build.unavailable_reason() is not None:
        return  # a compiler, but a CPU that runs no variant: nothing is loaded at start anyway
    monkeypatch.setenv("KVMESH_KERNEL_CFLAGS", "-mno-such-instruction-set")
    cpu_build.reset()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
            assert cpu_build.load() is None
        failed = [r for r in caplog.records if r.levelno == logging.WARNING and r.getMessage().startswith(
            "CPU kernels: ") and "build failed" in r.getMessage()]
        assert len(failed) == len(cpu_build.runnable_variants())
        assert "every build failed" in cpu_build.load_failure()
        assert "torch path runs" in caplog.text
    finally:
        monkeypatch.undo()
        cpu_build.reset()


def test_the_variant_follows_the_cpu_flags(monkeypatch):
    def runnable(flags: set[str]) -> list[str]:
        monkeypatch.setattr(cpu_build, "cpu_flags", lambda: frozenset(flags))
        return [v.name for v in cpu_build.runnable_variants()]

    avx2 = {"avx2", "fma", "f16c", "sse4_2"}
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    assert runnable(set()) == [] and runnable({"avx2", "fma"}) == []  # no F16C: not even avx2
    assert runnable(avx2) == ["avx2"]
    assert runnable(avx512) == ["avx512", "avx2"]
    assert runnable(avx512 | {"avx512_bf16", "avx512_vnni"}) == ["avx512_bf16", "avx512", "avx2"]
    assert runnable(avx512 | {"avx512_bf16"}) == ["avx512", "avx2"]  # BF16 without VNNI (no such CPU)
    assert runnable(avx512 | {"amx_tile", "amx_bf16", "amx_int8"}) == ["avx512", "avx2"]  # AMX without BF16
    assert runnable(avx512 | {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"})[0] == "amx"
    runnable(set())
    assert "no AVX2" in cpu_build.unavailable_reason()


def test_the_header_declares_the_structs_python_passes():
    """kvmesh_cpu.h's generated block is cpu_abi's current one (else the build refuses), and
    the ctypes layout is the flat one the C compiler gives these fields."""
    assert cpu_abi.header_block(cpu_abi.HEADER.read_text()) == cpu_abi.c_declarations()
    for struct in cpu_abi.STRUCTS:
        assert [name for name, _ in struct._fields_] == [name for name, _ in struct.c_fields]
    assert ctypes.sizeof(cpu_abi.LayerDescriptor) == 24 * 8
    # 22 int64 fields, the float padded to 8 bytes, 9 pointers
    assert ctypes.sizeof(cpu_abi.ModelDescriptor) == (22 + 1 + 9) * 8
    assert cpu_abi.ModelDescriptor.embed.offset == 23 * 8


@needs_compiler
def test_a_stale_header_refuses_to_build(monkeypatch, tmp_path):
    header = tmp_path / "kvmesh_cpu.h"
    header.write_text(cpu_abi.HEADER.read_text().replace("int64_t num_layers;", "int32_t num_layers;"))
    for source in cpu_build.sources():
        (tmp_path / source.name).write_text(source.read_text())
    monkeypatch.setattr(cpu_build, "SOURCE_DIR", tmp_path)
    with pytest.raises(cpu_build.BuildError, match="GENERATED ABI"):
        cpu_build.compile_variant(cpu_build.AVX2)
    assert cpu_abi.rewrite_header(header) and cpu_abi.header_block(header.read_text()) == cpu_abi.c_declarations()


@pytest.fixture(scope="module")
def bf16_engine(tiny_model_dir):
    return Engine.from_config(KvmeshConfig.from_dict({
        "model": {"path": tiny_model_dir, "dtype": "bf16", "max_model_len": 256, "cpu_native_max_tokens": 0},
        "cache": {"num_blocks": 8, "block_size": 8}, "parallel": {"device": "cpu"}}))


@needs_compiler
@pytest.mark.parametrize("variant", cpu_build.VARIANTS, ids=lambda v: v.name)
def test_each_variant_this_cpu_runs_reads_the_model_descriptor(bf16_engine, variant):
    """The descriptor crosses into C whole in every variant, the avx2 one included (its
    kvmesh_native_step_check reads every field the step reads): a real model passes, and a
    broken field is named."""
    if variant not in cpu_build.runnable_variants():
        pytest.skip(f"this CPU does not run the {variant.name} build (compiled in the test above)")
    kernels = cpu_build.load_variant(variant)
    runner = bf16_engine.runner
    description = cpu_native_step.describe(runner.model, runner.kv_caches)
    model = description.model
    assert kernels.native_step_check(ctypes.pointer(model)) == 0
    description.layers[1].value_cache = None
    assert cpu_native_step.CHECK_FAILURES[kernels.native_step_check(ctypes.pointer(model))].startswith("a layer")
    description.layers[1].value_cache = runner.kv_caches[1].value_cache.data_ptr()
    model.num_kv_heads = 3
    assert kernels.native_step_check(ctypes.pointer(model)) == 2
    model.num_kv_heads = runner.kv_caches[0].key_cache.shape[2]
    if not variant.native_step:
        batch = cpu_abi.StepBatch(num_tokens=1)
        answer = kernels.native_step(ctypes.pointer(model), ctypes.pointer(batch))
        assert answer == cpu_abi.STEP_ANSWERS["KVMESH_STEP_NOT_BUILT"]
        assert not kernels.features & cpu_abi.FEATURES["KVMESH_FEATURE_NATIVE_STEP"]
    assert kernels.native_step_check(ctypes.pointer(model)) == 0


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_cpu_runner_reports_what_serves_its_small_steps(tiny_model_dir, dtype):
    """worker/runner/cpu_model_runner.py owns the choice: the native step's projections
    (amx / avx512_bf16 / fma / avx2) where it takes the model, else torch with the reason; the same
    reaches kvmesh_model_info's forward_path through EngineParts."""
    from kvmesh.core.telemetry import ModelInfoLabels

    config = KvmeshConfig.from_dict({"model": {"path": tiny_model_dir, "dtype": dtype, "max_model_len": 256},
                                     "cache": {"num_blocks": 8, "block_size": 8}, "parallel": {"device": "cpu"}})
    engine = Engine.from_config(config)
    step = engine.runner.cpu_step
    unavailable = cpu_native_step.unavailable_reason()
    if unavailable is not None:
        assert step.path == "torch" and step.reason == unavailable and engine.runner.native_decoder is None
    else:  # on by default for both dtypes; fp32 float weights by fp32 GEMVs, token-exact
        decoder = engine.runner.native_decoder
        assert step.path == decoder.path in ("amx", "avx512_bf16", "fma", "avx2") and step.reason == ""
        assert step.variant == cpu_build.load().variant.name and step.max_tokens == decoder.max_tokens
        assert (step.numerics == "fp32, token-exact") == (dtype == "fp32"), step.numerics
        assert dtype == "bf16" or step.path in ("fma", "avx2")
    assert step.path in step.describe() and (step.reason in step.describe())
    info = ModelInfoLabels.of_engine(engine, config)
    if step.path == "torch":
        assert info.forward_path == "eager" and info.forward_path_reason == f"native step not taken: {step.reason}"
    else:
        assert info.forward_path == f"native {step.path}" and step.variant in info.forward_path_reason
        assert info.forward_path_reason.endswith(step.numerics)
