"""A step whose numbers cannot train stops the run with a message, instead of skipping every update quietly.

Three checks in ``train_step``: a reward term that counts must not fail on every response of a batch, nor on
most of them batch after batch (step 2, ``check_reward_failures``); the group advantages (step 3) must be
finite; and at least one mini-batch's update (step 6) must have been applied. A reward that raises scores 0:
when it always does, every advantage is 0 and the run would train on nothing and exit 0. A single skipped
update (one NaN gradient) is contained and counted
(``faults/skipped_updates``); a step where *every* update is skipped would repeat forever on the same data
and exit 0 having trained nothing.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import torch

REWARD_FAILURES_FILE = "reward_failures.log"  # in the run folder; rank r > 0 writes reward_failures.rank<r>.log


class TrainingStopped(RuntimeError):
    """The run cannot go on: the message says why and what to look at."""


def check_advantages(rewards: torch.Tensor, advantages: torch.Tensor, terms: Sequence, step: int) -> None:
    """rewards, advantages: [P, G] float32 (the step's summed rewards and their group advantages); ``terms``:
    ``rewards.terms`` (named in the message with their weights)."""
    if bool(torch.isfinite(advantages).all()):
        return
    finite = rewards[torch.isfinite(rewards)]
    largest = f"{finite.abs().max().item():g}" if finite.numel() else "none finite"
    named = ", ".join(f"rewards.terms[{i}] {t.metric_key!r} (weight {t.weight:g})" for i, t in enumerate(terms))
    raise TrainingStopped(
        f"step {step}: the group advantages are not finite: {int((~torch.isfinite(rewards)).sum())} summed rewards "
        f"overflow float32 (largest finite |reward| {largest}); the terms: {named}. Lower the weight or bound the "
        "reward (rewards.terms[i].range)")


def check_some_update_applied(per_minibatch: Sequence[dict], step: int, skipped_total: int) -> None:
    """per_minibatch: each mini-batch's update metrics (``update_skipped`` 1.0 when its gradient was not
    finite); ``skipped_total``: the run's count so far (``faults/skipped_updates``)."""
    if per_minibatch and all(m["update_skipped"] == 1.0 for m in per_minibatch):
        raise TrainingStopped(
            f"step {step}: every update was skipped ({len(per_minibatch)} mini-batches with non-finite gradients; "
            f"{skipped_total} skipped in this run): the model cannot train on this data; look at the rewards and "
            "advantages of this step (metrics.jsonl, completions.jsonl) and optimizer.lr")


def failure_fractions(reward_metrics: Mapping[str, float], terms: Sequence) -> dict[str, float]:
    """Each counting term's (weight != 0) failed share of the batch's responses: (errors + timeouts) /
    responses from the pool's ``rewards/<term>/errors``, ``.../timeouts`` and ``rewards/responses`` (averaged
    over data-parallel ranks alike, so their ratio is the whole batch's). {} when nothing was scored."""
    responses = reward_metrics.get("rewards/responses", 0.0)
    if not responses:
        return {}
    return {t.metric_key: (reward_metrics[f"rewards/{t.metric_key}/errors"]
                           + reward_metrics[f"rewards/{t.metric_key}/timeouts"]) / responses
            for t in terms if t.weight != 0}


def reward_failure_verdict(fractions: Mapping[str, float], streaks: Mapping[str, int], max_fraction: float,
                           max_batches: int) -> tuple[dict[str, int], str | None]:
    """(each term's failing batches in a row after this batch, why the run must stop or None).

    A batch is failing for a term above ``max_fraction``; ``max_batches`` in a row stop (0: never); a
    term failing on every response stops at once (its reward is 0 everywhere: nothing to learn)."""
    after = {key: (streaks.get(key, 0) + 1 if share > max_fraction else 0) for key, share in fractions.items()}
    for key, share in fractions.items():
        if share >= 1.0:
            return after, f"reward term {key!r} failed on every response of the batch"
    for key, run in after.items():
        if max_batches and run >= max_batches:
            return after, (f"reward term {key!r} failed on more than {max_fraction:g} of the responses in {run} "
                           f"batches in a row (rewards.stop_failure_fraction, rewards.stop_after_failing_batches)")
    return after, None


def write_first_failures(run_dir: Path, first_failures: Mapping[str, str], rank: int) -> Path:
    """Write each term's first traceback (rewards/pool.py ``first_failures``) to the run folder; its path."""
    path = Path(run_dir) / (REWARD_FAILURES_FILE if rank == 0 else f"reward_failures.rank{rank}.log")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"== {key}: first failure ==\n{text.rstrip()}\n\n" for key, text in first_failures.items()))
    tmp.replace(path)
    return path


def check_reward_failures(reward_metrics: Mapping[str, float], rewards_cfg, streaks: Mapping[str, int], step: int,
                          first_failures: Mapping[str, str], run_dir: Path, rank: int) -> dict[str, int]:
    """Stop the run (``TrainingStopped``) when ``reward_failure_verdict`` says so, after writing the first
    tracebacks; else return the new streaks. ``rewards_cfg``: the ``rewards:`` section. Every rank decides
    alike (the metrics are the whole batch's), so all stop together."""
    streaks, why = reward_failure_verdict(failure_fractions(reward_metrics, rewards_cfg.terms), streaks,
                                          rewards_cfg.stop_failure_fraction, rewards_cfg.stop_after_failing_batches)
    if why is None:
        return streaks
    path = write_first_failures(run_dir, first_failures, rank)
    failing = [key for key, run in streaks.items() if run]
    latest = "; ".join(f"{key}: {first_failures[key].rstrip().splitlines()[-1]}" for key in failing
                       if key in first_failures)
    raise TrainingStopped(f"step {step}: {why}" + (f" ({latest})" if latest else "")
                          + f"; the first traceback of each failing term: {path}")


__all__ = ["REWARD_FAILURES_FILE", "TrainingStopped", "check_advantages", "check_reward_failures",
           "check_some_update_applied", "failure_fractions", "reward_failure_verdict", "write_first_failures"]
