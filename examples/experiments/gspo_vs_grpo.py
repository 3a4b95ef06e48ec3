"""GSPO vs GRPO on a deeper MoE: run the arms, collect one results file, regenerate every figure and number.

    python examples/experiments/gspo_vs_grpo.py run --scale full --out runs/gspo_vs_grpo
    python examples/experiments/gspo_vs_grpo.py report              # figures + the docs/training.md block

``run`` trains, per seed, one supervised warm start (``train.steps=0``) and then every arm from it
(``--init-from``), with ``examples/experiments/moe_repro.yaml`` (4-layer, 16-expert top-4 Qwen3-MoE shape;
the ``chain`` multi-step arithmetic task), one ``gspo-megatron train`` process per run, and writes every
run's per-step metrics into one results file (``benchmarks/results/gspo_vs_grpo.json`` by default; temp
file, then rename, after every run; runs it already holds are skipped). ``report`` reads only that file: it
draws the figures (``docs/figures/gspo_vs_grpo/``) and rewrites the block between the
``<!-- gspo_vs_grpo:begin -->`` / ``<!-- gspo_vs_grpo:end -->`` markers of docs/training.md, so no number
in the docs is copied by hand.

Scales: ``full`` (the reproduction: 3 seeds, the config's 600 warm-start and 60 RL steps; about an hour on
2 CPU cores) and ``ci`` (2 RL steps of a shrunken model and batch, one seed: what tests/experiments runs).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from pathlib import Path

from gspo_megatron.testing.experiment_runs import read_metrics, replace_block, train_run, write_json

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "experiments" / "moe_repro.yaml"
RESULTS = REPO / "benchmarks" / "results" / "gspo_vs_grpo.json"
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

def run_one(run_dir: Path, overrides: list[str], env: dict, init_from: Path | None = None) -> float:
    """One ``gspo-megatron train`` run of this experiment's config; returns its wall time."""
    return train_run(CONFIG, run_dir, overrides, env, REPO, init_from)


def read_run(run_dir: Path) -> dict:
    return read_metrics(run_dir, KEYS)


def _seed_overrides(seed: int) -> list[str]:
    return [f"train.seed={seed}", f"model.init_seed={1234 + seed}"]


def run(scale: str, out: Path, results: Path, arms: list[str], seeds: int | None, extra: list[str]) -> dict:
    """Per seed, one warm start (``train.steps=0``: supervised stage, evaluation, checkpoint at step 0) that
    every arm of that seed starts from (``--init-from``): the arms differ only in the RL algorithm. The
    results file is rewritten after every run, and a run already in it (same settings) is not run again,
    so an interrupted ``run`` continues where it stopped."""
    from rich.progress import Progress

    settings = SCALES[scale]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    data = {"scale": scale, "config": str(CONFIG.relative_to(REPO)), "overrides": settings["overrides"] + extra,
            "arms": {a: ARMS[a] for a in arms}, "warm_start": {}, "runs": {}}
    if results.is_file():
        done = json.loads(results.read_text())
        if all(done.get(k) == data[k] for k in ("scale", "config", "overrides")):
            data["warm_start"], data["runs"] = done.get("warm_start", {}), {a: r for a, r in done["runs"].items()
                                                                            if a in arms}
    n_seeds = seeds or settings["seeds"]
    common = settings["overrides"] + extra
    with Progress() as progress:
        task = progress.add_task(f"{scale}: warm starts + runs", total=n_seeds * (len(arms) + 1))
        for seed in range(n_seeds):
            warm_dir = out / "warm_start" / f"seed{seed}"
            if str(seed) not in data["warm_start"]:
                wall = run_one(warm_dir, common + _seed_overrides(seed) + ["train.steps=0"], env)
                data["warm_start"][str(seed)] = {"wall_s": wall, **read_run(warm_dir)}
                write_json(results, data)
            progress.advance(task)
            init = warm_dir / "checkpoints" / "step_000000"
            for arm in arms:
                if str(seed) not in data["runs"].get(arm, {}):
                    run_dir = out / arm / f"seed{seed}"
                    wall = run_one(run_dir, ARMS[arm] + common + _seed_overrides(seed), env, init_from=init)
                    data["runs"].setdefault(arm, {})[str(seed)] = {"wall_s": wall, **read_run(run_dir)}
                    write_json(results, data)
                    progress.console.print(f"{arm} seed {seed}: {wall:.0f} s")
                progress.advance(task)
    return data


# ---- numbers from the results file ------------------------------------------------------------------------

def _values(run: dict, key: str, from_step: int = 1) -> list[float]:
    return [v for s, v in zip(run["steps"], run[key]) if s >= from_step and v is not None and math.isfinite(v)]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _spread(values: list[float]) -> tuple[float, float]:
    """(mean, sample std; 0 for one value) over the seeds that have a value (an arm without the metric, such as
    SAPO's clipping, has none: nan)."""
    values = [v for v in values if math.isfinite(v)]
    return _mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(data: dict) -> dict[str, dict]:
    """Per arm, over seeds: (mean, std) of each headline number."""
    out = {}
    for arm, runs in data["runs"].items():
        per_seed = {
            "eval_start": [_values(r, "eval_accuracy", 0)[0] for r in runs.values()],
            "eval_end": [_values(r, "eval_accuracy", 0)[-1] for r in runs.values()],
            # paired by seed (every arm of a seed starts from the same warm start): the warm starts differ
            # far more between seeds than the arms do
            "eval_gain": [_values(r, "eval_accuracy", 0)[-1] - _values(r, "eval_accuracy", 0)[0] for r in runs.values()],
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


def _same_steps(data: dict, a: str, b: str) -> str:
    """Per seed, how many RL steps arms ``a`` and ``b`` ran with identical train rewards (identical
    responses) before the first difference, and the largest relative grad-norm difference over those
    steps. Float rounding in a different but equivalent computation flips a sampled token sooner or later,
    after which the runs part."""
    parts = []
    for seed, run in sorted(data["runs"][a].items()):
        other = data["runs"][b].get(seed)
        if other is None:
            continue
        pairs = [(x, y, gx, gy) for step, x, y, gx, gy in zip(run["steps"], run["reward_mean"], other["reward_mean"],
                                                             run["grad_norm"], other["grad_norm"]) if step > 0]
        same = next((i for i, (x, y, _, _) in enumerate(pairs) if x != y), len(pairs))
        gap = max((abs(gx - gy) / max(abs(gy), 1e-12) for _, _, gx, gy in pairs[:same]), default=float("nan"))
        parts.append(f"seed {seed}: {same}/{len(pairs)} steps" + (f" (grad norms within {gap:.0e})" if same else ""))
    return "identical rewards for " + "; ".join(parts)


def _fmt(pair: tuple[float, float], digits: int = 3) -> str:
    mean, std = pair
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.{digits}g}" + (f" ± {std:.1g}" if std else "")


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.0f}x" if b > 0 and math.isfinite(a) else "n/a (GRPO clipped nothing)"


def doc_block(data: dict, summary: dict, figures_rel: str) -> str:
    arms = list(summary)
    seeds = {summary[a]["seeds"] for a in arms}
    lines = [BEGIN, "",
             f"Generated by `python examples/experiments/gspo_vs_grpo.py report` from `{RESULTS.relative_to(REPO)}` "
             f"(scale `{data['scale']}`, {'/'.join(map(str, sorted(seeds)))} seed(s) per arm, "
             f"{max(summary[a]['steps'] for a in arms)} RL steps; overrides: `{' '.join(data['overrides']) or 'none'}`). "
             "Means over seeds ± sample std; per-step means over all RL steps unless stated.", ""]
    warm = list(data["warm_start"].values())
    total_s = sum(w["wall_s"] for w in warm) + sum(r["wall_s"] for runs in data["runs"].values() for r in runs.values())
    lines += [f"Each seed's {len(arms)} arms start from one shared supervised warm start (held-out greedy accuracy "
              f"after it: {_fmt(_spread([w['eval_accuracy'][0] for w in warm]))}). Wall time of the whole run on this "
              f"2-core machine, one run at a time: {total_s / 3600:.2f} h ({len(warm)} warm starts, "
              f"{sum(len(r) for r in data['runs'].values())} RL runs; a run resumed after an interruption counts only "
              "its resumed part).", ""]
    lines += [
             "| arm | eval acc. start -> end | eval change (paired by seed) | reward (last quarter) | clipped-token fraction | mean per-sequence "
             "clipped-token fraction | routing drift per expert (set rate) | log-prob gap | s / RL step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        s = summary[arm]
        lines.append(f"| {arm} | {_fmt(s['eval_start'])} -> {_fmt(s['eval_end'])} | {_fmt(s['eval_gain'])} | "
                     f"{_fmt(s['reward_last_quarter'])} | "
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
        for a, b, claim, paper in (
                ("gspo_token", "gspo", "GSPO-token with sequence-level advantages is GSPO (Eq. 13-17)", "identical"),
                ("grpo_r3", "grpo_r2", "R3 (the engine's experts) vs R2 (the trainer's): the same routing here",
                 "differ by the engine's numerics"),
                ("grpo_r2", "grpo", "Routing Replay changes GRPO's run (control for the two rows above)", "yes")):
            if a in summary and b in summary:
                lines.append(f"| {claim} | {paper} | {a} vs {b}: {_same_steps(data, a, b)} |")
        replay = [a for a in ("grpo_r2", "grpo_r3") if a in summary]
        if replay:
            lines.append("| GRPO on MoE needs Routing Replay to converge | GRPO without replay collapses | eval end: "
                         + ", ".join(f"{a} {_fmt(summary[a]['eval_end'])}" for a in ["grpo"] + replay) + " |")
        lines.append("")
    lines += [f"![{name}]({figures_rel}/{name}.png)" for name in FIGURE_NAMES]
    lines += ["", END]
    return "\n".join(lines)


# ---- figures -----------------------------------------------------------------------------------------------

FIGURE_NAMES = ("reward", "eval_accuracy", "eval_gain", "clip_frac_token", "routing_drift", "logprob_gap_mean")
_TITLES = {"reward": ("reward_mean", "train reward"), "eval_accuracy": ("eval_accuracy", "held-out greedy accuracy"),
           "eval_gain": ("eval_accuracy", "held-out greedy accuracy minus the seed's warm start (paired)"),
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
                offset = _values(r, key, 0)[0] if name == "eval_gain" else 0.0
                for step, value in zip(r["steps"], r[key]):
                    if value is not None and math.isfinite(value) and (step > 0 or key == "eval_accuracy"):
                        by_step.setdefault(step, []).append(value - offset)
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


def report(results: Path, figures: Path, doc: Path) -> dict:
    data = json.loads(results.read_text())
    summary = summarise(data)
    draw_figures(data, figures)
    replace_block(doc, BEGIN, END, doc_block(data, summary, os.path.relpath(figures, doc.parent)))
    return summary


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
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args.scale, args.out, args.results, args.arms, args.seeds, args.overrides)
    else:
        print(json.dumps(report(args.results, args.figures, args.doc), indent=1))


if __name__ == "__main__":
    main()
