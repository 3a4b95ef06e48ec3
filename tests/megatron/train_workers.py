"""Spawned-rank functions for the GSPO-in-Megatron tests."""
from __future__ import annotations

import torch

from gspo_megatron.algorithms.config import LossConfig
from gspo_megatron.megatron import sharding
from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel
from gspo_megatron.batching import TrainSequence, split_for_data_parallel
from gspo_megatron.megatron.optimizer import OptimizerConfig
from gspo_megatron.megatron.policy_model import PolicyModel
from gspo_megatron.testing.models import canonical_weights

LAYOUTS = {
    "single": ParallelConfig(),
    "tp2": ParallelConfig(tensor_parallel=2),
    "pp2": ParallelConfig(pipeline_parallel=2),
    "ep2": ParallelConfig(expert_parallel=2),
    "dp2": ParallelConfig(),
    "dp2_distopt": ParallelConfig(distributed_optimizer=True),
    "tp2_distopt": ParallelConfig(tensor_parallel=2, distributed_optimizer=True),  # DP = 1
    "cp2": ParallelConfig(context_parallel=2),
}


def make_sequences(model_config, count: int = 6, seed: int = 0) -> list[TrainSequence]:
    """Prompts of 3-5 tokens, responses of 1-9 tokens, advantages of both signs."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(count):
        p = 3 + i % 3
        r = 1 + (i * 5) % 9
        tokens = torch.randint(0, model_config.vocab_size, (p + r,), generator=gen)
        seqs.append(TrainSequence(tokens=tokens, prompt_len=p, advantage=float(torch.randn((), generator=gen))))
    return seqs


def policy_step(rank, world_size, model_config, layout: str, loss: dict, max_tokens: int = 4096,
                optimizer_steps: int = 0) -> dict:
    """Old log-probs by a no-grad forward (then perturbed, so ratios differ from 1 and some clip), the GSPO
    gradient of one mini-batch, and optionally a few optimizer steps; everything gathered to full shapes."""
    from megatron.core import parallel_state as ps

    parallel = LAYOUTS[layout]
    initialize_model_parallel(parallel, seed=0)
    policy = PolicyModel(model_config, parallel, OptimizerConfig(lr=1e-2), LossConfig(**loss),
                         max_tokens_per_microbatch=max_tokens)
    sharding.load_full_state_dict(policy.module, canonical_weights(model_config, seed=1))
    seqs = make_sequences(model_config)
    olds = policy.compute_logprobs(seqs, with_entropy=True)
    gen = torch.Generator().manual_seed(5)
    for i, (q, old) in enumerate(zip(seqs, olds)):
        # sequences 0 and 1 move 1% in the direction of their advantage: clipped (no gradient);
        # the rest stay inside the 3e-4 / 4e-4 range: unclipped, with ratios != 1
        shift = -0.01 * (1.0 if q.advantage > 0 else -1.0) if i < 2 else 0.0
        q.old_logprobs = old["logprobs"] + shift + 1e-4 * torch.randn(q.response_len, generator=gen)
    mine = split_for_data_parallel(seqs, ps.get_data_parallel_world_size(), ps.get_data_parallel_rank())
    raw = policy.forward_backward(mine)
    result = {"old": [o["logprobs"] for o in olds], "entropy": [o["entropy"] for o in olds],
              "grads": sharding.full_state_dict(policy.ddp, model_config.vocab_size, grads=True),
              "metrics": {k: float(v) for k, v in raw.items()}}
    steps = []
    for _ in range(optimizer_steps):
        steps.append(policy.optimizer_step())
        policy.forward_backward(mine)
    result["steps"] = steps
    result["weights"] = sharding.full_state_dict(policy.module, model_config.vocab_size)
    return result


def all_layouts(rank, world_size, model_config, layouts, loss, optimizer_steps=0) -> dict:
    return {name: policy_step(rank, world_size, model_config, name, loss, optimizer_steps=optimizer_steps)
            for name in layouts}


def microbatch_splits(rank, world_size, model_config, budgets, loss) -> dict:
    return {b: policy_step(rank, world_size, model_config, "single", loss, max_tokens=b) for b in budgets}


def replay_after_update(rank, world_size, model_config, layout: str = "single") -> dict:
    """R2 through PolicyModel: record the experts of the old-policy forward, take a large optimizer step so
    free routing changes, then the update forward with routed_experts uses exactly the recorded experts.
    The records are the policy's own (``routing_recorder``: gathered over SP and CP to position order)."""
    from megatron.core import parallel_state as ps

    initialize_model_parallel(LAYOUTS[layout], seed=0)
    policy = PolicyModel(model_config, LAYOUTS[layout], OptimizerConfig(lr=0.5, clip_grad=0.0),
                         LossConfig(algorithm="grpo"))
    sharding.load_full_state_dict(policy.module, canonical_weights(model_config, seed=1))
    seqs = make_sequences(model_config)
    with policy.routing_recorder() as before:
        olds = policy.compute_logprobs(seqs)
    policy.record_routing(seqs, before)
    for q, o in zip(seqs, olds):
        q.old_logprobs = o["logprobs"]
    policy.train_minibatch(seqs)  # a big step: the routers move
    with policy.routing_recorder() as free:
        policy.compute_logprobs(seqs)
    with policy.routing_recorder() as replayed:
        policy.forward_backward(seqs, replay=True)
    assert ps.get_data_parallel_world_size() == 1
    return {"before": before.routed_experts(), "free": free.routed_experts(), "replayed": replayed.routed_experts(),
            "plan": policy._local_plan(seqs), "lengths": [int(q.tokens.numel()) for q in seqs]}


def nan_gradient_is_skipped(rank, world_size, model_config) -> dict:
    """A non-finite gradient on one rank skips the update on every rank (weights unchanged, counted);
    the next clean step updates normally."""
    parallel = LAYOUTS["ep2"] if world_size == 2 else LAYOUTS["single"]
    initialize_model_parallel(parallel, seed=0)
    policy = PolicyModel(model_config, parallel, OptimizerConfig(lr=1e-2), LossConfig())
    sharding.load_full_state_dict(policy.module, canonical_weights(model_config, seed=1))
    seqs = make_sequences(model_config)
    for q, o in zip(seqs, policy.compute_logprobs(seqs)):
        q.old_logprobs = o["logprobs"] + 0.05
    before = {n: p.detach().clone() for n, p in policy.module.named_parameters()}
    policy.forward_backward(seqs)
    if rank == 0:  # poison one gradient on one rank only
        next(p for p in policy.ddp.parameters() if p.main_grad is not None).main_grad.view(-1)[0] = float("nan")
    skipped = policy.optimizer_step()
    unchanged = all(torch.equal(p, before[n]) for n, p in policy.module.named_parameters())
    policy.forward_backward(seqs)
    clean = policy.optimizer_step()
    changed = any(not torch.equal(p, before[n]) for n, p in policy.module.named_parameters())
    return {"skipped": skipped, "unchanged": unchanged, "clean": clean, "changed": changed,
            "count": policy.skipped_steps}


def training_state_across_layouts(rank, world_size, model_config, save_layout: str, load_layout: str,
                                  directory: str) -> dict:
    """Two Adam steps at ``save_layout`` with a checkpoint (model, optimizer, scheduler) after the first;
    the checkpoint loaded at ``load_layout`` and the second step taken there must give the same weights."""
    from gspo_megatron.megatron import checkpoint as ckpt

    def policy_at(layout: str, seed: int) -> PolicyModel:
        initialize_model_parallel(LAYOUTS[layout], seed=seed)
        return PolicyModel(model_config, LAYOUTS[layout], OptimizerConfig(lr=1e-2, warmup_steps=2), LossConfig())

    def step(policy: PolicyModel, layout: str):
        from megatron.core import parallel_state as ps

        seqs = make_sequences(model_config)
        for q, o in zip(seqs, policy.compute_logprobs(seqs)):
            q.old_logprobs = o["logprobs"] + 0.002
        mine = split_for_data_parallel(seqs, ps.get_data_parallel_world_size(), ps.get_data_parallel_rank())
        return policy.train_minibatch(mine)

    policy = policy_at(save_layout, 0)
    sharding.load_full_state_dict(policy.module, canonical_weights(model_config, seed=1))
    step(policy, save_layout)
    ckpt.save(policy.sharded_state_dict(), f"{directory}/state")
    second = step(policy, save_layout)
    expected = sharding.full_state_dict(policy.module, model_config.vocab_size)

    resumed = policy_at(load_layout, 7)  # different init: everything must come from the checkpoint
    resumed.load_sharded_state_dict(ckpt.load(resumed.sharded_state_dict(is_loading=True), f"{directory}/state"))
    second_resumed = step(resumed, load_layout)
    return {"expected": expected, "lr": (second["lr"], second_resumed["lr"]),
            "got": sharding.full_state_dict(resumed.module, model_config.vocab_size)}


def replay_rollout_routing(rank, world_size, model_config, layout: str) -> dict:
    """R3 through PolicyModel and the transformers engine: sync the policy's weights into the engine,
    sample with routed experts, then the training forwards replay the engine's experts at every fed
    position -- before and after a large optimizer step that changes free routing."""
    from gspo_megatron.megatron.routing import RoutingRecorder
    from gspo_megatron.rollout.base import SamplingParams
    from gspo_megatron.rollout.hf_engine import HFRolloutEngine
    from gspo_megatron.rollout.weight_sync import sync_weights

    parallel = LAYOUTS[layout]
    initialize_model_parallel(parallel, seed=0)
    policy = PolicyModel(model_config, parallel, OptimizerConfig(lr=0.5, clip_grad=0.0), LossConfig(algorithm="grpo"))
    sharding.load_full_state_dict(policy.module, canonical_weights(model_config, seed=1))
    engine = HFRolloutEngine(model_config.to_hf_config(), init_seed=100 + rank)
    sync_weights(policy.ddp, model_config, engine)
    prompts = [[3, 9, 4], [7, 1, 8, 2, 6], [5]]
    samples = engine.generate(prompts, 2, SamplingParams(max_new_tokens=7, seed=3, return_routed_experts=True))
    seqs = [TrainSequence(torch.tensor(prompts[s.prompt_index] + s.response_ids), len(prompts[s.prompt_index]),
                          advantage=float(i % 3) - 1.0, routed_experts=s.all_routed_experts())
            for i, s in enumerate(samples)]
    out = {"engine": [q.routed_experts.clone() for q in seqs], "lengths": [int(q.tokens.numel()) for q in seqs],
           "engine_logprobs": [torch.tensor(s.logprobs) for s in samples]}
    with RoutingRecorder(policy.module) as rec:
        olds = policy.compute_logprobs(seqs, replay=True)
    out["replayed_before"] = rec.routed_experts()
    out["replayed_logprobs"] = [o["logprobs"] for o in olds]
    for q, o in zip(seqs, olds):
        q.old_logprobs = o["logprobs"]
    policy.train_minibatch(seqs, replay=True)  # a big step: free routing moves
    with RoutingRecorder(policy.module) as free:
        policy.compute_logprobs(seqs)
    with RoutingRecorder(policy.module) as replayed:
        policy.forward_backward(seqs, replay=True)
    out["free_after"], out["replayed_after"] = free.routed_experts(), replayed.routed_experts()
    out["plan"] = policy._local_plan(seqs)
    return out
