"""The parts a run is built from, shared by the trainer and ``gspo-megatron eval`` (which builds no optimizer,
signal handlers or run-folder lock): the tokenizer and model config, a policy model, the engine supervisor,
the reward scorer, the sampling rule, and the evaluation itself."""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch
import torch.distributed as dist

from gspo_megatron.megatron.model_config import ModelConfig
from gspo_megatron.megatron.policy_model import PolicyModel
from gspo_megatron.rollout.agent_loop import tool_metrics
from gspo_megatron.trainer import completions
from gspo_megatron.trainer.schedule.base import RolloutGroup, step_seed
from gspo_megatron.trainer.schedule.overlap import trainer_threads
from gspo_megatron.trainer.schedule.rollouts import Rollouts, SamplingRule, Score, stop_token_ids
from gspo_megatron.trainer.schedule.supervisor import EngineFactory, EngineSupervisor


def load_tokenizer(model_section):
    from transformers import AutoTokenizer

    from gspo_megatron.data.tokenizer import demo_tokenizer_path

    m = model_section
    return AutoTokenizer.from_pretrained(m.tokenizer_dir or m.hf_dir or demo_tokenizer_path())


def model_config_of(model_section) -> ModelConfig:
    return ModelConfig.from_hf_dir(model_section.hf_dir) if model_section.hf_dir is not None else model_section.config


def policy_model(config, model_config: ModelConfig, frozen: bool) -> PolicyModel:
    """A policy (or, ``frozen``, a forward-only model: the KL reference, an evaluated checkpoint) whose
    log-probs are of softmax(logits / T), the distribution the rollout samples from."""
    return PolicyModel(model_config, config.parallel, config.optimizer, config.loss, frozen=frozen,
                       max_tokens_per_microbatch=config.train.max_tokens_per_microbatch,
                       temperature=config.rollout.temperature, runtime=config.model.runtime,
                       distill=None if frozen else config.distill)


def agent_spec(config, tokenizer):
    """What the multi-turn agent loop needs besides the engine (``rollout.multi_turn``; None: single-turn)."""
    from gspo_megatron.rewards.sandbox import python_tool
    from gspo_megatron.rollout.agent_loop import AgentSpec

    if config.rollout.multi_turn is None:
        return None
    return AgentSpec(config.rollout.multi_turn, tokenizer, config.data.chat_template,
                     tuple(stop_token_ids(tokenizer, config.model.hf_dir)),
                     run_python=functools.partial(python_tool, config.rewards.code.sandbox))


def engine_supervisor(config, model_config: ModelConfig, tokenizer, policy: PolicyModel, faults: dict[str, int],
                      rank: int) -> EngineSupervisor:
    """The rollout engine's owner (trainer/schedule/supervisor.py), syncing ``policy``'s weights."""
    from gspo_megatron.rollout.weight_sync import DEFAULT_BUCKET_BYTES, sync_weights

    overlap, sglang = config.train.rollout_mode == "overlap", config.rollout.engine == "sglang"
    if overlap and not sglang:  # the engine process takes its own cores (rollout/process_engine.py)
        torch.set_num_threads(trainer_threads(torch.get_num_threads(), config.rollout.engine_threads,
                                              config.train.trainer_threads))
    shared = sglang and dist.get_world_size() > 1
    share_report = None
    if shared:
        from gspo_megatron.trainer.rollout_setup import share_sync_report as share_report
    # SGLang: one post per bucket of its bucket_bytes (docs/rollout.md, "Bucket size")
    bucket = config.rollout.sglang.bucket_bytes if sglang else DEFAULT_BUCKET_BYTES
    runner = policy.module if policy.frozen else policy.ddp
    factory = EngineFactory(config, model_config, agent_spec(config, tokenizer), overlap, dict(os.environ))
    return EngineSupervisor(factory, lambda engine: sync_weights(runner, model_config, engine, bucket), faults,
                            asynchronous=overlap, shared_servers=shared, share_report=share_report, rank=rank)


def sampling_rule(config, tokenizer) -> SamplingRule:
    r = config.rollout
    return SamplingRule(config.train.seed, r.samples_per_prompt, r.temperature, r.top_p, r.top_k, r.max_new_tokens,
                        tuple(stop_token_ids(tokenizer, config.model.hf_dir)),
                        routed_experts=config.train.routing_replay in ("r3", "auto"))


def reward_scorer(tokenizer, rewards, keep_routing: Callable[[list], list], num_experts: int) -> Score:
    """Step 2 on one rank: the rewards and verdicts of samples (prompt-major, G per prompt); a multi-turn
    trajectory is scored on its final model turn (the answer). ``keep_routing``: where R3 records stay
    until the step's shares are cut (trainer/routing_exchange.py)."""
    from gspo_megatron.rollout.agent_loop import final_turn_ids
    from gspo_megatron.rollout.base import compact_routed_experts

    def score(mine: list, samples: list, G: int) -> tuple[list[RolloutGroup], dict[str, float]]:
        samples = keep_routing(compact_routed_experts(samples, num_experts))  # one byte per expert id
        texts = [tokenizer.decode(final_turn_ids(s), skip_special_tokens=True) for s in samples]
        scores = rewards.score_verdicts([(mine[i // G], t) for i, t in enumerate(texts)]) if texts else None
        rs, ok = (scores.rewards, scores.correct) if scores is not None else ([], [])
        groups = [RolloutGroup(p, samples[k * G:(k + 1) * G], rs[k * G:(k + 1) * G], ok[k * G:(k + 1) * G])
                  for k, p in enumerate(mine)]
        return groups, scores.metrics if scores is not None else {}

    return score


def evaluate(rollouts: Rollouts, config, data, step: int, tokenizer, is_main: bool,
             stop: Callable[[], bool] = lambda: False) -> tuple[dict[str, float] | None, list]:
    """Greedy pass@1 (temperature 0: argmax decoding in both engines) and sampled pass@k on ``data``'s first
    ``eval.num_prompts`` prompts. Returns (metrics, per-prompt rows on the main rank); metrics None when
    ``stop()`` (a collective) said so before or between the two rollouts."""
    cfg, max_new = config.eval, config.rollout.max_new_tokens
    if stop():
        return None, []
    prompts = list(data)[:cfg.num_prompts]
    seed = step_seed(config.train.seed + 17, step, 0)  # the same on every rank
    greedy, _ = rollouts.rollout(prompts, seed, 1, 0.0, max_new)  # temperature 0: greedy
    out = {"eval_accuracy": fraction([g.verdicts[0] for g in greedy])}
    out.update({f"eval_{k}": v for k, v in tool_metrics([s for g in greedy for s in g.samples]).items()})
    sampled = None
    if cfg.pass_k > 1:
        if stop():
            return None, []
        sampled, _ = rollouts.rollout(prompts, seed + 1, cfg.pass_k, cfg.temperature, max_new)
        out[f"eval_pass@{cfg.pass_k}"] = fraction([any_correct(g.verdicts) for g in sampled])
    rows = completions.eval_rows(greedy, sampled, tokenizer) if is_main else []
    return {k: v for k, v in out.items() if v is not None}, rows  # None: no reward term judges correctness


def fraction(correct: list[bool | None]) -> float | None:
    """The fraction of correct responses; None when any is unjudged (no reward term judges correctness)."""
    if any(ok is None for ok in correct):
        return None
    return sum(float(ok) for ok in correct) / max(len(correct), 1)


def any_correct(group: list[bool | None]) -> bool | None:
    """pass@k of one prompt: any of its k responses correct (None when unjudged)."""
    return None if any(ok is None for ok in group) else any(group)
