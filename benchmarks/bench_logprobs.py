"""Vocab-parallel log-probs (``megatron/logprobs.py``) against full-vocabulary ``log_softmax`` + gather:
peak extra memory and time of forward + backward, side by side in one run, with and without entropy,
and the vocab-parallel path at TP=2 on two gloo ranks.

    .venv/bin/python benchmarks/bench_logprobs.py [--tokens 8192] [--vocab 32768] [--chunk-tokens 1024,128]
                                                  [--repeats 3] [--threads 1]

Problem: float32 logits [tokens, vocab] (3 x N(0, 1)), random targets, objective
``sum(w1 * logp) (+ sum(w2 * entropy))`` with random weights, backward into ``logits.grad``.

Memory: the peak of tensor bytes allocated during the measured call and alive at the same time; the
logits (made before) are excluded, the gradient of the logits (which any path must return, one
[N, V_local] float32 tensor) is included. Two independent counts of the same call, which must agree:
(1) ``PeakTensorBytes`` (benchmarks/bench_loss.py), a TorchDispatchMode that adds a storage's bytes when an
ATen op returns a tensor on a new storage and subtracts them when the last tensor viewing it is freed;
(2) torch.profiler with ``profile_memory=True``: the allocator's [memory] events (+bytes on allocation,
-bytes on free), summed in time order; the previous gradient is dropped before each count, because the
profiler would subtract a block made outside the session with a stale size (a negative sum raises). Both
count what the CPU allocator hands out for tensors, not allocator caching or Python objects. Besides forward + backward, the peak of a no-grad forward (the
old-policy / reference log-prob pass) is reported. Units: bytes, and multiples of one [N, V] float32
tensor (the full logits).

Time: median forward + backward wall time over ``--repeats`` runs after a warm-up, the two paths
interleaved so that load from other processes hits both alike; outside the memory counters. TP=2: the
slower rank's median, each rank with ``--threads`` threads (the ranks share the machine's cores). The
kernel CPU time of the same runs is reported beside it: on CPU, temporaries above glibc's mmap threshold
(32 MiB) are mapped afresh on every allocation and page-faulted in, which dominates large chunks.

Writes benchmarks/results/logprobs.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_loss import PeakTensorBytes  # noqa: E402
from gspo_megatron.megatron.logprobs import naive_logprobs, vocab_parallel_logprobs  # noqa: E402
from gspo_megatron.megatron.spawn import run_distributed  # noqa: E402

RESULT = Path(__file__).resolve().parent / "results" / "logprobs.json"
GRAD_ROW_STRIDE = 16  # agreement of gradients is checked on every 16th token row (full copies cost GiBs)


def make_problem(tokens: int, vocab: int, seed: int = 0):
    """logits [N, V] float32, targets [N], upstream weights w_logp, w_h [N]."""
    gen = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(tokens, vocab, generator=gen)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    return logits, targets, torch.randn(tokens, generator=gen), torch.randn(tokens, generator=gen)


def call(path: str, logits, targets, with_entropy: bool, *, chunk_tokens: int, vocab: int, tp_group=None,
         vocab_start: int = 0):
    """(logp [N], entropy [N] | None) by ``path``: "naive" or "vocab_parallel"."""
    if path == "naive":
        return naive_logprobs(logits, targets, with_entropy=with_entropy)
    return vocab_parallel_logprobs(logits, targets, tp_group=tp_group, vocab_start=vocab_start, vocab_size=vocab,
                                   chunk_tokens=chunk_tokens, with_entropy=with_entropy)


def forward_backward(logits, run, w_logp, w_h):
    """One measured unit: forward, the weighted objective, backward into ``logits.grad`` (None before)."""
    logp, entropy = run()
    objective = (logp * w_logp).sum()
    if entropy is not None:
        objective = objective + (entropy * w_h).sum()
    objective.backward()
    return logp.detach(), None if entropy is None else entropy.detach()


def profiler_peak_bytes(fn) -> int:
    """Peak of the running sum of the allocator's [memory] events (bytes) during ``fn()``."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
        # The profiler sizes a free by a pointer table that outlives a session; a block allocated outside
        # this session at a reused address would be subtracted with a stale size. measure() frees nothing
        # made outside, so a negative sum means the count is wrong.
        if current < 0:
            raise RuntimeError(f"profiler memory count went negative ({current} bytes): a block allocated "
                               "before profiling was freed inside it")
    return peak


def dispatch_peak_bytes(fn) -> int:
    with PeakTensorBytes() as tracker:
        fn()
    return tracker.peak


def measure(logits, run, w_logp, w_h) -> dict:
    """Peaks (both counters, fwd+bwd; no-grad forward) and the outputs for the agreement check. The
    previous gradient is dropped before each count, so nothing made outside a count is freed inside it."""
    step = lambda: forward_backward(logits, run, w_logp, w_h)  # noqa: E731
    logits.grad = None
    logp, entropy = step()
    sample = logits.grad[::GRAD_ROW_STRIDE].clone()
    out = {}
    for key, count in (("peak_bytes", dispatch_peak_bytes), ("peak_bytes_profiler", profiler_peak_bytes)):
        logits.grad = None
        out[key] = count(step)
    logits.grad = None
    with torch.no_grad():
        out["nograd_forward_peak_bytes"] = dispatch_peak_bytes(run)
    out["outputs"] = (logp, entropy, sample)
    return out


def timed_ms(logits, run, w_logp, w_h) -> tuple[float, float]:
    """(wall, kernel CPU) milliseconds of one forward + backward; the previous gradient is freed before the
    clock starts. Kernel time is mostly page faults of freshly mapped large temporaries (CPU allocator)."""
    logits.grad = None
    start, kernel = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_stime
    forward_backward(logits, run, w_logp, w_h)
    return (1e3 * (time.perf_counter() - start),
            1e3 * (resource.getrusage(resource.RUSAGE_SELF).ru_stime - kernel))


def tp2_worker(rank, world_size, tokens, vocab, chunk_tokens, repeats, threads):
    """One rank of TP=2: its vocabulary half of the same logits; measurements as at TP=1."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    full, targets, w_logp, w_h = make_problem(tokens, vocab)
    v_local = vocab // world_size
    logits = full[:, rank * v_local:(rank + 1) * v_local].clone().requires_grad_(True)
    del full
    out = {}
    for with_entropy in (False, True):
        def run():
            return call("vocab_parallel", logits, targets, with_entropy, chunk_tokens=chunk_tokens, vocab=vocab,
                        tp_group=dist.group.WORLD, vocab_start=rank * v_local)

        row = measure(logits, run, w_logp, w_h)
        timed_ms(logits, run, w_logp, w_h)  # warm-up
        times = [timed_ms(logits, run, w_logp, w_h) for _ in range(repeats)]
        row["fwd_bwd_ms"] = statistics.median(t[0] for t in times)
        row["fwd_bwd_kernel_ms"] = statistics.median(t[1] for t in times)
        out[with_entropy] = row
    return out


def max_diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def agreement(outputs, reference, column_slice=slice(None)) -> dict:
    """Largest differences of log-probs, entropy and the sampled gradient rows from ``reference``."""
    logp, entropy, grad = outputs
    ref_logp, ref_entropy, ref_grad = reference
    out = {"logp": max_diff(logp, ref_logp), "grad": max_diff(grad, ref_grad[:, column_slice])}
    if entropy is not None:
        out["entropy"] = max_diff(entropy, ref_entropy)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32768, help="must be even (split over two TP ranks)")
    parser.add_argument("--chunk-tokens", default="1024,128",
                        help="vocab_parallel_logprobs chunk_tokens, comma-separated; the first is used at TP=2 "
                             "and in the ratios (the trainer picks the chunk from a 16 MiB budget: megatron/policy_model.py LOGPROB_CHUNK_BYTES)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    args = parser.parse_args()
    if args.vocab % 2:
        parser.error(f"--vocab must be even for TP=2, got {args.vocab}")
    chunks = [int(c) for c in args.chunk_tokens.split(",")]
    if not chunks or min(chunks) < 1:
        parser.error(f"--chunk-tokens must be positive integers, got {args.chunk_tokens!r}")
    torch.set_num_threads(args.threads)
    unit = 4 * args.tokens * args.vocab  # one [N, V] float32 tensor

    logits, targets, w_logp, w_h = make_problem(args.tokens, args.vocab)
    logits.requires_grad_(True)
    rows, checks, references = [], {}, {}
    with Progress(transient=True) as progress:
        sides = [("vocab_parallel", c) for c in chunks] + [("naive", None)]
        task = progress.add_task("log-probs", total=2 * (len(sides) + args.repeats + 1) + 1)
        for with_entropy in (False, True):
            runs = {(path, chunk): (lambda p=path, c=chunk: call(p, logits, targets, with_entropy, chunk_tokens=c,
                                                                 vocab=args.vocab)) for path, chunk in sides}
            measured = {}
            for side, run in runs.items():
                progress.update(task, description=f"memory {side} entropy={with_entropy}")
                measured[side] = measure(logits, run, w_logp, w_h)
                progress.advance(task)
            times = {side: [] for side in runs}
            for i in range(args.repeats + 1):  # the first round is the warm-up
                progress.update(task, description=f"time entropy={with_entropy}")
                for side, run in runs.items():
                    t = timed_ms(logits, run, w_logp, w_h)
                    if i:
                        times[side].append(t)
                progress.advance(task)
            reference = measured["naive", None]["outputs"]
            for (path, chunk), m in measured.items():
                checks[f"{path}_tp1_chunk={chunk}_entropy={with_entropy}"] = agreement(m.pop("outputs"), reference)
                rows.append({"path": path, "tp": 1, "with_entropy": with_entropy, "chunk_tokens": chunk,
                             "fwd_bwd_ms": statistics.median(t[0] for t in times[path, chunk]),
                             "fwd_bwd_kernel_ms": statistics.median(t[1] for t in times[path, chunk]), **m})
            references[with_entropy] = reference
        logits.grad = None
        del logits
        progress.update(task, description="vocab_parallel at TP=2 (two gloo ranks)")
        tp2 = run_distributed(tp2_worker, 2, (args.tokens, args.vocab, chunks[0], args.repeats, args.threads))
        progress.advance(task)

    v_local = args.vocab // 2
    for with_entropy in (False, True):
        reference = references[with_entropy]
        per_rank = [tp2[r][with_entropy] for r in range(2)]
        for r, m in enumerate(per_rank):
            checks[f"vocab_parallel_tp2_rank{r}_chunk={chunks[0]}_entropy={with_entropy}"] = agreement(
                m.pop("outputs"), reference, slice(r * v_local, (r + 1) * v_local))
        rows.append({"path": "vocab_parallel", "tp": 2, "with_entropy": with_entropy, "chunk_tokens": chunks[0],
                     **{key: max(m[key] for m in per_rank)
                        for key in ("fwd_bwd_ms", "fwd_bwd_kernel_ms", "peak_bytes", "peak_bytes_profiler",
                                    "nograd_forward_peak_bytes")}})
    for row in rows:
        grad_bytes = 4 * args.tokens * args.vocab // row["tp"]
        row["peak_units"] = row["peak_bytes"] / unit
        row["peak_beyond_grad_units"] = (row["peak_bytes"] - grad_bytes) / unit
        row["nograd_forward_peak_units"] = row["nograd_forward_peak_bytes"] / unit
        row["counters_agree"] = abs(row["peak_bytes"] - row["peak_bytes_profiler"]) <= 0.01 * row["peak_bytes"]

    def find(path, tp, with_entropy, chunk=None):
        return next(r for r in rows
                    if (r["path"], r["tp"], r["with_entropy"], r["chunk_tokens"]) == (path, tp, with_entropy, chunk))

    ratios = []  # one row per (entropy, chunk size); TP=2 ran at the first chunk size only
    for with_entropy in (False, True):
        naive = find("naive", 1, with_entropy)
        for chunk in chunks:
            ours = find("vocab_parallel", 1, with_entropy, chunk)
            row = {"with_entropy": with_entropy, "chunk_tokens": chunk,
                   "naive_over_ours_peak": naive["peak_bytes"] / ours["peak_bytes"],
                   "naive_over_ours_peak_beyond_grad": naive["peak_beyond_grad_units"] / ours["peak_beyond_grad_units"],
                   "naive_over_ours_nograd_forward_peak":
                       naive["nograd_forward_peak_bytes"] / ours["nograd_forward_peak_bytes"],
                   "naive_over_ours_time": naive["fwd_bwd_ms"] / ours["fwd_bwd_ms"]}
            if chunk == chunks[0]:
                ours2 = find("vocab_parallel", 2, with_entropy, chunk)
                row["tp2_rank_over_tp1_peak"] = ours2["peak_bytes"] / ours["peak_bytes"]
                row["tp2_over_tp1_time"] = ours2["fwd_bwd_ms"] / ours["fwd_bwd_ms"]
            ratios.append(row)
    tolerance = 1e-4
    agree = all(v <= tolerance for c in checks.values() for v in c.values())

    result = {
        "command": "python benchmarks/bench_logprobs.py " + " ".join(sys.argv[1:]),
        "tokens": args.tokens, "vocab": args.vocab, "dtype": "float32", "chunk_tokens": chunks,
        "repeats": args.repeats, "threads_per_process": args.threads, "torch": torch.__version__, "device": "cpu",
        "memory_unit": f"one [tokens, vocab] float32 tensor = {unit} bytes; peaks exclude the logits and include "
                       "the logits gradient (1/tp unit per rank)",
        "memory_method": "TorchDispatchMode live-storage peak (peak_bytes) and torch.profiler [memory] events "
                         "(peak_bytes_profiler) of the same call",
        "results": rows, "ratios": ratios,
        "agreement_max_abs_diff": checks, "agreement_tolerance": tolerance, "agrees": agree,
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULT.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, RESULT)

    gib = 2 ** 30
    table = Table(title=f"log-probs forward+backward, {args.tokens} tokens x {args.vocab} vocabulary, float32, "
                        f"{args.threads} thread(s) per process; peaks per rank, logits excluded")
    for column in ("path", "chunk", "TP", "entropy", "fwd+bwd ms", "of it kernel", "peak GiB", "peak [N,V] units",
                   "beyond grad", "no-grad fwd GiB", "counters agree"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["path"], str(r["chunk_tokens"] or "-"), str(r["tp"]), str(r["with_entropy"]),
                      f"{r['fwd_bwd_ms']:.0f}", f"{r['fwd_bwd_kernel_ms']:.0f}",
                      f"{r['peak_bytes'] / gib:.3f}", f"{r['peak_units']:.3f}", f"{r['peak_beyond_grad_units']:.3f}",
                      f"{r['nograd_forward_peak_bytes'] / gib:.3f}", str(r["counters_agree"]))
    console = Console(width=160)
    console.print(table)
    ratio_table = Table(title="ratios (naive / ours: > 1 means ours is smaller or faster; TP=2 / TP=1 per rank)")
    names = [k for k in ratios[0] if k not in ("with_entropy", "chunk_tokens")]
    for column in ("entropy", "chunk", *names):
        ratio_table.add_column(column.replace("_", " "))
    for r in ratios:
        ratio_table.add_row(str(r["with_entropy"]), str(r["chunk_tokens"]),
                            *(f"{r[k]:.2f}" if k in r else "-" for k in names))
    console.print(ratio_table)
    print(f"agreement with log_softmax + gather: {'yes' if agree else 'NO'} (max abs diff <= {tolerance})")
    print(f"wrote {RESULT}")
    if not agree or not all(r["counters_agree"] for r in rows):
        raise SystemExit("bench_logprobs: paths disagree or the two memory counters disagree; see the JSON")


if __name__ == "__main__":
    main()
