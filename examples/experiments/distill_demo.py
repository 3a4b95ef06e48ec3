"""On-policy distillation on the CPU demo task: a teacher trained to high accuracy, then a fresh student of
another shape trained three ways from the same start -- distillation alone, GSPO alone, and both -- with
held-out accuracy against steps.

    python examples/experiments/distill_demo.py run --scale full --out runs/distill_demo
    python examples/experiments/distill_demo.py report          # the figure from the results file

``run``: (1) the teacher, a wider Qwen3-MoE (``TEACHER_SHAPE``) trained on the demo task (``sort``) by the
demo config with a long supervised warm start and GSPO after it; its last training checkpoint is the
teacher folder (``distill.teacher_dir`` takes checkpoint folders; same demo tokenizer and vocabulary);
(2) per seed, one short warm start of the student (the demo's own shape, ``train.steps=0``) that every arm
starts from (``--init-from``), so the arms differ only in the loss; (3) the arms (``ARMS``), one
``gspo-megatron train`` process each. Every run's per-step metrics go into one results file
(``benchmarks/results/distill_demo.json`` by default; rewritten after every run; runs it holds are skipped).
``report`` draws ``docs/figures/distill_demo/accuracy.png`` (mean over seeds, the teacher's accuracy as a
line) from that file alone and prints the numbers.

Scales: ``full`` (3 seeds; about an hour on 2 CPU cores: not run by the tests) and ``ci`` (a few steps of
everything, one seed: the pipeline, not the science).
"""
from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path

from gspo_megatron.testing.experiment_runs import (experiment_parser, read_metrics, replace_block, train_run,
                                                    write_json)

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "cpu_demo.yaml"
RESULTS = REPO / "benchmarks" / "results" / "distill_demo.json"
FIGURES = REPO / "docs" / "figures" / "distill_demo"
DOC = REPO / "docs" / "algorithms.md"
BEGIN, END = "<!-- distill_demo:begin -->", "<!-- distill_demo:end -->"

# another shape than the student (the demo's 64-wide, 4-expert model); same vocabulary and tokenizer
TEACHER_SHAPE = ["model.config.hidden_size=128", "model.config.num_experts=8", "model.config.moe_ffn_hidden_size=128",
                 "model.config.head_dim=32", "model.init_seed=99"]
# k3 in the main arms: on this task k1 (the sampled reverse KL) learned slower at the demo's learning rate and
# collapsed at 1e-3 (docs/algorithms.md, "On-policy distillation"); its arm shows it beside the others
ARMS = {
    "distill": ["distill.only=true", "distill.coef=1.0", "distill.estimator=k3"],
    "gspo": [],
    "both": ["distill.coef=1.0", "distill.estimator=k3"],
    "distill_k1": ["distill.only=true", "distill.coef=1.0", "distill.estimator=k1"],
}
SCALES = {
    # the student's warm start is shorter than the demo's (sft 45 of 60 steps: held-out accuracy about 0.4),
    # so that the teacher (about 0.9) is well ahead of it
    "full": {"seeds": 3, "teacher": ["sft.steps=300", "train.steps=60"],
             "student_warm": ["sft.steps=45"], "arm": ["train.steps=60"]},
    "ci": {"seeds": 1, "teacher": ["sft.steps=5", "train.steps=1", "eval.num_prompts=8", "eval.pass_k=1"],
           "student_warm": ["sft.steps=2", "eval.num_prompts=8", "eval.pass_k=1"],
           "arm": ["train.steps=2", "eval.every_steps=1", "eval.num_prompts=8", "eval.pass_k=1",
                   "train.prompts_per_step=4"]},
}
KEYS = ("eval_accuracy", "reward_mean", "distill_kl_mean", "pg_loss", "time_step_s")


def run_one(run_dir: Path, overrides: list[str], env: dict, init_from: Path | None = None) -> float:
    """One ``gspo-megatron train`` run of this experiment's config; returns its wall time."""
    return train_run(CONFIG, run_dir, ["logging.console=false", "logging.tensorboard=false", *overrides], env, REPO,
                     init_from)


def read_run(run_dir: Path) -> dict:
    return read_metrics(run_dir, KEYS)


def last_checkpoint(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").glob("step_[0-9]*"))[-1]


def run(scale: str, out: Path, results: Path, seeds: int | None) -> dict:
    settings = SCALES[scale]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    data = {"scale": scale, "teacher_shape": TEACHER_SHAPE, "teacher_settings": settings["teacher"],
            "student_settings": settings["student_warm"] + settings["arm"], "arms": ARMS, "teacher": None, "runs": {}}
    if results.is_file():  # what the file holds with the same settings is not run again
        done = json.loads(results.read_text())
        if all(done.get(k) == data[k] for k in ("scale", "teacher_shape", "teacher_settings")):
            data["teacher"] = done["teacher"]
            if done.get("student_settings") == data["student_settings"]:
                data["runs"] = {arm: runs for arm, runs in done["runs"].items() if done["arms"].get(arm) == ARMS.get(arm)}
    teacher_dir = out / "teacher"
    if data["teacher"] is None:
        wall = run_one(teacher_dir, TEACHER_SHAPE + settings["teacher"], env)
        data["teacher"] = {"wall_s": wall, **read_run(teacher_dir)}
        write_json(results, data)
    teacher = last_checkpoint(teacher_dir)
    print(f"teacher: {teacher} (held-out accuracy {data['teacher']['eval_accuracy'][-1]})", flush=True)
    tag = "_".join(data["student_settings"]).replace("=", "")  # runs of other student settings stay apart
    for seed in range(seeds or settings["seeds"]):
        seed_args = [f"train.seed={seed}", f"model.init_seed={1234 + seed}"]
        warm = out / "student_warm" / tag / f"seed{seed}"
        if not (warm / "checkpoints" / "step_000000").is_dir():
            run_one(warm, settings["student_warm"] + seed_args + ["train.steps=0"], env)
        for arm, overrides in ARMS.items():
            if str(seed) in data["runs"].get(arm, {}):
                continue
            teacher_args = [f"distill.teacher_dir={teacher}"] if arm != "gspo" else []
            run_dir = out / "arms" / tag / arm / f"seed{seed}"
            wall = run_one(run_dir, settings["arm"] + seed_args + overrides + teacher_args, env,
                           init_from=warm / "checkpoints" / "step_000000")
            data["runs"].setdefault(arm, {})[str(seed)] = {"wall_s": wall, **read_run(run_dir)}
            write_json(results, data)
            print(f"{arm} seed {seed}: {wall:.0f} s", flush=True)
    return data


def accuracy_curves(data: dict) -> dict[str, tuple[list[int], list[float]]]:
    """Per arm, the evaluated steps and the held-out accuracy there, averaged over seeds."""
    out = {}
    for arm, runs in data["runs"].items():
        by_step: dict[int, list[float]] = {}
        for r in runs.values():
            for step, acc in zip(r["steps"], r["eval_accuracy"]):
                if acc is not None and math.isfinite(acc):
                    by_step.setdefault(step, []).append(acc)
        steps = sorted(by_step)
        out[arm] = (steps, [sum(by_step[s]) / len(by_step[s]) for s in steps])
    return out


def _spread(values: list[float]) -> str:
    mean = sum(values) / len(values)
    return f"{mean:.3f}" + (f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else "")


def doc_block(data: dict, figure_rel: str) -> str:
    """The docs/algorithms.md block: per arm over seeds, held-out accuracy after the warm start, at the end and
    its best, the teacher's KL (estimator value) at the first and last step, and the wall time."""
    teacher = [a for a in data["teacher"]["eval_accuracy"] if a is not None][-1]
    lines = [BEGIN, "", f"Generated by `python examples/experiments/distill_demo.py report` from "
             f"`{RESULTS.relative_to(REPO)}` (scale `{data['scale']}`; teacher `{' '.join(data['teacher_settings'])}` "
             f"with `{' '.join(TEACHER_SHAPE)}`: held-out accuracy {teacher:.3f}; student warm start and arms "
             f"`{' '.join(data['student_settings'])}`). Means over seeds ± sample std.", "",
             "| arm | settings | seeds | held-out acc. start | end | best on the way | distill_kl_mean first -> last step "
             "| wall s per run |", "|---|---|---|---|---|---|---|---|"]
    for arm, runs in data["runs"].items():
        evals = [[a for a in r["eval_accuracy"] if a is not None] for r in runs.values()]
        kls = [[k for k in r["distill_kl_mean"] if k is not None] for r in runs.values()]
        kl = (f"{sum(k[0] for k in kls) / len(kls):.2f} -> {sum(k[-1] for k in kls) / len(kls):.2f}"
              if all(kls) else "(no teacher)")
        lines.append(f"| {arm} | `{' '.join(data['arms'][arm]) or 'GSPO only'}` | {len(runs)} | "
                     f"{_spread([e[0] for e in evals])} | {_spread([e[-1] for e in evals])} | "
                     f"{_spread([max(e) for e in evals])} | {kl} | {sum(r['wall_s'] for r in runs.values()) / len(runs):.0f} |")
    lines += ["", f"![held-out accuracy against steps]({figure_rel})", "", END]
    return "\n".join(lines)


def report(results: Path, figures: Path, doc: Path | None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(results.read_text())
    curves = accuracy_curves(data)
    teacher = [a for a in data["teacher"]["eval_accuracy"] if a is not None][-1]
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, (steps, acc) in curves.items():
        ax.plot(steps, acc, marker="o", label=arm)
        print(f"{arm}: held-out accuracy {acc[0]:.3f} at step {steps[0]} -> {acc[-1]:.3f} at step {steps[-1]} "
              f"(mean of {len(data['runs'][arm])} seed(s))")
    ax.axhline(teacher, color="grey", linestyle="--", label=f"teacher ({teacher:.2f})")
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_ylim(0, 1)
    ax.set_title(f"On-policy distillation on the demo task ({data['scale']} scale)")
    ax.legend()
    figures.mkdir(parents=True, exist_ok=True)
    path = figures / "accuracy.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")
    if doc is not None:
        replace_block(doc, BEGIN, END, doc_block(data, os.path.relpath(path, doc.parent)))
        print(f"rewrote the {BEGIN} block of {doc}")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = experiment_parser(__doc__.splitlines()[0], SCALES, REPO / "runs" / "distill_demo", RESULTS, FIGURES, DOC)
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args.scale, args.out, args.results, args.seeds)
    else:
        report(args.results, args.figures, args.doc)


if __name__ == "__main__":
    main()
