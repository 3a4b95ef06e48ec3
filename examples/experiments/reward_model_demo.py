"""GSPO with a learned reward model as the only reward, on the CPU demo task: does the verifier's held-out
accuracy rise with the reward model's score, and does retraining on the policy's own samples keep it so?

    python examples/experiments/reward_model_demo.py run --scale full --out runs/reward_model_demo
    python examples/experiments/reward_model_demo.py report     # the figure and the docs/rewards.md block

``run``: (1) round 0's reward model, trained by ``examples/make_demo_reward_model.py`` on written candidate
responses labelled by the sort verifier; (2) per seed, one warm start of the policy (the config's supervised
stage, ``train.steps=0``) that every run of that seed starts from (``--init-from``); (3) per round, GSPO on
seed 0 with that round's reward model as the only reward (``examples/cpu_demo_reward_model.yaml``; the
verifier at weight 0 as the monitor), logging every step's sampled responses; the next round's reward model
is trained from scratch on the candidates plus every response the rounds so far sampled, labelled by the
verifier (the usual remedy for reward hacking: label the policy's own samples and retrain); (4) the last
round's reward model trains the other seeds as well. Every run's per-step metrics go into one results file
(``benchmarks/results/reward_model_demo.json`` by default; rewritten after every run; what it holds is not
run again). ``report`` reads only that file: it draws ``docs/figures/reward_model_demo/score_vs_accuracy.png``
(the reward model's mean score and the verifier's accuracy per step, one panel per round) and rewrites the
block between the ``<!-- reward_model_demo:begin -->`` / ``<!-- reward_model_demo:end -->`` markers of
docs/rewards.md.

Scales: ``full`` (round 0 only, 3 seeds; about 15 minutes on 2 CPU cores, most of it training the reward
model; ``--rounds N`` adds retraining rounds) and ``ci`` (a few steps of everything, one round after the first,
one seed: the pipeline, not the science).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from gspo_megatron.testing.experiment_runs import (experiment_parser, load_script, publish_block, read_metrics,
                                                    train_run, write_json)

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "cpu_demo_reward_model.yaml"
MAKE_RM = REPO / "examples" / "make_demo_reward_model.py"
DATA_TRAIN = REPO / "examples" / "data" / "sort" / "train.jsonl"
RESULTS = REPO / "benchmarks" / "results" / "reward_model_demo.json"
FIGURES = REPO / "docs" / "figures" / "reward_model_demo"
DOC = REPO / "docs" / "rewards.md"
BEGIN, END = "<!-- reward_model_demo:begin -->", "<!-- reward_model_demo:end -->"

SCALES = {
    "full": {"rounds": 0, "seeds": 3, "rm": [], "sampled_prompts": 1000000, "samples_per_prompt": 8, "run": []},
    "ci": {"rounds": 1, "seeds": 1, "rm": ["--steps", "5"], "sampled_prompts": 16, "samples_per_prompt": 2,
           "run": ["train.steps=2", "sft.steps=2", "eval.every_steps=1", "eval.num_prompts=8", "eval.pass_k=1",
                   "train.prompts_per_step=4"]},
}
# reward_mean is the reward model's normalised score (the only weighted term); the verifier's are the monitors
KEYS = ("reward_mean", "reward/synthetic/mean", "eval_accuracy", "response_length_mean", "time_step_s")


def eval_outputs(checkpoint: Path, dataset: Path, prompts: int, k: int, path: Path, env: dict) -> None:
    """``gspo-megatron eval --outputs``: the checkpoint's greedy response and ``k`` samples for each of the
    first ``prompts`` prompts of ``dataset``, written to ``path``."""
    cmd = [sys.executable, "-m", "gspo_megatron.cli", "eval", "--checkpoint", str(checkpoint), "--dataset",
           str(dataset), "--k", str(k), "--num-prompts", str(prompts), "--outputs", str(path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stderr[-3000:]}")


def _rm_override(rm_dir: Path) -> str:
    return f"rewards.terms[0].reward_model.path={rm_dir}"


def _seed_overrides(seed: int) -> list[str]:
    return [f"train.seed={seed}", f"model.init_seed={1234 + seed}"]


def run(scale: str, out: Path, results: Path, rounds: int | None, seeds: int | None, extra: list[str]) -> dict:
    settings = {**SCALES[scale], "run": SCALES[scale]["run"] + extra}
    n_rounds = settings["rounds"] if rounds is None else rounds
    n_seeds = seeds or settings["seeds"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    make_rm = load_script(MAKE_RM)
    data = {"scale": scale, "settings": settings, "overrides": settings["run"], "reward_models": {},
            "warm_start": {}, "rounds": {}, "seeds": {}}
    if results.is_file():  # what the file holds with the same settings is not run again
        done = json.loads(results.read_text())
        if done.get("scale") == scale and done.get("settings") == settings:
            data = done

    def run_one(run_dir: Path, overrides: list[str], init_from: Path | None = None) -> dict:
        wall = train_run(CONFIG, run_dir, ["logging.console=false", "logging.tensorboard=false", *settings["run"],
                                           *overrides], env, REPO, init_from)
        return {"wall_s": wall, **read_metrics(run_dir, KEYS)}

    def warm_start(seed: int) -> Path:
        """The supervised stage alone (``train.steps=0``), evaluated by the verifier: no reward model yet."""
        warm_dir = out / "warm_start" / f"seed{seed}"
        if str(seed) not in data["warm_start"]:
            data["warm_start"][str(seed)] = run_one(warm_dir, _seed_overrides(seed) + [
                "train.steps=0", "rewards.terms=[{name: synthetic}]"])
            write_json(results, data)
        return warm_dir / "checkpoints" / "step_000000"

    def warm_samples() -> Path:
        """Seed 0's warm-start policy's responses to every training prompt (greedy and 8 samples each)."""
        path = out / "warm_samples.jsonl"
        if not path.is_file():
            eval_outputs(warm_start(0), DATA_TRAIN, settings["sampled_prompts"], settings["samples_per_prompt"], path,
                         env)
        return path

    def reward_model(r: int) -> Path:
        """Round ``r``'s reward model: the candidates, the warm start's samples and rounds 0..r-1's responses."""
        rm_dir = out / "reward_models" / f"round{r}"
        if str(r) not in data["reward_models"] or not rm_dir.is_dir():
            samples = [str(warm_samples())] + [str(out / "rounds" / f"round{k}" / "completions.jsonl")
                                              for k in range(r)]
            data["reward_models"][str(r)] = make_rm.main(["--out", str(rm_dir), *settings["rm"],
                                                          "--policy-samples", *samples])
            write_json(results, data)
        return rm_dir

    for r in range(n_rounds + 1):
        if str(r) not in data["rounds"]:
            rm_dir = reward_model(r)
            # a response of every prompt of every step: the next round's reward model trains on them
            data["rounds"][str(r)] = run_one(out / "rounds" / f"round{r}", _seed_overrides(0) + [
                "logging.completions_per_step=1000000", _rm_override(rm_dir)], warm_start(0))
            write_json(results, data)
            print(f"round {r}: held-out accuracy {data['rounds'][str(r)]['eval_accuracy'][-1]}", flush=True)
    final = reward_model(n_rounds)
    for seed in range(1, n_seeds):
        if str(seed) not in data["seeds"]:
            data["seeds"][str(seed)] = run_one(out / "final" / f"seed{seed}", _seed_overrides(seed)
                                               + [_rm_override(final)], warm_start(seed))
            write_json(results, data)
    return data


# ---- report ----------------------------------------------------------------------------------------------

def _series(run: dict, key: str) -> tuple[list[int], list[float]]:
    pairs = [(s, v) for s, v in zip(run["steps"], run[key]) if v is not None and math.isfinite(v)]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _rl(run: dict, key: str) -> list[float]:
    """The per-step values of ``key`` over the RL steps (step 0 is the warm start's evaluation)."""
    return [v for s, v in zip(*_series(run, key)) if s > 0]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _quarters(run: dict, key: str) -> tuple[float, float]:
    """(mean over the first quarter of the RL steps, over the last quarter)."""
    values = _rl(run, key)
    q = max(1, len(values) // 4)
    return _mean(values[:q]), _mean(values[-q:])


def summarise(data: dict) -> dict:
    """Per round (seed 0) and per seed of the last round's reward model: the reward model's agreement with the
    verifier, its mean score and the verifier's training reward over the first and last quarter of the steps,
    the held-out accuracy after the warm start and at the end, and the best held-out accuracy on the way."""
    def one(run: dict) -> dict:
        _, acc = _series(run, "eval_accuracy")
        return {"score": _quarters(run, "reward_mean"), "verifier": _quarters(run, "reward/synthetic/mean"),
                "eval_start": acc[0], "eval_end": acc[-1], "eval_max": max(acc)}

    rounds = {r: {**one(run), "rm": data["reward_models"][r]} for r, run in data["rounds"].items()}
    last = str(max(map(int, data["rounds"])))
    seeds = {"0": one(data["rounds"][last]), **{s: one(run) for s, run in data["seeds"].items()}}
    return {"rounds": rounds, "last_round": last, "seeds": seeds}


def figure(data: dict, figures: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = sorted(data["rounds"], key=int)
    fig, axes = plt.subplots(1, len(rounds), figsize=(4 * len(rounds), 3.6), sharey=True, squeeze=False)
    for ax, r in zip(axes[0], rounds):
        run, rm = data["rounds"][r], data["reward_models"][r]
        ax.plot(*_series(run, "reward_mean"), label="reward-model score (the reward)")
        ax.plot(*_series(run, "reward/synthetic/mean"), label="verifier: training reward", alpha=0.7)
        ax.plot(*_series(run, "eval_accuracy"), marker="o", color="black", label="verifier: held-out accuracy")
        ax.set_title(f"round {r}: {rm['policy_samples']} policy samples\n"
                     f"(agreement on held-out candidates {rm['eval_agreement']:.2f})", fontsize=9)
        ax.set_xlabel("GSPO step")
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("score / accuracy")
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.suptitle("GSPO with a learned reward model as the only reward", fontsize=10, y=1.06)
    figures.mkdir(parents=True, exist_ok=True)
    path = figures / "score_vs_accuracy.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _pair(pair: tuple[float, float]) -> str:
    return f"{pair[0]:.2f} -> {pair[1]:.2f}"


def doc_block(data: dict, summary: dict, figure_rel: str) -> str:
    wall = (sum(r["wall_s"] for r in data["rounds"].values()) + sum(r["wall_s"] for r in data["seeds"].values())
            + sum(w["wall_s"] for w in data["warm_start"].values()))
    lines = [BEGIN, "",
             f"Generated by `python examples/experiments/reward_model_demo.py report` from "
             f"`{RESULTS.relative_to(REPO)}` (scale `{data['scale']}`; overrides: "
             f"`{' '.join(data['overrides']) or 'none'}`). Training runs took {wall / 60:.1f} min on this 2-core "
             "machine, one at a time (the reward models' training is not counted). Score and verifier columns: "
             "mean over the first quarter of the GSPO steps -> over the last quarter.", "",
             "| round | policy samples in the reward model's data | its agreement with the verifier (held-out candidates) | "
             "reward-model score | verifier's training reward | held-out accuracy: warm start -> end (best) |",
             "|---|---|---|---|---|---|"]
    for r, s in sorted(summary["rounds"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"| {r} | {s['rm']['policy_samples']} | {s['rm']['eval_agreement']:.3f} | {_pair(s['score'])} | "
                     f"{_pair(s['verifier'])} | {s['eval_start']:.3f} -> {s['eval_end']:.3f} ({s['eval_max']:.3f}) |")
    seeds = summary["seeds"]
    lines += ["", f"Round {summary['last_round']}'s reward model on {len(seeds)} seed(s) (each its own warm start), "
              "held-out accuracy warm start -> end: " + "; ".join(
                  f"seed {k}: {s['eval_start']:.3f} -> {s['eval_end']:.3f}" for k, s in sorted(seeds.items())) + ".",
              "", f"![reward-model score against verifier accuracy]({figure_rel})", "", END]
    return "\n".join(lines)


def report(results: Path, figures: Path, doc: Path | None) -> str:
    data = json.loads(results.read_text())
    summary = summarise(data)
    path = figure(data, figures)
    block = doc_block(data, summary, os.path.relpath(path, (doc or DOC).parent))
    publish_block(block, doc, BEGIN, END)
    print(f"wrote {path}")
    return block


def main(argv: list[str] | None = None) -> None:
    parser = experiment_parser(__doc__.splitlines()[0], SCALES, REPO / "runs" / "reward_model_demo", RESULTS,
                               FIGURES, DOC)
    parser.run.add_argument("--rounds", type=int, default=None)
    parser.run.add_argument("overrides", nargs="*", help="config overrides for every GSPO run (loss.kl_coef=0.1 ...)")
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args.scale, args.out, args.results, args.rounds, args.seeds, args.overrides)
    else:
        report(args.results, args.figures, args.doc)


if __name__ == "__main__":
    main()
