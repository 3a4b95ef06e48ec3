"""Reward throughput: the worker pool against one process, side by side in one run.

    .venv/bin/python benchmarks/bench_rewards.py [--math 1000] [--code 200] [--workers 2]

Math: ``--math`` responses in groups of 8 per prompt (as GSPO samples them), gold answers in mixed
forms (integers, fractions, LaTeX, decimals, percentages), responses right or wrong, boxed or stated.
Code: ``--code`` responses to a-plus-b style stdin/stdout problems with 3 test cases each, run in the
sandbox (one sandbox per response, one program run per case): right, wrong, or crashing; none hangs.
Each workload is scored once by ``RewardPool(num_workers=--workers)`` and once in-process
(``num_workers=0``); both must give the same rewards. Pool start-up is reported separately and is not
in the throughput. Writes benchmarks/results/rewards.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import track
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gspo_megatron.rewards import RewardConfig, RewardPool  # noqa: E402
from gspo_megatron.typed_config import build  # noqa: E402

RESULT = Path(__file__).resolve().parent / "results" / "rewards.json"
GROUP = 8


def math_workload(n: int, seed: int = 0) -> list[tuple[dict, str]]:
    rng = random.Random(seed)
    items = []
    for p in range(-(-n // GROUP)):
        a, b = rng.randint(1, 40), rng.randint(2, 12)
        forms = [(str(a * b), str(a * b)), (f"\\frac{{{a}}}{{{b}}}", f"{a}/{b}"),
                 (f"{a / 8:g}", f"\\frac{{{a}}}{{8}}"), (f"{a}\\%", f"{a / 100:g}"), (f"{a}\\sqrt{{2}}", f"\\sqrt{{{2 * a * a}}}")]
        gold, equivalent = forms[p % len(forms)]
        for k in range(GROUP):
            right = rng.random() < 0.5
            answer = equivalent if right else f"{a + b + k}"
            style = rng.randrange(3)
            text = (f"We compute step by step. {a} and {b} give \\boxed{{{answer}}}." if style == 0 else
                    f"Working it out, the answer is ${answer}$." if style == 1 else
                    f"Let me think... {b} times something... so {answer}")
            items.append(({"answer": gold}, text))
    return items[:n]


def code_workload(n: int, seed: int = 0) -> list[tuple[dict, str]]:
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        k = rng.randint(2, 9)
        inputs = [f"{rng.randint(0, 99)} {rng.randint(0, 99)}\n" for _ in range(3)]
        tests = {"inputs": inputs, "outputs": [f"{sum(map(int, i.split())) * k}\n" for i in inputs]}
        kind = rng.random()
        if kind < 0.7:
            body = f"a, b = map(int, input().split())\nprint((a + b) * {k})"
        elif kind < 0.9:
            body = f"a, b = map(int, input().split())\nprint(a * b + {k})"
        else:
            body = "a, b = map(int, input().split())\nprint(a / (b - b))"
        items.append(({"tests": tests}, f"Here is the program:\n```python\n{body}\n```"))
    return items


def timed_score(cfg: RewardConfig, items) -> tuple[float, float, list[float]]:
    start = time.perf_counter()
    pool = RewardPool(cfg)
    startup = time.perf_counter() - start
    try:
        pool.score(items[:4])  # warm-up: first math-verify parse, first sandbox launch
        start = time.perf_counter()
        rewards, metrics = pool.score(items)
        elapsed = time.perf_counter() - start
    finally:
        pool.close()
    if metrics["rewards/errors"] or metrics["rewards/timeouts"]:
        raise RuntimeError(f"benchmark batch had errors or timeouts: {metrics}")
    return startup, elapsed, rewards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--math", type=int, default=1000)
    parser.add_argument("--code", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    sandbox = {"case_timeout_s": 5.0, "cpu_time_s": 5}
    workloads = {
        "math": ({"terms": [{"name": "math"}]}, math_workload(args.math)),
        "code": ({"terms": [{"name": "code"}], "code": {"sandbox": sandbox}}, code_workload(args.code)),
    }
    load_before = os.getloadavg()[0]
    jobs = [(name, workers) for name in workloads for workers in (args.workers, 0)]
    measured: dict[tuple[str, int], tuple[float, float, list[float]]] = {}
    for name, workers in track(jobs, description="scoring"):
        section, items = workloads[name]
        cfg = build(RewardConfig, {**section, "num_workers": workers, "timeout_s": 60}, "rewards")
        measured[name, workers] = timed_score(cfg, items)

    results = []
    for name, (_, items) in workloads.items():
        pool_start, pool_s, pool_rewards = measured[name, args.workers]
        _, single_s, single_rewards = measured[name, 0]
        results.append({
            "workload": name, "responses": len(items), "workers": args.workers,
            "pool_s": pool_s, "single_process_s": single_s,
            "pool_responses_per_s": len(items) / pool_s, "single_process_responses_per_s": len(items) / single_s,
            "speedup": single_s / pool_s, "pool_startup_s": pool_start,
            "mean_reward": sum(pool_rewards) / len(pool_rewards), "same_rewards": pool_rewards == single_rewards,
        })
    record = {
        "command": " ".join(["python benchmarks/bench_rewards.py", *sys.argv[1:]]),
        "cpu_count": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine(),
        "load_average_before_after": [load_before, os.getloadavg()[0]],
        "note": "the pool's speedup is bounded by the CPU cores the workers get; this machine is shared",
        "results": results,
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULT.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(RESULT)

    table = Table(title=f"reward throughput (responses/s), {args.workers} workers vs one process")
    for column in ("workload", "responses", "pool", "one process", "speedup", "pool start-up s", "same rewards"):
        table.add_column(column)
    for r in results:
        table.add_row(r["workload"], str(r["responses"]), f"{r['pool_responses_per_s']:.1f}",
                      f"{r['single_process_responses_per_s']:.1f}", f"{r['speedup']:.2f}x",
                      f"{r['pool_startup_s']:.2f}", str(r["same_rewards"]))
    Console().print(table)
    Console().print(f"wrote {RESULT}")


if __name__ == "__main__":
    main()
