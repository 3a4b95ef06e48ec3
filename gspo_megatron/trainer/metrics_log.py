"""Per-step metrics: ``run_dir/metrics.jsonl`` (the record of truth), TensorBoard, Weights & Biases, a live console.

``metrics.jsonl`` holds one JSON object per logged step, ``{"step": s, "reward_mean": ..., ...}``. Eval metrics
(``eval_accuracy``) are merged into the step's dict by the trainer, so there is one line format. Every line is
flushed and fsynced before ``log`` returns: a SIGKILL (Slurm's KillWait running out) loses at most the line being
written, which ``read_metrics`` then skips as a partial last line.

Resume: the trainer calls ``truncate_after(run_dir, step)`` before building the logger, so the file only holds
steps the restored checkpoint has seen. The logger then reads the last step left in the file and tells
TensorBoard to drop (``purge_step``) its events past that step, so the two sinks agree after a resume.
"""
from __future__ import annotations

import json
import numbers
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
# the supervised warm start's loss per sft step (1..sft.steps), in the same line format: its own file, since its
# steps precede RL step 1 and RL's steps must stay one increasing sequence in every sink (TensorBoard, W&B)
SFT_METRICS_FILE = "sft_metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
# the warm start's loss in TensorBoard: its own run (a subfolder), x axis = sft step, so it never mixes with RL's steps
TENSORBOARD_WARM_START_DIR = "warm_start"
WANDB_ID_FILE = "wandb_run_id.txt"

# what the console table shows, in order, when present; everything still goes to the file and the sinks. The labels
# are short so the table fits an 80-column terminal (CONSOLE_LEGEND spells them out).
CONSOLE_KEYS: tuple[tuple[str, str], ...] = (
    ("reward_mean", "reward"),
    ("accuracy", "acc"),
    ("eval_accuracy", "eval acc"),
    ("clip_frac_seq", "clip seq"),
    ("clip_frac_token", "clip tok"),
    ("routing_drift", "drift"),
    ("logprob_gap_mean", "logp gap"),
    ("grad_norm", "gnorm"),
    ("time_step_s", "step s"),
)
# the order in which columns are left out when the terminal is too narrow for all of them (least telling first)
CONSOLE_DROP_ORDER: tuple[str, ...] = ("clip_frac_token", "logprob_gap_mean", "grad_norm", "routing_drift",
                                       "clip_frac_seq", "time_step_s", "eval_accuracy")


class MetricsFileError(ValueError):
    """A metrics.jsonl that is missing or cannot be read; the message names the file (and line)."""


def metrics_path(run_dir: Path, file: str = METRICS_FILE) -> Path:
    return Path(run_dir) / file


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl, in file order.

    A last line without its newline that does not parse is a write cut short by a kill and is skipped; any
    other line that is not a JSON object with an integer ``step`` raises ``MetricsFileError`` naming
    ``path:line``. Blank lines are ignored.
    """
    path = Path(path)
    if not path.is_file():
        raise MetricsFileError(f"{path}: no such metrics file")
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    # text ending in "\n" leaves "" last; anything else last is an unterminated line
    unterminated = len(lines) - 1 if lines[-1] else None
    records = []
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if index == unterminated:
                break
            raise MetricsFileError(f"{path}:{index + 1}: not valid JSON ({err.msg} at column {err.colno})") from err
        records.append(_check_record(record, path, index + 1))
    return records


def _check_record(record: Any, path: Path, line_no: int) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise MetricsFileError(f"{path}:{line_no}: expected a JSON object, got {type(record).__name__}")
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        raise MetricsFileError(f"{path}:{line_no}: field 'step' must be an integer, got {step!r}")
    return record


def truncate_after(run_dir: Path, step: int, file: str = METRICS_FILE) -> int:
    """Keep only the records of ``run_dir/metrics.jsonl`` (or ``file``) with ``step <= step``; returns how many
    were kept.

    Rewritten to a temp file, fsynced and renamed over the original, so a kill during the rewrite leaves
    either the old file or the new one. Also drops a partial last line. No file: nothing to do, returns 0.
    """
    path = metrics_path(run_dir, file)
    if not path.exists():
        return 0
    kept = [r for r in read_metrics(path) if r["step"] <= step]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(_json_line(r) for r in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(kept)


def last_step(run_dir: Path) -> int | None:
    """The largest step recorded in ``run_dir/metrics.jsonl``, or None when there is no file or no record."""
    path = metrics_path(run_dir)
    if not path.exists():
        return None
    steps = [r["step"] for r in read_metrics(path)]
    return max(steps) if steps else None


def append_record(path: Path, step: int, metrics: dict[str, float]) -> None:
    """One ``{"step": step, **metrics}`` line appended to ``path``, fsynced (as ``MetricsLogger.log``): for
    files written outside the RL logger (``SFT_METRICS_FILE``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(_json_line({"step": int(step), **_as_floats(metrics)}))
        f.flush()
        os.fsync(f.fileno())


def _json_line(record: dict[str, Any]) -> str:
    return json.dumps(record, separators=(",", ":")) + "\n"


def _as_floats(metrics: dict[str, Any]) -> dict[str, float]:
    """Checks the values are plain numbers (a 0-d tensor would serialise as a string or fail late)."""
    out = {}
    for key, value in metrics.items():
        if key == "step":
            raise ValueError("metrics: key 'step' is reserved for the step number")
        if not isinstance(value, numbers.Real):
            raise TypeError(f"metrics[{key!r}] is {type(value).__name__}, expected a number (call .item() on tensors)")
        out[key] = float(value)
    return out


class MetricsLogger:
    """Appends each step's metrics to the sinks. Every method is a no-op when ``enabled`` is False (ranks != 0).

    ``total_steps`` sizes the console progress bar; ``console`` turns the console display off (the file and the
    other sinks still run). On a terminal the display is a live progress bar plus a table of ``CONSOLE_KEYS``;
    elsewhere (Slurm logs) it is one line per step.
    """

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool = True, wandb_project: str | None = None,
                 wandb_run_name: str | None = None, total_steps: int | None = None, console: bool = True):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.total_steps = total_steps
        self._file = None
        self._tb = None
        self._wandb_run = None
        self._display = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        resumed_at = last_step(self.run_dir)
        self._file = open(metrics_path(self.run_dir), "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # events past the last kept jsonl step come from the run before the resume: drop them
            purge = 0 if resumed_at is None else resumed_at + 1
            self._tb = SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD_DIR), purge_step=purge)
            warm_start_to_tensorboard(self.run_dir)
        if wandb_project is not None:
            self._wandb_run = _start_wandb(self.run_dir, wandb_project, wandb_run_name)
        if console:
            self._display = _ConsoleDisplay(total_steps)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """One record ``{"step": step, **metrics}`` to every enabled sink."""
        if not self.enabled:
            return
        values = _as_floats(metrics)
        try:
            self._file.write(_json_line({"step": int(step), **values}))
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as err:  # ENOSPC and the like name no file: name the one being written
            raise OSError(err.errno, f"{err.strerror} while writing the metrics of step {step}",
                          str(metrics_path(self.run_dir))) from err
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(values, step=step)
        if self._display is not None:
            self._display.update(step, values)

    def log_text(self, tag: str, text: str, step: int) -> None:
        """A text record (TensorBoard's text tab), e.g. sampled completions."""
        if self.enabled and self._tb is not None:
            self._tb.add_text(tag, text, global_step=step)
            self._tb.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._display is not None:
            self._display.close()
            self._display = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def warm_start_to_tensorboard(run_dir: Path) -> int:
    """Writes ``run_dir/sft_metrics.jsonl`` (the warm start, which ends before the RL logger starts) to TensorBoard's
    ``tensorboard/warm_start`` run; returns the number of records written (0 without a warm start).

    The whole file is written each time: its events start with a purge of every earlier one (``purge_step=0``), so
    after a resume TensorBoard shows exactly the file's steps, as metrics.jsonl and TensorBoard agree for RL.
    """
    from torch.utils.tensorboard import SummaryWriter

    path = metrics_path(run_dir, SFT_METRICS_FILE)
    records = read_metrics(path) if path.is_file() else []
    if not records:
        return 0
    writer = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR / TENSORBOARD_WARM_START_DIR), purge_step=0)
    try:
        for record in records:
            for key, value in record.items():
                if key != "step":
                    writer.add_scalar(key, value, global_step=record["step"])
    finally:
        writer.close()
    return len(records)


def _start_wandb(run_dir: Path, project: str, name: str | None):
    """A W&B run that a resume continues: its id is kept in ``run_dir/wandb_run_id.txt``."""
    try:
        import wandb
    except ImportError as err:
        raise ImportError("logging.wandb_project is set but wandb is not installed: pip install wandb") from err
    id_file = run_dir / WANDB_ID_FILE
    if id_file.exists():
        run_id = id_file.read_text(encoding="utf-8").strip()
    else:
        run_id = wandb.util.generate_id()
        id_file.write_text(run_id + "\n", encoding="utf-8")
    return wandb.init(project=project, name=name or run_dir.name, id=run_id, resume="allow", dir=str(run_dir))

# printed once above the console display: what the short column names and ``value@N`` mean
CONSOLE_LEGEND = ("columns: reward / acc = the step's rollouts (acc: reward >= 1); eval acc = held-out greedy "
                  "accuracy; clip seq / clip tok = fraction of sequences / tokens clipped; drift = routing drift, the "
                  "fraction of activated experts one update changed; logp gap = mean |trainer - engine| log-prob of "
                  "the sampled tokens; gnorm = gradient norm; step s = seconds per step; 'v@N' = the value from step N "
                  "(eval runs every eval.every_steps); a terminal too narrow for every column leaves some out. "
                  "All metrics: RUN_DIR/metrics.jsonl (docs/training.md)")

# the widest number ``_format`` writes: 4 significant digits where they fit in 7 characters, else 3 (a minus sign
# may add one)
_NUMBER_WIDTH = 7


def _format(value: float) -> str:
    """``value`` in at most 8 characters: ``0.8125``, ``1.11e-5``, ``1.235e4``, ``-0.00123``."""
    text = _compact_exponent(f"{value:.4g}")
    if len(text.lstrip("-")) > _NUMBER_WIDTH:
        text = _compact_exponent(f"{value:.3g}")
    return text


def _compact_exponent(text: str) -> str:
    """``1.11e-05`` -> ``1.11e-5``, ``1.23e+04`` -> ``1.23e4``: Python's exponent padding costs two columns."""
    mantissa, e, exponent = text.partition("e")
    if not e:
        return text
    sign = "-" if exponent.startswith("-") else ""
    return f"{mantissa}e{sign}{exponent.lstrip('+-').lstrip('0') or '0'}"


def fit_columns(cells: list[tuple[str, str, str]], width: int, gap: int = 2) -> list[tuple[str, str, str]]:
    """The ``(key, header, value)`` cells that fit side by side in ``width`` characters, in their given order.

    A column is as wide as its header or its value, whichever is longer, and ``gap`` characters separate two
    columns (rich's Table with ``pad_edge=False``: one space of padding each side of an inner edge). While the row
    is too wide, the column of the key earliest in ``CONSOLE_DROP_ORDER`` is left out, so no cell is cut short.
    """
    kept = list(cells)
    droppable = [key for key in CONSOLE_DROP_ORDER if any(key == c[0] for c in kept)]

    def row_width(row):
        return sum(max(len(h), len(v)) for _, h, v in row) + gap * max(len(row) - 1, 0)

    while kept and row_width(kept) > width:
        if droppable:
            key = droppable.pop(0)
            kept = [c for c in kept if c[0] != key]
        else:  # only undroppable columns left: keep the leftmost that fit
            kept = kept[:-1]
    return kept


class _ConsoleDisplay:
    """rich display: a live progress bar + key-metric table on a terminal, a plain line per step otherwise.

    ``console``: where to print (default: a rich Console on stdout, as wide as the terminal)."""

    def __init__(self, total_steps: int | None, console=None):
        from rich.console import Console

        self.console = console if console is not None else Console()
        self.total_steps = total_steps
        self.latest: dict[str, tuple[int, float]] = {}  # key -> (step, value); eval keys only come some steps
        self._live = None
        self._progress = None
        self._task = None
        self._step = 0

    def update(self, step: int, values: dict[str, float]) -> None:
        if not self.latest:
            self.console.print(CONSOLE_LEGEND, highlight=False, soft_wrap=True)
        self._step = step
        for key, _ in CONSOLE_KEYS:
            if key in values:
                self.latest[key] = (step, values[key])
        if not self.console.is_terminal:
            self.console.print(self._line(step), highlight=False, soft_wrap=True)
            return
        if self._live is None:
            self._start(step)
        self._progress.update(self._task, completed=step)
        self._live.update(self._renderable(), refresh=True)

    def _start(self, step: int) -> None:
        from rich.live import Live
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self._progress = Progress(TextColumn("[bold]GSPO"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                  TimeRemainingColumn(), console=self.console)
        # started at the first logged step so a resume does not count the restored steps as speed
        self._task = self._progress.add_task("train", total=self.total_steps, completed=step)
        self._live = Live(self._renderable(), console=self.console, auto_refresh=False)
        self._live.start()

    def _renderable(self):
        from rich.console import Group
        from rich.table import Table

        # the terminal's width now (a resized terminal re-fits on the next step)
        cells = fit_columns([(key, label, self._cell(key, self._step)) for key, label in CONSOLE_KEYS],
                            self.console.width)
        table = Table(box=None, pad_edge=False, padding=(0, 1))
        for _, label, _ in cells:
            table.add_column(label, justify="right", no_wrap=True)
        table.add_row(*(value for _, _, value in cells))
        return Group(self._progress, table)

    def _cell(self, key: str, now: int) -> str:
        """The latest value; ``@step`` marks one from an earlier step (eval runs every few steps)."""
        if key not in self.latest:
            return "-"
        step, value = self.latest[key]
        return _format(value) if step == now else f"{_format(value)}@{step}"

    def _line(self, step: int) -> str:
        total = f"/{self.total_steps}" if self.total_steps is not None else ""
        parts = [f"step {step}{total}"]
        parts += [f"{label} {self._cell(key, step)}" for key, label in CONSOLE_KEYS if key in self.latest]
        return "  ".join(parts)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


__all__ = ["CONSOLE_DROP_ORDER", "CONSOLE_KEYS", "CONSOLE_LEGEND", "METRICS_FILE", "MetricsFileError", "MetricsLogger", "fit_columns", "last_step", "metrics_path",
           "read_metrics", "truncate_after", "warm_start_to_tensorboard"]
