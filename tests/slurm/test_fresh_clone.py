"""Every sbatch example starts from a fresh clone: Slurm opens the --output / --error file before the
script runs, so their folder must exist in the repository (a `mkdir` in the script comes too late)."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.slurm.cluster import REPO_ROOT, LocalSlurm, submit_and_wait

SBATCH = sorted((REPO_ROOT / "examples" / "slurm").glob("*.sbatch"))


def _log_paths(script: Path) -> list[str]:
    return re.findall(r"^#SBATCH\s+--(?:output|error)=(\S+)", script.read_text(), re.M)


@pytest.mark.parametrize("script", SBATCH, ids=lambda p: p.name)
def test_log_folders_exist_in_a_fresh_clone(script: Path) -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    folders = {""} | {str(Path(f).parent) for f in tracked.splitlines()} | {"."}
    for path in _log_paths(script):
        assert not Path(path).is_absolute() and str(Path(path).parent) in folders, (
            f"{script.name}: --output/--error {path}: its folder is not in a fresh clone")


@pytest.mark.slurm
def test_gpu_sbatch_starts_from_a_fresh_clone(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    """Submitted from a `git clone` on the local Slurm (the GPU request and sizes shrunk to the CPU node):
    the job starts, and its log, in the submit folder, holds the script's own first error (no model path)."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO_ROOT), str(clone)], check=True, timeout=120)
    script = clone / "examples" / "slurm" / "qwen3_30b_a3b_gspo_multinode.sbatch"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GSPO_MODEL")}
    options = ["--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=1", "--gpus-per-node=0", "--mem=100M",
               "--time=00:05:00", "--no-requeue"]
    rc, job = submit_and_wait(slurm_cluster, script, options=options, env=env, cwd=clone, timeout_s=120)
    log = clone / f"slurm-gspo-qwen3-30b-a3b-{job}.out"
    assert log.is_file(), f"job {job} left no log in the clone (exit {rc}): {sorted(p.name for p in clone.iterdir())}"
    assert rc != 0 and "set GSPO_MODEL_PATH" in log.read_text()
