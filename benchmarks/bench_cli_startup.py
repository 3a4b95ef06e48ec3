"""Start-up time of the command line: wall seconds from process start to exit of the commands that must
answer at once: ``--help``, ``plot --help``, ``convert --help``, ``convert megatron-to-hf --help``, a real
``plot`` of a small run folder, and ``convert``'s refusal of a mistyped folder.

    .venv/bin/python benchmarks/bench_cli_startup.py [--repeats 7] [--limit-s 2]

Each command runs ``--repeats`` times as ``python -m gspo_megatron.cli ...`` (what the ``gspo-megatron``
console script runs: it imports ``gspo_megatron.cli`` and calls ``main``), one after another; the median
is reported, with the minimum and maximum. References put the figures in scale: the bare interpreter
(``python -c pass``), ``import torch``, and the imports a real conversion needs before its first output
(torch's distributed checkpoint, Megatron-Core, transformers). Writes benchmarks/results/cli_startup.json;
exits 1 when a command's median reaches ``--limit-s``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "benchmarks" / "results" / "cli_startup.json"
CLI = [sys.executable, "-m", "gspo_megatron.cli"]

def commands(scratch: Path) -> dict[str, tuple[list[str], int]]:
    """name -> (argv, expected exit status): the commands that must answer in under --limit-s."""
    run = scratch / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward_mean": s / 10, "eval_accuracy": s / 20})
                                               + "\n" for s in range(20)))
    return {
        "gspo-megatron --help": (CLI + ["--help"], 0),
        "gspo-megatron plot --help": (CLI + ["plot", "--help"], 0),
        "gspo-megatron convert --help": (CLI + ["convert", "--help"], 0),
        "gspo-megatron convert megatron-to-hf --help": (CLI + ["convert", "megatron-to-hf", "--help"], 0),
        "gspo-megatron plot RUN_DIR (20 steps, PNGs written)": (CLI + ["plot", str(run), "--out", str(scratch / "png")], 0),
        "gspo-megatron convert megatron-to-hf --megatron-dir MISTYPED (refused)":
            (CLI + ["convert", "megatron-to-hf", "--megatron-dir", str(scratch / "missing"), "--out", str(scratch / "o")], 2),
    }


REFERENCES = {
    "python -c pass (the interpreter alone)": ([sys.executable, "-c", "pass"], 0),
    "python -c 'import torch'": ([sys.executable, "-c", "import torch"], 0),
    "imports of a real conversion (torch DCP, megatron.core, transformers)":
        ([sys.executable, "-c", "import torch.distributed.checkpoint, megatron.core, transformers"], 0),
}


def wall_seconds(argv: list[str], status: int, repeats: int) -> list[float]:
    """Wall time of ``repeats`` runs of ``argv`` (each must exit with ``status``), one after another."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
        times.append(time.perf_counter() - started)
        if proc.returncode != status:
            raise SystemExit(f"{' '.join(argv)}: exit {proc.returncode}, expected {status}: {proc.stderr[-2000:]}")
    return times


def summary(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "runs": len(times)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="runs per command (default 7)")
    parser.add_argument("--limit-s", type=float, default=2.0, help="largest allowed median (default 2 s)")
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as scratch:
        limited = commands(Path(scratch))
        rows = {name: summary(wall_seconds(argv, status, args.repeats))
                for name, (argv, status) in {**limited, **REFERENCES}.items()}
    result = {"command": "python benchmarks/bench_cli_startup.py" + (f" --repeats {args.repeats}"
                                                                      if args.repeats != 7 else ""),
              "cpu_count": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine(),
              "load_average_before_after": [load_before[0], os.getloadavg()[0]], "limit_s": args.limit_s,
              "results": rows}
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    width = max(map(len, rows))
    print(f"{'command':<{width}}  median s   min s   max s  ({args.repeats} runs each)")
    for name, row in rows.items():
        print(f"{name:<{width}}  {row['median_s']:8.3f} {row['min_s']:7.3f} {row['max_s']:7.3f}")
    slow = [name for name in limited if rows[name]["median_s"] >= args.limit_s]
    if slow:
        print(f"over {args.limit_s:g} s: {', '.join(slow)}", file=sys.stderr)
        return 1
    print(f"wrote {RESULT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
