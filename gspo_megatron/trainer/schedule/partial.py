"""The partial-rollout schedule (``rollout.partial``; the pool and its rules: rollout/partial.py).

Each step's prompts join the pool of groups in flight; every unfinished response gets
``rollout.partial_token_budget`` tokens; the finished groups are scored and gathered, the rest is carried.
While the finished groups hold fewer than ``train.minibatches_per_step`` samples (the first step: no
group has had time to finish), further rounds continue just the oldest groups that could make up the
count, so the rest stays in flight. Overlapped, the step's first round was submitted while the last step
trained (``RoundAhead``; its tokens one update older), and the next step's is submitted before the update.

Dynamic sampling. An extra round adds fresh prompts to the pool and generates their first round now; the
groups it finishes are scored and returned, the others stay in the pool and are judged by the filter in
the step they finish, like every group (a filter sees whole groups only).
"""
from __future__ import annotations

from typing import Any

import torch

from gspo_megatron.rollout.partial import InFlightGroup, PartialRollouts
from gspo_megatron.trainer.batch_filling import round_seed
from gspo_megatron.trainer.schedule.base import RolloutDriver, RolloutGroup, StepRollout, my_part
from gspo_megatron.trainer.schedule.overlap import InFlight, RoundAhead, overlap_timing
from gspo_megatron.trainer.schedule.rollouts import Rollouts


class PartialDriver(RolloutDriver):
    """Partial rollouts (module docstring); ``overlapped``: each step's first round is submitted ahead."""

    owns = ("partial_rollouts",)

    def __init__(self, rollouts: Rollouts, pool: PartialRollouts, need: int, overlapped: bool):
        self.rollouts, self.pool, self.need, self.overlapped = rollouts, pool, need, overlapped
        self.busy_during_update = overlapped
        self.round_ahead: RoundAhead | None = None  # overlapped: the next step's first round, generating

    def _generate(self, prompts, samples_per_prompt, params):
        return self.rollouts.supervisor.generate(prompts, samples_per_prompt, params)

    def step_groups(self, step: int) -> StepRollout:
        r = self.rollouts
        sampling, timing = r.rule.for_step(step), {}
        if self.round_ahead is None:  # sync mode and overlap's first step: the first round now
            mine, params = r.sampling(r.next_prompts(), **sampling)
            self.pool.add(mine, params.prompt_offset, step)
            self.pool.generate_round(self._generate, params, step, 0)
        else:
            if self.round_ahead.step != step:
                raise RuntimeError(f"partial rollouts: the round generated ahead is step {self.round_ahead.step}'s, "
                                   f"not step {step}'s")
            timing, self.round_ahead = self._take_round_ahead(), None
            params = r.sampling([], **sampling)[1]  # the step's seed and settings, for further rounds
        G, rounds = r.rule.samples_per_prompt, 1
        while True:  # every rank the same number of rounds: the counts are summed over data-parallel ranks
            finished, running = (int(c) for c in r.dp_sum(self.pool.counts(), dtype=torch.long))
            if finished >= self.need or running == 0:
                break
            chosen = self._oldest_unfinished(-(-(self.need - finished) // G))  # the groups that could make up the count
            self.pool.generate_round(self._generate, params, step, rounds, chosen)
            rounds += 1
        groups, sums, oldest = self.pool.take_finished(step)
        if self.overlapped:
            self._submit_round_ahead(step + 1)
        batch, reward_metrics = self._score(groups)
        age = r.dp_max(oldest)
        counts = {**dict(zip(sums, r.dp_sum(sums.values()))), "partial/max_token_age": float(age),
                  "partial/rounds": float(rounds)}
        return StepRollout(batch, reward_metrics, age, {**counts, **timing})

    def _score(self, groups: list[InFlightGroup]) -> tuple[list[RolloutGroup], dict[str, float]]:
        """Score and gather finished groups, in the run's group order (start step, prompt index), not rank
        by rank: the mini-batches, and so the updates, are those of one process at any data-parallel size."""
        r, G = self.rollouts, self.rollouts.rule.samples_per_prompt
        batch, reward_metrics = r.score_and_gather([g.prompt for g in groups],
                                                   [x.to_sample(g.slot) for g in groups for x in g.responses], G)
        keys = r.gather_lists([g.key for g in groups])
        return [batch[i] for i in sorted(range(len(batch)), key=keys.__getitem__)], reward_metrics

    def extra_round(self, step: int, round_index: int) -> list[RolloutGroup]:
        """Fresh prompts join the pool (their slots after the step's own and earlier rounds') and get their
        first round now; the groups finished by it are returned (module docstring)."""
        r = self.rollouts
        sampling = r.rule.for_step(step)
        sampling["seed"] = round_seed(sampling["seed"], round_index)
        prompts = r.next_prompts()
        mine, params = r.sampling(prompts, **sampling)
        before = len(self.pool.groups)
        self.pool.add(mine, round_index * len(prompts) + params.prompt_offset, step)
        fresh = set(r.gather_lists([g.key for g in self.pool.groups[before:]]))
        self.pool.generate_round(self._generate, params, step, 0, only=fresh)
        groups, _, _ = self.pool.take_finished(step)
        return self._score(groups)[0]

    def _oldest_unfinished(self, n: int) -> set[tuple[int, int]]:
        """The keys of the ``n`` oldest unfinished groups over all data-parallel ranks (a collective), so an
        extra round continues the same groups at every layout."""
        return set(sorted(self.rollouts.gather_lists([g.key for g in self.pool.groups if not g.done]))[:n])

    def _submit_call(self, call) -> int | None:
        """Submit one engine call of a round (``partial.RoundCall``); None when it has no prompts."""
        engine = self.rollouts.supervisor.engine
        return engine.submit(call.prompts, call.samples_per_prompt, call.params) if call.prompts else None

    def _submit_round_ahead(self, upcoming: int) -> None:
        """The next step's prompts join the pool and its first round is submitted now, to be generated by
        the current weights while this step trains."""
        r = self.rollouts
        mine, params = r.sampling(r.next_prompts(), **r.rule.for_step(upcoming))
        self.pool.add(mine, params.prompt_offset, upcoming)
        calls = self.pool.plan_round(params, 0)
        flights = [InFlight(upcoming, [], version=r.supervisor.version) for _ in calls]
        self.round_ahead = RoundAhead(upcoming, calls, flights)
        for call, flight in zip(calls, flights):
            flight.request_id = self._submit_call(call)

    def _take_round_ahead(self) -> dict[str, float]:
        """The results of the round generating ahead into the pool (each call's samples a segment of the
        version that generated it, also after an engine restart generated it again), unless a checkpoint
        took them already (a collective: every rank makes the same calls). Returns its overlap timing."""
        ahead = self.round_ahead
        while ahead.calls:
            call, flight = ahead.calls.pop(0), ahead.flights.pop(0)
            samples = self.rollouts.supervisor.generate(call.prompts, call.samples_per_prompt, call.params, flight=flight)
            call.apply(samples, flight.version - 1, self.pool.max_new_tokens)
            ahead.taken.append(flight)
        return overlap_timing(*ahead.taken)

    def resubmit(self, rebuilt: bool) -> None:
        """The calls of the round ahead not yet taken are generated again with the current weights (the
        call being taken is out of the lists: ``supervisor.generate`` redoes it)."""
        if self.round_ahead is None:
            return
        engine, version = self.rollouts.supervisor.engine, self.rollouts.supervisor.version
        for call, flight in zip(self.round_ahead.calls, self.round_ahead.flights):
            if flight.samples is not None:
                continue
            if flight.request_id is not None and not rebuilt:
                engine.cancel(flight.request_id)
            flight.request_id, flight.version = self._submit_call(call), version

    def drain(self) -> None:
        if self.round_ahead is not None:  # the next step's round joins the pool it is saved with
            self._take_round_ahead()

    def state_dict(self) -> dict[str, Any]:
        # the partial responses in flight, continued exactly by the resumed run
        state = {"partial_rollouts": self.rollouts.per_dp_rank(self.pool.state_dict())}
        if self.round_ahead is not None:
            state["partial_round_ahead"] = self.round_ahead.step
        return state

    def load_state_dict(self, meta: dict[str, Any], path) -> None:
        super().load_state_dict(meta, path)
        r = self.rollouts
        mine = my_part(meta.get("partial_rollouts"), path, "partial responses in flight", r.dp_size, r.dp_rank)
        if mine is not None:
            self.pool.load_state_dict(mine, r.dataset)
        if "partial_round_ahead" in meta:  # that step's first round is in the pool already
            self.round_ahead = RoundAhead(int(meta["partial_round_ahead"]), calls=[], flights=[])
