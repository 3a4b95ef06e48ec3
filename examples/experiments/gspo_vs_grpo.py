"""GSPO vs GRPO on a deeper MoE: run the arms, collect one results file, regenerate every figure and number.

    python examples/experiments/gspo_vs_grpo.py run --scale full --out runs/gspo_vs_grpo
    python examples/experiments/gspo_vs_grpo.py report              # figures + the docs/training.md block

``run`` trains every arm x seed with ``examples/experiments/moe_repro.yaml`` (4-layer, 16-expert top-4
Qwen3-MoE shape; the ``chain`` multi-step arithmetic task; a supervised warm start, then RL), one
``gspo-megatron train`` process per run, and writes every run's per-step metrics into one results file
(``benchmarks/results/gspo_vs_grpo.json`` by default; temp file, then rename). ``report`` reads only that
file: it draws the figures (``docs/figures/gspo_vs_grpo/``) and rewrites the block between the
``<!-- gspo_vs_grpo:begin -->`` / ``<!-- gspo_vs_grpo:end -->`` markers of docs/training.md, so no number
in the docs is copied by hand.

Scales: ``full`` (the reproduction: 3 seeds, 100 RL steps after 300 warm-start steps), ``probe`` (the full
settings for 2 RL steps after 20 warm-start steps, one seed: times one step for the full run's estimate)
and ``ci`` (2 RL steps of a shrunken model and batch, one seed: what tests/experiments runs).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "experiments" / "moe_repro.yaml"
RESULTS = REPO / "benchmarks" / "results" / "gspo_vs_grpo.json"
ESTIMATE = REPO / "benchmarks" / "results" / "gspo_vs_grpo_estimate.json"
FIGURES = REPO / "docs" / "figures" / "gspo_vs_grpo"
DOC = REPO / "docs" / "training.md"
BEGIN, END = "<!-- gspo_vs_grpo:begin -->", "<!-- gspo_vs_grpo:end -->"

ARMS = {
    "gspo": ["loss.algorithm=gspo"],
    "grpo": ["loss.algorithm=grpo"],
    "grpo_r2": ["loss.algorithm=grpo", "train.routing_replay=r2"],
    "grpo_r3": ["loss.algorithm=grpo", "train.routing_replay=r3"],
    "gspo_token": ["loss.algorithm=gspo_token"],
}
SCALES = {
    "full": {"seeds": 3, "overrides": []},
    "probe": {"seeds": 1, "overrides": ["train.steps=2", "sft.steps=20", "eval.every_steps=0"]},
    # the pipeline of every arm, not the science: 2 layers, 8 experts (top-4 kept), a tiny batch
    "ci": {"seeds": 1, "overrides": ["train.steps=2", "sft.steps=5", "train.prompts_per_step=2",
                                     "rollout.samples_per_prompt=4", "train.minibatches_per_step=2",
                                     "rollout.max_new_tokens=40", "eval.every_steps=2", "eval.num_prompts=4",
                                     "model.config.num_layers=2", "model.config.num_experts=8"]},
}
# per-step metrics kept in the results file (absent ones are stored as null)
KEYS = ("reward_mean", "eval_accuracy", "clip_frac_token", "clip_frac_seq", "routing_drift", "routing_drift_set",
        "logprob_gap_mean", "seq_ratio_mean", "grad_norm", "response_length_mean", "time_step_s")
PAPER = {"gspo_clip_frac": 0.15, "grpo_clip_frac": 0.0013, "routing_drift": 0.10}  # Fig. 2; section 5.3


# ---- run -------------------------------------------------------------------------------------------------

def run_one(run_dir: Path, overrides: list[str], env: dict) -> float:
    """One ``gspo-megatron train`` run; returns its wall time in seconds. A failure stops everything."""
    cmd = [sys.executable, "-m", "gspo_megatron.cli", "train", "--config", str(CONFIG), "--run-dir", str(run_dir),
           *overrides]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{run_dir}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def read_run(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"steps": [r["step"] for r in records], **{k: [r.get(k) for r in records] for k in KEYS}}


def run(scale: str, out: Path, results: Path, arms: list[str], seeds: int | None, extra: list[str]) -> dict:
    settings = SCALES[scale]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    data = {"scale": scale, "config": str(CONFIG.relative_to(REPO)), "overrides": settings["overrides"] + extra,
            "arms": {a: ARMS[a] for a in arms}, "runs": {}}
    for arm in arms:
        for seed in range(seeds or settings["seeds"]):
            run_dir = out / arm / f"seed{seed}"
            overrides = ARMS[arm] + settings["overrides"] + extra + [f"train.seed={seed}",
                                                                     f"model.init_seed={1234 + seed}"]
            wall = run_one(run_dir, overrides, env)
            data["runs"].setdefault(arm, {})[str(seed)] = {"wall_s": wall, **read_run(run_dir)}
            print(f"{arm} seed {seed}: {wall:.0f} s", flush=True)
    _write_json(results, data)
    return data


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


# ---- numbers from the results file ------------------------------------------------------------------------

def _values(run: dict, key: str, from_step: int = 1) -> list[float]:
    return [v for s, v in zip(run["steps"], run[key]) if s >= from_step and v is not None and math.isfinite(v)]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _spread(values: list[float]) -> tuple[float, float]:
    """(mean, sample std; 0 for one value) over seeds."""
    return _mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(data: dict) -> dict[str, dict]:
    """Per arm, over seeds: (mean, std) of each headline number."""
    out = {}
    for arm, runs in data["runs"].items():
        per_seed = {
            "eval_start": [_values(r, "eval_accuracy", 0)[0] for r in runs.values()],
            "eval_end": [_values(r, "eval_accuracy", 0)[-1] for r in runs.values()],
            "reward_last_quarter": [_mean(_values(r, "reward_mean", max(1, 3 * max(r["steps"]) // 4)))
                                    for r in runs.values()],
            **{k: [_mean(_values(r, k)) for r in runs.values()]
               for k in ("clip_frac_token", "clip_frac_seq", "routing_drift", "routing_drift_set", "logprob_gap_mean",
                         "time_step_s")},
            "wall_s": [r["wall_s"] for r in runs.values()],
        }
        out[arm] = {k: _spread(v) for k, v in per_seed.items()} | {"seeds": len(runs), "steps": max(
            max(r["steps"]) for r in runs.values())}
    return out


def _fmt(pair: tuple[float, float], digits: int = 3) -> str:
    mean, std = pair
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.{digits}g}" + (f" ± {std:.1g}" if std else "")


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.0f}x" if b > 0 and math.isfinite(a) else "n/a (GRPO clipped nothing)"


def doc_block(data: dict, summary: dict, figures_rel: str, estimate: dict | None = None) -> str:
    arms = list(summary)
    seeds = {summary[a]["seeds"] for a in arms}
    lines = [BEGIN, "",
             f"Generated by `python examples/experiments/gspo_vs_grpo.py report` from `{RESULTS.relative_to(REPO)}` "
             f"(scale `{data['scale']}`, {'/'.join(map(str, sorted(seeds)))} seed(s) per arm, "
             f"{max(summary[a]['steps'] for a in arms)} RL steps; overrides: `{' '.join(data['overrides']) or 'none'}`). "
             "Means over seeds ± sample std; per-step means over all RL steps unless stated.", ""]
    if estimate is not None:
        lines += [f"Full run ({estimate['arms']} arms x {estimate['seeds']} seeds, {estimate['sft_steps']} warm-start + "
                  f"{estimate['rl_steps']} RL steps) estimated from the probe of {', '.join(estimate['probed_arms'])} "
                  f"(`{ESTIMATE.relative_to(REPO)}`): between {estimate['lower_h']:.1f} h (RL steps alone) and "
                  f"{estimate['upper_h']:.1f} h (warm start, start-up and evaluations scaled up from the probe) on "
                  "this shared 2-core machine, one run at a time.", ""]
    lines += [
             "| arm | eval acc. start -> end | reward (last quarter) | clipped-token fraction | mean per-sequence "
             "clipped-token fraction | routing drift per expert (set rate) | log-prob gap | s / RL step |",
             "|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        s = summary[arm]
        lines.append(f"| {arm} | {_fmt(s['eval_start'])} -> {_fmt(s['eval_end'])} | {_fmt(s['reward_last_quarter'])} | "
                     f"{_fmt(s['clip_frac_token'])} | {_fmt(s['clip_frac_seq'])} | {_fmt(s['routing_drift'])} "
                     f"({_fmt(s['routing_drift_set'])}) | {_fmt(s['logprob_gap_mean'])} | {_fmt(s['time_step_s'])} |")
    lines.append("")
    if "gspo" in summary and "grpo" in summary:
        g, r = summary["gspo"], summary["grpo"]
        drift = ", ".join(f"{a} {_fmt(summary[a]['routing_drift'])}" for a in arms)
        lines += ["| claim | paper | this run |", "|---|---|---|",
                  f"| GSPO clips far more tokens than GRPO and still learns | ~{PAPER['gspo_clip_frac']} vs "
                  f"~{PAPER['grpo_clip_frac']} (~{PAPER['gspo_clip_frac'] / PAPER['grpo_clip_frac']:.0f}x, Fig. 2) | "
                  f"{_fmt(g['clip_frac_token'])} vs {_fmt(r['clip_frac_token'])} "
                  f"({_ratio(g['clip_frac_token'][0], r['clip_frac_token'][0])}); eval end "
                  f"{_fmt(g['eval_end'])} vs {_fmt(r['eval_end'])} |",
                  f"| about 10% of activated experts change after one update (48-layer, 128-expert MoE) | "
                  f"~{PAPER['routing_drift']:.0%} | {drift} |"]
        replay = [a for a in ("grpo_r2", "grpo_r3") if a in summary]
        if replay:
            lines.append(f"| GRPO on MoE needs Routing Replay to converge | GRPO without replay collapses | eval end: "
                         + ", ".join(f"{a} {_fmt(summary[a]['eval_end'])}" for a in ["grpo"] + replay) + " |")
        lines.append("")
    lines += [f"![{name}]({figures_rel}/{name}.png)" for name in FIGURE_NAMES]
    lines += ["", END]
    return "\n".join(lines)


# ---- figures -----------------------------------------------------------------------------------------------

FIGURE_NAMES = ("reward", "eval_accuracy", "clip_frac_token", "routing_drift", "logprob_gap_mean")
_TITLES = {"reward": ("reward_mean", "train reward"), "eval_accuracy": ("eval_accuracy", "held-out greedy accuracy"),
           "clip_frac_token": ("clip_frac_token", "clipped-token fraction"),
           "routing_drift": ("routing_drift", "activated experts changed by one update"),
           "logprob_gap_mean": ("logprob_gap_mean", "|log pi_old - log pi_rollout| per token")}


def draw_figures(data: dict, out_dir: Path) -> list[Path]:
    """One PNG per metric: every arm's mean over seeds with a ± std band; temp file, then rename."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in FIGURE_NAMES:
        key, title = _TITLES[name]
        figure = Figure(figsize=(6, 3.6))
        axes = figure.add_subplot()
        for arm, runs in data["runs"].items():
            by_step: dict[int, list[float]] = {}
            for r in runs.values():
                for step, value in zip(r["steps"], r[key]):
                    if value is not None and math.isfinite(value) and (step > 0 or key == "eval_accuracy"):
                        by_step.setdefault(step, []).append(value)
            steps = sorted(by_step)
            means = [_mean(by_step[s]) for s in steps]
            stds = [statistics.stdev(by_step[s]) if len(by_step[s]) > 1 else 0.0 for s in steps]
            axes.plot(steps, means, label=arm, marker="." if len(steps) < 20 else None)
            axes.fill_between(steps, [m - d for m, d in zip(means, stds)], [m + d for m, d in zip(means, stds)], alpha=0.2)
        axes.set_title(title)
        axes.set_xlabel("RL step")
        axes.legend(fontsize=7)
        figure.tight_layout()
        path = out_dir / f"{name}.png"
        tmp = out_dir / f".{name}.tmp.{os.getpid()}.png"
        FigureCanvasAgg(figure).print_png(str(tmp))
        os.replace(tmp, path)
        written.append(path)
    return written


def report(results: Path, figures: Path, doc: Path, estimate: Path = ESTIMATE) -> dict:
    data = json.loads(results.read_text())
    estimated = json.loads(estimate.read_text()) if estimate.is_file() else None
    summary = summarise(data)
    draw_figures(data, figures)
    text = doc.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"{doc}: needs exactly one {BEGIN} ... {END} block to replace")
    head, rest = text.split(BEGIN)
    tail = rest.split(END, 1)[1]
    rel = os.path.relpath(figures, doc.parent)
    tmp = doc.with_name(doc.name + f".tmp.{os.getpid()}")
    tmp.write_text(head + doc_block(data, summary, rel, estimated) + tail)
    os.replace(tmp, doc)
    return summary


def estimate_full(probe: dict) -> dict:
    """Bounds on the full run's wall time from a ``probe`` results file, per arm times the full run's seeds:
    lower = the probe's time per RL step x the full run's RL steps (nothing else); upper = that plus the
    probe's remaining time (start-up, 20 warm-start steps, two evaluations) scaled by full / probe
    warm-start steps (an over-estimate: start-up and evaluations do not grow that much)."""
    import yaml

    config = yaml.safe_load(CONFIG.read_text())
    steps, sft = config["train"]["steps"], config["sft"]["steps"]
    lower = upper = 0.0
    for runs in probe["runs"].values():
        for r in runs.values():
            step_s = _mean(_values(r, "time_step_s"))
            rest = r["wall_s"] - sum(_values(r, "time_step_s"))
            lower += SCALES["full"]["seeds"] * step_s * steps
            upper += SCALES["full"]["seeds"] * (step_s * steps + rest * sft / 20)
    scale = len(ARMS) / len(probe["runs"])  # arms not probed cost the probed arms' mean
    return {"lower_h": lower * scale / 3600, "upper_h": upper * scale / 3600, "probed_arms": list(probe["runs"]),
            "arms": len(ARMS), "seeds": SCALES["full"]["seeds"], "rl_steps": steps, "sft_steps": sft}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="train the arms and write the results file")
    p_run.add_argument("--scale", choices=sorted(SCALES), default="full")
    p_run.add_argument("--out", type=Path, default=REPO / "runs" / "gspo_vs_grpo")
    p_run.add_argument("--results", type=Path, default=RESULTS)
    p_run.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    p_run.add_argument("--seeds", type=int, default=None, help="default: the scale's")
    p_run.add_argument("overrides", nargs="*", help="extra section.field=value overrides for every run")
    p_rep = sub.add_parser("report", help="figures and the docs block from a results file")
    p_rep.add_argument("--results", type=Path, default=RESULTS)
    p_rep.add_argument("--figures", type=Path, default=FIGURES)
    p_rep.add_argument("--doc", type=Path, default=DOC)
    p_rep.add_argument("--estimate", type=Path, default=ESTIMATE, help="included when the file exists")
    p_est = sub.add_parser("estimate", help="the full run's wall time from a probe results file")
    p_est.add_argument("--results", type=Path, required=True)
    p_est.add_argument("--out", type=Path, default=ESTIMATE)
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args.scale, args.out, args.results, args.arms, args.seeds, args.overrides)
    elif args.command == "report":
        print(json.dumps(report(args.results, args.figures, args.doc, args.estimate), indent=1))
    else:
        estimate = estimate_full(json.loads(args.results.read_text()))
        _write_json(args.out, estimate)
        print(json.dumps(estimate, indent=1))


if __name__ == "__main__":
    main()
