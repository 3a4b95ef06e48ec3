"""Dynamic sampling and overlong handling (trainer/batch_filling.py) and partial rollouts (rollout/partial.py)
against the plain step, side by side in one
run: on the CPU demo (sorting, answers of 6 tokens, max 8) and on the chain task (six +/- steps, answers of
35-46 tokens, max 56), every arm starting from the same warm start (``--init-from``).

    python benchmarks/bench_batch_filling.py [--tasks demo chain] [--arms ...] [--out runs/bench_batch_filling]
        [--results benchmarks/results/batch_filling.json]   # the figure: docs/figures/<results name>.png

Per arm: wall time per trained sample and per *informative* trained sample (non-zero advantage, outside the
overlong mask), samples generated per trained sample, held-out greedy accuracy gained and gained per
wall-clock minute of RL. Writes benchmarks/results/batch_filling.json (temp file, then rename, after every
run; runs already in it with the same settings are skipped) and docs/figures/batch_filling.png (held-out
accuracy against wall-clock time). The arms run one after another on the same machine: on a loaded machine
their wall times carry that load's noise, which the report shows as the spread of time per step.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "batch_filling.json"

TASKS = {
    "demo": {"config": "examples/cpu_demo.yaml", "buffer": 2, "budgets": (4, 6),
             "warm": ["sft.steps=60"],
             "rl": ["train.steps=20", "eval.every_steps=5", "eval.num_prompts=64", "eval.pass_k=1"]},
    "chain": {"config": "examples/experiments/moe_repro.yaml", "buffer": 8, "budgets": (28, 42),
              "warm": ["sft.steps=300"],
              "rl": ["train.steps=12", "train.prompts_per_step=8", "eval.every_steps=4", "eval.num_prompts=50",
                     "eval.pass_k=1"]},
}
ARMS = {
    "plain": [],
    "filter": ["rollout.filter_groups=zero_variance", "rollout.max_generation_rounds=3"],
    "mask": ["rollout.overlong=mask"],
    "soft_penalty": ["rollout.overlong=soft_penalty"],  # overlong_buffer_tokens: the task's buffer
    # partial rollouts take pi_old from the engine (per-token behaviour log-probs); plain_engine is their control.
    # partial_token_budget: the task's budgets (partial: the first, partial_wide: the second), each within
    # ceil(max_new_tokens / budget) - 1 <= train.max_staleness (1)
    "plain_engine": ["rollout.logprobs_from=engine"],
    "partial": ["rollout.logprobs_from=engine", "rollout.partial=true"],
    "partial_wide": ["rollout.logprobs_from=engine", "rollout.partial=true"],
    # overlap mode (the next batch generated while the trainer updates), without and with partial rollouts;
    # with them each token is one update older, so the first budget runs at train.max_staleness 2
    "overlap_engine": ["rollout.logprobs_from=engine", "train.rollout_mode=overlap"],
    "partial_overlap": ["rollout.logprobs_from=engine", "rollout.partial=true", "train.rollout_mode=overlap",
                        "train.max_staleness=2"],
}
COMMON = ["logging.console=false", "logging.tensorboard=false", "checkpoint.every_steps=0"]


def task_overrides(arm: str, spec: dict) -> list[str]:
    """The arm's settings that depend on the task: the overlong buffer, the partial-rollout budget."""
    if arm == "soft_penalty":
        return [f"rollout.overlong_buffer_tokens={spec['buffer']}"]
    if arm.startswith("partial"):
        return [f"rollout.partial_token_budget={spec['budgets'][arm == 'partial_wide']}"]
    return []


def train(config: str, run_dir: Path, overrides: list[str], init_from: Path | None = None) -> float:
    cmd = [sys.executable, "-m", "gspo_megatron.cli", "train", "--config", str(REPO / config), "--run-dir",
           str(run_dir), *COMMON, *overrides]
    if init_from is not None:
        cmd += ["--init-from", str(init_from)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{run_dir}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def summarise(records: list[dict], prompts_per_step: int, samples_per_prompt: int) -> dict:
    """Per-run figures from its metrics.jsonl records (step 0 is the evaluation before RL)."""
    steps = [m for m in records if m["step"] > 0]
    trained = informative = generated = 0.0
    for m in steps:
        groups = m.get("filter/groups_trained", m.get("partial/groups_trained", prompts_per_step))
        masked = m.get("overlong/masked_samples", 0.0)
        trained += groups * samples_per_prompt - masked
        informative += groups * (1.0 - m["zero_variance_group_frac"]) * samples_per_prompt - masked
        generated += m.get("filter/groups_generated", prompts_per_step) * samples_per_prompt
    step_s = [m["time_step_s"] for m in steps]
    evals = [(m["step"], m["eval_accuracy"]) for m in records if "eval_accuracy" in m]
    rl_s = sum(step_s)
    gain = evals[-1][1] - evals[0][1]
    return {"steps": len(steps), "train_s": rl_s, "step_s_min": min(step_s), "step_s_max": max(step_s),
            "s_per_trained_sample": rl_s / max(trained, 1.0), "s_per_informative_sample": rl_s / max(informative, 1.0),
            "generated_per_trained": generated / max(trained, 1.0), "informative_frac": informative / max(trained, 1.0),
            "eval_start": evals[0][1], "eval_end": evals[-1][1], "eval_gain": gain,
            "eval_gain_per_min": gain / (rl_s / 60.0), "reward_mean": sum(m["reward_mean"] for m in steps) / len(steps),
            "eval_curve": [[s, a, sum(step_s[:s])] for s, a in evals]}


def run(tasks: list[str], arms: list[str], out: Path, results: Path) -> dict:
    from gspo_megatron.trainer.config import load_config

    data = json.loads(results.read_text()) if results.is_file() else {}
    for task in tasks:
        spec = TASKS[task]
        cfg = load_config(REPO / spec["config"], spec["rl"])
        entry = data.setdefault(task, {"settings": {}, "arms": {}})
        settings = {"config": spec["config"], "warm": spec["warm"], "rl": spec["rl"], "buffer": spec["buffer"]}
        if entry["settings"] != settings:
            entry.update(settings=settings, arms={})
        warm = out / task / "warm_start"
        init = warm / "checkpoints" / "step_000000"
        if not init.is_dir():
            print(f"{task}: warm start ({' '.join(spec['warm'])})", flush=True)
            entry["warm_s"] = train(spec["config"], warm, spec["warm"] + spec["rl"] + ["train.steps=0"])
        for arm in arms:
            if arm in entry["arms"]:
                continue
            overrides = ARMS[arm] + task_overrides(arm, spec)
            run_dir = out / task / arm
            if run_dir.exists():  # an arm not in the results (other settings, or stopped before it finished)
                shutil.rmtree(run_dir)
            wall = train(spec["config"], run_dir, spec["rl"] + overrides, init_from=init)
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            entry["arms"][arm] = {"overrides": overrides, "wall_s": wall,
                                  **summarise(records, cfg.train.prompts_per_step, cfg.rollout.samples_per_prompt)}
            _write_json(results, data)
            s = entry["arms"][arm]
            print(f"{task} {arm}: {s['s_per_trained_sample'] * 1e3:.1f} ms/trained sample, "
                  f"{s['s_per_informative_sample'] * 1e3:.1f} ms/informative sample, eval {s['eval_start']:.3f} -> "
                  f"{s['eval_end']:.3f} in {s['train_s']:.0f} s", flush=True)
    return data


def report(data: dict) -> str:
    lines = ["| task | arm | s/step (min-max) | ms / trained sample | ms / informative sample | generated / trained "
             "| informative frac | eval start -> end | eval gain / RL min |", "|---|---|---|---|---|---|---|---|---|"]
    for task, entry in data.items():
        for arm, s in entry["arms"].items():
            lines.append(f"| {task} | {arm} | {s['train_s'] / s['steps']:.2f} ({s['step_s_min']:.2f}-{s['step_s_max']:.2f}) "
                         f"| {s['s_per_trained_sample'] * 1e3:.1f} | {s['s_per_informative_sample'] * 1e3:.1f} "
                         f"| {s['generated_per_trained']:.2f} | {s['informative_frac']:.2f} "
                         f"| {s['eval_start']:.3f} -> {s['eval_end']:.3f} | {s['eval_gain_per_min']:+.3f} |")
    return "\n".join(lines)


def plot(data: dict, figure: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(data), figsize=(5.5 * len(data), 4), squeeze=False)
    for ax, (task, entry) in zip(axes[0], data.items()):
        for arm, s in entry["arms"].items():
            curve = s["eval_curve"]
            ax.plot([c[2] / 60 for c in curve], [c[1] for c in curve], marker="o", label=arm)
        ax.set(title=f"{task}: held-out greedy accuracy", xlabel="RL wall-clock (min, training steps only)",
               ylabel="eval_accuracy")
        ax.legend()
    fig.tight_layout()
    figure.parent.mkdir(parents=True, exist_ok=True)
    tmp = figure.with_name(f".{figure.name}.{os.getpid()}.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, figure)


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_batch_filling")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--report", action="store_true", help="only print the table and draw the figure")
    args = parser.parse_args()
    data = json.loads(args.results.read_text()) if args.report else run(args.tasks, args.arms, args.out, args.results)
    plot(data, REPO / "docs" / "figures" / f"{args.results.stem}.png")
    print(report(data))


if __name__ == "__main__":
    main()
