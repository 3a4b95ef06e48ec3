"""Real Slurm jobs on the local single-node cluster (tools/slurm/local_cluster.sh), no trainer needed.

What these pin down: sbatch --wait reports the job's exit code; two srun tasks find their ranks with
resolve_launch and meet in a gloo group; a failing task ends the job and leaves no process behind; the
preemption path of the sbatch examples (SIGUSR1 to the batch script -> forwarded through srun, and
through a torchrun that ignores it, to the ranks -> clean exit -> requeue) works end to end.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from gspo_megatron.trainer.launch_env import derived_port, expand_hostlist
from tests.slurm.cluster import LocalSlurm, submit, submit_and_wait, wait_until

pytestmark = pytest.mark.slurm

PY = shlex.quote(sys.executable)


@pytest.mark.parametrize("exit_code", [0, 7])
def test_sbatch_wait_returns_the_job_exit_code(slurm_cluster: LocalSlurm, tmp_path: Path, exit_code: int) -> None:
    out = tmp_path / "job.out"
    rc, job_id = submit_and_wait(slurm_cluster, f"echo job-ran; exit {exit_code}", options=[f"--output={out}"])
    assert rc == exit_code
    assert out.read_text().strip() == "job-ran"
    assert slurm_cluster.job_info(job_id)["ExitCode"] == f"{exit_code}:0"


def test_two_srun_tasks_join_a_gloo_group(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    rc, job_id = submit_and_wait(
        slurm_cluster, f"srun --kill-on-bad-exit=1 {PY} -m tests.slurm.gloo_worker {shlex.quote(str(tmp_path))}",
        options=["--ntasks=2", f"--output={out}"], timeout_s=180)
    assert rc == 0, out.read_text()
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(results):
        assert result["job_id"] == job_id
        assert result["launch"] == {
            "rank": rank, "world_size": 2, "local_rank": rank, "local_world_size": 2, "node_rank": 0,
            "num_nodes": 1, "master_addr": "localhost", "master_port": derived_port(job_id), "launcher": "slurm",
        }
        assert (result["torch_rank"], result["torch_world_size"]) == (rank, 2)
        assert result["all_reduce_sum"] == 1.0 + 2.0
        assert result["gathered_ranks"] == [0, 1]


def _processes_with(marker: str) -> list[str]:
    lines = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout
    return [line for line in lines.splitlines() if marker in line]


def test_failing_task_ends_the_job_and_leaves_no_process(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    marker = f"gspo-stray-{uuid.uuid4().hex}"
    # Task 1 sleeps "forever"; task 0 fails once task 1 is surely running. srun must kill task 1.
    program = textwrap.dedent(f"""
        import os, sys, time
        out = {str(tmp_path)!r}
        if os.environ["SLURM_PROCID"] == "1":
            open(os.path.join(out, "sleeper.pid"), "w").write(str(os.getpid()))
            time.sleep(300)
        else:
            while not os.path.exists(os.path.join(out, "sleeper.pid")):
                time.sleep(0.05)
            sys.exit(3)
    """)
    (tmp_path / "task.py").write_text(program)
    out = tmp_path / "job.out"
    rc, job_id = submit_and_wait(
        slurm_cluster, f"srun --kill-on-bad-exit=1 {PY} {shlex.quote(str(tmp_path / 'task.py'))} {marker}",
        options=["--ntasks=2", f"--output={out}"], timeout_s=120)
    assert rc != 0
    assert slurm_cluster.job_info(job_id)["JobState"] == "FAILED"
    sleeper = int((tmp_path / "sleeper.pid").read_text())
    assert not Path(f"/proc/{sleeper}").exists(), f"task 1 (pid {sleeper}) outlived the job"
    assert _processes_with(marker) == []


def test_rendezvous_cli_in_a_job(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    """The multi-node example computes torchrun's --rdzv-endpoint this way in its batch script."""
    out = tmp_path / "job.out"
    rc, job_id = submit_and_wait(slurm_cluster, f"{PY} -m gspo_megatron.trainer.launch_env rendezvous",
                                 options=[f"--output={out}"])
    assert rc == 0, out.read_text()
    assert out.read_text().strip() == f"localhost:{derived_port(job_id)}"


HOSTLISTS = ["localhost", "node[01-04,07],gpu-a[1-2]", "a[1-2]b[3-4]", "n[8-11]", "n[08-11]", "n[008-10]",
             "a,,b", "h1.example.com,h2", "rack[1-2]-n[1,3]", "n[1-2],n[1-2]", "n[0-1]-[5-6]", "n[1-02]",
             "gpu[000-002]", "x[9],y"]


def test_hostlist_parser_agrees_with_scontrol(slurm_cluster: LocalSlurm) -> None:
    for hostlist in HOSTLISTS:
        expected = slurm_cluster.run(["scontrol", "show", "hostnames", hostlist]).stdout.split()
        assert expand_hostlist(hostlist) == expected, hostlist


PREEMPTIBLE_JOB = """#!/bin/bash
#SBATCH --ntasks={ntasks}
#SBATCH --requeue
#SBATCH --open-mode=append
set -euo pipefail
source tools/slurm/job_lib.sh
gspo_run_step {step} && rc=0 || rc=$?
echo "step rc=$rc preempted=$GSPO_PREEMPTED"
gspo_requeue_if_preempted "$rc"
exit "$rc"
"""


def _worker(out_dir: Path) -> str:
    return f"-m tests.slurm.preemptible_worker {shlex.quote(str(out_dir))}"


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_usr1_to_the_batch_script_checkpoints_and_requeues(slurm_cluster: LocalSlurm, tmp_path: Path,
                                                           launcher: str) -> None:
    results = tmp_path / "results"
    results.mkdir()
    if launcher == "srun":
        ntasks = 2
        step = f"srun --kill-on-bad-exit=1 {PY} {_worker(results)}"
    else:
        # The multi-node example's pattern on one node: one torchrun per node that ignores SIGUSR1.
        ntasks = 1
        step = ("srun --kill-on-bad-exit=1 bash -c 'trap \"\" USR1; exec \"$@\"' torchrun-ignoring-usr1 "
                f"{PY} -m torch.distributed.run --nnodes=1 --nproc-per-node=2 --rdzv-backend=c10d "
                f"--rdzv-endpoint=$({PY} -m gspo_megatron.trainer.launch_env rendezvous) --rdzv-id=$SLURM_JOB_ID "
                f"--max-restarts=0 {_worker(results)}")
    script = tmp_path / "job.sbatch"
    script.write_text(PREEMPTIBLE_JOB.format(ntasks=ntasks, step=step))
    out = tmp_path / "job.out"
    job_id = submit(slurm_cluster, script, options=[f"--output={out}"])
    try:
        wait_until(lambda: all((results / f"ready{r}").exists() for r in range(2)), 120, "both ranks ready")
        slurm_cluster.run(["scancel", "--batch", "--signal=USR1", str(job_id)])
        # A requeued batch job waits (BeginTime, 30 s here) before it runs again: seeing it back in the
        # queue with Restarts=1 is the proof, the rerun itself is not waited for.
        wait_until(lambda: slurm_cluster.job_info(job_id).get("Restarts") == "1", 60, f"job {job_id} requeued")
    finally:
        slurm_cluster.run(["scancel", str(job_id)], check=False)
    log = out.read_text()
    assert "step rc=0 preempted=1" in log, log
    for rank in range(2):
        result = json.loads((results / f"rank{rank}.json").read_text())
        assert result["signal"] == "SIGUSR1", result
        assert result["launcher"] == ("slurm" if launcher == "srun" else "torchrun")
        assert result["world_size"] == 2
        assert result["restart_count"] is None
