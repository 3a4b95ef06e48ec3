"""Our trainer's step at two revisions, side by side in one run: did a change to the rollout schedule change
the step time? (issue #41: the driver redesign must leave the overlap step time unchanged within noise.)

Each revision runs ``benchmarks/bench_trl.py``'s own worker (its ``--ours-worker``: ``Trainer.train_step`` on
the benchmark's tiny Qwen3-MoE, 16 prompts x 8 samples, from the same written HF weights), the baseline from a
git worktree of ``--base``, the other from this checkout. The driver alternates steps, baseline then this
tree, so the two never compete for the cores and drift in the machine's load hits both alike. With
``train.rollout_mode=overlap`` a step is the pipeline's period (the step plus the wait for the batch
generated ahead, as bench_trl reports it).

    .venv/bin/python benchmarks/bench_schedule.py --base 8872fb3 [--steps 30] [--warmup 3]
        [--override train.rollout_mode=overlap] [--out benchmarks/results/schedule_overlap.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_trl import CONFIG, OUR_OVERRIDES, Worker, free_port, write_hf_model, write_report  # noqa: E402


def worktree(base: str, folder: Path) -> Path:
    """A detached worktree of revision ``base`` in ``folder`` (removed by the caller)."""
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(folder), base], check=True)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the baseline revision (a commit, tag or branch)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--override", action="append", default=["train.rollout_mode=overlap"], metavar="KEY=VALUE")
    parser.add_argument("--step-timeout-s", type=float, default=600.0)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "schedule_overlap.json"))
    args = parser.parse_args()

    from rich.progress import track

    from gspo_megatron.trainer.config import load_config

    work = Path(tempfile.mkdtemp(prefix="bench-schedule-"))
    base_tree = worktree(args.base, work / "base")
    try:
        config = load_config(CONFIG, OUR_OVERRIDES + args.override)
        hf_dir = work / "hf"
        write_hf_model(config, hf_dir)
        loadavg_at_start = list(os.getloadavg())
        workers = {}
        for name, tree in (("base", base_tree), ("head", REPO)):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1",
                   "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                   "PYTHONPATH": str(tree)}
            workers[name] = Worker(name, [sys.executable, str(tree / "benchmarks" / "bench_trl.py"), "--ours-worker",
                                          "--hf-dir", str(hf_dir), "--run-dir", str(work / f"run-{name}"),
                                          "--threads", str(args.threads), "--overrides-json", json.dumps(args.override)],
                                   work / f"{name}.log", env)
            workers[name].read(args.step_timeout_s)
        steps: dict[str, list[dict]] = {name: [] for name in workers}
        for _ in track(range(args.warmup + args.steps), description="base / head steps"):
            for name, worker in workers.items():
                steps[name].append(worker.step(args.step_timeout_s))
        for worker in workers.values():
            worker.stop()
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_tree)], check=False)
    median = {name: statistics.median(s["step"] for s in runs[args.warmup:]) for name, runs in steps.items()}
    base_rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.base], capture_output=True,
                              text=True).stdout.strip()
    head_rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
    report = {"command": "python benchmarks/bench_schedule.py " + " ".join(sys.argv[1:]),
              "base": base_rev, "head": head_rev, "overrides": args.override, "warmup_steps": args.warmup,
              "timed_steps": args.steps, "median_step_s": median, "head_over_base": median["head"] / median["base"],
              "cpu_count": os.cpu_count(), "loadavg_at_start": loadavg_at_start, "loadavg_at_end": list(os.getloadavg()),
              "steps": steps}
    print(f"median step: base {base_rev} {median['base']:.3f} s, head {head_rev} {median['head']:.3f} s, "
          f"head / base {report['head_over_base']:.3f}")
    write_report(Path(args.out), report)


if __name__ == "__main__":
    main()
