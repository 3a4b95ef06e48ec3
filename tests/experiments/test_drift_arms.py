"""The arms at the drift map's regimes at CI size: every arm at every regime trains through the real CLI from one
shared warm start (two runs at a time), the results file holds their per-step metrics, a second ``run`` runs
nothing again, ``report`` draws the figures and rewrites the docs block; the collapse rule on made-up reward
curves; and the block shipped in docs/training.md is what ``report`` makes of the shipped results file."""
import json
from pathlib import Path

import pytest

from gspo_megatron.testing.experiment_runs import load_script
from tests.runs import rerun_then_report

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "experiments" / "drift_arms.py"


@pytest.mark.parametrize("rewards, expected", [
    ([0.4, 0.1, 0.0] + [0.0] * 9, (True, 2)),             # half of step 1's 0.4 is 0.2: below it from step 2 on
    ([0.4, 0.3, 0.1, 0.3, 0.25] + [0.1] * 7, (True, 6)),  # dips at step 3, recovers, then stays below from step 6
    ([0.4, 0.1, 0.1, 0.1] + [0.5] * 8, (False, None)),    # dips, then recovers: not a collapse at the end
    ([0.4] * 12, (False, None)),
    ([0.4, 0.0, 0.0], (False, None)),                    # too short to judge
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
    # everything is in the results file: nothing runs again
    text = rerun_then_report(driver, argv, results, tmp_path)
    assert "**Regime `paper_drift`** (lr 0.003" in text and "| sapo | 1 | 0 |" in text
    assert all((tmp_path / "fig" / regime / "reward.png").is_file() for regime in driver.REGIMES)



def test_shipped_docs_block_is_generated_from_the_shipped_results():
    driver = load_script(SCRIPT)
    data = json.loads(driver.RESULTS.read_text())
    block = driver.doc_block(data, driver.summarise(data), "figures/drift_arms")
    text = driver.DOC.read_text()
    assert driver.BEGIN + text.split(driver.BEGIN)[1].split(driver.END)[0] + driver.END == block
