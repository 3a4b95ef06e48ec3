"""Shared by the reliability tests: tiny training commands and finding every process of a tree."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "cpu_demo.yaml"
TAG_ENV = "GSPO_RELIABILITY_TAG"
# the smallest run that still rolls out, updates, evaluates and checkpoints
TINY = ["logging.console=false", "logging.tensorboard=false", "train.prompts_per_step=2", "eval.num_prompts=2",
        "eval.pass_k=1", "rollout.max_new_tokens=4", "train.minibatches_per_step=2", "sft.batch_size=4"]


def tagged_env() -> tuple[dict[str, str], str]:
    """An environment whose processes (and all their children) can be found again: a unique tag."""
    tag = uuid.uuid4().hex
    return {**os.environ, "OMP_NUM_THREADS": "1", TAG_ENV: tag}, tag


def train_command(run_dir: Path, *overrides: str, nproc: int = 1, resume: bool = False) -> list[str]:
    cmd = [sys.executable, "-m", "gspo_megatron.cli", "train", "--config", str(DEMO), "--run-dir", str(run_dir),
           *TINY, *overrides]
    return cmd + (["--nproc", str(nproc)] if nproc > 1 else []) + (["--resume"] if resume else [])


def tagged_pids(tag: str) -> list[int]:
    """Processes whose environment holds ``TAG_ENV=tag`` (zombies have no readable environment)."""
    needle = f"{TAG_ENV}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


def describe(pids: list[int]) -> str:
    lines = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmd = "?"
        lines.append(f"{pid}: {cmd[:160]}")
    return "\n".join(lines)


def wait_until_gone(tag: str, timeout_s: float) -> list[int]:
    """Poll until no tagged process remains; returns the leftovers at the deadline (empty: all gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = tagged_pids(tag)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def kill_tagged(tag: str) -> None:
    """Clean-up after a failed assertion: nothing a test starts may outlive it."""
    for pid in tagged_pids(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_train(run_dir, overrides, nproc: int, env: dict):
    """``gspo-megatron train`` in the background: (process, its output lines as they come, the reader thread)."""
    import threading

    proc = subprocess.Popen(train_command(run_dir, *overrides, nproc=nproc), cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    return proc, out, reader


def sigterm_when(proc, out: list[str], reader, tag: str, ready, what: str, timeout_s: float = 300) -> str:
    """Wait until ``ready()`` (``what``: for the messages), SIGTERM the run, and check that it exits 0 leaving
    nothing of its tree running; returns its whole output."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, f"the run ended before {what}:\n" + "".join(out[-30:])
        assert time.monotonic() < deadline, f"no {what} in time"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, "".join(out[-30:])
    reader.join(timeout=10)
    assert not wait_until_gone(tag, 10)
    return "".join(out)
