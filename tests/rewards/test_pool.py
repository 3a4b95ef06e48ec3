"""The reward worker pool: custom rewards by import path (sync, async, batched), weights, failures
contained and counted, workers replaced, set-up errors raised at construction."""
from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gspo_megatron.rewards import RewardConfig, RewardPool, RewardSetupError
from gspo_megatron.rewards.sandbox import SandboxConfig
from gspo_megatron.typed_config import ConfigError, build
from tests.rewards.helpers import FAST_SANDBOX, code_block, sandbox_uid_processes

CUSTOM = textwrap.dedent('''
    import asyncio, os, sys, time

    def length(sample, response):
        return len(response) / 10

    async def async_double(sample, response):
        await asyncio.sleep(0.01)
        return 2.0 * float(sample["x"])

    def batched_index(samples, responses):
        return [float(s["x"]) + 100 for s in samples]

    def flaky(sample, response):
        if response == "raise":
            raise RuntimeError("bad response")
        if response == "sleep":
            time.sleep(30)
        if response == "exit":
            os._exit(3)
        if response == "string":
            return "high"
        if response == "nan":
            return float("nan")
        return 1.0

    async def async_sleepy(sample, response):
        await asyncio.sleep(30 if response == "sleep" else 0)
        return 1.0

    def torch_loaded(sample, response):
        return float("torch" in sys.modules)

    def worker_pid(sample, response):
        return float(os.getpid())
''')


@pytest.fixture()
def custom_module(tmp_path, monkeypatch):
    """A reward module importable only through sys.path, which the pool hands to its workers."""
    name = f"gspo_test_rewards_{os.getpid()}_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def _cfg(terms, **kw) -> RewardConfig:
    return build(RewardConfig, {"terms": terms, **kw}, "rewards")


def test_custom_sync_async_batched_weighted(custom_module):
    cfg = _cfg([{"name": f"{custom_module}:length", "weight": 0.5},
                {"name": f"{custom_module}:async_double", "weight": 1.0},
                {"name": f"{custom_module}:batched_index", "weight": 0.01, "batched": True, "key": "idx"}],
               num_workers=2, timeout_s=10)
    batch = [({"x": i}, "r" * (i + 1)) for i in range(5)]
    with RewardPool(cfg) as pool:
        rewards, metrics = pool.score(batch)
    expected = [0.5 * (i + 1) / 10 + 2.0 * i + 0.01 * (i + 100) for i in range(5)]
    assert rewards == pytest.approx(expected)
    assert metrics["rewards/length/mean"] == pytest.approx(sum((i + 1) / 10 for i in range(5)) / 5)
    assert metrics["rewards/idx/mean"] == pytest.approx(sum(i + 100 for i in range(5)) / 5)
    assert metrics["rewards/mean"] == pytest.approx(sum(expected) / 5)
    assert metrics["rewards/errors"] == 0 and metrics["rewards/timeouts"] == 0


def test_in_process_mode_gives_the_same_rewards(custom_module):
    terms = [{"name": f"{custom_module}:length"}, {"name": f"{custom_module}:async_double", "weight": 0.5}]
    batch = [({"x": i}, "abc" * i) for i in range(4)]
    with RewardPool(_cfg(terms, num_workers=0)) as local, RewardPool(_cfg(terms, num_workers=1)) as pooled:
        assert local.score(batch)[0] == pooled.score(batch)[0]
        rewards, metrics = pooled.score([])
        assert rewards == [] and metrics["rewards/mean"] == 0.0


def test_failures_score_zero_and_are_counted(custom_module):
    cfg = _cfg([{"name": f"{custom_module}:flaky"}], num_workers=2, timeout_s=1.0)
    with RewardPool(cfg) as pool:
        start = time.monotonic()
        rewards, metrics = pool.score([({}, "ok"), ({}, "raise"), ({}, "sleep"), ({}, "exit"), ({}, "string"),
                                       ({}, "nan"), ({}, "ok")])
        assert time.monotonic() - start < 15
        assert rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        assert metrics["rewards/flaky/errors"] == 4  # raise, worker exit, non-number, NaN
        assert metrics["rewards/flaky/timeouts"] == 1
        assert metrics["rewards/worker_restarts"] == 2  # the hung worker and the one that exited
        assert any("bad response" in e for e in pool.recent_errors)
        # the replaced workers serve the next batch
        rewards, metrics = pool.score([({}, "ok")] * 4)
        assert rewards == [1.0] * 4 and metrics["rewards/worker_restarts"] == 0


def test_hang_or_crash_inside_a_chunk_spares_the_rest_of_it(custom_module):
    # one worker and 20 responses: tasks of 5 responses, streamed back one by one
    cfg = _cfg([{"name": f"{custom_module}:flaky"}], num_workers=1, timeout_s=1.0)
    responses = ["ok"] * 20
    responses[6], responses[12] = "sleep", "exit"
    with RewardPool(cfg) as pool:
        rewards, metrics = pool.score([({}, r) for r in responses])
    assert rewards == [0.0 if i in (6, 12) else 1.0 for i in range(20)]
    assert (metrics["rewards/flaky/timeouts"], metrics["rewards/flaky/errors"]) == (1, 1)
    assert metrics["rewards/worker_restarts"] == 2


def test_async_timeout_is_per_response(custom_module):
    cfg = _cfg([{"name": f"{custom_module}:async_sleepy"}], num_workers=1, timeout_s=0.5)
    with RewardPool(cfg) as pool:
        rewards, metrics = pool.score([({}, "ok"), ({}, "sleep"), ({}, "ok")])
    assert rewards == [1.0, 0.0, 1.0]
    assert metrics["rewards/async_sleepy/timeouts"] == 1 and metrics["rewards/worker_restarts"] == 0


def test_workers_do_not_import_torch(custom_module):
    cfg = _cfg([{"name": f"{custom_module}:torch_loaded"}, {"name": f"{custom_module}:worker_pid", "weight": 0}],
               num_workers=1)
    with RewardPool(cfg) as pool:
        rewards, _ = pool.score([({}, "x")])
    assert rewards == [0.0]


def test_bad_import_path_fails_at_setup(custom_module):
    with pytest.raises(RewardSetupError, match=r"rewards.terms\[1\].name.*no callable 'missing'"):
        RewardPool(_cfg([{"name": "math"}, {"name": f"{custom_module}:missing"}], num_workers=1))
    with pytest.raises(RewardSetupError, match="cannot import module 'no_such_module_xyz'"):
        RewardPool(_cfg([{"name": "no_such_module_xyz:f"}], num_workers=0))


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"rewards.terms\[0\].name"):
        _cfg([{"name": "not a path"}])
    with pytest.raises(ConfigError, match=r"rewards.terms\[1\].key"):
        _cfg([{"name": "a.b:f"}, {"name": "c.d:f"}])
    with pytest.raises(ConfigError, match=r"rewards.math.format_regex"):
        build(RewardConfig, {"math": {"format_weight": 0.2}}, "rewards")
    with pytest.raises(ConfigError, match=r"rewards.code.sandbox.memory_mb"):
        build(RewardConfig, {"code": {"sandbox": {"memory_mb": 8}}}, "rewards")


def test_hostile_code_through_the_pool_leaves_workers_alive():
    cfg = build(RewardConfig, {"terms": [{"name": "code"}], "num_workers": 2, "timeout_s": 20,
                               "code": {"sandbox": FAST_SANDBOX}}, "rewards")
    tests = {"inputs": ["2 3\n"], "outputs": ["5\n"]}
    hostile = [
        "while True: pass",
        "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass",
        "x = bytearray(10**10)",
        "import sys\nwhile True: sys.stdout.write('z' * 65536)",
        "import os, signal\nfor p in (os.getppid(), 1, -1):\n    try: os.kill(p, signal.SIGKILL)\n    except OSError: pass",
        "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)\nprint(5)",
    ]
    good = "a, b = map(int, input().split())\nprint(a + b)"
    with RewardPool(cfg) as pool:
        pids = pool.worker_pids
        rewards, metrics = pool.score([({"tests": tests}, code_block(src)) for src in hostile + [good]])
        assert rewards == [0.0] * len(hostile) + [1.0]
        assert metrics["rewards/errors"] == 0 and metrics["rewards/worker_restarts"] == 0
        assert pool.worker_pids == pids  # no worker was killed by what the code did
        assert sandbox_uid_processes(SandboxConfig()) == []


def test_score_after_close_raises(custom_module):
    pool = RewardPool(_cfg([{"name": f"{custom_module}:length"}], num_workers=1))
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        pool.score([({}, "x")])


def test_a_worker_killed_from_outside_is_replaced_and_the_run_goes_on(custom_module):
    """What the OOM killer does: SIGKILL a worker between batches (idle: the next send meets a broken pipe)
    and during a batch (the response it was on scores 0 and is counted); scoring never raises."""
    import signal

    cfg = _cfg([{"name": f"{custom_module}:flaky"}], num_workers=2, timeout_s=5.0)
    with RewardPool(cfg) as pool:
        assert pool.score([({}, "ok")] * 4)[0] == [1.0] * 4
        for pid in pool.worker_pids:  # both idle workers die
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        rewards, metrics = pool.score([({}, "ok")] * 6)
        assert rewards == [1.0] * 6  # an idle worker had no response: nothing is lost
        assert metrics["rewards/worker_restarts"] >= 1 and metrics["rewards/errors"] == 0
        # mid-batch: a response that sleeps long enough to be killed on
        def kill_soon():
            time.sleep(1.0)
            for pid in pool.worker_pids:
                os.kill(pid, signal.SIGKILL)

        import threading

        killer = threading.Thread(target=kill_soon)
        killer.start()
        rewards, metrics = pool.score([({}, "sleep"), ({}, "sleep")])
        killer.join()
        assert rewards == [0.0, 0.0]
        assert metrics["rewards/flaky/errors"] == 2 and metrics["rewards/flaky/timeouts"] == 0
        assert metrics["rewards/worker_restarts"] == 2
        assert pool.score([({}, "ok")] * 3)[0] == [1.0] * 3


CORRECTNESS = textwrap.dedent('''
    from gspo_megatron.rewards.types import Verdict

    def ten_scale(sample, response):
        return float(response)

    def judged(sample, response):
        return Verdict(float(response), correct=response == "7")
''')


def test_correctness_comes_from_the_verdict_or_the_declared_range(tmp_path, monkeypatch):
    """A 0-10 reward: undeclared, it judges no correctness (never 'reward >= 1'); declared [0, 10], 10 is
    correct and 11 is refused naming the term; a Verdict's own correct decides; a weight-0 term does not."""
    (tmp_path / "gspo_test_correct.py").write_text(CORRECTNESS)
    monkeypatch.syspath_prepend(str(tmp_path))
    batch = [({}, "3"), ({}, "10"), ({}, "11"), ({}, "7")]
    with RewardPool(_cfg([{"name": "gspo_test_correct:ten_scale"}], num_workers=0)) as pool:
        scores = pool.score_verdicts(batch)
    assert scores.rewards == [3.0, 10.0, 11.0, 7.0] and scores.correct == [None] * 4
    with RewardPool(_cfg([{"name": "gspo_test_correct:ten_scale", "range": [0, 10]}], num_workers=0)) as pool:
        scores = pool.score_verdicts(batch)
        assert scores.rewards == [3.0, 10.0, 0.0, 7.0] and scores.correct == [False, True, False, False]
        assert scores.metrics["rewards/ten_scale/out_of_range"] == 1 and scores.metrics["rewards/errors"] == 1
        assert "reward 11 outside rewards.terms[0].range [0, 10] of term 'ten_scale'" in pool.recent_errors[-1]
    terms = [{"name": "gspo_test_correct:judged", "range": [0, 10]}, {"name": "gspo_test_correct:ten_scale", "weight": 0}]
    with RewardPool(_cfg(terms, num_workers=0)) as pool:
        assert pool.score_verdicts(batch).correct == [False, False, False, True]
    with RewardPool(_cfg([{"name": "synthetic"}], num_workers=0)) as pool:
        # a built-in says so itself, and scores in [0, 1]
        sample = {"answer": "1 2 3", "meta": {"task": "sort"}}
        assert pool.score_verdicts([(sample, "x"), (sample, "1 2 3")]).correct == [False, True]
    with pytest.raises(ConfigError, match=r"rewards.terms\[0\].range: must be \[low, high\] with low < high"):
        _cfg([{"name": "a.b:f", "range": [1, 0]}])


def test_a_0_to_10_reward_does_not_report_wrong_answers_as_accurate(tmp_path, monkeypatch):
    """The trainer's metrics from the pool's verdicts: wrong answers scoring 3 and 7 on a 0-10 scale (>= 1,
    which `reward >= 1.0` counted as correct: eval accuracy 1.0 for an untrained model) give no accuracy,
    eval_accuracy or pass@k when the range is undeclared, and 0.0 once it is declared."""
    import torch

    from gspo_megatron.rollout.base import Sample
    from gspo_megatron.trainer.components import any_correct, fraction
    from gspo_megatron.trainer.loop import _batch_metrics
    from gspo_megatron.trainer.schedule.base import RolloutGroup

    (tmp_path / "gspo_test_correct.py").write_text(CORRECTNESS)
    monkeypatch.syspath_prepend(str(tmp_path))
    responses = [["3", "7"], ["7", "3"]]  # 2 prompts x 2 samples, all wrong (10 is right)
    for term, accuracy in [({"name": "gspo_test_correct:ten_scale"}, None),
                           ({"name": "gspo_test_correct:ten_scale", "range": [0, 10]}, 0.0)]:
        with RewardPool(_cfg([term], num_workers=0)) as pool:
            scores = pool.score_verdicts([({}, r) for group in responses for r in group])
        assert scores.rewards == [3.0, 7.0, 7.0, 3.0]
        batch = [RolloutGroup({}, [Sample(i, [1, 2], [-0.5, -0.5], "stop") for _ in group],
                              scores.rewards[2 * i:2 * i + 2], scores.correct[2 * i:2 * i + 2])
                 for i, group in enumerate(responses)]
        metrics = _batch_metrics(batch, torch.tensor(scores.rewards).view(2, 2), torch.zeros(2, dtype=torch.bool))
        assert metrics.get("accuracy") == accuracy and metrics["reward_mean"] == 5.0
        # Trainer.evaluate's two: greedy pass@1 (the first sample) and pass@k (any of the group)
        assert fraction([g.verdicts[0] for g in batch]) == accuracy
        assert fraction([any_correct(g.verdicts) for g in batch]) == accuracy


@pytest.mark.parametrize("field, value", [("weight", ".nan"), ("weight", ".inf")])
def test_non_finite_reward_settings_are_refused(field, value):
    import yaml

    with pytest.raises(ConfigError, match=rf"rewards.terms\[0\].{field}: must be a finite number"):
        _cfg([{"name": "math", field: yaml.safe_load(value)}])


@pytest.mark.timeout(60)
def test_an_in_process_reward_that_sleeps_times_out(custom_module):
    """num_workers: 0 (the demos' setting): a reward still running at timeout_s is interrupted in the calling
    process, scores 0 and is counted as a timeout; the other responses score as usual."""
    cfg = _cfg([{"name": f"{custom_module}:flaky"}], num_workers=0, timeout_s=0.5)
    start = time.monotonic()
    with RewardPool(cfg) as pool:
        rewards, metrics = pool.score([({}, "ok"), ({}, "sleep"), ({}, "ok")])
    assert time.monotonic() - start < 5
    assert rewards == [1.0, 0.0, 1.0] and metrics["rewards/flaky/timeouts"] == 1


@pytest.mark.timeout(60)
def test_a_stop_signal_ends_in_process_rewards_and_reaches_the_trainers_flag(custom_module):
    """SIGTERM while an in-process reward sleeps: the trainer's preemption flag records it (the run saves and
    exits after the step) and the batch's remaining in-process rewards are cut short, not waited for."""
    import signal
    import threading

    from gspo_megatron.trainer.preemption import PreemptionFlag

    cfg = _cfg([{"name": f"{custom_module}:flaky"}], num_workers=0, timeout_s=30)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    with PreemptionFlag() as flag, RewardPool(cfg) as pool:
        start = time.monotonic()
        timer.start()
        rewards, metrics = pool.score([({}, "ok"), ({}, "sleep"), ({}, "sleep"), ({}, "ok")])
        elapsed = time.monotonic() - start
    assert flag.requested and flag.signal_name == "SIGTERM"
    assert elapsed < 5 and rewards == [1.0, 0.0, 0.0, 0.0] and metrics["rewards/flaky/timeouts"] == 3


@pytest.mark.timeout(60)
def test_an_in_process_code_reward_cut_by_its_deadline_leaves_no_sandbox(tmp_path):
    """num_workers: 0 with the code reward: a program that sleeps past rewards.timeout_s is interrupted in the
    calling process, and its sandbox (launcher, init and program, under a sandbox uid) goes with it."""
    sandbox = {**FAST_SANDBOX, "case_timeout_s": 30, "cpu_time_s": 30}
    cfg = _cfg([{"name": "code"}], num_workers=0, timeout_s=1.0, code={"sandbox": sandbox})
    sample = {"tests": {"inputs": [""], "outputs": ["1"]}}
    with RewardPool(cfg) as pool:
        start = time.monotonic()
        rewards, metrics = pool.score([(sample, code_block("import time\ntime.sleep(25)\nprint(1)"))])
        assert time.monotonic() - start < 10
    assert rewards == [0.0] and metrics["rewards/code/timeouts"] == 1
    left, deadline = sandbox_uid_processes(build(SandboxConfig, sandbox, "sandbox")), time.monotonic() + 3
    while left and time.monotonic() < deadline:  # init's death signal and the namespace teardown are asynchronous
        time.sleep(0.05)
        left = sandbox_uid_processes(build(SandboxConfig, sandbox, "sandbox"))
    assert left == []


@pytest.mark.parametrize("num_workers", [0, 2])
def test_what_a_reward_prints_is_capped_per_batch_with_a_marker(num_workers):
    """A reward printing 8 MB per response wrote gigabytes of log: a batch's prints reach the log up to
    ``rewards.max_print_bytes``, then one line says how much was cut (and the metrics count it)."""
    import subprocess
    import sys

    script = ("from gspo_megatron.rewards.config import RewardConfig, RewardTermConfig\n"
              "from gspo_megatron.rewards.pool import RewardPool\n"
              f"cfg = RewardConfig(terms=[RewardTermConfig('tests.reliability.failing_reward:loud')], "
              f"num_workers={num_workers}, max_print_bytes=10000)\n"
              "with RewardPool(cfg) as pool:\n"
              "    for _ in range(2):\n"
              "        rewards, metrics = pool.score([({'answer': '1'}, 'r')] * 4)\n"
              "        assert rewards == [1.0] * 4, rewards\n"
              "        print('cut', int(metrics['rewards/print_cut_bytes']), flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stdout + proc.stderr
    assert len(printed) < 2 * (10000 + 200), len(printed)  # two batches, each its cap and one marker line
    cuts = [int(line.split()[1]) for line in proc.stdout.decode().splitlines() if line.startswith("cut ")]
    assert cuts == [4 * (8 << 20) + 8 - 10000] * 2, cuts
    assert printed.count(f"{cuts[0]} more bytes of the reward functions' output cut (rewards.max_print_bytes="
                         f"10000)".encode()) == 2
