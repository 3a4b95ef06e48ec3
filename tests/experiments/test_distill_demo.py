"""The distillation demonstration at CI size: the teacher, a student warm start and the three arms train
through the real CLI for a few steps, the results file holds every run, and ``report`` draws the figure."""
import json
from pathlib import Path

import pytest

from gspo_megatron.testing.experiment_runs import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "experiments" / "distill_demo.py"


def _driver():
    return load_script(SCRIPT)


@pytest.mark.slow
def test_distill_demo_pipeline_at_ci_scale(tmp_path):
    driver = _driver()
    results = tmp_path / "results.json"
    driver.main(["run", "--scale", "ci", "--out", str(tmp_path / "runs"), "--results", str(results)])
    data = json.loads(results.read_text())
    assert set(data["runs"]) == set(driver.ARMS)
    for arm, runs in data["runs"].items():
        run = runs["0"]
        assert run["steps"] == [0, 1, 2]
        kl = [v for v in run["distill_kl_mean"] if v is not None]
        assert (len(kl) == 2) == (arm != "gspo"), arm  # the teacher's KL is logged where it is in the loss
    doc = tmp_path / "page.md"
    doc.write_text(f"before\n{driver.BEGIN}\nold\n{driver.END}\nafter\n")
    driver.main(["report", "--results", str(results), "--figures", str(tmp_path / "fig"), "--doc", str(doc)])
    assert (tmp_path / "fig" / "accuracy.png").is_file()
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    assert all(f"| {arm} | " in text for arm in driver.ARMS)
