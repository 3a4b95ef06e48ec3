"""The shipped judge demo (examples/cpu_demo_judge.yaml) end to end with the judge its script makes: the run goes
through its steps with some verdicts parsed and some malformed (counted, not fatal), and the judge's scores do
not depend on how its prompts are batched."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_megatron.testing.experiment_runs import load_script

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "cpu_demo_judge.yaml"
STEPS = 3


def _run(run_dir: Path, judge: Path, *extra: str) -> list[dict]:
    cmd = [sys.executable, "-m", "gspo_megatron.cli", "train", "--config", str(CONFIG), "--run-dir", str(run_dir),
           f"train.steps={STEPS}", "eval.every_steps=0", "checkpoint.every_steps=0", "logging.console=false",
           f"rewards.terms[1].judge.path={judge}", *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_judge_demo_counts_malformed_verdicts_goes_on_and_batches_without_changing_verdicts(tmp_path):
    judge = tmp_path / "judge"
    made = load_script(REPO / "examples" / "make_demo_judge.py").main(["--out", str(judge)])
    assert 0.5 < made["eval_parsed_fraction"] < 1.0  # the script's own check: it answers in the format, mostly
    shipped = _run(tmp_path / "a", judge)
    one_by_five = _run(tmp_path / "b", judge, "rewards.terms[1].judge.batch_size=5")
    steps = [m for m in shipped if m["step"] > 0]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    errors = sum(m["reward/judge/errors"] for m in steps)
    responses = sum(m["reward/responses"] for m in steps)
    # some verdicts are malformed ("unsure"), most are scores; each malformed one is a counted reward failure
    assert 0 < errors < responses / 2
    assert steps[-1]["faults/reward_failures"] - steps[0]["faults/reward_failures"] == sum(
        m["reward/judge/errors"] for m in steps[1:])
    # batch size 5 instead of 32: the same greedy verdicts, so the same scores and failures at every step
    keys = ("reward/judge/mean", "reward/judge/errors", "reward_mean", "accuracy")
    assert [[m[k] for k in keys] for m in steps] == [[m[k] for k in keys] for m in one_by_five if m["step"] > 0]
