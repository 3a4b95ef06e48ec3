"""Partial rollouts in the trainer (rollout.partial, sync mode, transformers engine): responses carried over
steps with their weight versions, saved in checkpoints, and a SIGKILL + resume with responses in flight
equals the uninterrupted run."""
import json
import signal
import subprocess

import pytest

from tests.trainer.test_train_e2e import ENV, REPO, command, kill_after_checkpoint, train

PARTIAL = ["rollout.partial=true", "rollout.partial_token_budget=4", "rollout.logprobs_from=engine"]
COMMON = ["train.steps=4", "sft.steps=40", "train.prompts_per_step=8", "eval.every_steps=2", "eval.num_prompts=8",
          "eval.pass_k=1", "checkpoint.every_steps=2", *PARTIAL]
KEYS = ("reward_mean", "pg_loss", "grad_norm", "eval_accuracy", "staleness", "response_length_mean",
        "partial/groups_trained", "partial/carried_responses", "partial/carried_tokens", "partial/max_token_age",
        "partial/multi_version_responses", "partial/rounds")


@pytest.mark.slow
def test_partial_run_resumes_exactly_after_sigkill_with_responses_in_flight(tmp_path):
    full = train(tmp_path / "full", *COMMON)
    assert [m["step"] for m in full] == [0, 1, 2, 3, 4]
    steps = full[1:]
    # carried responses finish the next step under the next weights: tokens one update old, never more
    assert all(m["partial/carried_responses"] > 0 for m in steps)
    assert max(m["partial/max_token_age"] for m in steps) == 1.0
    assert all(m["staleness"] == m["partial/max_token_age"] for m in steps)
    assert sum(m["partial/multi_version_responses"] for m in steps) > 0
    saved = json.loads((tmp_path / "full" / "checkpoints" / "step_000002" / "gspo_meta.json").read_text())
    groups = saved["partial_rollouts"]["ranks"][0]
    assert groups and all(len(g["responses"]) == 8 for g in groups)
    assert any(r["finish_reason"] is None and r["segments"] for g in groups for r in g["responses"])

    assert kill_after_checkpoint(tmp_path / "split", 2, *COMMON) == -signal.SIGKILL
    resumed = train(tmp_path / "split", *COMMON, resume=True)
    assert [m["step"] for m in resumed] == [m["step"] for m in full]
    for a, b in zip(resumed, full):
        for key in KEYS:
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)


def test_a_checkpoint_with_responses_in_flight_is_not_resumed_without_partial(tmp_path):
    train(tmp_path / "run", "train.steps=1", "sft.steps=5", "eval.every_steps=0", "eval.num_prompts=4",
          "eval.pass_k=1", "checkpoint.every_steps=1", *PARTIAL)
    proc = subprocess.run(command(tmp_path / "run", "train.steps=2", "sft.steps=5", "eval.every_steps=0",
                                  "eval.num_prompts=4", "eval.pass_k=1", resume=True),
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=ENV)
    assert proc.returncode != 0
    assert "holds partial responses in flight; resume it with rollout.partial=true" in proc.stderr
