"""Generate, score and gather: the one object that issues the rollout's data-parallel collectives.

Prompts are split over data-parallel ranks by prompt, so groups stay whole; after generation and rewards
every rank holds the whole batch (token ids and scalars). Every driver reaches the engine and the other
ranks through ``Rollouts`` only, so the collectives of a step come in the same order on every rank by
construction: the drivers' own calls are the same on every rank (counts are summed, not branched on).

Sampling does not depend on the rank or the layout: each response has its own seed from (the step's
seed, the prompt's global index, the sample index), ``SamplingParams.prompt_offset``.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from gspo_megatron.batching import split_for_data_parallel
from gspo_megatron.rollout.base import Sample, SamplingParams
from gspo_megatron.trainer.schedule.base import RolloutGroup, step_seed

# (this rank's prompts, their samples prompt-major, G) -> (this rank's groups, reward metrics)
Score = Callable[[list, list[Sample], int], tuple[list[RolloutGroup], dict[str, float]]]


def stop_token_ids(tokenizer, hf_dir) -> list[int]:
    """Where a response ends, the same in both engines: the tokenizer's EOS and every EOS id of the model's
    generation config (SGLang stops at those too; chat models often list several, e.g. end-of-turn and
    end-of-text)."""
    ids = [tokenizer.eos_token_id]
    config = Path(hf_dir) / "generation_config.json" if hf_dir is not None else None
    if config is not None and config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [] if eos is None else [eos]
    return sorted({int(i) for i in ids if i is not None})


@dataclasses.dataclass(frozen=True)
class SamplingRule:
    """How the RL batch of a step is sampled (``rollout.*``, ``train.seed``); the same for every schedule."""

    seed: int
    samples_per_prompt: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    routed_experts: bool  # Routing Replay R3 (or auto): the engine returns the experts of every fed position

    def for_step(self, step: int) -> dict[str, Any]:
        """``Rollouts.rollout``'s sampling arguments for step ``step``'s batch."""
        return {"seed": step_seed(self.seed, step, 1), "temperature": self.temperature,
                "max_new_tokens": self.max_new_tokens, "routed_experts": self.routed_experts}


class Rollouts:
    """Steps 1-2's shared services (module docstring): this rank's share of prompts and its sampling
    parameters, the engine (through ``supervisor``, which restarts failed engines), scoring with ``score``
    and the gathers over the data-parallel ``group``. ``dataset``: where a checkpoint's prompt indices point."""

    def __init__(self, supervisor, prompts: Iterator[list], dataset, rule: SamplingRule, score: Score, group,
                 dp_size: int, dp_rank: int):
        self.supervisor, self.prompts, self.dataset, self.rule, self.score = supervisor, prompts, dataset, rule, score
        self.group, self.dp_size, self.dp_rank = group, dp_size, dp_rank

    def next_prompts(self) -> list:
        return next(self.prompts)

    def sampling(self, prompts: Sequence, seed: int, temperature: float, max_new_tokens: int,
                 routed_experts: bool) -> tuple[list, SamplingParams]:
        """This rank's share of ``prompts`` and its sampling parameters (``prompt_offset``: the global index
        of its first prompt, so each sample's seed does not depend on the layout)."""
        r = self.rule
        mine = split_for_data_parallel(list(prompts), self.dp_size, self.dp_rank)
        first = split_for_data_parallel(range(len(prompts)), self.dp_size, self.dp_rank)[:1]
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=r.top_p, top_k=r.top_k,
                                stop_token_ids=list(r.stop_token_ids), seed=seed,
                                prompt_offset=first[0] if first else 0, return_routed_experts=routed_experts)
        return mine, params

    def rollout(self, prompts: Sequence, seed: int, samples_per_prompt: int, temperature: float,
                max_new_tokens: int, routed_experts: bool = False) -> tuple[list[RolloutGroup], dict[str, float]]:
        """Generate this rank's share of ``prompts`` now, score it, and gather the whole batch on every rank
        (in prompt order). ``seed`` must be the same on every rank."""
        mine, params = self.sampling(prompts, seed, temperature, max_new_tokens, routed_experts)
        samples = self.supervisor.generate([p.prompt_ids for p in mine], samples_per_prompt, params)
        return self.score_and_gather(mine, samples, samples_per_prompt)

    def score_and_gather(self, mine: list, samples: list[Sample],
                         samples_per_prompt: int) -> tuple[list[RolloutGroup], dict[str, float]]:
        """Rewards of this rank's samples, then the whole batch on every rank, rank by rank; the reward
        metrics averaged over ranks."""
        local, metrics = self.score(mine, samples, samples_per_prompt)
        parts = self.dp_parts((local, metrics))
        gathered = [group for part, _ in parts for group in part]
        merged: dict[str, float] = {}
        for _, m in parts:
            for key, value in m.items():
                merged[key] = merged.get(key, 0.0) + float(value) / self.dp_size
        return gathered, merged

    # ---- the data-parallel collectives of the schedules ------------------------------------------------
    def dp_parts(self, mine) -> list:
        """Every data-parallel rank's ``mine`` (plain data), in rank order."""
        parts = [None] * self.dp_size
        dist.all_gather_object(parts, mine, group=self.group)
        return parts

    def gather_lists(self, mine: list) -> list:
        """Every data-parallel rank's ``mine``, concatenated in rank order."""
        return [item for part in self.dp_parts(mine) for item in part]

    def dp_sum(self, values: Sequence[float], dtype=torch.float64) -> list:
        out = torch.tensor(list(values), dtype=dtype)
        dist.all_reduce(out, group=self.group)
        return out.tolist()

    def dp_max(self, value: int) -> int:
        out = torch.tensor([value])
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return int(out)

    def per_dp_rank(self, state: list) -> dict:
        """Each data-parallel rank's ``state`` (plain data) for a checkpoint's metadata."""
        return {"dp_size": self.dp_size, "ranks": self.dp_parts(state)}
