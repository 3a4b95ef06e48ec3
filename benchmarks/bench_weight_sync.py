"""Weight sync (live Megatron model -> transformers rollout engine) against a plain ``copy_`` of the same bytes.

    .venv/bin/python benchmarks/bench_weight_sync.py [--repeats 3] [--bucket-mb 1 16 256]
                                                     [--out benchmarks/results/weight_sync.json]

Model: Qwen3-MoE, hidden 512, 8 layers, 8 query / 4 KV heads of 64, 16 experts of width 512 (top-2),
vocab 8192, fp32 (~117 M parameters, ~470 MB). Layouts: one process (EP=1), and EP=2 on two gloo ranks
(each rank holds half of the experts; the export broadcasts each expert from its owner). Every rank
holds a full engine, as in the colocated trainer.

Per layout, after one warm-up, repeats interleave for each bucket size:

- ``sync``: ``sync_weights(model, config, engine, bucket_bytes)`` (export + ``engine.update_weights``);
- ``export``: iterating ``export_hf_tensors`` alone (gathers, broadcasts, HF transforms, the copies
  into buckets), buckets dropped;
- ``copy``: ``param.copy_(src)`` over every engine parameter from a same-shaped source, i.e. moving the
  same number of bytes once (the floor any sync pays; once per repeat, independent of the bucket size).

Each timing is the slowest rank's (a collective ends when its last rank does), ranks start each timed
step together (barrier). Minor page faults (rank 0, per timed step) count fresh memory being touched.
The figures are medians over repeats; read the ratios, the absolute times move with the load of the
shared 2-core machine. Writes a JSON result and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULT = Path(__file__).resolve().parent / "results" / "weight_sync.json"
SHAPE = dict(architecture="qwen3_moe", vocab_size=8192, hidden_size=512, num_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, num_experts=16, moe_ffn_hidden_size=512, moe_router_topk=2,
             max_position_embeddings=1024)
MB = 1024 * 1024


def _slowest(elapsed_s: float) -> float:
    """The largest of the ranks' times (all ranks call this in the same order)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([elapsed_s], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timed(fn, faults: list[int]) -> float:
    """The slowest rank's time of ``fn()``; appends this rank's minor page faults during it to ``faults``."""
    import resource

    import torch.distributed as dist

    dist.barrier()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return _slowest(elapsed)


def worker(rank: int, world_size: int, expert_parallel: int, bucket_sizes: list[int], repeats: int) -> dict:
    """One layout: build the model and engine, then time sync / export / copy (see the module docstring)."""
    import torch
    from rich.progress import track

    from gspo_megatron.conversion.export import export_hf_tensors
    from gspo_megatron.megatron import sharding
    from gspo_megatron.megatron.model import build_model
    from gspo_megatron.megatron.model_config import ModelConfig
    from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel
    from gspo_megatron.rollout.hf_engine import HFRolloutEngine
    from gspo_megatron.rollout.weight_sync import sync_weights
    from gspo_megatron.testing.models import canonical_weights

    config = ModelConfig(**SHAPE)
    parallel = ParallelConfig(expert_parallel=expert_parallel)
    initialize_model_parallel(parallel, seed=0)
    model = build_model(config, parallel)
    sharding.load_full_state_dict(model, canonical_weights(config, seed=1))
    engine = HFRolloutEngine(config.to_hf_config(), init_seed=100 + rank)
    params = list(engine.model.parameters())  # tied parameters once
    sources = [p.detach().clone() for p in params]
    copy_bytes = sum(p.numel() * p.element_size() for p in params)
    local_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def copy_all():
        with torch.no_grad():
            for dst, src in zip(params, sources):
                dst.copy_(src)

    def export_only(bucket_bytes: int) -> int:
        return sum(1 for _ in export_hf_tensors(model, config, bucket_bytes))

    stats = sync_weights(model, config, engine, max(bucket_sizes))  # warm-up
    if int(stats["sync_bytes"]) != copy_bytes:
        raise RuntimeError(f"sync sent {stats['sync_bytes']} bytes, the engine holds {copy_bytes}")
    copy_all()
    buckets = {b: export_only(b) for b in bucket_sizes}
    times = {"copy_s": [], **{f"sync_s@{b}": [] for b in bucket_sizes}, **{f"export_s@{b}": [] for b in bucket_sizes}}
    faults = {key: [] for key in times}
    work = [(r, b) for r in range(repeats) for b in [None, *bucket_sizes]]
    label = f"EP={expert_parallel} on {world_size} rank(s)"
    for _, bucket in (track(work, description=label) if rank == 0 else work):
        if bucket is None:
            times["copy_s"].append(_timed(copy_all, faults["copy_s"]))
            continue
        key = f"sync_s@{bucket}"
        times[key].append(_timed(lambda: sync_weights(model, config, engine, bucket), faults[key]))
        key = f"export_s@{bucket}"
        times[key].append(_timed(lambda: export_only(bucket), faults[key]))
    return {"bytes": copy_bytes, "megatron_local_bytes": local_bytes, "buckets": buckets, "times": times,
            "minor_page_faults": faults, "weight_version": engine.weight_version}


def summarize(layout: str, result: dict, bucket_sizes: list[int]) -> list[dict]:
    copy_s = statistics.median(result["times"]["copy_s"])
    faults = result["minor_page_faults"]
    rows = []
    for b in bucket_sizes:
        sync_s = statistics.median(result["times"][f"sync_s@{b}"])
        export_s = statistics.median(result["times"][f"export_s@{b}"])
        rows.append({"layout": layout, "bucket_mb": b / MB, "buckets": result["buckets"][b],
                     "sync_s": sync_s, "export_s": export_s, "copy_s": copy_s,
                     "sync_gb_per_s": result["bytes"] / sync_s / 1e9, "copy_gb_per_s": result["bytes"] / copy_s / 1e9,
                     "sync_over_copy": sync_s / copy_s, "export_share_of_sync": export_s / sync_s,
                     "sync_minor_faults_rank0": statistics.median(faults[f"sync_s@{b}"]),
                     "copy_minor_faults_rank0": statistics.median(faults["copy_s"])})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[1, 16, 256])
    parser.add_argument("--out", default=str(RESULT))
    args = parser.parse_args()

    import torch
    import transformers
    from rich.console import Console
    from rich.table import Table

    from gspo_megatron.megatron.model_config import ModelConfig
    from gspo_megatron.megatron.spawn import run_distributed

    bucket_sizes = [int(mb * MB) for mb in args.bucket_mb]
    loadavg_at_start = list(os.getloadavg())
    results = {
        "1 process": run_distributed(worker, 1, (1, bucket_sizes, args.repeats))[0],
        "EP=2, 2 ranks": run_distributed(worker, 2, (2, bucket_sizes, args.repeats))[0],
    }
    rows = [row for layout, result in results.items() for row in summarize(layout, result, bucket_sizes)]

    table = Table(title=f"weight sync vs copy_ of the same {results['1 process']['bytes'] / 1e6:.0f} MB (medians)")
    for column in ("layout", "bucket MB", "buckets", "sync s", "export s", "copy_ s", "sync GB/s", "copy_ GB/s",
                   "sync / copy_", "page faults / sync"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["layout"], f"{r['bucket_mb']:g}", str(r["buckets"]), f"{r['sync_s']:.3f}",
                      f"{r['export_s']:.3f}", f"{r['copy_s']:.3f}", f"{r['sync_gb_per_s']:.2f}",
                      f"{r['copy_gb_per_s']:.2f}", f"{r['sync_over_copy']:.1f}x",
                      f"{r['sync_minor_faults_rank0']:.0f}")
    Console(width=150).print(table)

    report = {
        "command": "python benchmarks/bench_weight_sync.py " + " ".join(sys.argv[1:]),
        "model": {**SHAPE, "parameters": ModelConfig(**SHAPE).num_parameters(), "dtype": "float32"},
        "bytes_per_sync": results["1 process"]["bytes"],
        "megatron_bytes_per_rank": {k: v["megatron_local_bytes"] for k, v in results.items()},
        "repeats": args.repeats,
        "environment": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "python": platform.python_version(), "cpu_count": os.cpu_count(),
                        "torch_threads_per_rank": 1, "loadavg_at_start": loadavg_at_start},
        "rows": rows,
        "raw_times": {k: v["times"] for k, v in results.items()},
        "raw_minor_page_faults_rank0": {k: v["minor_page_faults"] for k, v in results.items()},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    os.replace(tmp, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
