"""Where the update phase of one GSPO step goes: ``Trainer._update``, i.e. ``PolicyModel.train_minibatch`` once
per mini-batch (the demo's four) plus the routing-drift forwards (``train.measure_routing_drift``, on by
default), on one torch thread, one process (gloo world size 1, like ``run_ours`` in bench_trl.py).

It builds the demo Trainer (examples/cpu_demo.yaml, engine log-probs as pi_old), runs one train_step to get a
rollout batch already split into mini-batch shares (advantages set to +-1: the untrained model's are all 0),
then:

* ``--baseline REV`` (default: none): a second PolicyModel built from ``policy_model.py``, ``optimizer.py``
  and ``batching.py`` as they are at git revision REV, with the same weights. Both first run the same update from the same
  state and must agree bit for bit (metrics and parameters); then their updates alternate A/B/A/B and the
  script prints the medians and the median of the per-pair ratios (the machine is shared: only ratios
  measured side by side mean anything).
* a cProfile of the current code's update, summarised by phase (forward, loss, backward, Megatron's
  schedule, DDP finalize, optimizer step, ...) and the top functions by own time.

    .venv/bin/python benchmarks/profile_update.py --baseline c05c0aa --repeats 30
"""
from __future__ import annotations

import argparse
import dataclasses
import cProfile
import importlib.util
import io
import pstats
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "cpu_demo.yaml"
OVERRIDES = ["sft.steps=0", "eval.every_steps=0", "checkpoint.every_steps=0", "train.steps=1000",
             "logging.tensorboard=false", "logging.console=false", "rewards.num_workers=0",
             "rollout.logprobs_from=engine"]
# the files a baseline revision supplies, in import order (each later one imports the earlier ones)
BASELINE_FILES = {"gspo_megatron.batching": "gspo_megatron/batching.py",
                  "gspo_megatron.megatron.optimizer": "gspo_megatron/megatron/optimizer.py",
                  "gspo_megatron.megatron.policy_model": "gspo_megatron/megatron/policy_model.py"}

# (label, file suffix, function name) of the calls whose cumulative time the profile summary reports
PHASES = (
    ("Trainer._update (all)", "loop.py", "_update"),
    ("train_minibatch", "policy_model.py", "train_minibatch"),
    ("forward_backward", "policy_model.py", "forward_backward"),
    ("  _microbatches (collate)", "policy_model.py", "_microbatches"),
    ("  schedule: forward_step", "schedules.py", "forward_step"),
    ("    model forward", "policy_model.py", "_forward"),
    ("    loss_func", "policy_model.py", "loss_func"),
    ("      token_logprobs", "policy_model.py", "token_logprobs"),
    ("      policy_loss", "policy.py", "policy_loss"),
    ("    to_device", "device.py", "to_device"),
    ("  schedule: backward_step", "schedules.py", "backward_step"),
    ("  finalize_model_grads", "finalize_model_grads.py", "finalize_model_grads"),
    ("  zero_grad_buffer", "distributed_data_parallel.py", "zero_grad_buffer"),
    ("  optimizer.zero_grad", "optimizer.py", "zero_grad"),
    ("  _reduce_to_all", "policy_model.py", "_reduce_to_all"),
    ("optimizer_step", "policy_model.py", "optimizer_step"),
    ("  grads_finite", "policy_model.py", "grads_finite"),
    ("  megatron optimizer.step", "optimizer.py", "step"),
    ("    clip_grad_norm", "optimizer.py", "clip_grad_norm"),
    ("    count_zeros", "optimizer.py", "count_zeros"),
    ("    AdamW.step", "adamw.py", "step"),
    ("  scheduler.step", "optimizer_param_scheduler.py", "step"),
    ("  finalize_metrics", "metrics.py", "finalize_metrics"),
    ("routing drift: compute_logprobs", "policy_model.py", "compute_logprobs"),
    ("routing drift: sequence_routing", "policy_model.py", "sequence_routing"),
    ("routing drift: routing_drift", "policy_model.py", "routing_drift"),
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_trainer(run_dir: str, overrides: list[str]):
    """The demo Trainer and one step's mini-batch shares (sequences with old log-probs set)."""
    from gspo_megatron.megatron import parallel
    from gspo_megatron.trainer.config import load_config
    from gspo_megatron.trainer.loop import Trainer

    parallel.init_process_group(0, 1, "127.0.0.1", free_port())
    trainer = Trainer(load_config(CONFIG, OVERRIDES + overrides), run_dir)
    captured = []
    update = trainer._update

    def capture(shares, replay):
        captured.append(shares)
        return update(shares, replay)

    trainer._update = capture
    trainer.train_step()
    del trainer._update  # the class's again
    shares = captured[0]
    # The random model (no warm start) scores 0 everywhere, so every advantage is 0 and so is the gradient:
    # +-1 advantages make the update (and the clipping) do real work.
    for share in shares:
        for i, q in enumerate(share):
            q.advantage = 1.0 if i % 2 else -1.0
    return trainer, shares


def load_at_revision(rev: str):
    """``BASELINE_FILES`` as at git ``rev``, imported as private modules that import each other: the
    baseline PolicyModel class."""
    modules = {}
    for name, path in BASELINE_FILES.items():
        source = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{path}"], check=True, capture_output=True,
                                text=True).stdout
        for earlier in modules:
            source = source.replace(f"from {earlier} import", f"from {_private(earlier)} import")
        spec = importlib.util.spec_from_loader(_private(name), loader=None)
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        exec(compile(source, f"{rev}:{path}", "exec"), module.__dict__)
        modules[name] = module
    return modules["gspo_megatron.megatron.policy_model"].PolicyModel


def _private(name: str) -> str:
    return "_baseline_" + name.replace(".", "_")


def policy_like(cls, trainer, weights: dict, clip_grad: float | None = None):
    """A PolicyModel of class ``cls`` built like the trainer's, holding ``weights`` (a module state dict);
    ``clip_grad`` overrides the config's."""
    cfg = trainer.config
    optim = cfg.optimizer if clip_grad is None else dataclasses.replace(cfg.optimizer, clip_grad=clip_grad)
    policy = cls(trainer.model_config, cfg.parallel, optim, cfg.loss,
                 max_tokens_per_microbatch=cfg.train.max_tokens_per_microbatch, temperature=cfg.rollout.temperature,
                 runtime=cfg.model.runtime)
    policy.module.load_state_dict(weights)
    return policy


def update(trainer, policy, shares) -> list[dict[str, float]]:
    """The update phase of one step, ``Trainer._update`` run on ``policy``: one optimizer step per
    mini-batch share, plus the routing-drift forwards when ``train.measure_routing_drift`` is on."""
    trainer.policy = policy
    per_minibatch, drift = trainer._update(shares, trainer.config.train.routing_replay)
    return [{**m, **drift} for m in per_minibatch]


def check_identical(trainer, a, b, shares) -> None:
    """``a`` and ``b`` start from the same weights: the same update must give the same metrics and weights."""
    ma, mb = update(trainer, a, shares), update(trainer, b, shares)
    if ma != mb:
        diff = [(k, x[k], y.get(k)) for x, y in zip(ma, mb) for k in x if x[k] != y.get(k)]
        raise SystemExit(f"metrics differ (key, baseline, current): {diff[:8]}")
    for (name, pa), pb in zip(a.module.named_parameters(), b.module.parameters()):
        if not bool((pa == pb).all()):
            raise SystemExit(f"parameter {name} differs after the update")
    print(f"identical: {len(ma)} mini-batches, {len(ma[0])} metrics each, all parameters bit-equal; grad norms "
          f"{[round(m['grad_norm'], 3) for m in ma]} (clip_grad {a.optim_config.clip_grad})")


def timed(trainer, policy, shares) -> float:
    t = time.perf_counter()
    update(trainer, policy, shares)
    return time.perf_counter() - t


def ab(trainer, baseline, current, shares, repeats: int) -> None:
    for _ in range(2):  # warm-up
        timed(trainer, baseline, shares), timed(trainer, current, shares)
    a, b = [], []
    for k in range(repeats):  # alternate which goes first
        if k % 2:
            b.append(timed(trainer, current, shares)), a.append(timed(trainer, baseline, shares))
        else:
            a.append(timed(trainer, baseline, shares)), b.append(timed(trainer, current, shares))
    ratios = [y / x for x, y in zip(a, b)]
    print(f"update phase ({len(shares)} optimizer steps), {repeats} A/B pairs:")
    print(f"  baseline median {statistics.median(a) * 1e3:.1f} ms, current median {statistics.median(b) * 1e3:.1f} ms")
    print(f"  current / baseline: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")


def profile(trainer, policy, shares, repeats: int, top: int, dump: str | None) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(repeats):
        update(trainer, policy, shares)
    profiler.disable()
    if dump:
        profiler.dump_stats(dump)
    stats = pstats.Stats(profiler)
    by_call = {}
    for (filename, _, func), (_, _, _, cumulative, _) in stats.stats.items():
        for label, suffix, name in PHASES:
            if func == name and filename.endswith(suffix):
                by_call[label] = by_call.get(label, 0.0) + cumulative
    total = by_call.get(PHASES[0][0], 0.0)
    print(f"cProfile of {repeats} update phases (cumulative ms per update phase, share of the whole; "
          "the profiler inflates per-call overhead):")
    for label, _, _ in PHASES:
        if label in by_call:
            print(f"  {label:<32} {by_call[label] / repeats * 1e3:8.2f} ms  {by_call[label] / total:6.1%}")
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    print("\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="git revision of policy_model.py, optimizer.py and batching.py to compare with")
    parser.add_argument("--repeats", type=int, default=20, help="A/B pairs of update phases")
    parser.add_argument("--profile-repeats", type=int, default=10, help="update phases under cProfile (0: none)")
    parser.add_argument("--top", type=int, default=30, help="functions listed by own time")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--override", action="append", default=[], help="config override, e.g. "
                        "train.measure_routing_drift=false (repeatable)")
    parser.add_argument("--dump", help="also write the raw cProfile stats here (for pstats / snakeviz)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from gspo_megatron.megatron import parallel
    from gspo_megatron.megatron.policy_model import PolicyModel

    with tempfile.TemporaryDirectory() as run_dir:
        trainer, shares = build_trainer(run_dir, args.override)
        print(f"{len(shares)} mini-batches of {[len(s) for s in shares]} sequences, "
              f"{sum(int(q.tokens.numel()) for s in shares for q in s)} tokens; torch threads {torch.get_num_threads()}")
        # every policy starts from the weights that sampled the batch (``update`` replaces trainer.policy)
        weights = {k: v.clone() for k, v in trainer.policy.module.state_dict().items() if v is not None}
        current = policy_like(PolicyModel, trainer, weights)
        if args.baseline:
            baseline_class = load_at_revision(args.baseline)
            # the demo's gradients stay under clip_grad 1: check once more with a clip that scales them
            check_identical(trainer, policy_like(baseline_class, trainer, weights, clip_grad=0.3),
                            policy_like(PolicyModel, trainer, weights, clip_grad=0.3), shares)
            baseline = policy_like(baseline_class, trainer, weights)
            check_identical(trainer, baseline, current, shares)
            ab(trainer, baseline, current, shares, args.repeats)
        else:
            times = [timed(trainer, current, shares) for _ in range(args.repeats)]
            print(f"update phase: median {statistics.median(times) * 1e3:.1f} ms over {args.repeats}")
        if args.profile_repeats:
            profile(trainer, current, shares, args.profile_repeats, args.top, args.dump)
        trainer.close()
    parallel.destroy()


if __name__ == "__main__":
    main()
