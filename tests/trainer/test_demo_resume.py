"""`gspo-megatron demo --resume` continues the newest unfinished demo run and says which and why."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_megatron.cli import resume_run_dir

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TINY = ["logging.console=false", "logging.tensorboard=false", "sft.steps=0", "train.steps=2", "eval.num_prompts=4",
        "eval.pass_k=1", "checkpoint.every_steps=1", "checkpoint.keep_last=3"]


def _fake_run(folder: Path, steps: int, saved: list[int]) -> Path:
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "config.yaml").write_text(f"train:\n  steps: {steps}\n")
    for step in saved:
        (folder / "checkpoints" / f"step_{step:06d}").mkdir()
        (folder / "checkpoints" / f"step_{step:06d}" / "gspo_meta.json").write_text("{}")
    return folder


def test_resume_picks_the_newest_unfinished_run(tmp_path):
    base = tmp_path / "cpu_demo"
    _fake_run(base, 60, [50, 60])
    older = _fake_run(tmp_path / "cpu_demo-2", 60, [10])
    newest = _fake_run(tmp_path / "cpu_demo-3", 60, [20, 30])
    other = _fake_run(tmp_path / "cpu_demo_other", 60, [10])  # another folder's run: named, not taken
    _fake_run(tmp_path / "done", 60, [60])  # finished: not named
    os.utime(older / "config.yaml", (1, 1))
    os.utime(older, (1, 1))
    os.utime(older / "checkpoints", (1, 1))
    folder, why = resume_run_dir(base)
    assert folder == newest
    assert why == (f"continuing the newest unfinished run (saved at step 30 of 60); older unfinished run left alone: "
                   f"{older} (saved at step 10 of 60); not demo folders, left alone (continue one with demo --resume "
                   f"--run-dir DIR): {other}")
    shutil.rmtree(newest)
    shutil.rmtree(older)
    shutil.rmtree(other)
    folder, why = resume_run_dir(base)
    assert folder == tmp_path / "cpu_demo-2"  # every demo run is finished: a new one, not the finished one again
    assert why == f"every demo run under {tmp_path} is finished; starting a new run"


@pytest.mark.slow
def test_demo_resume_after_an_interrupted_demo(tmp_path):
    def demo(*extra):
        proc = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "demo", *TINY, *extra], cwd=tmp_path,
                              env=ENV, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    assert "run folder runs/cpu_demo\n" in demo().stdout
    # the disk state of a second demo interrupted after its step-1 checkpoint
    shutil.copytree(tmp_path / "runs" / "cpu_demo", tmp_path / "runs" / "cpu_demo-2")
    shutil.rmtree(tmp_path / "runs" / "cpu_demo-2" / "checkpoints" / "step_000002")
    resumed = demo("--resume")
    out = resumed.stdout
    # the load went through DCP and ShardedTensor, whose deprecation FutureWarnings are silenced (Megatron's)
    assert "Warning" not in resumed.stderr, resumed.stderr[-3000:]
    assert ("gspo-megatron demo --resume: runs/cpu_demo-2: continuing the newest unfinished run "
            "(saved at step 1 of 2)") in out
    assert "resumed from runs/cpu_demo-2/checkpoints/step_000001 at step 1" in out
    assert (tmp_path / "runs" / "cpu_demo-2" / "checkpoints" / "step_000002" / "gspo_meta.json").is_file()
