"""GPU check steps (run by tools/gpu_check.sh on a lent GPU; docs/gpu.md).

    python tools/gpu_step.py train      one GSPO step of a ~0.5 B-parameter MoE, bf16, CUDA, NCCL world size 1
    python tools/gpu_step.py generate   the transformers rollout engine generating on the GPU
    python tools/gpu_step.py plan       the model and batch sizes only (no GPU needed; tested on CPU)

Each prints one line ``GPU_CHECK {json}`` with tokens/s and peak GPU memory (timed after a warm-up).
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

# ~0.49 B parameters: 8 layers of 16 experts (top-2, 1024 wide) at hidden 1024, 32k vocabulary
MODEL = dict(architecture="qwen3_moe", vocab_size=32000, hidden_size=1024, num_layers=8, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, num_experts=16, moe_ffn_hidden_size=1024, moe_router_topk=2,
             norm_topk_prob=True, rope_theta=1_000_000.0, max_position_embeddings=4096)
SEQS, PROMPT, LENGTH = 64, 128, 512  # the training batch: 64 sequences of 512 tokens, responses of 384
PROMPTS, SAMPLES, NEW_TOKENS = 32, 4, 128  # the rollout batch


def model_config():
    from gspo_megatron.megatron.model_config import ModelConfig

    config = ModelConfig(**MODEL)
    config.validate("gpu_step")
    return config


def parameter_count(config) -> int:
    h, d = config.hidden_size, config.head_dim
    attention = h * d * (config.num_attention_heads + 2 * config.num_key_value_heads) + config.num_attention_heads * d * h
    experts = config.num_experts * 3 * h * config.moe_ffn_hidden_size + config.num_experts * h
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return config.num_layers * (attention + experts) + embeddings


def report(name: str, **fields) -> None:
    print("GPU_CHECK " + json.dumps({"step": name, **fields}, sort_keys=True), flush=True)


def _sequences(config, seed: int):
    from gspo_megatron.batching import TrainSequence

    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(SEQS):
        q = TrainSequence(torch.randint(0, config.vocab_size, (LENGTH,), generator=gen), PROMPT)
        q.advantage = float(torch.randn((), generator=gen))
        seqs.append(q)
    return seqs


def train() -> None:
    from gspo_megatron.algorithms.config import LossConfig
    from gspo_megatron.megatron import parallel
    from gspo_megatron.megatron.model import ModelRuntime
    from gspo_megatron.megatron.optimizer import OptimizerConfig
    from gspo_megatron.megatron.policy_model import PolicyModel
    from gspo_megatron.megatron.spawn import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    parallel.init_process_group(0, 1, master_port=free_port())
    parallel.initialize_model_parallel(parallel.ParallelConfig(), seed=0)
    import torch.distributed as dist

    config = model_config()
    policy = PolicyModel(config, parallel.ParallelConfig(), OptimizerConfig(lr=1e-6), LossConfig(algorithm="gspo"),
                         max_tokens_per_microbatch=8192,
                         runtime=ModelRuntime(precision="bf16", recompute="selective", layer_spec="local"))
    for step in range(2):  # the first is the warm-up (allocator, kernels)
        seqs = _sequences(config, step)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for q, old in zip(seqs, policy.compute_logprobs(seqs)):
            q.old_logprobs = old["logprobs"]
        metrics = policy.train_minibatch(seqs)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    if not all(torch.isfinite(torch.tensor(v)) for v in metrics.values()):
        raise SystemExit(f"gpu_step train: non-finite metrics {metrics}")
    report("gspo_step", backend=dist.get_backend_config(), params=parameter_count(config), precision="bf16",
           tokens=SEQS * LENGTH, seconds=round(elapsed, 3), tokens_per_s=round(SEQS * LENGTH / elapsed, 1),
           peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2), grad_norm=metrics["grad_norm"],
           device=torch.cuda.get_device_name(0))
    parallel.destroy()


def generate() -> None:
    from gspo_megatron.rollout.base import SamplingParams
    from gspo_megatron.rollout.hf_engine import HFRolloutEngine

    config = model_config()
    engine = HFRolloutEngine(config.to_hf_config(), dtype=torch.bfloat16, device="cuda", init_seed=0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (64,), generator=gen).tolist() for _ in range(PROMPTS)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=1)
    for _ in range(2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        samples = engine.generate(prompts, SAMPLES, params)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    tokens = sum(len(s.response_ids) for s in samples)
    report("hf_engine_generate", params=parameter_count(config), samples=len(samples), tokens=tokens,
           seconds=round(elapsed, 3), tokens_per_s=round(tokens / elapsed, 1),
           peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2), device=torch.cuda.get_device_name(0))


def plan() -> None:
    config = model_config()
    report("plan", params=parameter_count(config), train_tokens=SEQS * LENGTH, rollout_samples=PROMPTS * SAMPLES)


if __name__ == "__main__":
    modes = {"train": train, "generate": generate, "plan": plan}
    if len(sys.argv) != 2 or sys.argv[1] not in modes:
        raise SystemExit(f"usage: python tools/gpu_step.py {'|'.join(modes)}")
    modes[sys.argv[1]]()
