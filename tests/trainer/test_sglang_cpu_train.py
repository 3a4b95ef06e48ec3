"""End to end against a real SGLang server on CPU: examples/cpu_demo_sglang.yaml, a few GSPO steps
(sglang leg of tools/run_tests.sh; skipped elsewhere). The longer runs (overlap, 2 ranks, disk sync,
logprobs_from: engine, bf16 server) were run by hand: docs/rollout.md, "SGLang on CPU"."""
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.rollout.sglang_cpu_models import SGLANG_PYTHON, free_port_block, needs_sglang, server_processes

import pytest

pytestmark = needs_sglang

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "cpu_demo_sglang.yaml"


def test_demo_trains_against_a_launched_cpu_server(tmp_path):
    port = free_port_block(1)
    overrides = [f"rollout.sglang.launch.python={SGLANG_PYTHON}", f"rollout.sglang.launch.base_port={port}",
                 f"rollout.sglang.launch.model_path={tmp_path / 'model'}",
                 f"rollout.sglang.launch.log_dir={tmp_path / 'logs'}",
                 "train.steps=2", "sft.steps=20", "eval.every_steps=2", "eval.num_prompts=16", "checkpoint.every_steps=0",
                 "logging.console=false", "logging.tensorboard=false"]
    cmd = [sys.executable, "-m", "gspo_megatron.cli", "train", "--config", str(DEMO), "--run-dir", str(tmp_path / "run"),
           *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics[1:]:
        # the server's fp32 log-probs of the trainer's synced weights against the trainer's own
        assert m["logprob_gap_mean"] < 1e-4, m["logprob_gap_mean"]
    # the server started from the trainer's model config (dummy weights) and stopped with the run
    assert json.loads((tmp_path / "model" / "config.json").read_text())["num_experts"] == 4
    assert (tmp_path / "logs" / f"sglang-127.0.0.1-{port}.log").read_text().count("===== start") == 1
    left = server_processes(port)
    assert not left, f"server processes left after the run: {left}"
