"""You can read what the model writes: sampled completions per step in completions.jsonl, TensorBoard
text and on the console; `eval --outputs` writes each prompt's outputs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_megatron.trainer.completions import truncate_completions

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "cpu_demo.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def test_a_resume_drops_the_rows_after_its_checkpoint(tmp_path):
    rows = [{"step": s, "prompt": "p", "response": "r", "answer": "a", "reward": 0.0} for s in (1, 1, 2, 3)]
    (tmp_path / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "pro')
    truncate_completions(tmp_path, 2)
    assert [json.loads(x)["step"] for x in (tmp_path / "completions.jsonl").read_text().splitlines()] == [1, 1, 2]


@pytest.mark.slow
def test_completions_are_logged_and_eval_writes_per_prompt_outputs(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "train", "--config", str(DEMO), "--run-dir",
                           str(run), "logging.console=false", "sft.steps=20", "train.steps=2", "eval.num_prompts=4",
                           "eval.pass_k=1", "logging.completions_per_step=3", "logging.console_completion_every=2"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2]
    assert all(r["prompt"].startswith("sort ") and isinstance(r["response"], str) and 0.0 <= r["reward"] <= 1.0
               and len(r["answer"].split()) == 3 for r in rows)
    assert f"step 2 sample: {rows[3]['prompt']!r} -> {rows[3]['response']!r}" in proc.stdout
    events = b"".join(p.read_bytes() for p in (run / "tensorboard").rglob("events.*"))
    assert b"completions" in events and rows[0]["prompt"].encode() in events

    outputs, summary = tmp_path / "outputs.jsonl", tmp_path / "eval.json"
    proc = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "eval", "--checkpoint",
                           str(run / "checkpoints" / "step_000002"), "--dataset",
                           str(REPO / "examples" / "data" / "sort" / "eval.jsonl"), "--num-prompts", "6", "--k", "2",
                           "--out", str(summary), "--outputs", str(outputs)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    per_prompt = [json.loads(line) for line in outputs.read_text().splitlines()]
    result = json.loads(summary.read_text())
    assert len(per_prompt) == 6 and all(len(r["samples"]) == len(r["sample_rewards"]) == 2 for r in per_prompt)
    assert sum(r["greedy_reward"] >= 1.0 for r in per_prompt) / 6 == pytest.approx(result["eval_accuracy"])
    assert sum(max(r["sample_rewards"]) >= 1.0 for r in per_prompt) / 6 == pytest.approx(result["eval_pass@2"])
