#!/usr/bin/env bash
# GSPO vs GRPO (+ Routing Replay R2 / R3, GSPO-token) on a 4-layer, 16-expert top-4 MoE learning multi-step
# arithmetic, 3 seeds per arm, then the figures and the docs/training.md block from the results file:
#   bash examples/experiments/gspo_vs_grpo.sh [--scale full|probe|ci] [--arms ...] [overrides...]
# Everything is done by examples/experiments/gspo_vs_grpo.py (run, report, estimate).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash tools/setup_env.sh
.venv/bin/python examples/experiments/gspo_vs_grpo.py run "$@"
.venv/bin/python examples/experiments/gspo_vs_grpo.py report
