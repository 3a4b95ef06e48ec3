"""The GSPO-vs-GRPO reproduction at CI size: two of its arms (GSPO, and GRPO + R3, the one that replays the
engine's experts) train through the real CLI for 2 steps of a shrunken model, the results file holds every run's per-step
metrics, and ``report`` regenerates the figures and the docs block from that file alone. Also: the block
shipped in docs/training.md is exactly what ``report`` makes of the shipped results file (no number in
the docs is copied by hand)."""
import json
from pathlib import Path

import pytest

from gspo_megatron.testing.experiment_runs import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "experiments" / "gspo_vs_grpo.py"


def _driver():
    return load_script(SCRIPT)


def _block(text, driver):
    return driver.BEGIN + text.split(driver.BEGIN)[1].split(driver.END)[0] + driver.END


def test_shipped_docs_block_is_generated_from_the_shipped_results():
    driver = _driver()
    data = json.loads(driver.RESULTS.read_text())
    rel = "figures/gspo_vs_grpo"
    expected = driver.doc_block(data, driver.summarise(data), rel)
    assert _block(driver.DOC.read_text(), driver) == expected
    for name in driver.FIGURE_NAMES:
        assert (driver.FIGURES / f"{name}.png").is_file()


# Each arm is one CLI process (~1 minute of CI on 2 cores); the other arms' settings (GRPO alone, R2,
# GSPO-token) are trainer options with their own tests, and all five ran at full scale (docs/training.md).
CI_ARMS = ["gspo", "grpo_r3"]


@pytest.mark.slow
def test_ci_scale_runs_two_arms_and_reports(tmp_path):
    driver = _driver()
    results = tmp_path / "results.json"
    data = driver.run("ci", tmp_path / "runs", results, CI_ARMS, None, [])
    assert json.loads(results.read_text()) == json.loads(json.dumps(data))
    assert sorted(data["runs"]) == sorted(CI_ARMS)
    warm = data["warm_start"]["0"]
    assert warm["steps"] == [0] and warm["eval_accuracy"][0] is not None
    for arm, runs in data["runs"].items():
        run = runs["0"]
        assert run["steps"] == [0, 1, 2], arm
        # every arm starts from the seed's one warm start: the same weights, the same greedy evaluation
        assert run["eval_accuracy"][0] == warm["eval_accuracy"][0], arm
        assert run["eval_accuracy"][0] is not None and run["eval_accuracy"][2] is not None
        assert all(run[k][1] is not None for k in ("reward_mean", "clip_frac_token", "routing_drift",
                                                    "routing_drift_set", "logprob_gap_mean")), arm
        assert run["response_length_mean"][1] > 1
    doc = tmp_path / "training.md"
    doc.write_text(f"before\n{driver.BEGIN}\nold\n{driver.END}\nafter\n")
    summary = driver.report(results, tmp_path / "figures", doc)
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("\nafter\n") and "\nold\n" not in text
    for arm in CI_ARMS:
        assert f"| {arm} | {driver._fmt(summary[arm]['eval_start'])} -> " in text
    assert sorted(p.name for p in (tmp_path / "figures").iterdir()) == sorted(f"{n}.png" for n in driver.FIGURE_NAMES)

    # an interrupted run continues: what the results file holds is not run again
    (tmp_path / "runs" / "gspo" / "seed0" / "metrics.jsonl").unlink()
    again = driver.run("ci", tmp_path / "runs", results, CI_ARMS, None, [])
    assert again == data
