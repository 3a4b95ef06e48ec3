"""The routing-drift map: how much of a MoE's expert routing one RL update changes, against depth, experts,
top-k, learning rate, warm-start length and precision, on the CPU demo task.

    python examples/experiments/drift_map.py run --scale full --out runs/drift_map    # resumable, point by point
    python examples/experiments/drift_map.py report      # figures + the docs/training.md block, from the results

The paper (GSPO, section 5.3) reports that after each RL update of a 48-layer, 128-expert top-8 model about
10 % of the experts activated for the same tokens change. ``run`` measures the same statistic here
(``routing_drift``: per (token, layer), the fraction of the k activated experts that changed after one
gradient update, read on the step's second mini-batch; trainer/loop.py ``_update``) for every point of
``POINTS``: a Qwen3-MoE of that shape on the demo's sort task (``examples/cpu_demo.yaml``), a supervised warm
start of ``warm`` steps (``train.steps=0``; shared by every point with the same model, warm start and seed),
then ``rl_steps`` GRPO steps at learning rate ``lr`` from it (``--init-from``), each step one drift reading.
Per point and seed it keeps the mean drift over the steps, the drift of each layer, the set rate (the
fraction of (token, layer) whose expert set changed at all) and, from the same updates, the spread of the
token-level importance ratios against the sequence-level ones (max - min of each, and the mean |log ratio|
per token). One results file (``benchmarks/results/drift_map.json`` by default) is rewritten after every run;
what it holds is not run again, so an interrupted ``run`` continues. A run that fails (a setting that does not
run here) is recorded with its error, reported, and tried again by the next ``run``. ``report`` reads only that
file.

Scales: ``full`` (every point, 2 seeds) and ``ci`` (two tiny points, one seed, two steps: the pipeline).
"""
from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path

from gspo_megatron.testing.experiment_runs import (experiment_parser, publish_block, read_metrics, train_run,
                                                    write_json)

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "cpu_demo.yaml"
RESULTS = REPO / "benchmarks" / "results" / "drift_map.json"
FIGURES = REPO / "docs" / "figures" / "drift_map"
DOC = REPO / "docs" / "training.md"
BEGIN, END = "<!-- drift_map:begin -->", "<!-- drift_map:end -->"
PAPER_DRIFT = 0.10  # section 5.3: 48 layers, 128 experts, top-8


def point(layers: int, experts: int, topk: int, lr: float = 3e-4, warm: int = 60, precision: str = "fp32") -> dict:
    return {"layers": layers, "experts": experts, "topk": topk, "lr": lr, "warm": warm, "precision": precision}


# every axis around one centre (4 layers, 16 experts, top-4, lr 3e-4, 60 warm-start steps, fp32); the cheap axes
# first, so that an interrupted map has them (run order is this order; the deep models cost most)
AXES = {
    "lr": [point(4, 16, 4, lr=lr) for lr in (3e-5, 1e-4, 3e-4, 1e-3, 3e-3)],
    "warm": [point(4, 16, 4, warm=w) for w in (0, 20, 60, 200)],
    "topk": [point(4, 64, k) for k in (2, 4, 8)],
    "experts": [point(4, e, min(4, e // 2)) for e in (4, 16, 64, 128)],
    "precision": [point(4, 16, 4, precision=p) for p in ("fp32", "bf16")],
    "depth": [point(n, 16, 4) for n in (2, 4, 8, 16, 48)],
    "paper_shape": [point(48, 128, 8)],
    # controls: an update too small to change a weight (lr > 0 is required), so any drift read is numerics
    "zero_update": [point(4, 16, 4, lr=1e-10, precision=p) for p in ("fp32", "bf16")],
}
SCALES = {
    "full": {"seeds": 2, "rl_steps": 4, "axes": AXES, "overrides": []},
    "ci": {"seeds": 1, "rl_steps": 2, "axes": {"depth": [point(1, 4, 2, warm=2), point(2, 4, 2, warm=2)]},
           "overrides": ["train.prompts_per_step=4", "rollout.samples_per_prompt=4", "train.minibatches_per_step=2"]},
}
KEYS = ("routing_drift", "routing_drift_set", "token_ratio_max", "token_ratio_min", "seq_ratio_max", "seq_ratio_min",
        "abs_log_ratio_mean", "reward_mean", "time_step_s")


def point_key(p: dict) -> str:
    return f"L{p['layers']}_E{p['experts']}_k{p['topk']}_lr{p['lr']:g}_w{p['warm']}_{p['precision']}"


def model_overrides(p: dict) -> list[str]:
    return [f"model.config.num_layers={p['layers']}", f"model.config.num_experts={p['experts']}",
            f"model.config.moe_router_topk={p['topk']}", "model.config.moe_ffn_hidden_size=32",
            f"model.precision={p['precision']}"]


def _mean(values: list[float]) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else float("nan")


def measure(run_dir: Path, layers: int) -> dict:
    """Per-run means over the RL steps of the drift, each layer's drift and the ratio spreads."""
    m = read_metrics(run_dir, KEYS + tuple(f"routing_drift/layer{i}" for i in range(layers)))
    rl = [i for i, s in enumerate(m["steps"]) if s > 0]
    mean = {k: _mean([m[k][i] for i in rl]) for k in KEYS}
    mean["per_layer"] = [_mean([m[f"routing_drift/layer{j}"][i] for i in rl]) for j in range(layers)]
    mean["drift_per_step"] = [m["routing_drift"][i] for i in rl]
    mean["token_ratio_spread"] = mean.pop("token_ratio_max") - mean.pop("token_ratio_min")
    mean["seq_ratio_spread"] = mean.pop("seq_ratio_max") - mean.pop("seq_ratio_min")
    return mean


def measure_point(p: dict, seed: int, rl_steps: int, common: list[str], out: Path, env: dict, data: dict,
                  results: Path) -> dict:
    """One point and seed: its warm start (made once, recorded in ``data``), then ``rl_steps`` GRPO steps from
    it; returns ``measure`` of them and the wall time. A run that fails raises RuntimeError."""
    seed_args = [f"train.seed={seed}", f"model.init_seed={1234 + seed}"]
    warm_key = f"L{p['layers']}_E{p['experts']}_k{p['topk']}_w{p['warm']}_{p['precision']}_s{seed}"
    warm_dir = out / "warm" / warm_key
    if warm_key not in data["warm_starts"]:
        wall = train_run(CONFIG, warm_dir, common + model_overrides(p) + seed_args + [
            f"sft.steps={p['warm']}", "train.steps=0"], env, REPO)
        data["warm_starts"][warm_key] = {"wall_s": wall}
        write_json(results, data)
    run_dir = out / "rl" / point_key(p) / f"seed{seed}"
    wall = train_run(CONFIG, run_dir, common + model_overrides(p) + seed_args + [
        "loss.algorithm=grpo", f"optimizer.lr={p['lr']}", f"train.steps={rl_steps}", "sft.steps=0",
        "checkpoint.every_steps=0"], env, REPO, init_from=warm_dir / "checkpoints" / "step_000000")
    return {"wall_s": wall, **measure(run_dir, p["layers"])}


def run(scale: str, out: Path, results: Path, seeds: int | None, axes: list[str] | None) -> dict:
    from rich.progress import Progress

    settings = SCALES[scale]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = ["logging.console=false", "logging.tensorboard=false", "eval.every_steps=0", *settings["overrides"]]
    data = {"scale": scale, "rl_steps": settings["rl_steps"], "overrides": settings["overrides"], "warm_starts": {},
            "points": {}, "axes": {a: [point_key(p) for p in ps] for a, ps in settings["axes"].items()}}
    if results.is_file():
        done = json.loads(results.read_text())
        if all(done.get(k) == data[k] for k in ("scale", "rl_steps", "overrides")):
            data["warm_starts"], data["points"] = done["warm_starts"], done["points"]
    todo = {point_key(p): p for a, ps in settings["axes"].items() if axes is None or a in axes for p in ps}
    n_seeds = seeds or settings["seeds"]
    with Progress() as progress:
        task = progress.add_task(f"{scale}: drift map", total=len(todo) * n_seeds)
        for key, p in todo.items():
            for seed in range(n_seeds):
                done = data["points"].get(key, {}).get("seeds", {}).get(str(seed))
                if done is not None and "failed" not in done:  # a failed run is tried again
                    progress.advance(task)
                    continue
                entry = data["points"].setdefault(key, {"point": p, "seeds": {}})
                try:
                    entry["seeds"][str(seed)] = measure_point(p, seed, settings["rl_steps"], common, out, env, data,
                                                              results)
                    line = f"drift {entry['seeds'][str(seed)]['routing_drift']:.4f}"
                except RuntimeError as err:  # a setting that does not run here (bf16 on CPU?) is a finding
                    entry["seeds"][str(seed)] = {"failed": str(err)[-2000:]}
                    line = f"FAILED: {str(err).splitlines()[-1][:200]}"
                write_json(results, data)
                progress.console.print(f"{key} seed {seed}: {line}")
                progress.advance(task)
    return data


# ---- report ----------------------------------------------------------------------------------------------

def summarise(data: dict) -> dict[str, dict]:
    """Per point: mean and sample std over seeds of the drift, the set rate and the ratio spreads; the mean
    per-layer drift; the mean step time."""
    out = {}
    for key, entry in data["points"].items():
        runs = [r for r in entry["seeds"].values() if "failed" not in r]
        if not runs:
            continue
        stat = {}
        for k in ("routing_drift", "routing_drift_set", "token_ratio_spread", "seq_ratio_spread", "abs_log_ratio_mean",
                  "time_step_s", "reward_mean"):
            values = [r[k] for r in runs if r[k] is not None and math.isfinite(r[k])]
            stat[k] = (_mean(values), statistics.stdev(values) if len(values) > 1 else 0.0)
        stat["per_layer"] = [_mean([r["per_layer"][i] for r in runs]) for i in range(entry["point"]["layers"])]
        out[key] = {"point": entry["point"], "seeds": len(runs), **stat}
    return out


def fit_log_linear(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares of log(y) = a + b log(x): (a, b). Drift against a scale knob, as a power law."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    b = sum((u - mx) * (v - my) for u, v in zip(lx, ly)) / sum((u - mx) ** 2 for u in lx)
    return my - b * mx, b


AXIS_X = {"depth": "layers", "experts": "experts", "topk": "topk", "lr": "lr", "warm": "warm"}


def figures(data: dict, summary: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    out.mkdir(parents=True, exist_ok=True)
    written = []
    axes = [a for a in AXIS_X if any(k in summary for k in data["axes"].get(a, []))]
    fig, panels = plt.subplots(1, max(1, len(axes)), figsize=(3.6 * max(1, len(axes)), 3.4), squeeze=False)
    for ax, axis in zip(panels[0], axes):
        keys = [k for k in data["axes"][axis] if k in summary]
        xs = [summary[k]["point"][AXIS_X[axis]] for k in keys]
        ys, err = [summary[k]["routing_drift"][0] for k in keys], [summary[k]["routing_drift"][1] for k in keys]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3)
        ax.axhline(PAPER_DRIFT, color="grey", linestyle="--", label="paper (48 L, 128 E)")
        ax.set_xscale("log" if axis in ("lr", "experts", "depth") else "linear")
        ax.set_yscale("log")
        ax.set_xticks(xs, [f"{x:g}" for x in xs], fontsize=7)
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(AXIS_X[axis])
        ax.set_title(f"drift vs {axis}", fontsize=9)
    panels[0][0].set_ylabel("experts changed per update (fraction)")
    panels[0][0].legend(fontsize=7)
    path = out / "drift_by_axis.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(5, 3.6))
    for key in data["axes"].get("depth", []) + data["axes"].get("paper_shape", []):
        if key in summary:
            layers = summary[key]["per_layer"]
            ax.plot(range(len(layers)), layers, marker=".", label=key.split("_lr")[0])
    ax.set_xlabel("layer index")
    ax.set_ylabel("drift of that layer")
    ax.set_title("Does drift compound with depth?", fontsize=9)
    ax.legend(fontsize=7)
    path = out / "drift_per_layer.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(5, 3.6))
    xs = [summary[k]["routing_drift"][0] for k in summary]
    ax.scatter(xs, [summary[k]["token_ratio_spread"][0] for k in summary], label="token ratios (max - min)")
    ax.scatter(xs, [summary[k]["seq_ratio_spread"][0] for k in summary], label="sequence ratios (max - min)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("routing drift per update")
    ax.set_ylabel("ratio spread in the same updates")
    ax.legend(fontsize=7)
    path = out / "ratio_spread.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    written.append(path)
    return written


def _fmt(pair: tuple[float, float], digits: int = 3) -> str:
    mean, std = pair
    return "n/a" if math.isnan(mean) else f"{mean:.{digits}g}" + (f" ± {std:.1g}" if std else "")


def doc_block(data: dict, summary: dict, figures_rel: str) -> str:
    lines = [BEGIN, "", f"Generated by `python examples/experiments/drift_map.py report` from "
             f"`{RESULTS.relative_to(REPO)}` (scale `{data['scale']}`, {data['rl_steps']} GRPO steps per point and "
             f"seed, one drift reading each; overrides: `{' '.join(data['overrides']) or 'none'}`). Means over seeds "
             "± sample std.", "",
             "| axis | layers | experts | top-k | lr | warm start | precision | seeds | drift per update | set rate | "
             "token ratio spread | sequence ratio spread | s / step |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for axis, keys in data["axes"].items():
        for key in keys:
            if key not in summary:
                continue
            s, p = summary[key], summary[key]["point"]
            lines.append(f"| {axis} | {p['layers']} | {p['experts']} | {p['topk']} | {p['lr']:g} | {p['warm']} | "
                         f"{p['precision']} | {s['seeds']} | {_fmt(s['routing_drift'])} | {_fmt(s['routing_drift_set'])} | "
                         f"{_fmt(s['token_ratio_spread'])} | {_fmt(s['seq_ratio_spread'])} | {_fmt(s['time_step_s'])} |")
    failed = [(k, seed, r["failed"].strip().splitlines()[-1][:160]) for k, e in data["points"].items()
              for seed, r in e["seeds"].items() if "failed" in r]
    if failed:
        lines += ["", "Runs that failed (kept out of the table): " + "; ".join(
            f"`{k}` seed {seed}: {why}" for k, seed, why in failed) + "."]
    for axis in ("depth", "lr"):
        keys = [k for k in data["axes"].get(axis, []) if k in summary and summary[k]["routing_drift"][0] > 0]
        if len(keys) >= 2:
            xs = [summary[k]["point"][AXIS_X[axis]] for k in keys]
            a, b = fit_log_linear(xs, [summary[k]["routing_drift"][0] for k in keys])
            lines += ["", f"Fitted over the {axis} axis: drift ≈ {math.exp(a):.3g} × {AXIS_X[axis]}^{b:.2f}"
                      + (f"; extrapolated (an extrapolation, not a measurement) to 48 layers: {math.exp(a) * 48 ** b:.3g}"
                         if axis == "depth" else "") + "."]
    lines += ["", f"![drift by axis]({figures_rel}/drift_by_axis.png)",
              f"![drift per layer]({figures_rel}/drift_per_layer.png)",
              f"![ratio spread]({figures_rel}/ratio_spread.png)", "", END]
    return "\n".join(lines)


def report(results: Path, figures_dir: Path, doc: Path | None) -> dict:
    data = json.loads(results.read_text())
    summary = summarise(data)
    figures(data, summary, figures_dir)
    block = doc_block(data, summary, os.path.relpath(figures_dir, (doc or DOC).parent))
    publish_block(block, doc, BEGIN, END)
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = experiment_parser(__doc__.splitlines()[0], SCALES, REPO / "runs" / "drift_map", RESULTS, FIGURES, DOC)
    parser.run.add_argument("--axes", nargs="*", default=None, help=f"only these axes (of {sorted(AXES)})")
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args.scale, args.out, args.results, args.seeds, args.axes)
    else:
        report(args.results, args.figures, args.doc)


if __name__ == "__main__":
    main()
