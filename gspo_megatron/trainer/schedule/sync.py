"""The synchronous schedule (``train.rollout_mode: sync``): step k's prompts are generated at the start of
step k by the weights of k updates, and nothing is in flight between steps."""
from __future__ import annotations

from gspo_megatron.trainer.batch_filling import round_seed
from gspo_megatron.trainer.schedule.base import RolloutDriver, RolloutGroup, StepRollout
from gspo_megatron.trainer.schedule.rollouts import Rollouts


def fresh_round(rollouts: Rollouts, step: int, round_index: int) -> list[RolloutGroup]:
    """Dynamic sampling's round ``round_index`` >= 1 of ``step``: the next prompts, generated now by the
    current weights (staleness 0 in every schedule), seeded by ``round_seed``."""
    sampling = rollouts.rule.for_step(step)
    sampling["seed"] = round_seed(sampling["seed"], round_index)
    groups, _ = rollouts.rollout(rollouts.next_prompts(), samples_per_prompt=rollouts.rule.samples_per_prompt,
                                 **sampling)
    return groups


class SyncDriver(RolloutDriver):
    def __init__(self, rollouts: Rollouts):
        self.rollouts = rollouts

    def step_groups(self, step: int) -> StepRollout:
        r = self.rollouts
        groups, reward_metrics = r.rollout(r.next_prompts(), samples_per_prompt=r.rule.samples_per_prompt,
                                           **r.rule.for_step(step))
        return StepRollout(groups, reward_metrics)

    def extra_round(self, step: int, round_index: int) -> list[RolloutGroup]:
        return fresh_round(self.rollouts, step, round_index)
