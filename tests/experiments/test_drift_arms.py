"""The arms at the drift map's regimes at CI size: every arm at both regimes trains through the real CLI from one
shared warm start (two runs at a time), the results file holds their per-step metrics, a second ``run`` runs
nothing again, ``report`` draws the figures and rewrites the docs block; the collapse rule on made-up reward
curves; and the block shipped in docs/training.md is what ``report`` makes of the shipped results file."""
import json
from pathlib import Path

import pytest

from gspo_megatron.testing.experiment_runs import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "experiments" / "drift_arms.py"


@pytest.mark.parametrize("rewards, expected", [
    ([0.4] * 10 + [0.3] * 20 + [0.0] * 10, (True, 34)),   # falls below 0.2 for good: collapsed at step 34
    ([0.4] * 10 + [0.1] * 10 + [0.5] * 20, (False, 17)),  # dips, then recovers: not a collapse at the end
    ([0.4] * 40, (False, None)),
    ([0.4] * 15, (False, None)),                          # too short to judge
])
def test_collapse_rule(rewards, expected):
    assert load_script(SCRIPT).collapse(rewards) == expected


@pytest.mark.slow
def test_drift_arms_pipeline_at_ci_scale(tmp_path):
    driver = load_script(SCRIPT)
    results = tmp_path / "results.json"
    argv = ["run", "--scale", "ci", "--out", str(tmp_path / "runs"), "--results", str(results), "--jobs", "2",
            "--arms", "gspo", "grpo_r3", "sapo"]
    driver.main(argv)
    data = json.loads(results.read_text())
    assert sorted(data["runs"]) == sorted(driver.REGIMES)
    for arms in data["runs"].values():
        assert sorted(arms) == ["grpo_r3", "gspo", "sapo"]
        for run in (r["0"] for r in arms.values()):
            assert run["steps"][-1] == 2 and run["eval_accuracy"][0] is not None
            assert all(0.0 <= d <= 1.0 for s, d in zip(run["steps"], run["routing_drift"]) if s > 0)
    # one warm start for the seed, and the arms started from it: the same step-0 evaluation everywhere
    starts = {r["0"]["eval_accuracy"][0] for arms in data["runs"].values() for r in arms.values()}
    assert starts == {data["warm_start"]["0"]["eval_accuracy"][0]}
    stamp = results.stat().st_mtime_ns
    driver.main(argv)  # everything is in the results file: nothing runs, nothing is rewritten
    assert results.stat().st_mtime_ns == stamp
    doc = tmp_path / "page.md"
    doc.write_text(f"before\n{driver.BEGIN}\nold\n{driver.END}\nafter\n")
    driver.main(["report", "--results", str(results), "--figures", str(tmp_path / "fig"), "--doc", str(doc)])
    text = doc.read_text()
    assert "old" not in text and "**Regime `paper_drift`** (lr 0.003" in text and "| sapo | 1 | 0 |" in text
    assert all((tmp_path / "fig" / regime / "reward.png").is_file() for regime in driver.REGIMES)

