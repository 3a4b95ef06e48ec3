"""Batch filling: the stage between rollout + rewards and the group advantages (DESIGN.md, step 3's input).

Two things happen here, both from DAPO (Yu et al., arXiv 2503.14476), and nothing else:

**Overlong responses** (``rollout.overlong``, DAPO section 3.4). A response cut at ``rollout.max_new_tokens``
(finish reason ``length``) has no verifiable end, so its reward says little about its tokens.

* ``mask`` (DAPO's *overlong filtering*): truncated responses leave the loss. They keep their reward and
  stay in their group's baseline (the group is what the prompt's samples look like) and in every rollout
  metric; only the training sequences drop them, so the loss normalisers count the sequences that remain.
* ``soft_penalty`` (DAPO Eq. 13, *soft overlong punishment*): a length penalty is added to the reward of
  every response longer than ``L_max - L_cache`` (``L_max = max_new_tokens``, ``L_cache =
  overlong_buffer_tokens``), growing linearly to -1 at ``L_max``. It is applied before the group filter
  and the advantages (it changes both).

**Dynamic sampling** (``rollout.filter_groups: zero_variance``, DAPO section 3.2). A group whose rewards are all
equal has advantage 0 for every sample under every estimator (``algorithms/advantages.py``): it costs a
forward and a backward and teaches nothing. Such groups are dropped, and further rounds of
``train.prompts_per_step`` fresh prompts are generated until the step holds ``prompts_per_step``
informative groups, at most ``rollout.max_generation_rounds`` rounds in all. Informative groups beyond
``prompts_per_step`` are discarded (the batch keeps its size, so its normalisers and mini-batches do not
change with luck). When the rounds run out the step trains on the informative groups it has (counted in
``filter/underfilled``), made up with zero-variance groups (advantage 0) to at least
``train.minibatches_per_step`` sequences, so that no mini-batch is empty and the optimizer still takes its
steps (the schedule keeps its length). For the same reason a step whose every mini-batch cannot get a
sequence past the overlong mask trains all its samples (``overlong/mask_lifted``).

Every rank holds the whole gathered batch of every round (``schedule.rollouts.Rollouts``), so every rank takes the
same decision and trains the same groups: the global normalisers stay exact at any data-parallel size.
Round r of step k is seeded by ``round_seed(step seed, r)`` and draws its prompts from the resumable
prompt iterator, so a resumed run generates exactly the rounds the uninterrupted run generated.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Callable, Literal, Sequence

from gspo_megatron.trainer.schedule.base import RolloutGroup as Group
OverlongMode = Literal["none", "mask", "soft_penalty"]
FilterMode = Literal["none", "zero_variance"]


def overlong_penalty(length: int, max_new_tokens: int, buffer_tokens: int) -> float:
    """DAPO Eq. 13, the soft overlong punishment R_length(y) added to the reward (L_max = ``max_new_tokens``,
    L_cache = ``buffer_tokens``):

        0                                  if |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
        -1                                 if |y| > L_max
    """
    threshold = max_new_tokens - buffer_tokens
    if length <= threshold:
        return 0.0
    if length > max_new_tokens:
        return -1.0
    return (threshold - length) / buffer_tokens


def is_truncated(sample) -> bool:
    """A response cut at the token limit (no verifiable end)."""
    return sample.finish_reason == "length"


def shape_overlong_rewards(batch: Sequence[Group], mode: OverlongMode, max_new_tokens: int,
                           buffer_tokens: int) -> list[Group]:
    """The batch with ``soft_penalty``'s length penalty added to every reward (other modes: unchanged)."""
    if mode != "soft_penalty":
        return list(batch)
    return [g._replace(rewards=[r + overlong_penalty(len(s.response_ids), max_new_tokens, buffer_tokens)
                                for s, r in zip(g.samples, g.rewards)]) for g in batch]


def loss_keep(batch: Sequence[Group], mode: OverlongMode) -> list[list[bool]]:
    """[B][G]: whether each sample enters the loss; under ``mask`` truncated samples do not."""
    return [[mode != "mask" or not is_truncated(s) for s in g.samples] for g in batch]


def informative(rewards: Sequence[float]) -> bool:
    """A group with any learning signal: not all rewards exactly equal (the advantages' zero-variance test)."""
    return max(rewards) != min(rewards)


def _num_samples(groups: Sequence[Group]) -> int:
    return sum(len(g.samples) for g in groups)


def round_seed(step_seed: int, round_index: int) -> int:
    """The sampling seed of dynamic-sampling round ``round_index`` of a step; round 0 keeps the step's seed,
    so a run that never refills samples exactly what a run without the filter samples."""
    if round_index == 0:
        return step_seed
    digest = hashlib.blake2b(f"{step_seed}:round:{round_index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % (2**31 - 1)


@dataclasses.dataclass(frozen=True)
class FilledBatch:
    """batch: the groups the step trains on, in generation order;
    keep: [len(batch)][G] whether each sample enters the loss (``loss_keep``);
    generated: every group generated this step (all rounds), after reward shaping, for the rollout metrics;
    metrics: ``filter/...`` and ``overlong/...`` counts of the step."""

    batch: list[Group]
    keep: list[list[bool]]
    generated: list[Group]
    metrics: dict[str, float]


@dataclasses.dataclass(frozen=True)
class BatchFiller:
    """The batch-filling stage configured from ``rollout.*`` and ``train.prompts_per_step`` (module docstring)."""

    prompts_per_step: int
    min_samples: int = 1  # train.minibatches_per_step: no mini-batch may be empty
    filter_groups: FilterMode = "none"
    max_generation_rounds: int = 1
    overlong: OverlongMode = "none"
    overlong_buffer_tokens: int = 0
    max_new_tokens: int = 1

    @classmethod
    def from_config(cls, rollout, train) -> "BatchFiller":
        """From the ``rollout`` and ``train`` config sections."""
        return cls(train.prompts_per_step, train.minibatches_per_step, rollout.filter_groups,
                   rollout.max_generation_rounds, rollout.overlong, rollout.overlong_buffer_tokens,
                   rollout.max_new_tokens)

    def fill(self, first: Sequence[Group], next_round: Callable[[int], Sequence[Group] | None]) -> FilledBatch:
        """The step's training batch from its first round ``first`` and, under dynamic sampling, as many
        further rounds ``next_round(r)`` (r = 1, 2, ...) as it takes (module docstring); ``next_round``
        returns None when a stop signal came (no more rounds: ``filter/stopped_by_signal``)."""
        generated = self._shape(first)
        rounds, informative_count, stopped = 1, None, False
        if self.filter_groups == "none":
            batch = generated
        else:
            kept = [g for g in generated if informative(g.rewards)]
            while len(kept) < self.prompts_per_step and rounds < self.max_generation_rounds:
                groups = next_round(rounds)
                if groups is None:  # a stop signal: the step trains on what it has, as when the rounds run out
                    stopped = True
                    break
                more = self._shape(groups)
                rounds += 1
                generated += more
                kept += [g for g in more if informative(g.rewards)]
            informative_count = len(kept)
            batch = kept[:self.prompts_per_step]
            # too few sequences for the mini-batches: zero-variance groups (advantage 0) make up the count
            spare = (g for g in generated if not informative(g.rewards))
            while _num_samples(batch) < self.min_samples and len(batch) < len(generated):
                batch.append(next(spare))
        keep = loss_keep(batch, self.overlong)
        lifted = sum(map(sum, keep)) < self.min_samples
        if lifted:  # masking would leave a mini-batch empty: this step trains every sample
            keep = loss_keep(batch, "none")
        metrics = self._metrics(generated, batch, keep, rounds, informative_count)
        if informative_count is not None:
            metrics["filter/stopped_by_signal"] = float(stopped)
        if self.overlong == "mask":
            metrics["overlong/mask_lifted"] = float(lifted)
        return FilledBatch(batch, keep, generated, metrics)

    def _shape(self, groups: Sequence[Group]) -> list[Group]:
        return shape_overlong_rewards(groups, self.overlong, self.max_new_tokens, self.overlong_buffer_tokens)

    def _metrics(self, generated: list[Group], batch: list[Group], keep: list[list[bool]], rounds: int,
                 informative_count: int | None) -> dict[str, float]:
        out: dict[str, float] = {}
        samples = [s for g in generated for s in g.samples]
        trained = sum(sum(k) for k in keep)
        if self.overlong != "none":
            out["overlong/truncated_frac"] = sum(is_truncated(s) for s in samples) / max(len(samples), 1)
        if self.overlong == "mask":
            out["overlong/masked_samples"] = float(sum(len(k) - sum(k) for k in keep))
        if self.overlong == "mask" or informative_count is not None:
            out["samples_per_trained_sample"] = len(samples) / max(trained, 1)
        if self.overlong == "soft_penalty":
            penalties = [overlong_penalty(len(s.response_ids), self.max_new_tokens, self.overlong_buffer_tokens)
                         for s in samples]
            out["overlong/penalty_mean"] = sum(penalties) / max(len(penalties), 1)
            out["overlong/penalised_frac"] = sum(p < 0 for p in penalties) / max(len(penalties), 1)
        if informative_count is not None:
            dropped = len(generated) - informative_count
            out.update({
                "filter/rounds": float(rounds),
                "filter/groups_generated": float(len(generated)),
                "filter/groups_dropped": float(dropped),
                "filter/groups_surplus": float(max(0, informative_count - self.prompts_per_step)),
                "filter/groups_trained": float(len(batch)),
                "filter/underfilled": float(informative_count < self.prompts_per_step),
                "filter/reward_mean_generated": (sum(r for g in generated for r in g.rewards)
                                                 / max(len(samples), 1)),
            })
        return out


__all__ = ["BatchFiller", "FilledBatch", "informative", "is_truncated", "loss_keep", "overlong_penalty",
           "round_seed", "shape_overlong_rewards"]
