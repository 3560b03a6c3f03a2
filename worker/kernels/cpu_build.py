"""Small C kernels for the CPU path: built with the system C compiler on first use, loaded
through ctypes.

No torch headers, so a kernel builds in about a second (a torch C++ extension takes a minute
on these 2-core machines); the shared object is cached in ~/.cache/kvmesh/kernels (or
$KVMESH_KERNEL_CACHE) under a hash of its source and flags, written by an atomic rename so
concurrent engines and test workers each load a whole file. ctypes releases the GIL for the
call. Flags: AVX2 + FMA wherever a kernel is built, AVX-512 where torch itself runs AVX-512
code; never -march=native (VMs that advertise AMX have died with SIGILL on such builds).

`build(name, source)` returns the loaded library, or None with the reason logged once, where
there is no C compiler, the CPU has neither AVX2 nor AVX-512, $KVMESH_NATIVE_KERNELS is 0, or
the build fails: callers keep their torch path then.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp-simd", "-fno-math-errno", "-mavx2", "-mfma", "-mf16c")
_AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mprefer-vector-width=512")
_COMPILERS = ("cc", "gcc", "clang")

_lock = threading.Lock()
_built: dict[tuple[str, str], ctypes.CDLL | None] = {}


def _cache_dir() -> Path:
    return Path(os.environ.get("KVMESH_KERNEL_CACHE", Path.home() / ".cache" / "kvmesh" / "kernels"))


def flags() -> tuple[str, ...] | None:
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", ...
    if capability.startswith("AVX512"):
        return _BASE_FLAGS + _AVX512_FLAGS
    if capability.startswith("AVX2"):
        return _BASE_FLAGS
    return None


def compiler() -> str | None:
    return next((path for path in map(shutil.which, _COMPILERS) if path), None)


def unavailable_reason() -> str | None:
    if os.environ.get("KVMESH_NATIVE_KERNELS", "1") == "0":
        return "disabled by KVMESH_NATIVE_KERNELS=0"
    if flags() is None:
        return f"CPU capability {torch.backends.cpu.get_cpu_capability()} (kernels are built for AVX2 or AVX-512)"
    if compiler() is None:
        return "no C compiler on PATH"
    return None


def _compile(name: str, source: str, cc: str, cflags: tuple[str, ...]) -> Path:
    key = hashlib.sha256((source + cc + " ".join(cflags)).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{name}_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, lib = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
        src.write_text(source)
        subprocess.run([cc, *cflags, str(src), "-o", str(lib)], check=True, capture_output=True, timeout=120)
        os.replace(lib, target)
    return target


def build(name: str, source: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library compiled from `source` (with `extra_flags` after the common ones), built once
    per process (and cached on disk); None where unavailable (see the module doc), logged once
    per name."""
    reason = unavailable_reason()
    key = (name, reason or hashlib.sha256((source + " ".join(extra_flags)).encode()).hexdigest())
    with _lock:
        if key in _built:
            return _built[key]
        lib = None
        if reason is None:
            try:
                lib = ctypes.CDLL(str(_compile(name, source, compiler(), flags() + tuple(extra_flags))))
            except (OSError, subprocess.SubprocessError) as exc:
                detail = getattr(exc, "stderr", b"") or b""
                reason = f"build failed: {exc} {detail.decode(errors='replace')[-500:]}"
        if lib is None:
            logger.info("CPU kernel %s unavailable (%s): the torch path runs instead", name, reason)
        _built[key] = lib
        return lib
