#!/usr/bin/env bash
# The README's main command: set up the environment and run the CPU demo (GSPO on a tiny Qwen3-MoE).
# Extra arguments are passed to `gspo-megatron train` (e.g. parallel.expert_parallel=2 --nproc 2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
exec .venv/bin/gspo-megatron demo "$@"
