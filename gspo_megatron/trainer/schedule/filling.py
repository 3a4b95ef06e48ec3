"""Batch filling around any driver: dynamic sampling's extra rounds and overlong shaping
(trainer/batch_filling.py holds the pure rules; this wraps a driver with them)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from gspo_megatron.trainer.batch_filling import BatchFiller
from gspo_megatron.trainer.schedule.base import RolloutDriver, RolloutGroup, StepRollout


class FillingDriver(RolloutDriver):
    """``inner``'s groups through ``filler``: zero-variance groups replaced by ``inner.extra_round`` s, length
    penalties in the rewards, truncated samples out of the loss (``StepRollout.keep``). ``progress``: a
    line per extra round on the main rank (a long fill is not silent). ``stop_requested`` (a collective, asked
    before every extra round): a stop signal ends the filling; the step trains on what it has and the run
    stops after it (docs/training.md, "Dynamic sampling and overlong responses")."""

    def __init__(self, inner: RolloutDriver, filler: BatchFiller, progress: bool = False,
                 stop_requested: Callable[[], bool] = lambda: False):
        self.inner, self.filler, self.progress, self.stop_requested = inner, filler, progress, stop_requested
        self.owns, self.busy_during_update = inner.owns, inner.busy_during_update

    def step_groups(self, step: int) -> StepRollout:
        first = self.inner.step_groups(step)
        filled = self.filler.fill(first.groups, lambda r: None if self.stop_requested() else self.extra_round(step, r))
        return StepRollout(filled.batch, first.reward_metrics, first.staleness, {**first.metrics, **filled.metrics},
                           keep=filled.keep)

    def extra_round(self, step: int, round_index: int) -> list[RolloutGroup]:
        if self.progress:
            print(f"step {step + 1}: dynamic sampling round {round_index + 1}/{self.filler.max_generation_rounds}",
                  flush=True)
        return self.inner.extra_round(step, round_index)

    def resubmit(self, rebuilt: bool) -> None:
        self.inner.resubmit(rebuilt)

    def drain(self) -> None:
        self.inner.drain()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, meta: dict[str, Any], path: Path) -> None:
        self.inner.load_state_dict(meta, path)
