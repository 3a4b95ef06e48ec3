"""When rollouts run: the schedule of steps 1-2, in one package (docs/training.md, "Rollout schedules").

``base`` (the group type and the driver interface), ``rollouts`` (sampling, scoring and the
data-parallel gathers), ``supervisor`` (the engine: build, restarts, memory, weight sync), and one driver
per schedule: ``sync``, ``overlap``, ``partial``; ``filling`` wraps any of them with dynamic sampling and
overlong shaping. ``build_driver`` picks them from the config."""
from __future__ import annotations

from gspo_megatron.trainer.schedule.base import RolloutDriver


def build_driver(config, rollouts, progress: bool = False, stop_requested=lambda: False) -> RolloutDriver:
    """The run's driver: sync, overlap or partial (overlapped or not), inside batch filling (``progress``: a
    line per dynamic-sampling round, on the main rank; ``stop_requested``: a collective asked between rounds)."""
    from gspo_megatron.rollout.partial import PartialRollouts
    from gspo_megatron.trainer.batch_filling import BatchFiller
    from gspo_megatron.trainer.schedule.filling import FillingDriver
    from gspo_megatron.trainer.schedule.overlap import OverlapDriver
    from gspo_megatron.trainer.schedule.partial import PartialDriver
    from gspo_megatron.trainer.schedule.sync import SyncDriver

    r, t = config.rollout, config.train
    overlapped = t.rollout_mode == "overlap"
    if r.partial:
        pool = PartialRollouts(r.samples_per_prompt, r.partial_token_budget, r.max_new_tokens, t.max_staleness)
        inner: RolloutDriver = PartialDriver(rollouts, pool, t.minibatches_per_step, overlapped)
    elif overlapped:
        inner = OverlapDriver(rollouts, t.max_staleness)
    else:
        inner = SyncDriver(rollouts)
    filler = BatchFiller.from_config(r, t)
    return FillingDriver(inner, filler, progress=progress and filler.filter_groups != "none",
                         stop_requested=stop_requested)
