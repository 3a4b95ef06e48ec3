"""Spawned-rank functions for tests/rollout/test_weight_sync.py.

Spawned ranks import the rank function as ``tests.rollout.weight_sync_workers.sync_cases`` (tests/rollout
is a package).

One spawn serves every case: each case re-initialises Megatron's parallel state for its layout, builds the
policy (DDP-wrapped, as the trainer passes it to ``sync_weights``) with canonical weights, and a
transformers engine whose random initialisation differs per rank, then syncs.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import torch

from gspo_megatron.algorithms.config import LossConfig
from gspo_megatron.megatron import sharding
from gspo_megatron.megatron.model_config import ModelConfig
from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel
from gspo_megatron.batching import TrainSequence
from gspo_megatron.megatron.optimizer import OptimizerConfig
from gspo_megatron.megatron.policy_model import PolicyModel
from gspo_megatron.rollout.base import RolloutEngine, SamplingParams
from gspo_megatron.rollout.hf_engine import HFRolloutEngine
from gspo_megatron.rollout.weight_sync import sync_weights
from gspo_megatron.testing.models import canonical_weights

SMALL_BUCKET_BYTES = 4096  # below one expert's weights: many buckets, some tensors travel alone


@dataclasses.dataclass(frozen=True)
class SyncCase:
    """One model at one parallel layout; ``bucket_bytes`` is the first sync's bound."""

    name: str
    model_config: ModelConfig
    parallel: ParallelConfig
    bucket_bytes: int


class RecordingEngine(RolloutEngine):
    """Passes every bucket to ``inner`` and records (names, bytes, final) per call."""

    def __init__(self, inner: HFRolloutEngine):
        self.inner = inner
        self.calls: list[dict] = []

    def generate(self, prompts, samples_per_prompt, params):
        return self.inner.generate(prompts, samples_per_prompt, params)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, final: bool) -> None:
        bucket = list(named_tensors)
        self.calls.append({"names": [n for n, _ in bucket], "final": final,
                           "bytes": sum(t.numel() * t.element_size() for _, t in bucket)})
        self.inner.update_weights(bucket, final=final)

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version


def fixed_sequences(model_config: ModelConfig, count: int = 3, seed: int = 7) -> list[TrainSequence]:
    """Prompts of 4-6 tokens and responses of 5-9 tokens, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(count):
        prompt_len, response_len = 4 + i, 5 + 2 * i
        tokens = torch.randint(0, model_config.vocab_size, (prompt_len + response_len,), generator=gen)
        seqs.append(TrainSequence(tokens=tokens, prompt_len=prompt_len))
    return seqs


@torch.no_grad()
def teacher_forced_logprobs(engine: HFRolloutEngine, seqs: list[TrainSequence]) -> list[torch.Tensor]:
    """Per sequence, [L - P] log-probs of the response tokens from one unpadded transformers forward."""
    out = []
    for q in seqs:
        logits = engine.model(input_ids=q.tokens[None]).logits[0].float()
        logp = torch.log_softmax(logits[q.prompt_len - 1 : -1], dim=-1)
        out.append(logp.gather(1, q.tokens[q.prompt_len :, None])[:, 0])
    return out


def _engine_state(engine: HFRolloutEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.model.state_dict().items()}


def run_case(rank: int, case: SyncCase) -> dict:
    """Megatron log-probs vs the engine's, before and after a sync; a second engine synced in small buckets;
    generated samples' log-probs vs Megatron's recomputation of them."""
    cfg = case.model_config
    initialize_model_parallel(case.parallel, seed=0)
    policy = PolicyModel(cfg, case.parallel, OptimizerConfig(), LossConfig(algorithm="gspo"))
    sharding.load_full_state_dict(policy.module, canonical_weights(cfg, seed=1))
    seqs = fixed_sequences(cfg)
    megatron = [o["logprobs"] for o in policy.compute_logprobs(seqs)]

    engine = RecordingEngine(HFRolloutEngine(cfg.to_hf_config(), init_seed=100 + rank))
    before = teacher_forced_logprobs(engine.inner, seqs)
    first = sync_weights(policy.ddp, cfg, engine, case.bucket_bytes)
    after = teacher_forced_logprobs(engine.inner, seqs)
    calls_first = list(engine.calls)
    version_after_first = engine.weight_version
    state_first = _engine_state(engine.inner)

    # rollout path: the engine's own decode loop samples; Megatron recomputes the same tokens
    prompts = [q.tokens[: q.prompt_len].tolist() for q in seqs]
    samples = engine.generate(prompts, 2, SamplingParams(max_new_tokens=6, seed=11))
    sampled = [TrainSequence(torch.tensor(prompts[s.prompt_index] + s.response_ids), len(prompts[s.prompt_index]))
               for s in samples]
    recomputed = [o["logprobs"] for o in policy.compute_logprobs(sampled)]

    # second engine, different init again, many small buckets
    small = RecordingEngine(HFRolloutEngine(cfg.to_hf_config(), init_seed=200 + rank))
    sync_weights(policy.ddp, cfg, small, SMALL_BUCKET_BYTES)
    state_small = _engine_state(small.inner)

    # a second sync into the first engine: the version moves once more, the weights stay
    engine.calls.clear()
    sync_weights(policy.ddp, cfg, engine, case.bucket_bytes)
    return {
        "megatron": megatron, "before": before, "after": after, "stats": first,
        "calls": calls_first, "calls_small": small.calls, "calls_second": engine.calls,
        "version_after_first": version_after_first, "version_after_second": engine.weight_version,
        "version_small": small.weight_version,
        "required_names": engine.inner.checkpoint_weight_names(),
        "state_first": state_first, "state_small": state_small,
        "states_equal_after_second": all(torch.equal(v, state_first[k])
                                         for k, v in _engine_state(engine.inner).items()),
        "sample_logprobs": [torch.tensor(s.logprobs) for s in samples], "recomputed": recomputed,
    }


def sync_cases(rank: int, world_size: int, cases: list[SyncCase]) -> dict:
    return {case.name: run_case(rank, case) for case in cases}
