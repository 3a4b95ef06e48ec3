"""metrics.jsonl writing, truncation on resume, reading with a partial or corrupt line, TensorBoard events."""
from __future__ import annotations

import json
import sys

import pytest

from gspo_megatron.trainer.metrics_log import MetricsFileError, MetricsLogger, read_metrics, truncate_after


def _write_lines(path, lines: list[str]) -> None:
    path.write_text("".join(lines), encoding="utf-8")


def _tb_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_logger_writes_jsonl_and_tensorboard(tmp_path):
    steps = {0: {"eval_accuracy": 0.25}, 1: {"reward_mean": 0.5, "accuracy": 0.125}, 2: {"reward_mean": 0.75}}
    with MetricsLogger(tmp_path, enabled=True, tensorboard=True, total_steps=2, console=False) as logger:
        for step, metrics in steps.items():
            logger.log(step, metrics)
        # each line is on disk before log() returns (no buffering until close)
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": s, **m} for s, m in steps.items()]
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events)
    scalars = _tb_scalars(tmp_path / "tensorboard")
    assert scalars["reward_mean"] == [(1, 0.5), (2, 0.75)]
    assert scalars["eval_accuracy"] == [(0, 0.25)]


def test_disabled_logger_writes_nothing(tmp_path):
    run = tmp_path / "run"
    with MetricsLogger(run, enabled=False, tensorboard=True, console=True) as logger:
        logger.log(1, {"reward_mean": 1.0})
    assert not run.exists()


def test_logger_rejects_non_numbers_and_step_key(tmp_path):
    import torch

    with MetricsLogger(tmp_path, enabled=True, tensorboard=False, console=False) as logger:
        with pytest.raises(TypeError, match="reward_mean.*Tensor"):
            logger.log(1, {"reward_mean": torch.tensor(1.0)})
        with pytest.raises(ValueError, match="'step' is reserved"):
            logger.log(1, {"step": 3.0})


def test_console_line_when_not_a_terminal(tmp_path, capsys):
    with MetricsLogger(tmp_path, enabled=True, tensorboard=False, total_steps=4, console=True) as logger:
        logger.log(1, {"reward_mean": 0.5, "eval_accuracy": 0.25, "other": 3.0})
        logger.log(2, {"reward_mean": 0.75})
    legend, *out = capsys.readouterr().out.splitlines()
    # the short column names and the @N mark are explained once, above the first line
    assert legend.startswith("columns: ") and "logp gap = " in legend and "'v@N' = the value from step N" in legend
    assert out[0].startswith("step 1/4") and "reward 0.5" in out[0] and "eval acc 0.25" in out[0]
    # a value from an earlier step is marked with its step
    assert "reward 0.75" in out[1] and "eval acc 0.25@1" in out[1] and len(out) == 2


def test_truncate_after_keeps_steps_up_to_resume(tmp_path):
    _write_lines(tmp_path / "metrics.jsonl", [json.dumps({"step": s, "x": float(s)}) + "\n" for s in range(6)]
                 + ['{"step": 6, "x": 6.'])  # cut short by a kill
    assert truncate_after(tmp_path, 3) == 4
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
    assert (tmp_path / "metrics.jsonl").read_text().endswith("\n")
    assert not list(tmp_path.glob(".*tmp"))
    assert truncate_after(tmp_path / "nowhere", 3) == 0


def test_resume_appends_after_truncation_and_purges_tensorboard(tmp_path):
    with MetricsLogger(tmp_path, enabled=True, tensorboard=True, console=False) as logger:
        for step in range(1, 5):
            logger.log(step, {"reward_mean": float(step)})
    truncate_after(tmp_path, 2)
    with MetricsLogger(tmp_path, enabled=True, tensorboard=True, console=False) as logger:
        logger.log(3, {"reward_mean": 30.0})
    assert [(r["step"], r["reward_mean"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        (1, 1.0), (2, 2.0), (3, 30.0)]
    assert _tb_scalars(tmp_path / "tensorboard")["reward_mean"] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_read_metrics_skips_partial_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write_lines(path, ['{"step": 1, "a": 1.0}\n', '{"step": 2, "a": 2.0}\n', '{"step": 3, "a"'])
    assert [r["step"] for r in read_metrics(path)] == [1, 2]


def test_read_metrics_corrupt_middle_line_names_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write_lines(path, ['{"step": 1, "a": 1.0}\n', '{"step": 2, "a": \n', '{"step": 3, "a": 3.0}\n'])
    with pytest.raises(MetricsFileError, match=rf"{path}:2: not valid JSON"):
        read_metrics(path)


def test_read_metrics_corrupt_terminated_last_line_raises(tmp_path):
    # a complete (newline-terminated) line was fully written: garbage there is corruption, not a kill
    path = tmp_path / "metrics.jsonl"
    _write_lines(path, ['{"step": 1}\n', 'garbage\n'])
    with pytest.raises(MetricsFileError, match=":2:"):
        read_metrics(path)


def test_read_metrics_requires_integer_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write_lines(path, ['{"step": 1}\n', '{"reward_mean": 1.0}\n'])
    with pytest.raises(MetricsFileError, match=r":2: field 'step' must be an integer"):
        read_metrics(path)


def test_wandb_missing_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(ImportError, match="logging.wandb_project is set but wandb is not installed: pip install wandb"):
        MetricsLogger(tmp_path, enabled=True, tensorboard=False, wandb_project="p", console=False)


# the widest values a step logs: negative, tiny and large numbers, and an eval value from an earlier step
_WIDE_STEP = {"reward_mean": -0.123456789, "accuracy": 0.123456789, "clip_frac_seq": 1.1072345e-05,
              "clip_frac_token": -1.1072345e-05, "routing_drift": 0.00123456, "logprob_gap_mean": 1.107234e-05,
              "grad_norm": 123456.789, "time_step_s": 1234.5678}


def _live_display(width: int, steps: int = 1234):
    """A terminal display as the trainer drives it, on a ``width``-column console that records what it prints."""
    import io

    from rich.console import Console

    from gspo_megatron.trainer.metrics_log import _ConsoleDisplay

    console = Console(width=width, file=io.StringIO(), force_terminal=True, record=True, color_system=None)
    display = _ConsoleDisplay(total_steps=steps, console=console)
    display.update(steps - 10, {"eval_accuracy": 0.123456789, **_WIDE_STEP})
    display.update(steps - 1, _WIDE_STEP)
    return display, console


def _render(renderable, width: int) -> str:
    import io

    from rich.console import Console

    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.file.getvalue()


@pytest.mark.parametrize("width", [80, 60])
def test_console_table_fits_the_terminal_without_cut_cells(width):
    """At 80 columns (and narrower) no header or value is ellipsised or wrapped: columns that do not fit are left
    out, the most important (reward, accuracy) kept."""
    from gspo_megatron.trainer.metrics_log import CONSOLE_KEYS, _format

    display, console = _live_display(width)
    text = _render(display._renderable(), width)
    display.close()
    assert "…" not in text and "…" not in console.export_text(), text
    header, row = text.splitlines()[-2:]  # the progress bar, then one header line and one value line
    assert max(len(line) for line in text.splitlines()) <= width
    labels = dict(CONSOLE_KEYS)
    assert header.split()[:2] == [labels["reward_mean"], labels["accuracy"]]
    assert row.split()[:2] == [_format(_WIDE_STEP["reward_mean"]), _format(_WIDE_STEP["accuracy"])]


def test_console_table_shows_every_column_when_wide():
    from gspo_megatron.trainer.metrics_log import CONSOLE_KEYS, _format

    display, _ = _live_display(160)
    text = _render(display._renderable(), 160)
    display.close()
    header, row = text.splitlines()[-2:]
    assert "…" not in text
    for _, label in CONSOLE_KEYS:
        assert label in header
    assert f"{_format(0.123456789)}@1224" in row.split()


@pytest.mark.parametrize("value", [-0.123456789, 1.1072345e-05, -1.1072345e-05, 123456.789, 0.0, 1.0, -1234.5678,
                                   0.000123456, 1e300])
def test_compact_number_format_is_short_and_close(value):
    from gspo_megatron.trainer.metrics_log import _format

    text = _format(value)
    assert len(text) <= 8, text
    assert float(text) == pytest.approx(value, rel=5e-3)


def test_tensorboard_gets_the_warm_start_loss_as_its_own_run(tmp_path):
    """sft_metrics.jsonl's loss reaches TensorBoard under RUN_DIR/tensorboard/warm_start (its own run, so its sft
    steps never mix with RL's); a resume whose warm start kept fewer steps shows only those."""
    from gspo_megatron.trainer.metrics_log import SFT_METRICS_FILE, append_record

    for step in range(1, 6):
        append_record(tmp_path / SFT_METRICS_FILE, step, {"sft_loss": 3.0 / step})
    with MetricsLogger(tmp_path, enabled=True, tensorboard=True, console=False) as logger:
        logger.log(1, {"reward_mean": 0.5})
    assert _tb_scalars(tmp_path / "tensorboard" / "warm_start") == {
        "sft_loss": [(s, pytest.approx(3.0 / s)) for s in range(1, 6)]}
    assert "sft_loss" not in _tb_scalars(tmp_path / "tensorboard")

    truncate_after(tmp_path, 0)
    truncate_after(tmp_path, 3, SFT_METRICS_FILE)  # a resume inside the warm start, which then ran 2 new steps
    append_record(tmp_path / SFT_METRICS_FILE, 4, {"sft_loss": 7.0})
    with MetricsLogger(tmp_path, enabled=True, tensorboard=True, console=False):
        pass
    assert _tb_scalars(tmp_path / "tensorboard" / "warm_start") == {
        "sft_loss": [(1, 3.0), (2, 1.5), (3, 1.0), (4, 7.0)]}
