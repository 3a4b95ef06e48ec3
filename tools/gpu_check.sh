#!/bin/bash
# The GPU check: one command for one lent GPU machine (one H200; Python 3.12 with CUDA torch and
# transformers installed; no network; no megatron-core, Transformer Engine or SGLang). docs/gpu.md.
#
#   tools/gpu_check.sh --fetch-wheels   here, with network: download tools/gpu_wheels.txt into build/gpu_wheels
#   tools/gpu_check.sh --dry-run        print the steps without running them
#   tools/gpu_check.sh                  on the GPU machine (carry build/gpu_wheels): about 5 minutes
#
# Steps: install the wheels (--no-index) into a venv that sees the system's CUDA torch; run the gpu-marked
# tests; one GSPO step of a ~0.4 B-parameter MoE in bf16 on CUDA with NCCL at world size 1 (local spec,
# tools/gpu_step.py); the transformers engine generating on the GPU (same script). Each prints one
# "GPU_CHECK {json}" line with tokens/s and peak memory. Exit status: the first failing step's.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${GSPO_GPU_WHEELS:-build/gpu_wheels}
VENV=${GSPO_GPU_VENV:-/tmp/gspo-gpu-venv}
PY=${GSPO_GPU_PYTHON:-python3}
MODE=${1:-run}

step() {  # step NAME COMMAND...: print, or run with a wall-clock bound
    local name=$1; shift
    echo "== $name: $*"
    if [ "$MODE" != "--dry-run" ]; then
        timeout "${GSPO_GPU_STEP_TIMEOUT:-240}" "$@"
    fi
}

case "$MODE" in
    --fetch-wheels)
        mkdir -p "$WHEELS"
        # megatron-core and psutil/PyYAML are binary (cp312, manylinux); the rest pure Python
        exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
            --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any \
            -r tools/gpu_wheels.txt -d "$WHEELS" ;;
    --dry-run|run) ;;
    *) echo "usage: $0 [--fetch-wheels | --dry-run]" >&2; exit 2 ;;
esac

if [ "$MODE" != "--dry-run" ]; then
    missing=$(grep -v '^#' tools/gpu_wheels.txt | grep -v '^$' | while read -r req; do
        name=$(echo "${req%%==*}" | tr 'A-Z-' 'a-z_'); ver=${req##*==}
        ls "$WHEELS" 2>/dev/null | tr 'A-Z-' 'a-z_' | grep -q "^${name}_${ver}_" || echo "$req"; done)  # names and "-" both normalised to "_"
    if [ -n "$missing" ]; then
        echo "gpu_check: wheels missing from $WHEELS (run tools/gpu_check.sh --fetch-wheels where there is network):" >&2
        echo "$missing" >&2
        exit 3
    fi
fi
step venv "$PY" -m venv --system-site-packages "$VENV"
step wheels "$VENV/bin/python" -m pip install -q --no-index --find-links "$WHEELS" -r tools/gpu_wheels.txt
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
step device "$VENV/bin/python" -c "import torch, megatron.core; assert torch.cuda.is_available(), 'no CUDA'; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), 'megatron-core', megatron.core.__version__)"
step gpu-tests "$VENV/bin/python" -m pytest -q -m gpu -p no:cacheprovider tests/megatron/test_gpu_path.py \
    tests/megatron/test_gpu_precision.py tests/conversion/test_gpu.py tests/rollout/test_sglang_gpu.py
step gspo-step "$VENV/bin/python" tools/gpu_step.py train
step hf-engine "$VENV/bin/python" tools/gpu_step.py generate
echo "gpu_check: done"
