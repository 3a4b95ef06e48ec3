"""Loss forward + backward on a packed batch: vectorised losses against a per-sequence Python loop.

    .venv/bin/python benchmarks/bench_loss.py [--tokens 65536] [--seqs 512] [--repeats 20] [--threads 1]

Both sides run in the same process on the same batch, interleaved (a few vectorised calls, then one loop
call, repeated) so that load from other processes hits both alike; the figure that matters is the ratio
of the medians. Memory is
the peak of live tensor bytes allocated during forward + backward (inputs excluded), counted by a
TorchDispatchMode that sees every ATen op: an output tensor whose storage is new adds its bytes, and the
bytes are released when the last tensor viewing that storage is freed (a weakref finalizer). It counts
what the allocator is asked for by tensors, not allocator caching or Python objects. The peak is given
in units of one float32 token tensor (4 * N bytes); the gradient of the log-probs (1.0 unit) is part of
it. While a dispatch mode is active, autograd adds two gradients of one tensor out of place (it treats
the tensors as subclass-like), so configurations with two gradient paths into the log-probs (KL) read
one unit higher here than they use in a plain run. Besides the three default configurations it
measures the peak (only) of the options (KL, entropy, TIS, per-token advantages, other aggregations).
Writes benchmarks/results/loss.json and prints two tables.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import weakref
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gspo_megatron.algorithms import LossConfig, count_normalisers, packed_batch, policy_loss  # noqa: E402

RESULT = Path(__file__).resolve().parent / "results" / "loss.json"


class PeakTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storages created inside the mode and still alive (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage data_ptr -> [nbytes, live tensors viewing it]
        self.current = 0
        self.peak = 0

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            # A view or in-place result of a storage made outside the mode (an input) is not an allocation.
            if key == 0 or (key in inputs and key not in self.live):
                continue
            if key in self.live:
                self.live[key][1] += 1
            else:
                self.live[key] = [storage.nbytes(), 1]
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
            weakref.finalize(t, self._release, key)
        return out


def make_batch(num_tokens: int, num_seqs: int, seed: int = 0):
    """Random lengths (each >= 1) summing to num_tokens; log-ratios ~ N(0, 1e-3) so some sequences clip."""
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(num_tokens - 1, generator=gen)[: num_seqs - 1].sort().values + 1
    cu_seqlens = torch.cat([torch.tensor([0]), cuts, torch.tensor([num_tokens])])
    old = -torch.rand(num_tokens, generator=gen) * 5
    new = (old + 1e-3 * torch.randn(num_tokens, generator=gen)).requires_grad_(True)
    advantages = torch.randn(num_seqs, generator=gen)
    return cu_seqlens, new, old, advantages


# Option configurations whose peak memory is reported next to the defaults (no timing).
OPTIONS = [
    ("grpo", {"aggregation": "token_mean"}),
    ("grpo", {"aggregation": "token_sum", "constant_length_tokens": 1024}),
    ("grpo", {"per_token_advantages": True}),
    ("gspo_token", {"per_token_advantages": True}),
    ("gspo", {"tis_mode": "sequence"}),
    ("grpo", {"tis_mode": "sequence"}),
    ("grpo", {"tis_mode": "token"}),
    ("gspo_token", {"tis_mode": "token"}),
    ("gspo", {"entropy_coef": 0.01}),
    ("grpo", {"entropy_coef": 0.01}),
    ("gspo", {"kl_coef": 0.1}),
    ("gspo_token", {"kl_coef": 0.1}),
    ("grpo", {"kl_coef": 0.1}),
]


def option_peak(algorithm: str, options: dict, cu_seqlens, new, old, advantages, unit_bytes: int) -> tuple[float, float]:
    """``memory_units`` of one option configuration; its extra inputs (reference, rollout, entropy) are made here."""
    options = dict(options)
    per_token = options.pop("per_token_advantages", False)
    gen = torch.Generator().manual_seed(1)
    extra = {}
    if options.get("kl_coef", 0) > 0:
        extra["ref_logprobs"] = old + 0.05 * torch.randn(old.shape, generator=gen)
    if options.get("entropy_coef", 0) > 0:
        extra["entropy"] = torch.rand(old.shape, generator=gen).requires_grad_(True)
    if options.get("tis_mode", "none") != "none":
        extra["rollout_logprobs"] = old + 0.01 * torch.randn(old.shape, generator=gen)
    adv = {"token_advantages": torch.randn(old.shape, generator=gen)} if per_token else {"advantages": advantages}
    config = LossConfig(algorithm=algorithm, **options)
    batch = packed_batch(new, old, cu_seqlens=cu_seqlens, **adv, **extra)
    normalisers = count_normalisers(batch.mask, batch.segments)
    return memory_units(lambda: policy_loss(config, batch, normalisers)[0], new, unit_bytes)


def loop_gspo(new, old, advantages, cu_seqlens, clip_low: float, clip_high: float):
    """The straightforward reference: one Python iteration per sequence (Eq. 5, 7)."""
    bounds = cu_seqlens.tolist()
    total = new.new_zeros(())
    for i in range(len(bounds) - 1):
        lr = new[bounds[i] : bounds[i + 1]] - old[bounds[i] : bounds[i + 1]]
        s = torch.exp(lr.mean().clamp(-20, 20))
        a = advantages[i]
        total = total - torch.minimum(s * a, s.clamp(1 - clip_low, 1 + clip_high) * a)
    return total / (len(bounds) - 1)


def loop_grpo(new, old, advantages, cu_seqlens, clip_low: float, clip_high: float):
    """Per-sequence loop for GRPO, seq-mean-token-mean."""
    bounds = cu_seqlens.tolist()
    total = new.new_zeros(())
    for i in range(len(bounds) - 1):
        ratio = torch.exp((new[bounds[i] : bounds[i + 1]] - old[bounds[i] : bounds[i + 1]]).clamp(-20, 20))
        a = advantages[i]
        total = total - torch.minimum(ratio * a, ratio.clamp(1 - clip_low, 1 + clip_high) * a).mean()
    return total / (len(bounds) - 1)


def run_once(fn, new):
    new.grad = None
    loss = fn()
    loss.backward()
    return loss.detach(), new.grad


def timed_pair(vectorised, reference, new, repeats: int, label: str) -> tuple[float, float]:
    """Median seconds of each side, interleaved: rounds of 4 vectorised calls and 1 loop call."""
    run_once(vectorised, new)  # warm-up
    run_once(reference, new)
    times_v, times_r = [], []
    for _ in track(range(max(3, repeats // 4)), description=label, transient=True):
        for fn, times, calls in ((vectorised, times_v, 4), (reference, times_r, 1)):
            for _ in range(calls):
                start = time.perf_counter()
                run_once(fn, new)
                times.append(time.perf_counter() - start)
    return statistics.median(times_v), statistics.median(times_r)


def peak_units(fn, new, unit_bytes: int) -> float:
    return memory_units(fn, new, unit_bytes)[0]


def memory_units(fn, new, unit_bytes: int) -> tuple[float, float]:
    """(peak over forward + backward, bytes still held when forward returns: what autograd keeps for
    backward, which is what each in-flight micro-batch costs under pipeline parallelism), in units."""
    new.grad = None
    with PeakTensorBytes() as tracker:
        loss = fn()
        held = tracker.current
        loss.backward()
    return tracker.peak / unit_bytes, held / unit_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--seqs", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both sides")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    cu_seqlens, new, old, advantages = make_batch(args.tokens, args.seqs)
    unit = 4 * args.tokens
    rows = []
    for algorithm, loop in (("gspo", loop_gspo), ("gspo_token", loop_gspo), ("grpo", loop_grpo)):
        config = LossConfig(algorithm=algorithm)
        batch = packed_batch(new, old, cu_seqlens=cu_seqlens, advantages=advantages)  # segments built once per micro-batch
        normalisers = count_normalisers(batch.mask, batch.segments)

        def vectorised():
            return policy_loss(config, batch, normalisers)[0]

        def reference():
            return loop(new, old, advantages, cu_seqlens, config.clip_low, config.clip_high)

        loss_v, grad_v = (t.clone() for t in run_once(vectorised, new))
        loss_r, grad_r = (t.clone() for t in run_once(reference, new))
        agree = bool(torch.allclose(loss_v, loss_r, rtol=1e-4, atol=1e-6) and torch.allclose(grad_v, grad_r, rtol=1e-3, atol=1e-9))
        t_v, t_r = timed_pair(vectorised, reference, new, args.repeats, algorithm)
        peak_v, held_v = memory_units(vectorised, new, unit)
        peak_r, held_r = memory_units(reference, new, unit)
        rows.append(
            {
                "algorithm": algorithm,
                "vectorised_ms": 1e3 * t_v,
                "loop_ms": 1e3 * t_r,
                "speedup": t_r / t_v,
                "vectorised_peak_token_tensors": peak_v,
                "loop_peak_token_tensors": peak_r,
                "vectorised_held_for_backward_token_tensors": held_v,
                "loop_held_for_backward_token_tensors": held_r,
                "agrees_with_loop": agree,
            }
        )

    options = []
    for algorithm, opts in track(OPTIONS, description="options (peak memory)", transient=True):
        peak, held = option_peak(algorithm, opts, cu_seqlens, new, old, advantages, unit)
        options.append(
            {"algorithm": algorithm, "options": opts, "vectorised_peak_token_tensors": peak, "vectorised_held_for_backward_token_tensors": held}
        )

    result = {
        "command": "python benchmarks/bench_loss.py " + " ".join(sys.argv[1:]),
        "tokens": args.tokens,
        "seqs": args.seqs,
        "threads": args.threads,
        "torch": torch.__version__,
        "device": "cpu",
        "memory_unit": "one float32 token tensor = 4 * tokens bytes; peak includes the log-prob gradient (1.0); "
        "held = allocated by the loss and still alive when forward returns (kept for backward), inputs excluded",
        "results": rows,
        "option_peaks": options,
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULT.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, RESULT)

    table = Table(title=f"loss forward+backward, {args.tokens} tokens in {args.seqs} packed sequences, {args.threads} thread(s)")
    for column in ("algorithm", "vectorised ms", "loop ms", "speed-up", "peak (vectorised)", "peak (loop)", "held (vectorised)", "agrees"):
        table.add_column(column)
    for r in rows:
        table.add_row(
            r["algorithm"],
            f"{r['vectorised_ms']:.2f}",
            f"{r['loop_ms']:.1f}",
            f"{r['speedup']:.1f}x",
            f"{r['vectorised_peak_token_tensors']:.2f}",
            f"{r['loop_peak_token_tensors']:.2f}",
            f"{r['vectorised_held_for_backward_token_tensors']:.2f}",
            str(r["agrees_with_loop"]),
        )
    console = Console(width=140)
    console.print(table)
    opt_table = Table(title="peak memory of the options (units of one float32 token tensor, gradient included)")
    for column in ("algorithm", "options", "peak", "held for backward"):
        opt_table.add_column(column)
    for r in options:
        opt_table.add_row(
            r["algorithm"],
            json.dumps(r["options"]),
            f"{r['vectorised_peak_token_tensors']:.2f}",
            f"{r['vectorised_held_for_backward_token_tensors']:.2f}",
        )
    console.print(opt_table)
    print(f"wrote {RESULT}")
    if not all(r["agrees_with_loop"] for r in rows):
        raise SystemExit("bench_loss: a vectorised loss disagrees with its loop reference")


if __name__ == "__main__":
    main()
