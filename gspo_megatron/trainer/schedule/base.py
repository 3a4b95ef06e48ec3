"""What every rollout schedule has in common: the group it produces and the driver interface.

A *driver* decides when generations run (``sync``: now; ``overlap``: a queue one or more steps ahead;
``partial``: rounds over a pool of unfinished responses). It produces step k's whole, scored groups
(``step_groups``), may leave work in flight, runs an extra round now when dynamic sampling asks
(``extra_round``), submits again what a rebuilt engine lost (``resubmit``), finishes what is in flight
before a checkpoint (``drain``) and saves and loads its own state. Dynamic sampling and overlong shaping
wrap any driver (``filling.FillingDriver``); multi-turn is not a schedule but an engine decorator
(``rollout/agent_loop.py``): it changes what one generation is, not when it runs.

Vocabulary, one name per concept: a *round* is one set of engine calls of a step; *ahead* is work
submitted for a later step while this one trains; the *pool* holds the partial rollouts' unfinished
responses; the rest of an update a stop interrupted is a ``preemption.StoppedUpdate``.
"""
from __future__ import annotations

import abc
import dataclasses
from pathlib import Path
from typing import Any, NamedTuple

from gspo_megatron.rollout.base import Sample
from gspo_megatron.typed_config import ConfigError


def step_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 7919 + rank * 104_729) % (2**31 - 1)


class RolloutGroup(NamedTuple):
    """One prompt's group, scored: ``prompt`` (data.dataset.PromptSample), its G ``samples``, their
    ``rewards`` and the verifiers' ``verdicts`` (correct or not; None where no term judges correctness,
    rewards/pool.py response_correct, never a threshold)."""

    prompt: Any
    samples: list[Sample]
    rewards: list[float]
    verdicts: list[bool | None]


@dataclasses.dataclass
class StepRollout:
    """Steps 1-2's output: the groups step k trains on (whole, scored, the same on every rank), the reward
    pool's metrics, the age in updates of its oldest token (``staleness``), the schedule's own metrics
    (overlap timing, partial-rollout counts, filter and overlong counts) and, after batch filling, which
    samples enter the loss (``keep`` [B][G]; None: all)."""

    groups: list[RolloutGroup]
    reward_metrics: dict[str, float]
    staleness: int = 0
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    keep: list[list[bool]] | None = None


# checkpoint metadata entries a driver may own: key -> (what it holds, the setting that resumes it)
STATE_ENTRIES = {"rollout_ahead": ("batches generated ahead", "train.rollout_mode=overlap"),
                 "partial_rollouts": ("partial responses in flight", "rollout.partial=true")}


class RolloutDriver(abc.ABC):
    """When rollouts run (module docstring). ``owns``: the checkpoint entries (``STATE_ENTRIES``) it saves;
    ``busy_during_update``: the engine generates while the trainer updates (its memory is not released)."""

    owns: tuple[str, ...] = ()
    busy_during_update: bool = False

    @abc.abstractmethod
    def step_groups(self, step: int) -> StepRollout:
        """Steps 1-2 of ``step``: its whole, scored groups (a collective: every rank calls it)."""

    @abc.abstractmethod
    def extra_round(self, step: int, round_index: int) -> list[RolloutGroup]:
        """Round ``round_index`` >= 1 of ``step`` for dynamic sampling: fresh prompts, generated now by the
        current weights; the groups finished by it."""

    def resubmit(self, rebuilt: bool) -> None:
        """After an engine restart: generate again what was submitted ahead (``rebuilt``: the engine lost it)."""

    def drain(self) -> None:
        """Before a checkpoint: finish what is in flight, so the checkpoint holds it."""

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint metadata entries (a collective; ``drain`` first)."""
        return {}

    def load_state_dict(self, meta: dict[str, Any], path: Path) -> None:
        """Take this driver's entries of a checkpoint's metadata; refuse, naming the setting, what another
        schedule left there (``STATE_ENTRIES``)."""
        for key, (what, setting) in STATE_ENTRIES.items():
            saved = meta.get(key)
            if key not in self.owns and saved is not None and any(saved["ranks"]):
                raise ConfigError(f"{path}: the checkpoint holds {what}; resume it with {setting}")


def my_part(saved: dict | None, path: Path, what: str, dp_size: int, dp_rank: int) -> list | None:
    """This data-parallel rank's part of per-rank state saved by ``Rollouts.per_dp_rank`` (None: nothing
    saved); another data-parallel size is refused."""
    if saved is None or not any(saved["ranks"]):
        return None
    if saved["dp_size"] != dp_size:
        raise ConfigError(f"{path}: the {what} were split over {saved['dp_size']} data-parallel "
                          f"ranks, this run has {dp_size}; resume at the same data-parallel size")
    return saved["ranks"][dp_rank]
