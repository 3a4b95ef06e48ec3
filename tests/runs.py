"""Shared helpers for tests that run the trainer as a user does (``gspo-megatron train`` in a subprocess):
the demo config, the command line, a run to its end, and a run killed right after a checkpoint."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "cpu_demo.yaml"


def command(run_dir, *overrides, resume=False):
    cmd = [sys.executable, "-m", "gspo_megatron.cli", "train", "--config", str(DEMO), "--run-dir", str(run_dir),
           "logging.console=false", "logging.tensorboard=false", *overrides]
    return cmd + (["--resume"] if resume else [])


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def train(run_dir, *overrides, resume=False):
    proc = subprocess.run(command(run_dir, *overrides, resume=resume), capture_output=True, text=True, timeout=600,
                          cwd=REPO, env=ENV)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def kill_after_checkpoint(run_dir, step, *overrides):
    """Start a run and SIGKILL it as soon as the checkpoint of ``step`` is complete."""
    proc = subprocess.Popen(command(run_dir, *overrides), cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    marker = Path(run_dir) / "checkpoints" / f"step_{step:06d}" / "gspo_meta.json"
    deadline = time.monotonic() + 600
    while not marker.exists():
        assert proc.poll() is None, "the run ended before its checkpoint"
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return proc.returncode
