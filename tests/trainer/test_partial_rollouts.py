"""Partial rollouts in the trainer (rollout.partial, sync mode, transformers engine): responses carried over
steps with their weight versions, saved in checkpoints, and a SIGKILL + resume with responses in flight
equals the uninterrupted run."""
import json
import signal
import subprocess

import pytest

from tests.trainer.test_train_e2e import DEMO, ENV, REPO, command, kill_after_checkpoint, train

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


def sglang_partial_worker(rank, world_size, run_dir: str, url: str, disk_dir: str) -> list[dict]:
    from gspo_megatron.trainer.config import load_config
    from gspo_megatron.trainer.loop import Trainer
    from tests.trainer.test_sglang_ranks import _trainer_overrides

    config = load_config(DEMO, _trainer_overrides([url], disk_dir, "train.steps=2", "rollout.partial=true",
                                                  "rollout.partial_token_budget=2", "rollout.logprobs_from=engine"))
    trainer = Trainer(config, run_dir)
    try:
        out = []
        for _ in range(2):
            out.append(trainer.train_step())
            trainer.step += 1
        return out
    finally:
        trainer.close()


@pytest.mark.slow
def test_the_sglang_engine_continues_partial_responses_with_input_ids(tmp_path):
    """The SGLang engine against the HTTP stand-in (tests/rollout/sglang_standin.py, not SGLang): step 1
    samples 2 of the 4 tokens of every response; step 2 sends each unfinished response back as ``input_ids``
    (its prompt + its 2 tokens) for 2 more, under the weights synced after step 1."""
    from gspo_megatron.megatron.spawn import run_distributed
    from tests.rollout.sglang_standin import StandinServer

    with StandinServer() as server:
        metrics = run_distributed(sglang_partial_worker, 1, (str(tmp_path / "run"), server.url, str(tmp_path / "sync")),
                                  timeout_s=300)[0]
        bodies = [body for path, body in server.state.requests if path == "/generate"]
    rows = [(ids, sp) for body in bodies for ids, sp in zip(body["input_ids"], body["sampling_params"])]
    assert all(sp["max_new_tokens"] == 2 for _, sp in rows)
    sent = {tuple(ids) for ids, _ in rows}
    # a continuation is an earlier request's input (its prompt) + the 2 tokens sampled for it, the first of
    # which echoes the prompt's last token (the stand-in's rule)
    continued = [ids for ids, _ in rows if tuple(ids[:-2]) in sent and ids[-2] == ids[-3]]
    first, second = metrics
    # step 1's extra round (no group had finished) continued one group; step 2 continues every carried one
    assert first["partial/rounds"] == 2 and len(continued) > first["partial/carried_responses"] > 0 and second["partial/multi_version_responses"] > 0
    assert second["partial/max_token_age"] == 1.0
