#!/usr/bin/env bash
# GSPO vs GRPO on the CPU demo task (tiny Qwen3-MoE, sort three digits), same warm start, seeds and steps:
#   gspo            clip 3e-4 / 4e-4 (paper), sequence-level ratio
#   grpo            clip 0.2 / 0.27 (the paper's GRPO baseline), token-level ratio
#   grpo_replay     the same GRPO with Routing Replay (R2: experts of the old-policy forward replayed)
# then plots reward, clip fraction and routing drift side by side.
#   bash examples/experiments/gspo_vs_grpo.sh [OUT_DIR] [extra overrides...]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-runs/gspo_vs_grpo}
shift || true
bash tools/setup_env.sh
GM=.venv/bin/gspo-megatron
common=(logging.console=false "$@")
$GM train --config examples/cpu_demo.yaml --run-dir "$OUT/gspo" loss.algorithm=gspo "${common[@]}"
$GM train --config examples/cpu_demo.yaml --run-dir "$OUT/grpo" loss.algorithm=grpo "${common[@]}"
$GM train --config examples/cpu_demo.yaml --run-dir "$OUT/grpo_replay" loss.algorithm=grpo train.routing_replay=r2 "${common[@]}"
$GM plot "$OUT/gspo" "$OUT/grpo" "$OUT/grpo_replay" --out "$OUT/plots"
.venv/bin/python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = {}
for name in ("gspo", "grpo", "grpo_replay"):
    recs = [json.loads(l) for l in (out / name / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["step"] > 0]
    mean = lambda k: sum(r[k] for r in train if k in r) / max(1, sum(1 for r in train if k in r))
    evals = [r for r in recs if "eval_accuracy" in r]
    rows[name] = {"eval_accuracy_first": evals[0]["eval_accuracy"], "eval_accuracy_last": evals[-1]["eval_accuracy"],
                  "reward_mean": mean("reward_mean"), "clip_frac_token": mean("clip_frac_token"),
                  "clip_frac_seq": mean("clip_frac_seq"), "routing_drift": mean("routing_drift")}
(out / "summary.json").write_text(json.dumps(rows, indent=2))
print(json.dumps(rows, indent=2))
PY
