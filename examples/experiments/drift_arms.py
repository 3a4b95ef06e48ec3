"""The paper's MoE claim at the paper's routing drift: GSPO, GRPO, GRPO + R2, GRPO + R3 and SAPO at the drift
regimes the drift map found, on the CPU demo task.

    python examples/experiments/drift_arms.py run --scale full --jobs 2    # resumable, run by run
    python examples/experiments/drift_arms.py report      # figures + the docs/training.md block, from the results

The paper (GSPO, section 5.3): after each update of a 48-layer, 128-expert MoE about 10 % of the activated
experts change, token-level importance ratios then fluctuate, GRPO needs Routing Replay to converge and GSPO
does not. The drift map (``drift_map.py``) reaches that drift on CPU with the learning rate: a 4-layer,
16-expert top-4 Qwen3-MoE on the demo's sort task drifts 8.5 % per GRPO update at lr 3e-3, 3.9 % at 1e-3 and
0.2 % at 3e-5 (our earlier reproduction's level). ``run`` trains that model, per seed one 60-step supervised warm
start (``train.steps=0``; shared by every regime and every arm of the seed, so the arms of a seed differ only in
the algorithm and the learning rate), then every arm of ``ARMS`` at every regime of ``REGIMES`` from it
(``--init-from``), each run one ``gspo-megatron train`` process. ``--jobs 2`` runs two at a time (one thread
each; a 2-core machine). One results file (``benchmarks/results/drift_arms.json`` by default) is rewritten
after every run; what it holds is not run again, and a run cut short resumes from its last checkpoint.
``report`` reads only that file.

A run *collapses* (``collapse``) when its train reward over the last quarter of its steps is below half of its
step-1 reward (step 1 samples the warm start itself); it collapsed at the first step from which its reward never
again reaches that half.

Scales: ``full`` (3 seeds, 150 RL steps of 16 prompts x 8 samples, 4 updates each: 600 updates per run) and
``ci`` (one seed, 2 steps of a shrunken model and batch: the pipeline, not the science).
"""
from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gspo_megatron.testing.experiment_runs import (experiment_parser, load_script, publish_block, read_metrics,
                                                    train_run, write_json)

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "cpu_demo.yaml"
RESULTS = REPO / "benchmarks" / "results" / "drift_arms.json"
FIGURES = REPO / "docs" / "figures" / "drift_arms"
DOC = REPO / "docs" / "training.md"
BEGIN, END = "<!-- drift_arms:begin -->", "<!-- drift_arms:end -->"
# the reporting of the GSPO-vs-GRPO reproduction (per-arm summaries and curves), reused per regime
ARMS_REPORT = load_script(REPO / "examples" / "experiments" / "gspo_vs_grpo.py")

ARMS = {
    "gspo": ["loss.algorithm=gspo"],
    "grpo": ["loss.algorithm=grpo"],
    "grpo_r2": ["loss.algorithm=grpo", "train.routing_replay=r2"],
    "grpo_r3": ["loss.algorithm=grpo", "train.routing_replay=r3"],
    "sapo": ["loss.algorithm=sapo"],
}
# the drift map's centre shape (4 layers, 16 experts, top-4, expert width 32) at the learning rates whose GRPO
# drift per update is closest to the paper's ~10 % and to our earlier reproduction's ~0.1 %, and one between
# (at 3e-3 every arm collapsed within 3 steps, so the paper's drift alone says nothing about replay there)
MODEL = ["model.config.num_layers=4", "model.config.num_experts=16", "model.config.moe_router_topk=4",
         "model.config.moe_ffn_hidden_size=32"]
REGIMES = {"paper_drift": 3e-3, "mid_drift": 1e-3, "low_drift": 3e-5}
WARM_STEPS = 60
SCALES = {
    "full": {"seeds": 3, "overrides": ["train.steps=150", "eval.every_steps=25", "checkpoint.every_steps=50",
                                       "checkpoint.keep_last=1"]},
    "ci": {"seeds": 1, "overrides": ["train.steps=2", "train.prompts_per_step=2", "rollout.samples_per_prompt=4",
                                     "train.minibatches_per_step=2", "eval.every_steps=2", "eval.num_prompts=4",
                                     "model.config.num_layers=2", "model.config.num_experts=8"]},
}
KEYS = ARMS_REPORT.KEYS + ("token_ratio_max", "token_ratio_min", "seq_ratio_max", "seq_ratio_min")


def _seed_overrides(seed: int) -> list[str]:
    return [f"train.seed={seed}", f"model.init_seed={1234 + seed}"]


def collapse(rewards: list[float]) -> tuple[bool, int | None]:
    """(collapsed, collapse step) of one run's per-RL-step train rewards (index 0 = step 1, whose samples come
    from the warm start itself): collapsed when the mean over the last quarter of the steps is below half of
    step 1's reward; the collapse step is the first step from which the reward never again reaches that half."""
    if len(rewards) < 4:
        return False, None
    half = 0.5 * rewards[0]
    last = rewards[-max(1, len(rewards) // 4):]
    if sum(last) / len(last) >= half:
        return False, None
    step = len(rewards)
    while step > 1 and rewards[step - 2] < half:
        step -= 1
    return True, step


def run(scale: str, out: Path, results: Path, seeds: int | None, arms: list[str], regimes: list[str],
        jobs: int) -> dict:
    """Warm starts first (one per seed), then every (regime, arm, seed) run not in the results file, ``jobs`` at
    a time; the results file is rewritten after every run."""
    from rich.progress import Progress

    settings = SCALES[scale]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = ["logging.console=false", "logging.tensorboard=false", *MODEL, *settings["overrides"]]
    data = {"scale": scale, "config": str(CONFIG.relative_to(REPO)), "overrides": MODEL + settings["overrides"],
            "warm_steps": WARM_STEPS, "arms": ARMS, "regimes": REGIMES, "warm_start": {}, "runs": {}}
    if results.is_file():
        done = json.loads(results.read_text())
        if all(done.get(k) == data[k] for k in ("scale", "config", "overrides", "warm_steps")):
            data["warm_start"], data["runs"] = done["warm_start"], done["runs"]
    lock = threading.Lock()
    n_seeds = seeds or settings["seeds"]
    todo = [(regime, arm, seed) for seed in range(n_seeds) for regime in regimes for arm in arms
            if str(seed) not in data["runs"].get(regime, {}).get(arm, {})]

    def warm_dir(seed: int) -> Path:
        return out / "warm_start" / f"seed{seed}"

    def one(regime: str, arm: str, seed: int) -> str:
        run_dir = out / regime / arm / f"seed{seed}"
        wall = train_run(CONFIG, run_dir, common + _seed_overrides(seed) + ARMS[arm] + [
            f"optimizer.lr={REGIMES[regime]}", "sft.steps=0"], env, REPO,
            init_from=warm_dir(seed) / "checkpoints" / "step_000000")
        record = {"wall_s": wall, "concurrent_runs": jobs, **read_metrics(run_dir, KEYS)}
        with lock:
            data["runs"].setdefault(regime, {}).setdefault(arm, {})[str(seed)] = record
            write_json(results, data)
        return f"{regime} {arm} seed {seed}: {wall:.0f} s"

    with Progress() as progress:
        task = progress.add_task(f"{scale}: warm starts + runs", total=n_seeds + len(todo))
        for seed in range(n_seeds):
            if str(seed) not in data["warm_start"]:
                wall = train_run(CONFIG, warm_dir(seed), common + _seed_overrides(seed) + [
                    f"sft.steps={WARM_STEPS}", "train.steps=0"], env, REPO)
                data["warm_start"][str(seed)] = {"wall_s": wall, **read_metrics(warm_dir(seed), KEYS)}
                write_json(results, data)
            progress.advance(task)
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for future in [pool.submit(one, *item) for item in todo]:
                progress.console.print(future.result())
                progress.advance(task)
    return data


# ---- report ----------------------------------------------------------------------------------------------

def _rl_rewards(run: dict) -> list[float]:
    return [v for s, v in zip(run["steps"], run["reward_mean"]) if s > 0]


def _spread_of(run: dict, high: str, low: str) -> float:
    """Mean over RL steps of (max - min) of one kind of importance ratio in the step."""
    pairs = [(h, lo) for s, h, lo in zip(run["steps"], run[high], run[low]) if s > 0 and h is not None and lo is not None]
    return sum(h - lo for h, lo in pairs) / len(pairs) if pairs else float("nan")


def summarise(data: dict) -> dict[str, dict[str, dict]]:
    """Per regime and arm: the GSPO-vs-GRPO report's summary, the collapse count and the ratio spreads."""
    out = {}
    for regime in [g for g in data["regimes"] if g in data["runs"]]:  # the script's order: high drift to low
        arms = data["runs"][regime]
        summary = ARMS_REPORT.summarise({"runs": arms})
        for arm, runs in arms.items():
            flags = [collapse(_rl_rewards(r)) for r in runs.values()]
            summary[arm]["collapsed"] = sum(c for c, _ in flags)
            summary[arm]["collapse_steps"] = [s for c, s in flags if c]
            summary[arm]["drift_first"] = ARMS_REPORT._spread([r["routing_drift"][r["steps"].index(1)]
                                                               for r in runs.values()])
            summary[arm]["token_ratio_spread"] = ARMS_REPORT._spread(
                [_spread_of(r, "token_ratio_max", "token_ratio_min") for r in runs.values()])
            summary[arm]["seq_ratio_spread"] = ARMS_REPORT._spread(
                [_spread_of(r, "seq_ratio_max", "seq_ratio_min") for r in runs.values()])
        out[regime] = summary
    return out


def figures(data: dict, out: Path) -> list[Path]:
    """The GSPO-vs-GRPO report's curves (reward, held-out accuracy, clipping, drift...), one folder per regime."""
    return [path for regime, arms in data["runs"].items()
            for path in ARMS_REPORT.draw_figures({"runs": arms}, out / regime)]


def doc_block(data: dict, summary: dict, figures_rel: str) -> str:
    fmt = ARMS_REPORT._fmt
    warm = list(data["warm_start"].values())
    walls = {regime: sum(r["wall_s"] for runs in data["runs"][regime].values() for r in runs.values())
             for regime in summary}
    jobs = sorted({r["concurrent_runs"] for arms in data["runs"].values() for runs in arms.values()
                   for r in runs.values()})
    lines = [BEGIN, "", f"Generated by `python examples/experiments/drift_arms.py report` from "
             f"`{RESULTS.relative_to(REPO)}` (scale `{data['scale']}`; overrides for every run: "
             f"`{' '.join(data['overrides'])}`). Means over seeds ± sample std. Per seed, one {data['warm_steps']}-step "
             f"supervised warm start (held-out greedy accuracy after it: "
             f"{fmt(ARMS_REPORT._spread([w['eval_accuracy'][0] for w in warm]))}) that every arm of every regime "
             f"starts from. Wall time: warm starts {sum(w['wall_s'] for w in warm) / 60:.1f} min, "
             + ", ".join(f"regime `{g}` {s / 60:.1f} min of run time" for g, s in walls.items())
             + f" ({'/'.join(map(str, jobs))} run(s) at a time on this 2-core machine, one thread each). "
             "A run *collapses* when its train reward over the last quarter of its steps is below half its step-1 "
             "reward (step 1 samples the warm start itself); it collapsed at the first step from which its reward "
             "never again reached that half.", ""]
    for regime, arms in summary.items():
        lr = data["regimes"][regime]
        steps = max(s["steps"] for s in arms.values())
        lines += [f"**Regime `{regime}`** (lr {lr:g}; {steps} RL steps, {4 * steps} optimizer updates per run)", "",
                  "| arm | seeds | collapsed (at step) | eval acc. start -> end | eval change (paired) | reward (last "
                  "quarter) | routing drift: first update / mean (set rate) | token ratio spread | sequence ratio spread | "
                  "clipped-token fraction | s / RL step |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for arm, s in arms.items():
            at = ", ".join(map(str, s["collapse_steps"]))
            lines.append(f"| {arm} | {s['seeds']} | {s['collapsed']}{f' ({at})' if at else ''} | "
                         f"{fmt(s['eval_start'])} -> {fmt(s['eval_end'])} | {fmt(s['eval_gain'])} | "
                         f"{fmt(s['reward_last_quarter'])} | {fmt(s['drift_first'])} / {fmt(s['routing_drift'])} "
                         f"({fmt(s['routing_drift_set'])}) | "
                         f"{fmt(s['token_ratio_spread'])} | {fmt(s['seq_ratio_spread'])} | {fmt(s['clip_frac_token'])} | "
                         f"{fmt(s['time_step_s'])} |")
        pairs = [(a, b) for a, b in (("grpo_r2", "grpo"), ("grpo_r3", "grpo_r2")) if a in arms and b in arms]
        if pairs:
            lines += ["", "Routing Replay against the run without it (same seed, same warm start): " + "; ".join(
                f"{a} vs {b}: {ARMS_REPORT._same_steps({'runs': data['runs'][regime]}, a, b)}" for a, b in pairs) + "."]
        lines += ["", " ".join(f"![{regime} {name}]({figures_rel}/{regime}/{name}.png)"
                               for name in ("reward", "eval_accuracy", "routing_drift")), ""]
    lines.append(END)
    return "\n".join(lines)


def report(results: Path, figures_dir: Path, doc: Path | None) -> dict:
    data = json.loads(results.read_text())
    summary = summarise(data)
    figures(data, figures_dir)
    block = doc_block(data, summary, os.path.relpath(figures_dir, (doc or DOC).parent))
    publish_block(block, doc, BEGIN, END)
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = experiment_parser(__doc__.splitlines()[0], SCALES, REPO / "runs" / "drift_arms", RESULTS, FIGURES, DOC)
    parser.run.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.run.add_argument("--regimes", nargs="+", choices=list(REGIMES), default=list(REGIMES))
    parser.run.add_argument("--jobs", type=int, default=1, help="runs at a time (one thread each)")
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args.scale, args.out, args.results, args.seeds, args.arms, args.regimes, args.jobs)
    else:
        report(args.results, args.figures, args.doc)


if __name__ == "__main__":
    main()
