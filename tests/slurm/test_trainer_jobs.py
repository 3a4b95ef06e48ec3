"""The real trainer as Slurm jobs on the local cluster: the two-task CPU demo job trains (EP=2 over
gloo), and a job signalled mid-run checkpoints, exits cleanly, and a resubmitted job resumes from it."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.slurm.cluster import REPO_ROOT, LocalSlurm, metrics, submit, submit_and_wait, wait_until

SCRIPT = REPO_ROOT / "examples" / "slurm" / "cpu_demo.sbatch"
SMALL = ["parallel.expert_parallel=2", "sft.steps=20", "eval.num_prompts=16", "logging.console=false",
         "logging.tensorboard=false"]


def job_env(run_dir: Path) -> dict[str, str]:
    return {"GSPO_PYTHON": sys.executable, "GSPO_RUN_DIR": str(run_dir)}


@pytest.mark.slurm
@pytest.mark.slow
def test_demo_job_trains_on_two_tasks(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    rc, _ = submit_and_wait(slurm_cluster, SCRIPT, args=[*SMALL, "train.steps=3", "eval.every_steps=3"],
                            options=[f"--output={out}"], env=job_env(run_dir), timeout_s=600)
    assert rc == 0, out.read_text()[-3000:]
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(0.0 <= r["reward_mean"] <= 1.0 and "routing_drift" in r for r in records[1:])
    assert "eval_accuracy" in records[-1]
    assert (run_dir / "checkpoints" / "step_000003" / "gspo_meta.json").is_file()


@pytest.mark.slurm
@pytest.mark.slow
def test_signalled_job_checkpoints_and_a_resubmitted_job_resumes(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    args = [*SMALL, "train.steps=500", "eval.every_steps=0", "checkpoint.every_steps=0"]
    job = submit(slurm_cluster, SCRIPT, args=args, options=[f"--output={out}"], env=job_env(run_dir))
    wait_until(lambda: len(metrics(run_dir)) >= 3, 600, "two training steps of the job")
    # what `#SBATCH --signal=B:USR1@60` does before the time limit: USR1 to the batch shell
    slurm_cluster.run(["scancel", "--batch", "--signal=USR1", str(job)])
    checkpoints = run_dir / "checkpoints"
    wait_until(lambda: checkpoints.is_dir() and any((p / "gspo_meta.json").is_file() for p in checkpoints.iterdir()),
               300, "the preemption checkpoint")
    # the batch script requeues itself after a clean preempted exit; Slurm holds it 30 s here: cancel it
    wait_until(lambda: slurm_cluster.job_info(job).get("Restarts") == "1", 120, "the job to be requeued")
    slurm_cluster.run(["scancel", str(job)])
    saved = sorted(p.name for p in checkpoints.iterdir() if (p / "gspo_meta.json").is_file())
    assert len(saved) == 1 and "preempted: checkpoint saved" in out.read_text()
    step = int(saved[0].split("_")[1])
    assert 2 <= step < 500

    # a new job with the same run dir resumes from that checkpoint and trains two more steps
    out2 = tmp_path / "job2.out"
    rc, _ = submit_and_wait(slurm_cluster, SCRIPT, args=[*SMALL, f"train.steps={step + 2}", "eval.every_steps=0"],
                            options=[f"--output={out2}"], env=job_env(run_dir), timeout_s=600)
    assert rc == 0, out2.read_text()[-3000:]
    assert f"resumed from {checkpoints / saved[0]} at step {step}" in out2.read_text()
    assert [r["step"] for r in metrics(run_dir)] == list(range(step + 3))
