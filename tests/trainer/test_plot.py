"""`gspo-megatron plot`: PNGs for overlaid runs, sparse eval series, errors for folders without metrics."""
from __future__ import annotations

import json

import pytest

from gspo_megatron.trainer import plot
from gspo_megatron.trainer.metrics_log import MetricsFileError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _make_run(path, scale: float, with_drift: bool) -> None:
    path.mkdir(parents=True)
    lines = [{"step": 0, "eval_accuracy": 0.1 * scale}]
    for step in range(1, 8):
        record = {"step": step, "reward_mean": scale * step / 8, "accuracy": step / 10,
                  "clip_frac_seq": 0.03 * step, "clip_frac_token": 0.003, "logprob_gap_mean": 0.003}
        if with_drift:
            record["routing_drift"] = 0.05 * step
        if step % 4 == 0:
            record["eval_accuracy"] = 0.2 * scale
        lines.append(record)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def _assert_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert len(data) > 5000, (path, len(data))


def test_plot_two_runs_overlaid(tmp_path):
    a, b = tmp_path / "run_a", tmp_path / "run_b"
    _make_run(a, 1.0, with_drift=True)
    _make_run(b, 2.0, with_drift=False)
    written = plot.plot_runs([a, b])
    names = [p.name for p in written]
    assert names == ["reward.png", "accuracy.png", "clip_fraction.png", "routing_drift.png", "logprob_gap.png",
                     "overview.png"]
    assert all(p.parent == a / "plots" for p in written)
    for path in written:
        _assert_png(path)
    assert not list((a / "plots").glob(".*tmp"))


def test_series_keeps_sparse_eval_and_the_last_value_of_a_repeated_step(tmp_path):
    records = [{"step": 1, "clip_frac_seq": 0.75}, {"step": 2, "eval_accuracy": 0.5},
               {"step": 3, "clip_frac_seq": 0.5}, {"step": 3, "clip_frac_seq": 0.125}]
    assert plot.series(records, "clip_frac_seq") == ([1, 3], [0.75, 0.125])
    assert plot.series(records, "eval_accuracy") == ([2], [0.5])


def test_missing_metrics_file_errors(tmp_path):
    a = tmp_path / "a"
    _make_run(a, 1.0, with_drift=True)
    empty = tmp_path / "not_a_run"
    empty.mkdir()
    with pytest.raises(MetricsFileError, match=r"not_a_run: no metrics.jsonl"):
        plot.plot_runs([a, empty])


def test_main_prints_paths_and_skips_group_absent_everywhere(tmp_path, capsys):
    a = tmp_path / "a"
    _make_run(a, 1.0, with_drift=False)
    assert plot.main([str(a), "--out", str(tmp_path / "o")]) == 0
    printed = capsys.readouterr().out.split()
    assert [p.rsplit("/", 1)[-1] for p in printed] == ["reward.png", "accuracy.png", "clip_fraction.png",
                                                       "logprob_gap.png", "overview.png"]
    assert all(p.startswith(str(tmp_path / "o")) for p in printed)
    _assert_png(tmp_path / "o" / "overview.png")


def test_main_reports_missing_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        plot.main([str(tmp_path / "missing")])
    assert exc.value.code == 2
    assert "missing: no metrics.jsonl" in capsys.readouterr().err


def test_cli_plot_subcommand_passes_arguments(tmp_path, monkeypatch, capsys):
    from gspo_megatron.cli import main as cli_main

    calls = []
    monkeypatch.setattr(plot, "plot_runs", lambda dirs, out: calls.append((dirs, out)) or [out / "overview.png"])
    assert cli_main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "o")]) == 0
    assert calls == [([tmp_path / "a", tmp_path / "b"], tmp_path / "o")]
    assert str(tmp_path / "o" / "overview.png") in capsys.readouterr().out


def test_length_pass_at_k_and_timing_charts_with_integer_step_ticks(tmp_path):
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": s, "response_length_mean": 5.0 + s, "time_step_s": 0.5, "time_rollout_s": 0.2,
                "eval_pass@4": 0.1 * s, "routing_drift": 0.01} for s in range(3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    names = [p.name for p in plot.plot_runs([run])]
    assert names == ["routing_drift.png", "response_length.png", "pass_at_k.png", "timings.png", "overview.png"]
    runs = [plot.Run("run", plot.load_run(run))]
    ax = Figure().add_subplot(1, 1, 1)
    group = next(g for g in plot.GROUPS if g.file == "pass_at_k")
    assert plot._draw_panel(ax, group, runs) and ax.get_title() == "Held-out pass@4"
    assert isinstance(ax.xaxis.get_major_locator(), MaxNLocator)
    assert all(float(t).is_integer() for t in ax.get_xticks())
    drift = Figure().add_subplot(1, 1, 1)
    plot._draw_panel(drift, next(g for g in plot.GROUPS if g.file == "routing_drift"), runs)
    assert drift.get_ylabel() == "fraction of activated experts changed"


def test_per_layer_agreement_panel_draws_every_logged_layer_in_order(tmp_path):
    run = tmp_path / "auto"
    run.mkdir()
    records = [{"step": s, "routing_agreement": 0.9 - 0.1 * s, "routing_replay_active": float(s >= 2),
                "routing_agreement/layer0": 0.95 - 0.1 * s, "routing_agreement/layer10": 0.85 - 0.1 * s,
                "routing_agreement/layer2": 0.9, "routing_agreement/layerx": 1.0} for s in range(4)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    group = next(g for g in plot.GROUPS if g.file == "routing_agreement_layers")
    assert plot.metrics_of(group, [plot.Run("auto", records)]) == [
        "routing_agreement/layer0", "routing_agreement/layer2", "routing_agreement/layer10"]
    names = [p.name for p in plot.plot_runs([run])]
    assert names == ["routing_agreement.png", "routing_agreement_layers.png", "overview.png"]
    for path in (run / "plots").glob("*.png"):
        _assert_png(path)


def test_warm_start_loss_gets_its_chart_by_sft_step(tmp_path):
    """sft_metrics.jsonl (the warm start, before RL step 1) is drawn against its own steps; a run without a warm
    start gets no such chart."""
    a, b = tmp_path / "warm", tmp_path / "cold"
    _make_run(a, 1.0, with_drift=False)
    _make_run(b, 1.0, with_drift=False)
    (a / "sft_metrics.jsonl").write_text("".join(json.dumps({"step": s, "sft_loss": 3.0 / s}) + "\n"
                                                 for s in range(1, 41)))
    written = plot.plot_runs([a])
    assert [p.name for p in written][-2:] == ["warm_start_loss.png", "overview.png"]
    _assert_png(a / "plots" / "warm_start_loss.png")
    group = next(g for g in plot.GROUPS if g.file == "warm_start_loss")
    run = plot.Run("warm", plot.load_run(a), plot.load_warm_start(a))
    assert plot.series(run.records_of(group), "sft_loss") == (list(range(1, 41)), [3.0 / s for s in range(1, 41)])
    assert plot.series(run.records, "sft_loss") == ([], [])  # RL steps hold no warm-start loss
    assert "warm_start_loss.png" not in [p.name for p in plot.plot_runs([b])]


def _panel(tmp_path, file: str, records: list[dict], runs: int = 1):
    """The axes of group ``file`` drawn for ``runs`` runs holding ``records`` (each run's copy under its name)."""
    from matplotlib.figure import Figure

    group = next(g for g in plot.GROUPS if g.file == file)
    ax = Figure().add_subplot(1, 1, 1)
    assert plot._draw_panel(ax, group, [plot.Run(f"run{i}", records) for i in range(runs)])
    return ax


def test_single_run_series_differ_in_colour_and_dash(tmp_path):
    """One run's timings: every series its own colour and its own dash, so two solid lines never look alike."""
    from matplotlib.colors import to_hex

    records = [{"step": s, "time_step_s": 1.0, "time_rollout_s": 0.5, "time_logprobs_s": 0.2, "time_update_s": 0.2,
                "time_sync_s": 0.1} for s in range(3)]
    lines = _panel(tmp_path, "timings", records).get_lines()
    assert len(lines) == 5
    assert len({to_hex(line.get_color()) for line in lines}) == 5
    assert len({str(line.get_linestyle()) for line in lines}) >= 4  # matplotlib has four named dash styles


def test_pass_at_k_title_says_k_and_legends_show_readable_names(tmp_path):
    records = [{"step": s, "eval_pass@4": 0.1 * s, "clip_frac_seq": 0.1, "clip_frac_token": 0.01,
                "routing_agreement/layer0": 0.9, "routing_agreement/layer12": 0.8} for s in range(3)]
    assert _panel(tmp_path, "pass_at_k", records).get_title() == "Held-out pass@4"
    legend = [t.get_text() for t in _panel(tmp_path, "clip_fraction", records).get_legend().get_texts()]
    assert legend == ["sequences clipped", "tokens clipped"]
    two_runs = [t.get_text() for t in _panel(tmp_path, "clip_fraction", records, runs=2).get_legend().get_texts()]
    assert two_runs == ["run0: sequences clipped", "run0: tokens clipped", "run1: sequences clipped",
                        "run1: tokens clipped"]
    layers = [t.get_text() for t in _panel(tmp_path, "routing_agreement_layers", records).get_legend().get_texts()]
    assert layers == ["layer 0", "layer 12"]


def test_every_plotted_metric_has_a_readable_name():
    """No legend shows a raw key: each group's metrics has a name without underscores."""
    for group in plot.GROUPS:
        for metric in group.metrics:
            name = plot.metric_name(metric.rstrip("*") + ("4" if metric.endswith("*") else ""))
            assert name != metric and "_" not in name, (group.file, metric, name)
