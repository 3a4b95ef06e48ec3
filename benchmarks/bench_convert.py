"""Checkpoint conversion speed and memory against `cp` of the same bytes, side by side in one run.

    .venv/bin/python benchmarks/bench_convert.py [--size-gb 1.2] [--workdir /tmp] [--keep]

Generates a synthetic Qwen3-MoE-shaped Hugging Face checkpoint (random bf16 safetensors written
directly, shards capped at a quarter of the total (5 files for 1.5 GB) + index; Qwen3-30B-A3B's layer
shapes with a 32k vocabulary, layers added until ``--size-gb`` is reached: one layer is 1.5 GB), then,
each in its own process:

1. ``cp -r`` of the HF folder, then ``sync`` of the copied files (the converters fsync what they write,
   so "cp + sync" is the like-for-like baseline; plain ``cp`` is reported too);
2. ``convert hf-to-megatron``;
3. ``convert megatron-to-hf`` of a checkpoint converted beforehand (with the source as template), whose
   files must equal the source's bytes;
repeated ``--repeat`` times, the best and the median time of each step reported (the machine is shared).
Each step's output is deleted before the next step, so all of them write into the same free memory.

Conversion times are measured inside the converting process around the conversion itself; start-up
(interpreter, imports, and a round trip of a tiny model, which absorbs a one-time first-conversion cost)
is the same for any checkpoint size and is reported separately. Peak memory is the
converting process's peak resident set (VmHWM), next to its peak after imports (the baseline).
Writes benchmarks/results/convert.json and prints a table.
"""
from __future__ import annotations

import argparse
import filecmp
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULT = Path(__file__).resolve().parent / "results" / "convert.json"
# The layers of Qwen3-30B-A3B (hidden 2048, 32 heads in 4 KV groups of dim 128, 128 experts of width 768,
# top-8), so tensors have the real sizes; a 32k vocabulary keeps the embeddings from dominating a small file.
SHAPE = dict(architecture="qwen3_moe", vocab_size=32000, hidden_size=2048, num_attention_heads=32,
             num_key_value_heads=4, head_dim=128, num_experts=128, moe_ffn_hidden_size=768, moe_router_topk=8,
             tie_word_embeddings=False)


def model_config(size_gb: float):
    """The benchmark model: as many layers as it takes to reach ``size_gb`` in bf16."""
    from gspo_megatron.megatron.model_config import ModelConfig

    one = ModelConfig(num_layers=1, **SHAPE).num_parameters() * 2
    per_layer = ModelConfig(num_layers=2, **SHAPE).num_parameters() * 2 - one
    layers = max(1, math.ceil((size_gb * 1e9 - (one - per_layer)) / per_layer))
    return ModelConfig(num_layers=layers, **SHAPE)


def generate(directory: Path, config, shards: int = 4, progress: bool = True) -> int:
    """Random bf16 safetensors for ``config`` (HF names, shards capped at 1/``shards`` of the total, and an
    index), one tensor in memory at a time."""
    import torch
    from rich.progress import track

    from gspo_megatron.conversion.safetensors_io import SafetensorsWriter, TensorSpec, plan_shards, write_index
    from gspo_megatron.conversion.tables import expand

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({**config.to_hf_dict(), "dtype": "bfloat16"}, indent=2))
    (directory / "generation_config.json").write_text(json.dumps({"_from_model_config": True}))
    specs = []
    for entry in expand(config):
        shape = _canonical_shape(entry.megatron, config)
        specs += [TensorSpec(n, tuple(s), torch.bfloat16) for n, s in zip(entry.hf, entry.transform.hf_shapes(shape))]
    total = sum(s.nbytes for s in specs)
    plan = plan_shards(specs, -(-total // shards))
    gen = torch.Generator().manual_seed(0)
    for file, group in plan.files.items():
        writer = SafetensorsWriter(directory / file, group)
        for spec in track(group, description=f"generate {file}", disable=not progress):
            writer.write(spec.name, (torch.randn(spec.shape, generator=gen) * 0.02).to(torch.bfloat16))
        writer.close()
    if plan.index is not None:
        write_index(directory, plan.index)
    return total


def _canonical_shape(name: str, config) -> tuple[int, ...]:
    from gspo_megatron.testing.models import canonical_shapes

    return canonical_shapes(config)[name]


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM). Not ru_maxrss: Linux carries the parent's peak
    over fork + exec into the child's ru_maxrss."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(argv: list[str]) -> None:
    """Run one conversion in this process; print timings and memory as JSON on the last line."""
    start = time.perf_counter()
    from gspo_megatron.conversion import cli, offline
    from gspo_megatron.testing.models import tiny_moe_config

    # Start-up, outside the timed part: imports, and a round trip of a tiny model. The first conversion
    # in a process was ~1.5 s slower than the next ones (1.5 GB: 3.4-3.7 s vs 1.8-2.5 s), a one-time
    # cost that a 0.3 s tiny round trip absorbs; a conversion of any size pays it once.
    with tempfile.TemporaryDirectory() as tmp:
        tiny = Path(tmp)
        generate(tiny / "hf", tiny_moe_config(), shards=1, progress=False)
        offline.megatron_to_hf(offline.hf_to_megatron(tiny / "hf", tiny / "meg", progress=False), tiny / "back",
                               progress=False)
    baseline = peak_rss_bytes()
    startup_s = time.perf_counter() - start
    start = time.perf_counter()
    code = cli.main(argv)
    seconds = time.perf_counter() - start
    print(json.dumps({"code": code, "seconds": seconds, "startup_s": startup_s,
                      "baseline_rss_bytes": baseline, "peak_rss_bytes": peak_rss_bytes()}))


def run_child(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", *args], stdout=subprocess.PIPE, text=True)
    if proc.returncode:
        raise SystemExit(f"conversion failed: {args}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if result["code"] != 0:
        raise SystemExit(f"conversion exited {result['code']}: {args}")
    return result


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=1.5)
    parser.add_argument("--workdir", default="/tmp")
    parser.add_argument("--repeat", type=int, default=3, help="times each step runs (the best is reported)")
    parser.add_argument("--keep", action="store_true", help="keep the generated folder")
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    config = model_config(args.size_gb)
    work = Path(tempfile.mkdtemp(prefix="gspo-bench-convert-", dir=args.workdir))
    free = shutil.disk_usage(work).free
    if free < 5 * args.size_gb * 1e9:
        raise SystemExit(f"{work}: {free / 1e9:.1f} GB free, the benchmark needs about {5 * args.size_gb:.1f} GB")
    runs: dict[str, list[dict]] = {"cp": [], "hf -> megatron": [], "megatron -> hf": []}
    try:
        hf, meg_ref = work / "hf", work / "meg-ref"
        nbytes = generate(hf, config)
        run_child(["hf-to-megatron", "--hf-dir", str(hf), "--out", str(meg_ref)])  # the megatron -> hf input
        for rep in range(args.repeat):  # the machine is shared: each step is timed --repeat times, best kept
            # each step's output is deleted before the next step runs, so every step writes into the
            # same amount of free memory (writing new pages is much slower when the kernel must reclaim)
            copy, meg, back = work / f"cp{rep}", work / f"meg{rep}", work / f"back{rep}"
            cp_s = timed(["cp", "-r", str(hf), str(copy)])
            sync_s = timed(["sync", *map(str, sorted(copy.iterdir()))])
            runs["cp"].append({"cp_s": cp_s, "sync_s": sync_s})
            shutil.rmtree(copy)
            runs["hf -> megatron"].append(run_child(["hf-to-megatron", "--hf-dir", str(hf), "--out", str(meg)]))
            shutil.rmtree(meg)
            runs["megatron -> hf"].append(run_child(["megatron-to-hf", "--megatron-dir", str(meg_ref),
                                                     "--out", str(back), "--hf-template", str(hf)]))
            files = sorted(p.name for p in hf.iterdir())
            if not all(filecmp.cmp(hf / f, back / f, shallow=False) for f in files):
                raise SystemExit(f"{back}: the round trip changed the checkpoint")
            shutil.rmtree(back)
    finally:
        if not args.keep:
            shutil.rmtree(work)

    best_cp = min(runs["cp"], key=lambda r: r["cp_s"] + r["sync_s"])
    cp_s = min(r["cp_s"] for r in runs["cp"])
    cp_sync_s = best_cp["cp_s"] + best_cp["sync_s"]
    rows = []
    for name in ("hf -> megatron", "megatron -> hf"):
        result = min(runs[name], key=lambda r: r["seconds"])
        rows.append({
            "direction": name, "seconds": result["seconds"], "all_seconds": [r["seconds"] for r in runs[name]],
            "median_seconds": statistics.median(r["seconds"] for r in runs[name]),
            "startup_s": result["startup_s"], "gb_per_s": nbytes / result["seconds"] / 1e9,
            "ratio_vs_cp_sync": cp_sync_s / result["seconds"], "ratio_vs_cp": cp_s / result["seconds"],
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs[name]),
            "baseline_rss_bytes": min(r["baseline_rss_bytes"] for r in runs[name]),
            "peak_over_baseline_bytes": max(r["peak_rss_bytes"] - r["baseline_rss_bytes"] for r in runs[name]),
            "peak_rss_over_checkpoint": max(r["peak_rss_bytes"] for r in runs[name]) / nbytes,
        })
    record = {
        "command": "python benchmarks/bench_convert.py " + " ".join(sys.argv[1:]),
        "cpu_count": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine(),
        "checkpoint_bytes": nbytes, "num_layers": config.num_layers, "shape": SHAPE, "repeat": args.repeat,
        "cp_s": cp_s, "cp_sync_s": cp_sync_s, "cp_runs": runs["cp"], "cp_gb_per_s": nbytes / cp_s / 1e9,
        "cp_sync_median_s": statistics.median(r["cp_s"] + r["sync_s"] for r in runs["cp"]),
        "cp_sync_gb_per_s": nbytes / cp_sync_s / 1e9, "round_trip_files_identical": True,
        "note": ("best of --repeat runs per step; the source is in the page cache for every step; this 2-core "
                 "machine is shared with other jobs, so absolute figures vary from run to run"),
        "results": rows,
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(record, indent=2) + "\n")

    table = Table(title=f"conversion of a {nbytes / 1e9:.2f} GB Qwen3-MoE-shaped bf16 checkpoint "
                        f"({config.num_layers} layers x {config.num_experts} experts)")
    for column in ("step", "best s", "median s", "GB/s (best)", "vs cp+sync", "vs cp", "peak RSS", "after imports"):
        table.add_column(column, justify="right")
    table.add_row("cp -r", f"{cp_s:.2f}", f"{statistics.median(r['cp_s'] for r in runs['cp']):.2f}",
                  f"{nbytes / cp_s / 1e9:.2f}", "", "1.00", "", "")
    table.add_row("cp -r + sync", f"{cp_sync_s:.2f}", f"{record['cp_sync_median_s']:.2f}",
                  f"{nbytes / cp_sync_s / 1e9:.2f}", "1.00", "", "", "")
    for row in rows:
        table.add_row(row["direction"], f"{row['seconds']:.2f}", f"{row['median_seconds']:.2f}",
                      f"{row['gb_per_s']:.2f}", f"{row['ratio_vs_cp_sync']:.2f}", f"{row['ratio_vs_cp']:.2f}",
                      f"{row['peak_rss_bytes'] / 2**20:.0f} MiB", f"{row['baseline_rss_bytes'] / 2**20:.0f} MiB")
    Console(width=140).print(table)
    print(f"round trip byte-identical in every run; results in {RESULT}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
    else:
        main()
