"""End to end on CPU: the demo config trains, logs, checkpoints, resumes; config errors name the field."""
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_megatron.trainer.config import load_config
from gspo_megatron.typed_config import ConfigError

from tests.runs import DEMO, ENV, REPO, command, kill_after_checkpoint, train


@pytest.mark.slow
def test_short_run_then_resume_matches_uninterrupted(tmp_path):
    common = ["sft.steps=30", "eval.every_steps=2", "eval.num_prompts=16", "checkpoint.every_steps=2"]
    full = train(tmp_path / "full", "train.steps=4", *common)
    steps = [m["step"] for m in full]
    assert steps == [0, 1, 2, 3, 4]
    for m in full[1:]:
        for key in ("reward_mean", "clip_frac_seq", "grad_norm", "routing_drift", "logprob_gap_mean"):
            assert key in m
        assert 0.0 <= m["clip_frac_seq"] <= 1.0
        assert m["logprob_gap_mean"] < 1e-4  # the engine holds exactly the trained weights after each sync
    assert (tmp_path / "full" / "config.yaml").is_file()
    ckpts = sorted(p.name for p in (tmp_path / "full" / "checkpoints").iterdir())
    assert ckpts == ["step_000002", "step_000004"]  # keep_last: 2
    # the warm start's loss, by sft step, in its own file (RL's steps stay 0..4 in metrics.jsonl)
    warm = [json.loads(line) for line in (tmp_path / "full" / "sft_metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in warm] == list(range(1, 31)) and all(m.keys() == {"step", "sft_loss"} for m in warm)
    assert warm[-1]["sft_loss"] < 0.7 * warm[0]["sft_loss"]

    # `gspo-megatron eval` on the last checkpoint reproduces the run's own held-out greedy accuracy
    out = tmp_path / "eval.json"
    proc = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "eval", "--checkpoint",
                           str(tmp_path / "full" / "checkpoints" / "step_000004"), "--dataset",
                           str(REPO / "examples" / "data" / "sort" / "eval.jsonl"), "--num-prompts", "16",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=REPO, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evaluated = json.loads(out.read_text())
    assert evaluated["num_prompts"] == 16 and 0.0 <= evaluated["eval_pass@4"] <= 1.0
    assert evaluated["eval_accuracy"] == pytest.approx(full[-1]["eval_accuracy"])

    # SIGKILL once step 2's checkpoint exists, resume: exactly the uninterrupted run's metrics
    # (weights, Adam state, LR schedule, data position; randomness is a function of seed, step, rank)
    assert kill_after_checkpoint(tmp_path / "split", 2, "train.steps=4", *common) == -signal.SIGKILL
    resumed = train(tmp_path / "split", "train.steps=4", *common, resume=True)
    assert [m["step"] for m in resumed] == steps
    split_warm = [json.loads(line) for line in (tmp_path / "split" / "sft_metrics.jsonl").read_text().splitlines()]
    assert split_warm == warm  # the resume did not run the warm start again (nor append to its losses)
    for a, b in zip(resumed, full):
        for key in ("reward_mean", "pg_loss", "grad_norm", "seq_ratio_mean", "eval_accuracy", "routing_drift"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)


def test_init_from_a_warm_start_checkpoint_equals_the_warm_start_in_process(tmp_path):
    """``train.steps=0`` runs the warm start and saves step 0; ``--init-from`` it gives exactly the run that
    warm-starts in process (the same weights, a fresh optimizer, the same RL randomness). How
    examples/experiments/gspo_vs_grpo.py shares one warm start between its arms."""
    common = ["eval.every_steps=1", "eval.num_prompts=8", "train.prompts_per_step=4", "eval.pass_k=1"]
    warm = train(tmp_path / "warm", "train.steps=0", "sft.steps=15", *common)
    assert [m["step"] for m in warm] == [0]
    start = tmp_path / "warm" / "checkpoints" / "step_000000"
    assert (start / "gspo_meta.json").is_file()
    direct = train(tmp_path / "direct", "train.steps=2", "sft.steps=15", *common)
    # sft.steps is ignored with --init-from: the weights are the checkpoint's
    proc = subprocess.run(command(tmp_path / "init", "train.steps=2", "sft.steps=15", *common) + ["--init-from", str(start)],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=ENV)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "sft step" not in proc.stdout
    init = [json.loads(line) for line in (tmp_path / "init" / "metrics.jsonl").read_text().splitlines()]
    assert init[0]["eval_accuracy"] == warm[0]["eval_accuracy"]
    assert [m["step"] for m in init] == [m["step"] for m in direct] == [0, 1, 2]
    for a, b in zip(init, direct):
        for key in ("reward_mean", "pg_loss", "grad_norm", "eval_accuracy"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)

    missing = tmp_path / "nowhere"
    proc = subprocess.run(command(tmp_path / "bad", "train.steps=1") + ["--init-from", str(missing)],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=ENV)
    assert proc.returncode != 0 and f"{missing / 'metadata.json'}: missing" in proc.stderr


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"^rollout\.samples_per_prompt: must be >= 2"):
        load_config(DEMO, ["rollout.samples_per_prompt=1"])
    with pytest.raises(ConfigError, match=r"^train\.stepz: unknown field"):
        load_config(DEMO, ["train.stepz=3"])
    with pytest.raises(ConfigError, match=r"^optimizer\.lr: expected a number"):
        load_config(DEMO, ["optimizer.lr=fast"])
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        load_config(DEMO, ["train.steps"])
    cfg = load_config(DEMO, ["optimizer.lr=1e-4", "loss.algorithm=grpo"])
    assert cfg.optimizer.lr == 1e-4 and cfg.loss.clip_low == 0.2 and cfg.loss.clip_high == 0.27
    assert Path(cfg.data.train_files[0]).is_absolute()


def test_configuration_doc_lists_every_field():
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "gen_config_docs.py"), "--check"], capture_output=True,
                          text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_validate(path):
    cfg = load_config(path)
    if "qwen3_30b" in path.name:  # the paper's settings
        assert (cfg.loss.algorithm, cfg.loss.clip_low, cfg.loss.clip_high) == ("gspo", 3e-4, 4e-4)
        assert cfg.train.minibatches_per_step == 4 and cfg.loss.kl_coef == 0.0
        assert cfg.parallel.expert_parallel == 8 and cfg.rollout.engine == "sglang"
