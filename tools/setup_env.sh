#!/usr/bin/env bash
# Create .venv (if missing) and install gspo-megatron with its test extras. Idempotent and quick when
# everything is already there. torch is pinned first to the CPU wheel (2.13.0) unless CUDA torch is present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.gspo-installed
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q "torch==${GSPO_TORCH_VERSION:-2.13.0}"
  fi
  .venv/bin/python -m pip install -q -e ".[dev]"
  touch "$stamp"
fi
