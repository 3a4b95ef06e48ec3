"""Two spellings of resuming: `--resume` continues an existing run and refuses a folder that holds none (a
mistyped --run-dir must not start a new run), `--resume-or-start` continues or starts (a Slurm requeue before
the first checkpoint). And `eval --checkpoint` of a folder that does not exist names the checkpoints that do;
a stopped run prints the command that continues it."""
import subprocess
import sys

import pytest

from tests.reliability.helpers import DEMO, REPO, TINY, tagged_env

CLI = [sys.executable, "-m", "gspo_megatron.cli"]


def _run(args, cwd=REPO, timeout=600):
    env, _ = tagged_env()
    return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def _fake_run(folder, steps):
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "config.yaml").write_text("train:\n  steps: 2\n")
    for step in steps:
        (folder / "checkpoints" / f"step_{step:06d}").mkdir()
        (folder / "checkpoints" / f"step_{step:06d}" / "gspo_meta.json").write_text("{}")


def test_resume_of_a_folder_without_a_run_is_refused_naming_the_runs_beside_it(tmp_path):
    _fake_run(tmp_path / "runs" / "mine", [1])
    proc = _run(["train", "--config", str(DEMO), "--run-dir", str(tmp_path / "runs" / "mnie"), "--resume"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == (
        f"gspo-megatron train: error: --resume: {tmp_path}/runs/mnie: no such folder; runs in {tmp_path}/runs: "
        f"{tmp_path}/runs/mine. To start a new run there drop --resume; a job that starts or continues the same run "
        "(a Slurm requeue) passes --resume-or-start")
    assert not (tmp_path / "runs" / "mnie").exists()
    (tmp_path / "runs" / "empty").mkdir()
    proc = _run(["train", "--config", str(DEMO), "--run-dir", str(tmp_path / "runs" / "empty"), "--resume"])
    assert proc.returncode == 2 and "empty: holds no run (no config.yaml, no checkpoints)" in proc.stderr


@pytest.mark.slow
def test_resume_or_start_starts_a_run_that_has_none_and_continues_it_after(tmp_path):
    run = tmp_path / "run"
    args = ["train", "--config", str(DEMO), "--run-dir", str(run), *TINY, "sft.steps=0", "eval.every_steps=0",
            "checkpoint.every_steps=1", "--resume-or-start"]
    first = _run([*args, "train.steps=1"])
    assert first.returncode == 0, first.stderr[-3000:]
    assert (run / "checkpoints" / "step_000001" / "gspo_meta.json").is_file()
    again = _run([*args, "train.steps=2"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {run}/checkpoints/step_000001 at step 1" in again.stdout, again.stdout[-3000:]


def test_eval_of_a_missing_checkpoint_names_the_ones_that_exist(tmp_path):
    run = tmp_path / "run"
    _fake_run(run, [0, 10, 20])
    missing = run / "checkpoints" / "step_000030"
    proc = _run(["eval", "--checkpoint", str(missing), "--dataset", "x.jsonl"], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    listed = ", ".join(str(run / "checkpoints" / f"step_{s:06d}") for s in (0, 10, 20))
    assert proc.stderr.strip() == (f"gspo-megatron eval: error: --checkpoint {missing}: no such folder; the "
                                   f"checkpoints in {run / 'checkpoints'}: {listed}")
    proc = _run(["eval", "--checkpoint", str(run), "--dataset", "x.jsonl"], timeout=120)
    assert proc.stderr.strip() == (f"gspo-megatron eval: error: --checkpoint {run}: a run folder, not a checkpoint; "
                                   f"the checkpoints in {run}: {listed}")
    proc = _run(["eval", "--checkpoint", str(tmp_path / "nowhere" / "step_1"), "--dataset", "x.jsonl"], timeout=120)
    assert proc.stderr.strip() == (f"gspo-megatron eval: error: --checkpoint {tmp_path}/nowhere/step_1: no such "
                                   f"folder (and no checkpoint in {tmp_path})")


def test_the_resume_command_keeps_the_arguments_and_the_process_count():
    from gspo_megatron.reporting import cli_command
    from gspo_megatron.trainer.entry import resume_command

    argv = ["train", "--config", "my config.yaml", "--nproc", "2", "rewards.terms=[{name: math}]", "--run-dir", "r"]
    assert resume_command(argv, 2) == (f"{cli_command()} train --config 'my config.yaml' "
                                       "'rewards.terms=[{name: math}]' --run-dir r --nproc 2 --resume")
    assert resume_command(["train", "--run-dir", "r", "--resume"], 1) == f"{cli_command()} train --run-dir r --resume"


def test_overrides_after_a_flag_are_applied_not_dropped(tmp_path):
    """`train ... a=1 --resume b=2`: argparse returns b=2 unparsed; it must count like a=1 (it was ignored)."""
    proc = _run(["train", "--config", str(DEMO), "train.steps=1", "--run-dir", str(tmp_path / "r"),
                 "train.prompts_per_step=0"], timeout=120)
    assert proc.returncode == 2 and "train.prompts_per_step: must be >= 1" in proc.stderr, proc.stderr[-2000:]
    proc = _run(["train", "--config", str(DEMO), "--run-dir", str(tmp_path / "r"), "--bogus"], timeout=120)
    assert proc.returncode == 2 and "unrecognized arguments: --bogus" in proc.stderr, proc.stderr[-2000:]
