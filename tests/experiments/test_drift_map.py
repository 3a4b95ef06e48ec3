"""The drift map at CI size: two tiny points train through the real CLI (warm start, then GRPO steps each
reading the routing drift), the results file holds the per-layer drift and the ratio spreads, a second
``run`` runs nothing again, and ``report`` draws the figures and rewrites the docs block."""
import json
import math
from pathlib import Path

import pytest

from gspo_megatron.testing.experiment_runs import load_script
from tests.runs import rerun_then_report

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "experiments" / "drift_map.py"


def test_the_power_law_fit_recovers_its_exponent():
    driver = load_script(SCRIPT)
    a, b = driver.fit_log_linear([2, 4, 8, 16], [0.01 * x ** 0.5 for x in (2, 4, 8, 16)])
    assert (math.exp(a), b) == (pytest.approx(0.01), pytest.approx(0.5))


@pytest.mark.slow
def test_drift_map_pipeline_at_ci_scale(tmp_path):
    driver = load_script(SCRIPT)
    results = tmp_path / "results.json"
    argv = ["run", "--scale", "ci", "--out", str(tmp_path / "runs"), "--results", str(results)]
    driver.main(argv)
    data = json.loads(results.read_text())
    points = data["points"]
    assert sorted(points) == sorted(data["axes"]["depth"])
    for entry in points.values():
        run = entry["seeds"]["0"]
        assert len(run["per_layer"]) == entry["point"]["layers"]
        assert len(run["drift_per_step"]) == 2 and all(0.0 <= d <= 1.0 for d in run["drift_per_step"])
        assert run["token_ratio_spread"] >= 0 and run["seq_ratio_spread"] >= 0
    # everything is in the results file: nothing runs again
    text = rerun_then_report(driver, argv, results, tmp_path)
    assert "| depth | 2 | 4 | 2 |" in text
    assert all((tmp_path / "fig" / f).is_file() for f in ("drift_by_axis.png", "drift_per_layer.png", "ratio_spread.png"))


def test_a_point_that_does_not_run_is_recorded_reported_and_tried_again(tmp_path, monkeypatch):
    """A setting the trainer refuses (here 0 layers) does not stop the map: its error is kept in the results
    file, the report names it, and the next ``run`` tries it again."""
    driver = load_script(SCRIPT)
    monkeypatch.setitem(driver.SCALES["ci"], "axes", {"depth": [driver.point(0, 4, 2, warm=0)]})
    results = tmp_path / "results.json"
    argv = ["run", "--scale", "ci", "--out", str(tmp_path / "runs"), "--results", str(results)]
    driver.main(argv)
    (entry,) = json.loads(results.read_text())["points"].values()
    assert "num_layers" in entry["seeds"]["0"]["failed"]
    stamp = results.stat().st_mtime_ns
    driver.main(argv)
    assert results.stat().st_mtime_ns != stamp  # tried again, rewritten
    block = driver.doc_block(json.loads(results.read_text()), {}, "fig")
    assert "Runs that failed" in block and "L0_E4_k2" in block
