"""Sampling temperature end to end: the training side (PolicyModel's old-policy, update and reference
log-probs and entropy, vocab-parallel at TP=2) computes softmax(logits / T), the distribution the engines
sample from and report, so the first mini-batch of a step has sequence ratios of 1 and nothing clips.

One 2-rank spawn (TP=2) serves every check: for each temperature, a policy and a frozen reference at that
temperature, the transformers engine synced from the policy and sampling at it, and a policy left at
temperature 1 as the control that must disagree.
"""
from pathlib import Path

import pytest
import torch

from gspo_megatron.megatron.spawn import run_distributed
from gspo_megatron.testing.models import tiny_moe_config

TEMPERATURES = (0.6, 1.3)
PROMPTS = [[3, 9, 4], [7, 1, 8, 2, 6], [5, 11], [40, 41, 42, 43]]


def _worker(rank, world_size, model_config, temperatures):
    from gspo_megatron.algorithms.config import LossConfig
    from gspo_megatron.batching import TrainSequence, iter_minibatches
    from gspo_megatron.megatron import sharding
    from gspo_megatron.megatron.logprobs import naive_logprobs
    from gspo_megatron.megatron.optimizer import OptimizerConfig
    from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel
    from gspo_megatron.megatron.policy_model import PolicyModel
    from gspo_megatron.rollout.base import SamplingParams
    from gspo_megatron.rollout.hf_engine import HFRolloutEngine
    from gspo_megatron.rollout.weight_sync import sync_weights
    from gspo_megatron.testing.models import canonical_weights

    parallel = ParallelConfig(tensor_parallel=2)
    initialize_model_parallel(parallel, seed=0)
    weights = canonical_weights(model_config, seed=1)

    def policy_at(temperature, frozen=False):
        policy = PolicyModel(model_config, parallel, OptimizerConfig(lr=1e-3), LossConfig(algorithm="gspo"),
                             frozen=frozen, temperature=temperature)
        sharding.load_full_state_dict(policy.module, weights)
        return policy

    out = {}
    for temperature in temperatures:
        policy, reference, untempered = policy_at(temperature), policy_at(temperature, True), policy_at(1.0, True)
        engine = HFRolloutEngine(model_config.to_hf_config(), init_seed=100 + rank)
        sync_weights(policy.ddp, model_config, engine)
        samples = engine.generate(PROMPTS, 3, SamplingParams(max_new_tokens=8, temperature=temperature, seed=3))
        seqs = [TrainSequence(torch.tensor(PROMPTS[s.prompt_index] + s.response_ids), len(PROMPTS[s.prompt_index]),
                              advantage=1.0 if i % 2 else -1.0) for i, s in enumerate(samples)]
        # the trainer's order: old log-probs of the whole step in one call, then mini-batch 1's update
        old = policy.compute_logprobs(seqs, with_entropy=True)
        for q, o in zip(seqs, old):
            q.old_logprobs = o["logprobs"]
        first = next(iter(iter_minibatches(seqs, 2)))
        with torch.no_grad():  # the engine's own model, teacher-forced: the entropy of softmax(x / T)
            entropy = []
            for q in seqs:
                logits = engine.model(q.tokens[None]).logits[0].float()
                entropy.append(naive_logprobs(logits[q.prompt_len - 1:-1], q.tokens[q.prompt_len:], True,
                                              temperature)[1])
        out[temperature] = {
            "engine": [torch.tensor(s.logprobs) for s in samples],
            "old": [o["logprobs"] for o in old],
            "entropy": [o["entropy"] for o in old],
            "engine_entropy": entropy,
            "reference": [o["logprobs"] for o in reference.compute_logprobs(seqs)],
            "untempered": [o["logprobs"] for o in untempered.compute_logprobs(seqs)],
            "first_minibatch": policy.train_minibatch(first),
        }
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_worker, 2, (tiny_moe_config(), TEMPERATURES))


@pytest.mark.distributed
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_training_logprobs_equal_the_engines(runs, temperature):
    for rank in range(2):
        out = runs[rank][temperature]
        assert sum(len(e) for e in out["engine"]) > 40
        for key in ("old", "reference"):
            for got, engine in zip(out[key], out["engine"]):
                torch.testing.assert_close(got, engine, rtol=0, atol=1e-5, msg=key)
        for got, want in zip(out["entropy"], out["engine_entropy"]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        # the control: log-probs at temperature 1 are far from the sampling distribution's
        gap = torch.cat([a - b for a, b in zip(out["untempered"], out["engine"])]).abs().mean()
        assert gap > 0.05


@pytest.mark.distributed
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_first_minibatch_has_sequence_ratios_of_one(runs, temperature):
    metrics = runs[0][temperature]["first_minibatch"]
    assert metrics["seq_ratio_min"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["seq_ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["clip_frac_low_seq"] == 0.0 and metrics["clip_frac_high_seq"] == 0.0
    assert metrics["grad_norm"] > 0  # the update is real: advantages of both signs, ratio 1


def test_sglang_reports_the_tempered_distribution_unless_told_otherwise():
    """SGLang returns log_softmax(logits / T) (srt/layers/sampler.py) unless SGLANG_RETURN_ORIGINAL_LOGPROB
    is set; our launcher sets it only on request, and the trainer refuses that request at T != 1."""
    from gspo_megatron.rollout.sglang.config import SGLangLaunchConfig
    from gspo_megatron.rollout.sglang.protocol import launch_env
    from gspo_megatron.trainer.config import load_config
    from gspo_megatron.typed_config import ConfigError

    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in launch_env(SGLangLaunchConfig(model_path="/m"))
    demo = Path(__file__).resolve().parents[2] / "examples" / "cpu_demo.yaml"
    sglang = ["rollout.engine=sglang", "rollout.sglang.launch.model_path=/m"]
    load_config(demo, sglang + ["rollout.temperature=0.6"])
    load_config(demo, sglang + ["rollout.temperature=1.0", "rollout.sglang.launch.return_original_logprob=true"])
    with pytest.raises(ConfigError, match="rollout.sglang.launch.return_original_logprob"):
        load_config(demo, sglang + ["rollout.temperature=0.6", "rollout.sglang.launch.return_original_logprob=true"])
