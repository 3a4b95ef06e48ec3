"""Context parallelism on CPU: peak memory per rank and step time of one long micro-batch at CP=1 and CP=2,
side by side in one run.

    .venv/bin/python benchmarks/bench_context_parallel.py [--tokens 8192] [--repeats 3] [--threads 1]

Problem: the trainer's update (``PolicyModel.forward_backward``: forward, vocab-parallel log-probs, the
GSPO loss with its per-sequence sums over CP, backward into Megatron DDP's buffers) on one sequence of
``--tokens`` tokens (a 16-token prompt, the rest response) in one micro-batch, on the tiny Qwen3-MoE-shaped
model (2 layers, hidden 64, 4 experts top-2, 4 query heads in 2 KV groups). CP=1 runs on one process, CP=2
on two gloo ranks; every rank uses ``--threads`` torch threads, so CP=2 uses twice the cores.

Memory: the peak of tensor bytes allocated during the measured ``forward_backward`` and alive at the same
time (``PeakTensorBytes`` from benchmarks/bench_loss.py: storages created by ATen ops inside the call,
counted until their last tensor dies); the weights, DDP's gradient buffers and the batch made before the call
are excluded. Per rank; the larger rank is reported.

Time: median wall time of ``forward_backward`` over ``--repeats`` runs after one warm-up, outside the memory
counter, the slower rank. CPU cost = time x ranks x threads (core-seconds).

Writes benchmarks/results/context_parallel.json and .png, and prints a table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_loss import PeakTensorBytes  # noqa: E402
from gspo_megatron.megatron.spawn import run_distributed  # noqa: E402

RESULT = Path(__file__).resolve().parent / "results" / "context_parallel.json"
PROMPT = 16


def measure(rank: int, world_size: int, tokens: int, repeats: int, threads: int) -> dict:
    """One rank's peak tensor bytes and forward_backward times at CP = world_size."""
    from gspo_megatron.algorithms.config import LossConfig
    from gspo_megatron.batching import TrainSequence
    from gspo_megatron.megatron import sharding
    from gspo_megatron.megatron.optimizer import OptimizerConfig
    from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel
    from gspo_megatron.megatron.policy_model import PolicyModel
    from gspo_megatron.testing.models import canonical_weights, tiny_moe_config

    torch.set_num_threads(threads)
    config = tiny_moe_config(max_position_embeddings=tokens + 64)
    parallel = ParallelConfig(context_parallel=world_size)
    initialize_model_parallel(parallel, seed=0)
    policy = PolicyModel(config, parallel, OptimizerConfig(lr=1e-4), LossConfig(algorithm="gspo"),
                         max_tokens_per_microbatch=tokens)
    sharding.load_full_state_dict(policy.module, canonical_weights(config, seed=1))
    gen = torch.Generator().manual_seed(0)
    seq = TrainSequence(torch.randint(0, config.vocab_size, (tokens,), generator=gen), PROMPT, advantage=1.0)
    seq.old_logprobs = policy.compute_logprobs([seq])[0]["logprobs"] + 1e-4 * torch.randn(tokens - PROMPT, generator=gen)
    policy.forward_backward([seq])  # warm-up
    counter = PeakTensorBytes()
    with counter:
        metrics = policy.forward_backward([seq])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        policy.forward_backward([seq])
        times.append(time.perf_counter() - start)
    return {"peak_bytes": counter.peak, "time_s": statistics.median(times), "times_s": times,
            "loss": float(metrics["loss"]), "tokens": float(metrics["tokens"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    rows = {}
    for cp in (1, 2):
        print(f"CP={cp}: {args.tokens} tokens on {cp} rank(s) x {args.threads} thread(s) ...", flush=True)
        ranks = run_distributed(measure, cp, (args.tokens, args.repeats, args.threads), timeout_s=3000)
        rows[cp] = {"peak_bytes_per_rank": [r["peak_bytes"] for r in ranks],
                    "time_s": max(r["time_s"] for r in ranks), "times_s": [r["times_s"] for r in ranks],
                    "loss": ranks[0]["loss"], "tokens": ranks[0]["tokens"]}
    one, two = rows[1], rows[2]
    summary = {
        "tokens": args.tokens, "threads_per_rank": args.threads, "model": "tiny_moe_config (2 layers, hidden 64, 4 experts)",
        "cp1": one, "cp2": two,
        "peak_ratio_cp2_over_cp1": max(two["peak_bytes_per_rank"]) / max(one["peak_bytes_per_rank"]),
        "time_ratio_cp2_over_cp1": two["time_s"] / one["time_s"],
        "core_seconds_ratio_cp2_over_cp1": 2 * two["time_s"] / one["time_s"],
        "loss_difference": abs(two["loss"] - one["loss"]),
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULT.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(RESULT)
    gib = 2 ** 30
    print(f"{'':8} {'peak GiB / rank':>16} {'step s':>8} {'core-s':>8}")
    for cp, row in rows.items():
        print(f"CP={cp:<5} {max(row['peak_bytes_per_rank']) / gib:16.3f} {row['time_s']:8.2f} {cp * args.threads * row['time_s']:8.2f}")
    print(f"CP=2 / CP=1: peak memory {summary['peak_ratio_cp2_over_cp1']:.2f}x, step time "
          f"{summary['time_ratio_cp2_over_cp1']:.2f}x, core-seconds {summary['core_seconds_ratio_cp2_over_cp1']:.2f}x; "
          f"loss difference {summary['loss_difference']:.2e}")
    plot(summary, RESULT.with_suffix(".png"))


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 3.2))
    labels = ["CP=1", "CP=2"]
    ax1.bar(labels, [max(summary[k]["peak_bytes_per_rank"]) / 2 ** 30 for k in ("cp1", "cp2")], color=["grey", "tab:blue"])
    ax1.set_ylabel("peak tensor GiB per rank")
    ax2.bar(labels, [summary[k]["time_s"] for k in ("cp1", "cp2")], color=["grey", "tab:blue"])
    ax2.set_ylabel("forward+backward s (slowest rank)")
    fig.suptitle(f"one {summary['tokens']}-token micro-batch, tiny MoE, {summary['threads_per_rank']} thread(s)/rank")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    tmp.replace(path)


if __name__ == "__main__":
    main()
