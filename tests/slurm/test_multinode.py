"""The CPU trainer across two Slurm nodes (network namespaces made by ``local_cluster.sh start --nodes 2``),
with examples/slurm/cpu_multinode.sbatch: one rank per node, the rendezvous on the first host.

What these pin down: 2 nodes x 1 task trains with the same per-step metrics as 1 node x 2 tasks, at EP=2
and at DP=2; SIGUSR1 to the batch script reaches the ranks on both nodes, they checkpoint, the job
requeues and the rerun resumes at that step and reproduces the uninterrupted run; a rank SIGKILLed on
one node ends the job on both (srun --kill-on-bad-exit) with a clear message and no process left; a
checkpoint interrupted by a node's death is never resumed from.

Runs are kept tiny (3 RL steps, 4 prompts x 4 samples, no SFT) and scored by tests.slurm.digit_reward,
which gives an untrained model's responses different rewards, so gradients and updates are not all zero.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.slurm.cluster import (REPO_ROOT, MultiNodeSlurm, alive, metrics, submit, submit_and_wait,
                                 wait_until)

pytestmark = [pytest.mark.slurm]

SCRIPT = REPO_ROOT / "examples" / "slurm" / "cpu_multinode.sbatch"
STEPS = 3
TINY = [f"train.steps={STEPS}", "sft.steps=0", "train.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "train.minibatches_per_step=2", "eval.num_prompts=4", "eval.every_steps=0", "checkpoint.every_steps=1",
        "logging.console=false", "logging.tensorboard=false",
        "rewards.terms=[{name: 'tests.slurm.digit_reward:digit_fraction'}]"]
# EP=2 over the two nodes also all-reduces the dense gradients across them (expert DP 1, dense DP 2), so a
# separate DP=2 layout repeated that path for ~1.5 minutes of CI; it ran and matched (docs/slurm.md)
LAYOUTS = {"ep2": ["parallel.expert_parallel=2"]}
TWO_NODES = ["--nodes=2", "--ntasks-per-node=1"]
ONE_NODE = ["--nodes=1", "--ntasks-per-node=2"]
JOB_TIMEOUT_S = 600


def comparable(record: dict) -> dict:
    """A metrics record without its timings (wall-clock, throughput), which no two runs share."""
    return {k: v for k, v in record.items()
            if not (k.startswith("time_") or k.endswith(("_per_s", "/time_s")))}


# float32 rounding: the same layout run twice (or on one node and on two) may differ in the last bits of
# near-zero sums (log-prob gaps ~1e-8, a 1e-4 loss); counts and everything else must match.
RTOL, ATOL = 1e-5, 1e-6


def assert_same_metrics(records: list[dict], expected: list[dict], what: str) -> None:
    assert [r["step"] for r in records] == [r["step"] for r in expected], what
    for got, want in zip(records, expected):
        assert comparable(got) == pytest.approx(comparable(want), rel=RTOL, abs=ATOL), f"{what}: step {got['step']}"


def by_step(records: list[dict]) -> dict[int, list[dict]]:
    steps: dict[int, list[dict]] = {}
    for record in records:
        steps.setdefault(record["step"], []).append(record)
    return steps


def job_env(run_dir: Path) -> dict[str, str]:
    return {"GSPO_PYTHON": sys.executable, "GSPO_RUN_DIR": str(run_dir)}


def run_job(cluster: MultiNodeSlurm, tmp_path: Path, name: str, layout: list[str], options: list[str],
            extra: list[str] = ()) -> tuple[Path, str]:
    """Submit the multi-node script, wait, and return (run dir, job log); a failed job fails the test."""
    run_dir, out = tmp_path / name, tmp_path / f"{name}.out"
    rc, _ = submit_and_wait(cluster, SCRIPT, args=[*TINY, *layout, *extra], options=[*options, f"--output={out}"],
                            env=job_env(run_dir), timeout_s=JOB_TIMEOUT_S)
    log = out.read_text()
    assert rc == 0, log[-4000:]
    return run_dir, log


def hosts_of_ranks(log: str) -> dict[int, str]:
    """The script's `srun --label hostname` lines: {rank: host}."""
    return {int(rank): host for rank, host in re.findall(r"^(\d+): (node\d+)$", log, re.M)}


@pytest.fixture(scope="module")
def ep2_reference(slurm_multinode: MultiNodeSlurm, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The EP=2 run on 2 nodes x 1 task, uninterrupted: what every other EP=2 run here must reproduce."""
    return run_job(slurm_multinode, tmp_path_factory.mktemp("ep2-reference"), "two-nodes", LAYOUTS["ep2"], TWO_NODES)


@pytest.mark.slow
def test_two_nodes_train_like_one_node(slurm_multinode: MultiNodeSlurm, ep2_reference: tuple[Path, str],
                                       tmp_path: Path) -> None:
    two_dir, two_log = ep2_reference
    one_dir, one_log = run_job(slurm_multinode, tmp_path, "one-node", LAYOUTS["ep2"], ONE_NODE)
    assert hosts_of_ranks(two_log) == {0: "node1", 1: "node2"}, two_log[:2000]
    assert hosts_of_ranks(one_log) == {0: "node1", 1: "node1"}, one_log[:2000]
    assert "rendezvous node1:" in two_log
    two, one = metrics(two_dir), metrics(one_dir)
    assert [r["step"] for r in two] == list(range(STEPS + 1))
    # Real training happened: rewards with spread, so non-zero gradients.
    assert all(r["grad_norm"] > 0 and r["reward_std"] > 0 for r in two[1:]), two
    assert_same_metrics(two, one, "ep2 on 2 nodes x 1 task vs 1 node x 2 tasks")


def _rank_pid(cluster: MultiNodeSlurm, node: str) -> int:
    # the trainer itself, not srun or the batch shell, whose command lines name it too, nor a child it forked
    # (a reward worker keeps its parent's command line), so the matching process whose parent does not match
    trainers = {pid for pid, args in cluster.processes(node).items()
                if args.startswith(f"{sys.executable} -m gspo_megatron.cli train")}
    ranks = [pid for pid in trainers if _parent(pid) not in trainers]
    assert len(ranks) == 1, cluster.processes(node)
    return ranks[0]


def _parent(pid: int) -> int:
    # /proc/PID/stat: "pid (comm) state ppid ...", comm may hold spaces
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])


def _assert_nodes_empty(cluster: MultiNodeSlurm) -> None:
    """Nothing but slurmd on any node (slurmstepd may take a moment to exit after the job ends)."""
    try:
        wait_until(lambda: not any(cluster.processes(node) for node in cluster.nodes), 30, "the nodes to be empty")
    except TimeoutError:
        pytest.fail(f"processes left on the nodes: {[cluster.processes(n) for n in cluster.nodes]}")


def _complete(checkpoints: Path) -> list[str]:
    if not checkpoints.is_dir():
        return []
    return sorted(p.name for p in checkpoints.iterdir() if (p / "gspo_meta.json").is_file()
                  and not p.name.endswith((".incomplete", ".old")))


def _assert_reproduces(records: list[dict], reference: list[dict]) -> None:
    """Every record of ``records`` (a run that was interrupted and resumed, so some steps twice) equals the
    reference run's record of that step."""
    expected = by_step(reference)
    for step, seen in by_step(records).items():
        for record in seen:
            assert_same_metrics([record], expected[step], "the resumed run vs the uninterrupted one")


@pytest.mark.slow
def test_usr1_checkpoints_both_nodes_and_the_requeued_job_resumes(
        slurm_multinode: MultiNodeSlurm, ep2_reference: tuple[Path, str], tmp_path: Path) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    job = submit(slurm_multinode, SCRIPT, args=[*TINY, *LAYOUTS["ep2"]], options=[*TWO_NODES, f"--output={out}"],
                 env=job_env(run_dir))
    try:
        wait_until(lambda: len(metrics(run_dir)) >= 2, JOB_TIMEOUT_S, "the first training step")
        # what `#SBATCH --signal=B:USR1@60` does before the time limit
        slurm_multinode.run(["scancel", "--batch", "--signal=USR1", str(job)])
        wait_until(lambda: slurm_multinode.job_info(job).get("Restarts") == "1", 300, "the job to requeue itself")
        # Held for the credential lifetime (local_cluster.sh: 30 s) before it may start again.
        wait_until(lambda: slurm_multinode.job_info(job)["JobState"] in ("COMPLETED", "FAILED", "CANCELLED"),
                   JOB_TIMEOUT_S, "the requeued run to finish")
    finally:
        slurm_multinode.run(["scancel", str(job)], check=False)
    log = out.read_text()
    assert slurm_multinode.job_info(job)["JobState"] == "COMPLETED", log[-4000:]
    saved = re.findall(r"preempted: checkpoint saved at step (\d+)", log)
    assert len(saved) == 1 and 1 <= int(saved[0]) < STEPS, log[-4000:]
    step = int(saved[0])
    assert "job_lib: SIGUSR1" in log and "requeueing job" in log
    assert f"job {job} restart 1: 2 tasks on 2 node(s)" in log
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{step:06d}'} at step {step}" in log
    # The rerun's steps match the uninterrupted run: both ranks (one per node, each with half the
    # experts) restored their shard of the model and optimizer.
    records = metrics(run_dir)
    assert sorted({r["step"] for r in records}) == list(range(STEPS + 1))
    _assert_reproduces(records, metrics(ep2_reference[0]))
    _assert_nodes_empty(slurm_multinode)


def test_usr1_reaches_the_ranks_on_both_nodes(slurm_multinode: MultiNodeSlurm, tmp_path: Path) -> None:
    """The trainer's ranks agree on stopping through an all-reduce, so one rank seeing the signal would
    be enough for them; this shows srun delivers it to every node (without a trainer, in seconds)."""
    results = tmp_path / "results"
    results.mkdir()
    worker = f"{shlex.quote(sys.executable)} -m tests.slurm.preemptible_worker {shlex.quote(str(results))}"
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\nset -euo pipefail\nsource tools/slurm/job_lib.sh\n"
                      f"gspo_run_step srun --kill-on-bad-exit=1 {worker} && rc=0 || rc=$?\nexit $rc\n")
    out = tmp_path / "job.out"
    job = submit(slurm_multinode, script, options=[*TWO_NODES, f"--output={out}"])
    try:
        wait_until(lambda: all((results / f"ready{r}").exists() for r in range(2)), 120, "both ranks ready")
        pids = {node: [pid for pid, args in slurm_multinode.processes(node).items()
                       if args.startswith(f"{sys.executable} -m tests.slurm.preemptible_worker")]
                for node in slurm_multinode.nodes}
        slurm_multinode.run(["scancel", "--batch", "--signal=USR1", str(job)])
        wait_until(lambda: slurm_multinode.job_info(job)["JobState"] == "COMPLETED", 60, "the job to end")
    finally:
        slurm_multinode.run(["scancel", str(job)], check=False)
    # one worker on each node, each caught the signal itself
    assert {node: len(p) for node, p in pids.items()} == {"node1": 1, "node2": 1}, pids
    for rank in range(2):
        assert json.loads((results / f"rank{rank}.json").read_text())["signal"] == "SIGUSR1", out.read_text()


@pytest.mark.slow
def test_a_rank_killed_on_one_node_ends_the_job_on_both(slurm_multinode: MultiNodeSlurm, tmp_path: Path) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    job = submit(slurm_multinode, SCRIPT, args=[*TINY, *LAYOUTS["ep2"], "train.steps=100"],
                 options=[*TWO_NODES, f"--output={out}"], env=job_env(run_dir))
    checkpoints = run_dir / "checkpoints"
    try:
        wait_until(lambda: "step_000001" in _complete(checkpoints), JOB_TIMEOUT_S, "the step 1 checkpoint")
        time.sleep(1.0)  # into step 2 (a step takes seconds): the ranks are mid-rollout or mid-update
        victim = _rank_pid(slurm_multinode, "node2")
        survivor = _rank_pid(slurm_multinode, "node1")
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        # No hang: srun --kill-on-bad-exit ends the other node's rank, far sooner than any collective timeout.
        wait_until(lambda: slurm_multinode.job_info(job)["JobState"] not in ("RUNNING", "COMPLETING"), 120,
                   "the job to end after the kill")
        ended_s = time.monotonic() - killed_at
    finally:
        slurm_multinode.run(["scancel", str(job)], check=False)
    log = out.read_text()
    assert slurm_multinode.job_info(job)["JobState"] == "FAILED", log[-4000:]
    assert not alive(survivor)
    assert re.search(r"srun: error: node2: task 1: Killed", log), log[-4000:]
    assert "job_lib: the training step failed" in log and "without requeue" in log
    assert "requeueing job" not in log
    _assert_nodes_empty(slurm_multinode)
    # The last complete checkpoint is what a resubmission would resume from (resubmission itself is run in
    # the next test, where the kill lands mid-checkpoint).
    assert _complete(checkpoints)[-1] >= "step_000001"
    print(f"job ended {ended_s:.1f} s after the SIGKILL")


@pytest.mark.slow
def test_a_checkpoint_cut_by_a_node_death_is_never_resumed(
        slurm_multinode: MultiNodeSlurm, ep2_reference: tuple[Path, str], tmp_path: Path) -> None:
    """Node 2's rank is frozen (SIGSTOP) as soon as a checkpoint's staging folder appears, so it cannot
    finish its part; if that checkpoint still got completed (we were too late), the rank is let go and the
    next checkpoint is tried. Then the frozen rank is SIGKILLed: its node died mid-write."""
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    job = submit(slurm_multinode, SCRIPT, args=[*TINY, *LAYOUTS["ep2"], "train.steps=100"],
                 options=[*TWO_NODES, f"--output={out}"], env=job_env(run_dir))
    checkpoints = run_dir / "checkpoints"
    cut = None
    try:
        for step in range(2, 10):
            staging = checkpoints / f"step_{step:06d}.incomplete"
            wait_until(lambda: staging.is_dir(), JOB_TIMEOUT_S, f"the step {step} checkpoint to start", poll_s=0.002)
            victim = _rank_pid(slurm_multinode, "node2")
            os.kill(victim, signal.SIGSTOP)
            time.sleep(2.0)  # far longer than a checkpoint of this model takes
            if staging.is_dir() and not (checkpoints / f"step_{step:06d}").exists():
                cut = step
                break
            os.kill(victim, signal.SIGCONT)
        assert cut is not None, "never caught a checkpoint mid-write"
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: slurm_multinode.job_info(job)["JobState"] not in ("RUNNING", "COMPLETING"), 120,
                   "the job to end after the kill")
    finally:
        slurm_multinode.run(["scancel", str(job)], check=False)
    log = out.read_text()
    assert slurm_multinode.job_info(job)["JobState"] == "FAILED", log[-4000:]
    _assert_nodes_empty(slurm_multinode)
    staging = checkpoints / f"step_{cut:06d}.incomplete"
    assert staging.is_dir() and not (staging / "gspo_meta.json").exists()
    assert _complete(checkpoints)[-1] == f"step_{cut - 1:06d}"

    # A resubmitted job resumes from the last complete checkpoint and redoes the interrupted step.
    out2 = tmp_path / "job2.out"
    rc, _ = submit_and_wait(slurm_multinode, SCRIPT, args=[*TINY, *LAYOUTS["ep2"], f"train.steps={cut}"],
                            options=[*TWO_NODES, f"--output={out2}"], env=job_env(run_dir), timeout_s=JOB_TIMEOUT_S)
    log2 = out2.read_text()
    assert rc == 0, log2[-4000:]
    assert f"resumed from {checkpoints / f'step_{cut - 1:06d}'} at step {cut - 1}" in log2
    assert _complete(checkpoints)[-1] == f"step_{cut:06d}" and not staging.exists()
    reference = [r for r in metrics(ep2_reference[0]) if 0 < r["step"]]
    records = [{k: v for k, v in r.items() if not k.startswith("eval_")} for r in metrics(run_dir) if 0 < r["step"] <= STEPS]
    _assert_reproduces(records, [{k: v for k, v in r.items() if not k.startswith("eval_")} for r in reference])
