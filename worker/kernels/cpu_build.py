"""The CPU kernels (worker/kernels/cpu/*.c and its one header): built with the system C
compiler at first use, one shared library per instruction set, the best one this CPU runs
loaded through ctypes.

    variant       adds to AVX2 + FMA + F16C          native step projections
    amx           AVX-512 BF16 + AMX tiles           AMX tiles (bf16; the self-draft's int8)
    avx512_bf16   AVX-512 F/BW/VL/DQ + BF16 + VNNI   VDPBF16PS
    avx512        AVX-512 F/BW/VL/DQ                 AVX-512 FMA
    avx2          -                                  AVX2 FMA
    (every variant: int4 weights by the AVX2 int4 GEMV, the same code in each)

As llama.cpp builds ggml-cpu once per instruction set and picks one at run time: the CPU's
flags are read from /proc/cpuinfo (never -march=native: VMs that advertise AMX have died with
SIGILL on such builds), the best variant it lists every flag of is built, and where that build
fails the next one down is tried (each failure a WARNING). Every variant compiles with -Wall
-Werror on any x86 machine with a compiler (tests/test_cpu_kernels.py builds all four).

No torch headers, so a build takes seconds (a torch C++ extension takes a minute on 2 cores).
The library is cached in ~/.cache/kvmesh/kernels (or $KVMESH_KERNEL_CACHE) under a hash of the
sources, the flags and the compiler's identity, written by an atomic rename so concurrent
engines and test workers each load a whole file. $KVMESH_KERNEL_CFLAGS adds flags to every
build; $KVMESH_NATIVE_KERNELS=0 turns the kernels off. ctypes releases the GIL for each call.
-fopenmp: the native step's threads are an OpenMP team, and libgomp.so.1 resolves to the one
torch has already loaded (same soname), so the step runs on torch's own thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from kvmesh.worker.kernels import cpu_abi

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "cpu"
COMMON_FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-Wall", "-Werror",
                "-mavx2", "-mfma", "-mf16c")
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mprefer-vector-width=512")
_COMPILERS = ("cc", "gcc", "clang")


@dataclass(frozen=True)
class IsaVariant:
    name: str
    cpu_flags: frozenset[str]  # what /proc/cpuinfo must list for the library to run here
    cflags: tuple[str, ...]  # after COMMON_FLAGS
    native_step: bool  # the native step is compiled in (every variant now; kept for the tests' parametrisation)


AVX2 = IsaVariant("avx2", frozenset({"avx2", "fma", "f16c"}), (), True)
AVX512 = IsaVariant("avx512", AVX2.cpu_flags | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}, _AVX512, True)
# + VNNI (every CPU with AVX-512 BF16 has it: Cooper Lake, Sapphire Rapids, Zen 4): the int4 x
# int8 panels' VPDPBUSD (int4_panels.c)
AVX512_BF16 = IsaVariant("avx512_bf16", AVX512.cpu_flags | {"avx512_bf16", "avx512_vnni"},
                         _AVX512 + ("-mavx512bf16", "-mavx512vnni"), True)
AMX = IsaVariant("amx", AVX512_BF16.cpu_flags | {"amx_tile", "amx_bf16", "amx_int8"},
                 AVX512_BF16.cflags + ("-mamx-tile", "-mamx-bf16", "-mamx-int8"), True)
VARIANTS = (AMX, AVX512_BF16, AVX512, AVX2)  # best first


class BuildError(RuntimeError):
    """A variant did not compile (the message ends with the compiler's own)."""


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The first processor's flags in /proc/cpuinfo; empty where there is no such file."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def runnable_variants() -> tuple[IsaVariant, ...]:
    """The variants this CPU runs, best first."""
    flags = cpu_flags()
    return tuple(v for v in VARIANTS if v.cpu_flags <= flags)


def compiler() -> str | None:
    return next((path for path in map(shutil.which, _COMPILERS) if path), None)


@functools.lru_cache(maxsize=None)
def _compiler_identity(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _cache_dir() -> Path:
    return Path(os.environ.get("KVMESH_KERNEL_CACHE", Path.home() / ".cache" / "kvmesh" / "kernels"))


def sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.c"))


def build_flags(variant: IsaVariant) -> tuple[str, ...]:
    return COMMON_FLAGS + variant.cflags + tuple(shlex.split(os.environ.get("KVMESH_KERNEL_CFLAGS", "")))


def compile_variant(variant: IsaVariant, cc: str | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    """The variant's shared library (built now unless cached): BuildError where the header's
    ABI block is stale or the compiler fails. Compiling does not need the CPU to run it."""
    cc = cc or compiler()
    if cc is None:
        raise BuildError("no C compiler on PATH")
    header = (SOURCE_DIR / "kvmesh_cpu.h").read_text()
    if cpu_abi.header_block(header) != cpu_abi.c_declarations():
        raise BuildError("kvmesh_cpu.h's GENERATED ABI block differs from worker/kernels/cpu_abi.py "
                         "(run `python -m kvmesh.worker.kernels.cpu_abi`)")
    flags = build_flags(variant) + tuple(extra_flags)
    digest = hashlib.sha256(header.encode())
    for path in sources():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update("\0".join((cc, _compiler_identity(cc), *flags)).encode())
    target = _cache_dir() / f"kvmesh_cpu_{variant.name}_{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        lib = Path(tmp) / target.name
        try:
            subprocess.run([cc, *flags, "-I", str(SOURCE_DIR), *map(str, sources()), "-o", str(lib)],
                           check=True, capture_output=True, timeout=300)
        except subprocess.CalledProcessError as exc:
            raise BuildError(f"{variant.name} build failed ({cc} exit {exc.returncode}): "
                             f"{exc.stderr.decode(errors='replace')[-2000:]}") from exc
        except (OSError, subprocess.SubprocessError) as exc:
            raise BuildError(f"{variant.name} build failed: {exc}") from exc
        os.replace(lib, target)
    return target


class CpuKernels:
    """One loaded variant: the entry points with their signatures, and what the build does."""

    def __init__(self, variant: IsaVariant, path: Path):
        self.variant = variant
        lib = ctypes.CDLL(str(path))
        self.paged_decode = {"float32": lib.kvmesh_paged_decode_f32, "bfloat16": lib.kvmesh_paged_decode_bf16}
        for fn in self.paged_decode.values():
            fn.argtypes, fn.restype = _PAGED_DECODE_ARGTYPES, ctypes.c_int
        self.native_step = lib.kvmesh_native_step
        self.native_step.argtypes = [ctypes.POINTER(cpu_abi.ModelDescriptor), ctypes.POINTER(cpu_abi.StepBatch)]
        self.native_step.restype = ctypes.c_int
        self.native_step_check = lib.kvmesh_native_step_check
        self.native_step_check.argtypes = [ctypes.POINTER(cpu_abi.ModelDescriptor)]
        self.native_step_check.restype = ctypes.c_int
        # the batched kernels' token threshold (int4_gemm_avx2.c), one setting for the process
        self.set_gemm_min_rows, self.gemm_min_rows = lib.kvmesh_set_gemm_min_rows, lib.kvmesh_gemm_min_rows
        self.set_gemm_min_rows.argtypes, self.set_gemm_min_rows.restype = [ctypes.c_int], ctypes.c_int
        self.gemm_min_rows.argtypes, self.gemm_min_rows.restype = [], ctypes.c_int
        # an int4 projection dequantized to the bf16 values the native step's int4_bf16 form multiplies
        self.int4_to_bf16 = lib.kvmesh_int4_to_bf16
        self.int4_to_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6 + [ctypes.c_void_p, ctypes.c_int64]
        self.int4_to_bf16.restype = ctypes.c_int
        self.i8g_to_bf16 = lib.kvmesh_i8g_to_bf16  # a Q8_0 head's rows alike
        self.i8g_to_bf16.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p, ctypes.c_int64]
        self.i8g_to_bf16.restype = ctypes.c_int
        lib.kvmesh_cpu_init.restype = lib.kvmesh_cpu_features.restype = ctypes.c_int
        lib.kvmesh_cpu_init()  # asks Linux for AMX tile state (the amx build only)
        self.features = lib.kvmesh_cpu_features()
        self._lib = lib  # the functions above keep it loaded; kept for clarity


# kvmesh_paged_decode_*: KVMESH_PAGED_DECODE_ARGS in kvmesh_cpu.h
_PAGED_DECODE_ARGTYPES = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
                          + [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                                    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
                          + [ctypes.c_int64] * 6 + [ctypes.c_float])


def unavailable_reason() -> str | None:
    """Why no variant can load here (no build is tried), or None."""
    if os.environ.get("KVMESH_NATIVE_KERNELS", "1") == "0":
        return "disabled by KVMESH_NATIVE_KERNELS=0"
    if not runnable_variants():
        return "the CPU lists no AVX2 + FMA + F16C in /proc/cpuinfo"
    if compiler() is None:
        return "no C compiler on PATH"
    return None


def load_variant(variant: IsaVariant) -> CpuKernels:
    """That variant, built and loaded (tests: every variant this CPU runs); BuildError."""
    return _load(variant)


@functools.lru_cache(maxsize=None)
def _load(variant: IsaVariant) -> CpuKernels:
    return CpuKernels(variant, compile_variant(variant))


_lock = threading.Lock()
_chosen: list = []  # [CpuKernels | None, the reason when None], once per process


def load() -> CpuKernels | None:
    """The best variant this CPU runs that builds, once per process; None where none does
    (the reason in `load_failure()`; callers keep their torch path)."""
    with _lock:
        if not _chosen:
            _chosen.extend(_choose())
        return _chosen[0]


def load_failure() -> str | None:
    """Why load() is None (after it ran), else None."""
    load()
    return _chosen[1]


def _choose() -> tuple[CpuKernels | None, str | None]:
    reason = unavailable_reason()
    if reason is not None:
        log = logger.info if reason.startswith("disabled") else logger.warning
        log("CPU kernels unavailable (%s): the torch path runs instead", reason)
        return None, reason
    failures = []
    for variant in runnable_variants():
        try:
            kernels = _load(variant)
        except (BuildError, OSError) as exc:
            logger.warning("CPU kernels: %s", exc)
            failures.append(f"{variant.name}: {str(exc)[:300]}")
            continue
        logger.info("CPU kernels: the %s build (%s)", variant.name, " ".join(build_flags(variant)))
        return kernels, None
    reason = "every build failed: " + "; ".join(failures)
    logger.warning("CPU kernels unavailable (%s): the torch path runs instead", reason)
    return None, reason


def reset() -> None:
    """Forget the chosen variant (tests that change the environment)."""
    with _lock:
        _chosen.clear()
    _load.cache_clear()
