"""The CPU demo's measured figures: run the demo, keep one results file, regenerate the one doc block and chart.

    python tools/cpu_demo_results.py run       # the demo: one process, two (EP=2), seeds 1 and 2: ~3 min on 2 cores
    python tools/cpu_demo_results.py report    # docs/quickstart.md's block + docs/figures/cpu_demo/overview.png

``run`` trains ``examples/cpu_demo.yaml`` as the README says (``gspo-megatron train``, then ``--nproc 2
parallel.expert_parallel=2``, and with ``train.seed=1`` and ``=2``), times each whole command and writes every run's per-step metrics (the plotted
ones) to ``benchmarks/results/cpu_demo.json`` (temp file, then rename). ``report`` reads only that file: it
rewrites the block between ``<!-- cpu_demo:begin -->`` and ``<!-- cpu_demo:end -->`` of docs/quickstart.md
and draws the chart with ``gspo-megatron plot``'s code. Every other page links to that block rather than
repeating its numbers; tests/test_docs.py checks that the block is what this file renders from the results.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "cpu_demo.yaml"
RESULTS = REPO / "benchmarks" / "results" / "cpu_demo.json"
DOC = REPO / "docs" / "quickstart.md"
FIGURE = REPO / "docs" / "figures" / "cpu_demo" / "overview.png"
BEGIN, END = "<!-- cpu_demo:begin -->", "<!-- cpu_demo:end -->"
# name -> extra command-line arguments of `gspo-megatron train --config examples/cpu_demo.yaml`
RUNS = {"1 process": [], "2 processes, EP=2": ["--nproc", "2", "parallel.expert_parallel=2"],
        # other seeds: how much of a result is the seed's (its warm start lands elsewhere)
        "1 process, seed 1": ["train.seed=1"], "1 process, seed 2": ["train.seed=2"]}
# the metrics kept per step: what the block and `gspo-megatron plot` read
KEYS = ("reward_mean", "accuracy", "eval_accuracy", "eval_pass@4", "clip_frac_seq", "clip_frac_token",
        "routing_drift", "logprob_gap_mean", "response_length_mean", "grad_norm", "time_step_s")


# ---- run ---------------------------------------------------------------------------------------------------

def _versions() -> dict[str, str]:
    from importlib.metadata import version

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    return {"torch": version("torch"), "transformers": version("transformers"),
            "megatron-core": version("megatron-core"), "python": platform.python_version(),
            "commit": (commit.stdout.strip() or "unknown") + (" with uncommitted changes" if dirty else "")}


def run_demo(extra: list[str], run_dir: Path) -> dict:
    """One demo run: its command, wall time and the kept metrics of every logged step."""
    from gspo_megatron.trainer.metrics_log import read_metrics

    command = [sys.executable, "-m", "gspo_megatron.cli", "train", "--config", str(CONFIG), "--run-dir",
               str(run_dir), "logging.console=false", *extra]
    load = os.getloadavg()[0]
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: exit {done.returncode}\n{done.stderr[-3000:]}")
    records = [{k: r[k] for k in ("step", *KEYS) if k in r} for r in read_metrics(run_dir / "metrics.jsonl")]
    shown = ["gspo-megatron", "train", "--config", "examples/cpu_demo.yaml", *extra]
    return {"command": " ".join(shown), "wall_s": round(wall, 1), "load_before": round(load, 2), "records": records}


def run(results: Path, out: Path | None) -> dict:
    """Both runs (in ``out``, default a temporary folder) and the results file."""
    data = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "versions": _versions(), "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in RUNS.items():
            folder = Path(out or tmp) / name.replace(" ", "_").replace(",", "").replace("=", "")
            data["runs"][name] = run_demo(extra, folder)
            print(f"{name}: {data['runs'][name]['wall_s']} s", flush=True)
    tmp = results.with_name(f".{results.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, results)
    return data


# ---- report ------------------------------------------------------------------------------------------------

def _series(records: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in records if key in r]


def summarise(run: dict) -> dict:
    """Held-out greedy accuracy after the warm start (the first evaluation), at the end and at its best, and the
    train reward's mean over the first and the last 10 RL steps."""
    evals = _series(run["records"], "eval_accuracy")
    rewards = [v for _, v in _series(run["records"], "reward_mean")]
    best_step, best = max(evals, key=lambda e: (e[1], -e[0]))
    return {"start": evals[0][1], "end": evals[-1][1], "end_step": evals[-1][0], "best": best, "best_step": best_step,
            "reward_first": sum(rewards[:10]) / len(rewards[:10]), "reward_last": sum(rewards[-10:]) / len(rewards[-10:]),
            "wall_s": run["wall_s"]}


def render(data: dict) -> str:
    """The block between the markers (markers included): what the results file says, nothing typed by hand."""
    v = data["versions"]
    lines = [BEGIN, "",
             f"Generated by `python tools/cpu_demo_results.py report` from `{RESULTS.relative_to(REPO)}` (measured "
             f"{data['date']} on a {data['cpus']}-core machine; torch {v['torch']}, transformers {v['transformers']}, "
             f"megatron-core {v['megatron-core']}, Python {v['python']}, commit {v['commit']}).", "",
             "| run | held-out greedy accuracy after the warm start | at the last step | best (step) | "
             "train reward, first 10 / last 10 steps | wall time of the command |",
             "|---|---|---|---|---|---|"]
    for name, run in data["runs"].items():
        s = summarise(run)
        lines.append(f"| {name} (`{run['command']}`) | {s['start']:.3f} | {s['end']:.3f} (step {s['end_step']}) | "
                     f"{s['best']:.3f} ({s['best_step']}) | {s['reward_first']:.2f} / {s['reward_last']:.2f} | "
                     f"{s['wall_s']:.0f} s (load {run['load_before']:.1f} at its start) |")
    lines += ["", f"![the demo's metrics, every run](figures/cpu_demo/{FIGURE.name})", "", END]
    return "\n".join(lines)


def doc_block(text: str) -> str:
    """The block of ``text`` between the markers (markers included)."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"needs exactly one {BEGIN} ... {END} block")
    return BEGIN + text.split(BEGIN)[1].split(END)[0] + END


def draw(data: dict, figure: Path) -> Path:
    """``gspo-megatron plot``'s overview of the runs, from the results file's records."""
    from gspo_megatron.trainer.plot import plot_runs

    with tempfile.TemporaryDirectory() as tmp:
        folders = []
        for name, run in data["runs"].items():
            folder = Path(tmp) / name.replace(" ", "_").replace(",", "")
            folder.mkdir()
            (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run["records"]))
            folders.append(folder)
        written = plot_runs(folders, Path(tmp) / "plots")
        figure.parent.mkdir(parents=True, exist_ok=True)
        os.replace(next(p for p in written if p.name == "overview.png"), figure)
    return figure


def report(results: Path, doc: Path, figure: Path) -> str:
    data = json.loads(results.read_text())
    text = doc.read_text()
    block = render(data)
    tmp = doc.with_name(f".{doc.name}.{os.getpid()}.tmp")
    tmp.write_text(text.replace(doc_block(text), block))
    os.replace(tmp, doc)
    draw(data, figure)
    return block


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="run the demo (one and two processes) and write the results file")
    p_run.add_argument("--results", type=Path, default=RESULTS)
    p_run.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    p_rep = sub.add_parser("report", help="the docs/quickstart.md block and the chart from the results file")
    p_rep.add_argument("--results", type=Path, default=RESULTS)
    p_rep.add_argument("--doc", type=Path, default=DOC)
    p_rep.add_argument("--figure", type=Path, default=FIGURE)
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args.results, args.out)
    else:
        print(report(args.results, args.doc, args.figure))


if __name__ == "__main__":
    main()
