"""Real signals to `gspo-megatron train` in its supervised warm start (which used to ignore them): SIGHUP and
SIGINT in one process, SIGTERM under --nproc 2 (forwarded past torchrun, whose own handling SIGKILLs the
ranks 30 s later). Each saves the warm start where it was, exits with the documented status (0; 130 for
Ctrl-C), leaves no process and no lock, and the resume continues the warm start from that step."""
import json
import signal
import subprocess
import time

import pytest

from tests.reliability.helpers import (REPO, describe, kill_tagged, sigterm_when, start_train, tagged_env, train_command,
                                       wait_until_gone)

pytestmark = pytest.mark.slow
WARM = ["train.steps=1", "sft.steps=400", "eval.every_steps=0"]


@pytest.mark.parametrize("nproc, sig, code", [(1, signal.SIGHUP, 0), (1, signal.SIGINT, 130), (2, signal.SIGTERM, 0)])
def test_a_signal_in_the_warm_start_saves_it_and_the_resume_continues_it(tmp_path, nproc, sig, code):
    env, tag = tagged_env()
    run_dir = tmp_path / "run"
    overrides = WARM + (["parallel.expert_parallel=2"] if nproc == 2 else [])
    proc, out, reader = start_train(run_dir, overrides, nproc, env)
    try:
        deadline = time.monotonic() + 600
        while not any(line.startswith("sft step 1/400") for line in out):
            assert proc.poll() is None, "the run ended before its warm start:\n" + "".join(out[-30:])
            assert time.monotonic() < deadline, "no warm start in time"
            time.sleep(0.01)
        proc.send_signal(sig)
        assert proc.wait(timeout=300) == code, "".join(out[-30:])
        reader.join(timeout=10)
        left = wait_until_gone(tag, 10)
        assert not left, describe(left)
        stop = [line for line in out if line.startswith("preempted: checkpoint saved at step 0; exiting")]
        named = "SIGTERM" if nproc == 2 else sig.name  # the launcher forwards SIGTERM to the ranks
        assert len(stop) == 1 and f"({named} in the warm start at sft step " in stop[0], "".join(out[-30:])
        meta = json.loads((run_dir / "checkpoints" / "step_000000" / "gspo_meta.json").read_text())
        assert 1 <= meta["warm_start"]["step"] < 400 and not (run_dir / ".lock").exists()
    finally:
        proc.kill()
        kill_tagged(tag)
    if sig != signal.SIGHUP:  # the summary ends with the command that continues the run; it runs as printed
        _run_the_printed_resume_command(out, run_dir, overrides, env, meta["warm_start"]["step"], nproc)
    if nproc == 1 and sig == signal.SIGHUP:  # the resume continues the warm start (once is enough)
        resumed = subprocess.run(train_command(run_dir, *WARM, "sft.steps=" + str(meta["warm_start"]["step"] + 2),
                                               resume=True), cwd=REPO, env=env, capture_output=True, text=True,
                                 timeout=600)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"(in the warm start, sft step {meta['warm_start']['step']})" in resumed.stdout
        assert f"sft step {meta['warm_start']['step'] + 2}/{meta['warm_start']['step'] + 2}" in resumed.stdout
        assert "resume: sft.steps 400 -> " in resumed.stdout
        # the warm start's losses: one per sft step, the stopped run's kept and continued, none twice
        losses = (run_dir / "sft_metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in losses] == list(range(1, meta["warm_start"]["step"] + 3))


def _run_the_printed_resume_command(out, run_dir, overrides, env, saved_sft_step, nproc):
    import shlex

    printed = [line.removeprefix("resume: ").strip() for line in out if line.startswith("resume: ")]
    assert len(printed) == 1, "".join(out[-30:])
    # the same arguments, --nproc included (the ranks run without it, under our own torchrun)
    assert shlex.split(printed[0])[1:] == train_command(run_dir, *overrides, nproc=nproc, resume=True)[3:], printed[0]
    _, tag = tagged_env()
    resumed = subprocess.Popen(["bash", "-c", printed[0]], cwd=REPO, env={**env, "GSPO_RELIABILITY_TAG": tag},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in iter(resumed.stdout.readline, ""):
            if f"(in the warm start, sft step {saved_sft_step})" in line:
                break
        else:
            raise AssertionError(f"the printed command did not resume the run (exit {resumed.wait()})")
    finally:
        resumed.kill()
        kill_tagged(tag)
        resumed.wait()


def test_sigterm_stops_a_run_whose_in_process_reward_hangs(tmp_path):
    """rewards.num_workers: 0 (the demos) with a reward that sleeps for an hour: SIGTERM during the rewards
    (here the step-0 evaluation's) reaches the trainer's flag and ends the in-process calls, counted as
    timeouts; the run saves and exits 0, leaving nothing running."""
    env, tag = tagged_env()
    started = tmp_path / "reward_started"
    env["GSPO_TEST_REWARD_STARTED"] = str(started)
    run_dir = tmp_path / "run"
    overrides = ["train.steps=3", "sft.steps=0", "eval.every_steps=0", "rewards.num_workers=0",
                 "rewards.terms=[{name: 'tests.reliability.failing_reward:sleeps'}]"]
    proc, out, reader = start_train(run_dir, overrides, 1, env)
    try:
        text = sigterm_when(proc, out, reader, tag, started.exists, "its rewards")
        assert "preempted: checkpoint saved at step 0; exiting (SIGTERM" in text, text[-3000:]
        assert "sleeps: skipped: stopped by SIGTERM" in text, text[-3000:]  # the first call ended, the rest skipped
    finally:
        proc.kill()
        kill_tagged(tag)


def test_sigterm_between_dynamic_sampling_rounds_ends_the_filling_and_the_run(tmp_path):
    """Every group has zero variance (a constant reward), so each step would refill for all of its 64 rounds:
    SIGTERM after the first refill ends the filling (the step trains on what it has, counted in
    filter/stopped_by_signal), and the run saves after that step and exits 0; the resume finishes the run."""
    env, tag = tagged_env()
    run_dir = tmp_path / "run"
    overrides = ["train.steps=2", "sft.steps=0", "eval.every_steps=0", "rewards.num_workers=0",
                 "rollout.filter_groups=zero_variance", "rollout.max_generation_rounds=64",
                 "rewards.terms=[{name: 'tests.reliability.failing_reward:constant'}]"]
    proc, out, reader = start_train(run_dir, overrides, 1, env)
    try:
        text = sigterm_when(proc, out, reader, tag, lambda: any("dynamic sampling round 2/64" in line for line in out),
                            "its refills")
        assert "preempted: checkpoint saved at step 1; exiting (SIGTERM after step 1)" in text, text[-3000:]
        assert not any("dynamic sampling round 64/64" in line for line in out)
        [step1] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                   if json.loads(line)["step"] == 1]
        assert step1["filter/stopped_by_signal"] == 1.0 and step1["filter/rounds"] < 64
        resumed = subprocess.run(train_command(run_dir, *overrides, resume=True), cwd=REPO, env=env,
                                 capture_output=True, text=True, timeout=600)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in steps] == [0, 1, 2] and steps[-1]["filter/rounds"] == 64.0
    finally:
        proc.kill()
        kill_tagged(tag)
