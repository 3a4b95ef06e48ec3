"""SIGKILL / SIGTERM `gspo-megatron train` (1 and 2 processes) at a rollout, an update and a checkpoint
save: no process of its tree (launcher, torchrun, ranks, Megatron's checkpoint writers and their queue
manager) may remain a few seconds later. Processes are found by a unique environment variable."""
import re
import signal
import time
from pathlib import Path

import pytest

from tests.reliability.helpers import REPO, start_train, describe, kill_tagged, tagged_env, tagged_pids, train_command, wait_until_gone

pytestmark = pytest.mark.slow


def _in_rollout(run_dir: Path, _out: list[str]) -> bool:
    # the step-0 evaluation is logged, so step 1's rollout is what runs now
    metrics = run_dir / "metrics.jsonl"
    return metrics.is_file() and metrics.stat().st_size > 0


def _in_update(_run_dir: Path, out: list[str]) -> bool:
    return any(line.startswith("sft step 1/") for line in out)  # printed after the first optimizer step


def _in_checkpoint_save(run_dir: Path, _out: list[str]) -> bool:
    return any((run_dir / "checkpoints").glob("step_*.incomplete/*"))


PHASES = {"rollout": _in_rollout, "update": _in_update, "checkpoint": _in_checkpoint_save}
OVERRIDES = {"rollout": ["sft.steps=0", "rollout.max_new_tokens=8"], "update": ["sft.steps=400"],
             "checkpoint": ["sft.steps=0", "checkpoint.every_steps=1"]}


@pytest.mark.parametrize("nproc, sig, phase", [
    (2, signal.SIGKILL, "checkpoint"),
    (2, signal.SIGTERM, "rollout"),
    (1, signal.SIGKILL, "update"),
    (2, signal.SIGKILL, "rollout"),
])
def test_no_process_outlives_a_killed_train(tmp_path, nproc, sig, phase):
    env, tag = tagged_env()
    run_dir = tmp_path / "run"
    overrides = ["train.steps=20", "eval.every_steps=0", *OVERRIDES[phase]]
    if nproc == 2:
        overrides.append("parallel.expert_parallel=2")
    proc, out, reader = start_train(run_dir, overrides, nproc, env)
    try:
        deadline = time.monotonic() + 600
        while not PHASES[phase](run_dir, out):
            assert proc.poll() is None, f"the run ended before its {phase}:\n" + "".join(out[-30:])
            assert time.monotonic() < deadline, f"no {phase} in time"
            time.sleep(0.01)
        tree = tagged_pids(tag)
        assert len(tree) >= (3 if nproc == 2 else 1), describe(tree)  # launcher, torchrun, ranks
        proc.send_signal(sig)
        # SIGKILL: the kernel's parent-death signals; SIGTERM: torchrun stops the ranks, which end the step,
        # checkpoint and exit (docs/failures.md)
        left = wait_until_gone(tag, 10 if sig == signal.SIGKILL else 120)
        assert not left, f"still running {phase} after {sig.name}:\n" + describe(left)
        code = proc.wait(timeout=10)
        if sig == signal.SIGKILL:
            assert code == -signal.SIGKILL
        else:  # the ranks finished the step they were in and saved it: step 1, or step 0 when the signal
            # came between step 0's logged evaluation (what the phase detector sees) and step 1's start
            saved = [int(m.group(1)) for line in out if (m := re.search(r"preempted: checkpoint saved at step (\d+)", line))]
            assert saved and saved[0] in (0, 1), "".join(out[-30:])
            assert code == 0  # the launcher stops the ranks past torchrun, which then exits 0 too
            assert (run_dir / "checkpoints" / f"step_{saved[0]:06d}" / "gspo_meta.json").is_file()
    finally:
        proc.kill()
        kill_tagged(tag)
