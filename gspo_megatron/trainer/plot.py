"""`gspo-megatron plot RUN_DIR [RUN_DIR ...] [--out DIR]`: PNG charts from run folders' metrics.jsonl
(and sft_metrics.jsonl: the warm start's loss by sft step).

One figure per metric group, every run overlaid (legend: the run folder's name), plus ``overview.png`` with all
groups in a grid. A group whose metrics are absent from every run gets no figure; a metric absent from every run
is named in its panel's title. Drawn with matplotlib's ``Figure`` (Agg canvas) rather than pyplot, so no global
backend or figure state is touched. Each PNG is written to a temp name and renamed.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
from pathlib import Path
from typing import Any

from gspo_megatron.trainer.metrics_log import METRICS_FILE, SFT_METRICS_FILE, MetricsFileError, read_metrics

PLOTS_DIR = "plots"


@dataclasses.dataclass(frozen=True)
class MetricGroup:
    """One figure: ``file`` name stem, axis ``title`` (``{k}`` in it: the suffixes the ``name*`` metrics matched,
    such as the 4 of ``eval_pass@4``) and y ``label``, the ``metrics`` drawn in it (``name*``:
    every logged metric starting with ``name``, such as the run's ``eval_pass@k``); with a
    ``prefix`` (per-layer metrics such as ``routing_agreement/layer``), every logged metric named
    ``prefix<N>`` too, in layer order (``metrics_of``). ``source``: the run folder's file the metrics are
    read from, whose steps the x axis counts (``xlabel``)."""

    file: str
    title: str
    ylabel: str
    metrics: tuple[str, ...]
    prefix: str = ""
    source: str = METRICS_FILE
    xlabel: str = "step"


GROUPS: tuple[MetricGroup, ...] = (
    MetricGroup("reward", "Reward", "mean reward", ("reward_mean",)),
    MetricGroup("accuracy", "Accuracy", "fraction correct", ("accuracy", "eval_accuracy")),
    MetricGroup("clip_fraction", "Clip fraction", "fraction clipped", ("clip_frac_seq", "clip_frac_token")),
    MetricGroup("routing_drift", "Routing drift (per update)", "fraction of activated experts changed",
                ("routing_drift",)),
    MetricGroup("logprob_gap", "Train/rollout log-prob gap", "mean |gap|", ("logprob_gap_mean",)),
    MetricGroup("response_length", "Response length", "tokens (mean)", ("response_length_mean",)),
    MetricGroup("pass_at_k", "Held-out pass@{k}", "fraction solved", ("eval_pass@*",)),  # * : the run's k
    MetricGroup("timings", "Time per step", "seconds", ("time_step_s", "time_rollout_s", "time_logprobs_s",
                                                         "time_update_s", "time_sync_s")),
    MetricGroup("routing_agreement", "Engine/trainer routing agreement (auto: R3 while replay active = 1)",
                "fraction of top-k shared", ("routing_agreement", "routing_replay_active")),
    MetricGroup("routing_agreement_layers", "Routing agreement per layer", "fraction of top-k shared", (),
                prefix="routing_agreement/layer"),
    MetricGroup("routing_drift_layers", "Routing drift per layer", "experts changed", (), prefix="routing_drift/layer"),
    MetricGroup("stability_masks", "Masked and capped by the stability options", "fraction",
                ("rollout_seq_mask_frac", "opsm_mask_frac", "icepop_mask_frac", "clip_frac_dual_token", "cispo_clip_frac")),
    MetricGroup("tool_use", "Tool use (rollout.multi_turn)", "responses calling a tool",
                ("tool_use_frac", "eval_tool_use_frac")),
    MetricGroup("warm_start_loss", "Supervised warm start (before RL step 1)", "mean NLL per response token",
                ("sft_loss",), source=SFT_METRICS_FILE, xlabel="sft step"),
)

Series = tuple[list[int], list[float]]

# what a legend calls each metric (the raw keys are in metrics.jsonl and docs/training.md's table)
METRIC_NAMES: dict[str, str] = {
    "reward_mean": "mean reward",
    "accuracy": "rollout accuracy",
    "eval_accuracy": "held-out accuracy",
    "clip_frac_seq": "sequences clipped",
    "clip_frac_token": "tokens clipped",
    "routing_drift": "routing drift",
    "logprob_gap_mean": "mean log-prob gap",
    "response_length_mean": "mean response length",
    "time_step_s": "whole step",
    "time_rollout_s": "rollout",
    "time_logprobs_s": "log-probs",
    "time_update_s": "update",
    "time_sync_s": "weight sync",
    "routing_agreement": "routing agreement",
    "routing_replay_active": "replay active",
    "rollout_seq_mask_frac": "sequences masked (rollout correction)",
    "opsm_mask_frac": "masked by OPSM",
    "icepop_mask_frac": "masked by IcePop",
    "clip_frac_dual_token": "tokens dual-clipped",
    "cispo_clip_frac": "tokens capped by CISPO",
    "tool_use_frac": "rollouts",
    "eval_tool_use_frac": "held-out",
    "sft_loss": "warm-start loss",
}
# metric-name prefixes and what a legend calls the rest of the key: eval_pass@4 -> pass@4, .../layer3 -> layer 3
_PREFIX_NAMES: tuple[tuple[str, str], ...] = (("eval_pass@", "pass@"), ("routing_agreement/layer", "layer "),
                                              ("routing_drift/layer", "layer "))


def metric_name(metric: str) -> str:
    """The readable name a legend gives ``metric`` (``clip_frac_seq`` -> ``sequences clipped``); a key this module
    does not know keeps its words (``_`` -> space)."""
    if metric in METRIC_NAMES:
        return METRIC_NAMES[metric]
    for prefix, name in _PREFIX_NAMES:
        if metric.startswith(prefix):
            return name + metric[len(prefix):]
    return metric.replace("_", " ")


@dataclasses.dataclass
class Run:
    label: str
    records: list[dict[str, Any]]
    warm_start: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # SFT_METRICS_FILE's records

    def records_of(self, group: MetricGroup) -> list[dict[str, Any]]:
        return self.warm_start if group.source == SFT_METRICS_FILE else self.records


def load_warm_start(run_dir: Path) -> list[dict[str, Any]]:
    """The warm start's records; none when the run had no warm start (no file)."""
    path = Path(run_dir) / SFT_METRICS_FILE
    return read_metrics(path) if path.is_file() else []


def load_run(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise MetricsFileError(f"{run_dir}: no {METRICS_FILE} here -- is this a training run folder?")
    records = read_metrics(path)
    if not records:
        raise MetricsFileError(f"{path}: empty (the run has not logged a step yet)")
    return records


def series(records: list[dict[str, Any]], metric: str) -> Series:
    """(steps, values) of the records holding ``metric`` (eval metrics only appear every few steps).

    A step logged twice (a resume without truncation) keeps its last value so the line does not fold back."""
    by_step: dict[int, float] = {}
    for record in records:
        if metric in record:  # the trainer logs every metric by its one name (algorithms/metrics.py)
            by_step[record["step"]] = float(record[metric])
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def run_labels(run_dirs: list[Path]) -> list[str]:
    """The folder names, or the full paths when two runs share a name (runs/a/run vs runs/b/run)."""
    names = [Path(d).resolve().name for d in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [str(d) for d in run_dirs]


def metrics_of(group: MetricGroup, runs: list[Run]) -> list[str]:
    """``group.metrics`` with each ``name*`` replaced by the keys the runs logged that start with ``name``
    (e.g. eval_pass@4; none logged: ``name`` + ``k``), then the runs' ``group.prefix<N>`` metrics, by N."""
    logged = {key for r in runs for record in r.records_of(group) for key in record}
    metrics = []
    for m in group.metrics:
        if not m.endswith("*"):
            metrics.append(m)
            continue
        metrics += sorted(k for k in logged if k.startswith(m[:-1])) or [m[:-1] + "k"]
    if group.prefix:
        found = [k for k in logged if k.startswith(group.prefix) and k[len(group.prefix):].isdigit()]
        metrics += sorted(found, key=lambda key: int(key[len(group.prefix):]))
    return metrics


def _draw_panel(ax, group: MetricGroup, runs: list[Run]) -> bool:
    """Draws ``group`` into ``ax``; False when no run has any of its metrics (the panel then says so)."""
    from matplotlib.ticker import MaxNLocator

    metrics = metrics_of(group, runs)
    present = [m for m in metrics if any(series(r.records_of(group), m)[0] for r in runs)]
    absent = [m for m in metrics if m not in present]
    title = group.title.format(k=", ".join(_wildcard_suffixes(group, present or metrics)))
    title = title if not absent else f"{title} (absent: {', '.join(metric_name(m) for m in absent)})"
    ax.set_title(title, fontsize=9)
    if not present:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_xticks([])
        ax.set_yticks([])
        return False
    styles = ["-", "--", ":", "-."]
    for run_index, run in enumerate(runs):
        for metric_index, metric in enumerate(present):
            steps, values = series(run.records_of(group), metric)
            if not steps:
                continue
            # one run: a colour per metric; several: a colour per run; the dash always tells the metrics apart
            color = f"C{(metric_index if len(runs) == 1 else run_index) % 10}"
            if len(present) == 1:
                label = run.label
            else:
                label = metric_name(metric) if len(runs) == 1 else f"{run.label}: {metric_name(metric)}"
            ax.plot(steps, values, linestyle=styles[metric_index % len(styles)], color=color, label=label,
                    marker="." if len(steps) <= 50 else None)
    ax.set_xlabel(group.xlabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_ylabel(group.ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return True


def _wildcard_suffixes(group: MetricGroup, metrics: list[str]) -> list[str]:
    """What the group's ``name*`` metrics matched after ``name`` (``["4"]`` for ``eval_pass@4``)."""
    stems = [m[:-1] for m in group.metrics if m.endswith("*")]
    return [m[len(stem):] for m in metrics for stem in stems if m.startswith(stem)]


def _save(fig, path: Path) -> Path:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, path)
    return path


def plot_runs(run_dirs: list[Path], out_dir: Path | None = None) -> list[Path]:
    """Writes ``<group>.png`` for each group with data and ``overview.png``; returns their paths (overview last).

    ``out_dir`` defaults to ``run_dirs[0]/plots``. Raises ``MetricsFileError`` for a run folder without a
    readable, non-empty metrics.jsonl, or when no run holds any plotted metric.
    """
    from matplotlib.figure import Figure

    if not run_dirs:
        raise ValueError("plot_runs: no run folders given")
    run_dirs = [Path(d) for d in run_dirs]
    runs = [Run(label, load_run(d), load_warm_start(d)) for label, d in zip(run_labels(run_dirs), run_dirs)]
    out_dir = Path(out_dir) if out_dir is not None else run_dirs[0] / PLOTS_DIR

    with_data = [g for g in GROUPS if any(series(r.records_of(g), m)[0] for r in runs for m in metrics_of(g, runs))]
    if not with_data:
        wanted = sorted({m for g in GROUPS for m in g.metrics} | {f"{g.prefix}N" for g in GROUPS if g.prefix})
        files = ", ".join(str(d / METRICS_FILE) for d in run_dirs)
        raise MetricsFileError(f"{files}: no plotted metric logged (looked for {', '.join(wanted)})")
    out_dir.mkdir(parents=True, exist_ok=True)

    written = []
    for group in with_data:
        fig = Figure(figsize=(7, 4.5), layout="constrained")
        _draw_panel(fig.add_subplot(1, 1, 1), group, runs)
        written.append(_save(fig, out_dir / f"{group.file}.png"))

    cols = 2
    rows = math.ceil(len(with_data) / cols)
    fig = Figure(figsize=(6 * cols, 3.8 * rows), layout="constrained")
    for index, group in enumerate(with_data):
        _draw_panel(fig.add_subplot(rows, cols, index + 1), group, runs)
    fig.suptitle(" vs ".join(r.label for r in runs), fontsize=10)
    written.append(_save(fig, out_dir / "overview.png"))
    return written


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gspo-megatron plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="training run folder(s)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: the first RUN_DIR/plots)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        paths = plot_runs(args.run_dirs, args.out)
    except MetricsFileError as err:
        # an input problem, not a bug: a usage message rather than a traceback
        parser.exit(2, f"gspo-megatron plot: error: {err}\n")
    for path in paths:
        print(path)
    return 0


__all__ = ["GROUPS", "METRIC_NAMES", "MetricGroup", "build_parser", "load_run", "main", "metric_name", "plot_runs",
           "series"]
