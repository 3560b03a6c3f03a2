#!/usr/bin/env bash
# Run the GPU check (load_tests/gpu_check.py) from the repository root on a GPU machine.
#
#   load_tests/gpu_check.sh [--out PATH] [--model PATH] [--skip-engine] [--dry-run]
#
# Needs torch (CUDA build), triton and transformers. pytest is needed for the test sections;
# if the machine lacks it, prepare a folder here beforehand and ship it with the checkout:
#   pip install --target .gpu_deps pytest        (then carry .gpu_deps to the GPU machine)
# --dry-run needs no GPU (toy sizes on CPU, Triton's interpreter; CI runs it via pytest).
# Results: JSON at --out (default $OUT/gpu_check.json when $OUT is set). Exit status 1 when
# any section failed; the JSON says which and why.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .gpu_deps ]; then
  export PYTHONPATH="$PWD/.gpu_deps${PYTHONPATH:+:$PYTHONPATH}"
fi
unset TRITON_INTERPRET  # compile for the GPU, never the interpreter
exec timeout 470 python load_tests/gpu_check.py "$@"
