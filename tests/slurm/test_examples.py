"""The sbatch examples: shell syntax everywhere; the CPU demo and conversion jobs run for real on the
local cluster with a stand-in interpreter that records how it was called (the trainer is not needed to
check the job plumbing: directory, job_lib, srun task count, arguments)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.slurm.cluster import REPO_ROOT, LocalSlurm, submit_and_wait

SCRIPTS = sorted((REPO_ROOT / "examples" / "slurm").glob("*")) + sorted((REPO_ROOT / "tools" / "slurm").glob("*.sh"))

FAKE_PYTHON = """#!/bin/bash
# Stands in for python: records the task and its arguments, one file per task.
printf '%s\\n' "$@" > "$FAKE_OUT/task${SLURM_PROCID}.args"
echo "cwd=$PWD ntasks=$SLURM_NTASKS omp=$OMP_NUM_THREADS" > "$FAKE_OUT/task${SLURM_PROCID}.env"
"""


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shell_syntax(script: Path) -> None:
    if script.suffix not in (".sh", ".sbatch"):
        pytest.fail(f"unexpected file {script} in a scripts folder")
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def _fake_python(tmp_path: Path) -> dict[str, str]:
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    return {"GSPO_PYTHON": str(fake), "FAKE_OUT": str(tmp_path)}


@pytest.mark.slurm
def test_cpu_demo_job(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    rc, _ = submit_and_wait(slurm_cluster, REPO_ROOT / "examples" / "slurm" / "cpu_demo.sbatch",
                            args=["trainer.steps=3", "rollout.samples_per_prompt=4"],
                            options=[f"--output={out}"], env={**_fake_python(tmp_path), "GSPO_RUN_DIR": "/tmp/x"})
    assert rc == 0, out.read_text()
    expected = ["-m", "gspo_megatron.cli", "train", "--config", "examples/cpu_demo.yaml", "--run-dir", "/tmp/x",
                "--resume-or-start", "trainer.steps=3", "rollout.samples_per_prompt=4"]
    for task in range(2):
        assert (tmp_path / f"task{task}.args").read_text().splitlines() == expected
        assert (tmp_path / f"task{task}.env").read_text().strip() == f"cwd={REPO_ROOT} ntasks=2 omp=1"


@pytest.mark.slurm
def test_conversion_job(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    script = REPO_ROOT / "examples" / "slurm" / "convert_hf_to_megatron.sbatch"
    out = tmp_path / "job.out"
    # The example asks for 160G and 16 CPUs; the local node has less, and command-line options win.
    options = [f"--output={out}", "--mem=100M", "--cpus-per-task=1"]
    rc, _ = submit_and_wait(slurm_cluster, script, options=options, env=_fake_python(tmp_path))
    assert rc == 2 and "usage:" in out.read_text()
    rc, _ = submit_and_wait(slurm_cluster, script, args=["/m/hf", "/m/out", "2", "1", "4"], options=options,
                            env=_fake_python(tmp_path))
    assert rc == 0, out.read_text()
    assert (tmp_path / "task0.args").read_text().splitlines() == [
        "-m", "gspo_megatron.cli", "convert", "hf-to-megatron", "--hf-dir", "/m/hf", "--out", "/m/out",
        "--tp", "2", "--pp", "1", "--ep", "4"]
