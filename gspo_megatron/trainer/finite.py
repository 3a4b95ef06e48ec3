"""A step whose numbers cannot train stops the run with a message, instead of skipping every update quietly.

Two checks in ``train_step``: the group advantages (step 3) must be finite, and at least one mini-batch's
update (step 6) must have been applied. A single skipped update (one NaN gradient) is contained and counted
(``faults/skipped_updates``); a step where *every* update is skipped would repeat forever on the same data
and exit 0 having trained nothing.
"""
from __future__ import annotations

from typing import Sequence

import torch


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


__all__ = ["TrainingStopped", "check_advantages", "check_some_update_applied"]
