"""Routing Replay in the trainer: under R3 the rollout engine's experts (prompt and response positions)
reach the training forwards and are the ones used; under R2 the old-policy forward's are."""
from pathlib import Path

import pytest
import torch

from gspo_megatron.megatron.spawn import run_distributed

DEMO = Path(__file__).resolve().parents[2] / "examples" / "cpu_demo.yaml"


# Qwen2-MoE on the demo's shape: q/k/v biases, top-3 of 6 experts without renormalisation, a gated shared expert
QWEN2_MOE = ("model.config.architecture=qwen2_moe", "model.config.qkv_bias=true", "model.config.qk_layernorm=false",
             "model.config.num_experts=6", "model.config.moe_router_topk=3", "model.config.norm_topk_prob=false",
             "model.config.moe_shared_expert_intermediate_size=48", "model.config.moe_shared_expert_gate=true")
# GLM-4.5 on the demo's shape: layer 0 dense, a sigmoid router with a (frozen) expert bias and scaling 2.5, a shared
# expert, RoPE on half of each head, q/k norm and q/k/v biases
GLM4_MOE = ("model.config.architecture=glm4_moe", "model.config.first_dense_layers=1", "model.config.ffn_hidden_size=96",
            "model.config.moe_router_score_function=sigmoid", "model.config.moe_router_expert_bias=true",
            "model.config.moe_router_topk_scaling_factor=2.5", "model.config.moe_shared_expert_intermediate_size=64",
            "model.config.rotary_percent=0.5", "model.config.qkv_bias=true", "model.config.qk_layernorm=true")
EP2 = "parallel.expert_parallel=2"  # the 2-rank layout of the replay checks (CP=2: "r3-cp2")
# DeepSeek-V3 on the demo's shape: multi-latent attention (q latent 24, kv latent 20, 10 + 6 rotated query/key dims,
# 12 value dims), layer 0 dense, a sigmoid router with a (frozen) expert bias and scaling 2.5, a shared expert
DEEPSEEK_V3 = ("model.config.architecture=deepseek_v3", "model.config.num_key_value_heads=4",
               "model.config.qk_rope_head_dim=6", "model.config.q_lora_rank=24", "model.config.kv_lora_rank=20",
               "model.config.v_head_dim=12", "model.config.qk_layernorm=true", "model.config.first_dense_layers=1",
               "model.config.ffn_hidden_size=96", "model.config.moe_router_score_function=sigmoid",
               "model.config.moe_router_expert_bias=true", "model.config.moe_router_topk_scaling_factor=2.5",
               "model.config.moe_shared_expert_intermediate_size=64")


def replayed_step(rank, world_size, run_dir: str, mode: str, model: tuple[str, ...] = (),
                  parallel: str = EP2) -> dict:
    """One train step under ``mode``; on 2 ranks with ``parallel`` (EP=2, or CP=2: each rank holds two
    chunks of every sequence, and the policy's recorder gathers them back in position order)."""
    from gspo_megatron.trainer.config import load_config
    from gspo_megatron.trainer.loop import Trainer

    overrides = ["sft.steps=0", "train.steps=1", "logging.console=false", "logging.tensorboard=false",
                 "train.prompts_per_step=4", f"train.routing_replay={mode}", "optimizer.lr=0.05",
                 "loss.entropy_coef=0.5", *model]  # rewards are 0 before the warm start: the entropy term moves the weights
    if world_size == 2:
        overrides.append(parallel)
    trainer = Trainer(load_config(DEMO, overrides), run_dir)
    engine_rows: list[torch.Tensor] = []
    real_generate = trainer.engine.generate

    def generate(prompts, samples_per_prompt, params):
        samples = real_generate(prompts, samples_per_prompt, params)
        engine_rows.extend(s.all_routed_experts() for s in samples if s.routed_experts is not None)
        return samples

    trainer.engine.generate = generate
    checks = {"replayed": 0, "mismatched": 0, "free_differs": 0, "given": [], "flags": [], "dtypes": [],
              "gathered_records": 0}
    real_gather = trainer.rollouts.score_and_gather

    def score_and_gather(mine, samples, samples_per_prompt):
        # what every data-parallel rank receives: the batch without its routed experts (they go to the
        # rank that trains each sequence, trainer/routing_exchange.py)
        batch, metrics = real_gather(mine, samples, samples_per_prompt)
        checks["gathered_records"] += sum(s.routed_experts is not None for g in batch for s in g.samples)
        return batch, metrics

    trainer.rollouts.score_and_gather = score_and_gather
    real_train = trainer.policy.train_minibatch

    def train_minibatch(seqs, replay=False):
        checks["flags"].append(replay)
        checks["given"].extend(q.routed_experts.clone() for q in seqs if q.routed_experts is not None)
        checks["dtypes"].extend(str(q.routed_experts.dtype) for q in seqs if q.routed_experts is not None)
        with trainer.policy.routing_recorder() as free:  # routing the current weights would pick
            trainer.policy.compute_logprobs(seqs)
        with trainer.policy.routing_recorder() as rec:
            metrics = real_train(seqs, replay=replay)
        plan = trainer.policy._local_plan(seqs)
        for name, forwards in (("replayed", rec.routed_experts()), ("free", free.routed_experts())):
            for batch, members in zip(forwards, plan):
                for row, i in enumerate(members):
                    q = seqs[i]
                    rows = q.routed_experts.shape[0]
                    same = torch.equal(batch[row, :rows].sort(-1).values, q.routed_experts.long().sort(-1).values)
                    if name == "replayed":
                        checks["replayed" if same else "mismatched"] += 1
                    else:
                        checks["free_differs"] += int(not same)
        return metrics

    trainer.policy.train_minibatch = train_minibatch
    bias = {n: b.clone() for n, b in trainer.policy.module.named_buffers() if n.endswith("router.expert_bias")}
    metrics = trainer.train_step()
    after = {n: b for n, b in trainer.policy.module.named_buffers() if n.endswith("router.expert_bias")}
    checks["expert_bias_frozen"] = bias.keys() == after.keys() and all(torch.equal(bias[n], after[n]) for n in bias)
    checks["expert_bias_layers"] = len(bias)
    trainer.close()
    return {**checks, "engine_rows": engine_rows, "metrics": metrics}


@pytest.mark.slow
@pytest.mark.parametrize("mode, ranks, model, parallel",
                         [("r3", 2, (), EP2), ("r2", 1, (), EP2), ("r3", 2, QWEN2_MOE, EP2), ("r3", 2, GLM4_MOE, EP2),
                          ("r3", 2, DEEPSEEK_V3, EP2), ("r3", 2, (), "parallel.context_parallel=2")],
                         ids=["r3", "r2", "r3-qwen2_moe", "r3-glm4_moe", "r3-deepseek_v3", "r3-cp2"])
def test_update_forwards_replay_the_recorded_experts(tmp_path, mode, ranks, model, parallel):
    outs = run_distributed(replayed_step, ranks, (str(tmp_path), mode, model, parallel))
    # each DP rank generates its share of the prompts; the update shares are cut from the gathered batch
    engine = {tuple(r.flatten().tolist()) for out in outs for r in out["engine_rows"]}
    for out in outs:
        assert out["expert_bias_frozen"] and out["expert_bias_layers"] == (1 if model in (GLM4_MOE, DEEPSEEK_V3) else 0)
        assert out["flags"] and all(out["flags"])
        assert out["mismatched"] == 0 and out["replayed"] == len(out["given"]) > 0
        # the first update moves the weights, so free routing differs for some later sequence: replay mattered
        assert out["free_differs"] > 0
        if mode == "r3":  # every sequence trains on exactly the engine's rows: prompt + response - 1 positions
            assert all(tuple(g.flatten().tolist()) in engine for g in out["given"])
            assert set(out["dtypes"]) == {"torch.uint8"}  # one byte per expert id (<= 256 experts)
            assert out["gathered_records"] == 0
        else:
            assert out["engine_rows"] == []
        assert "routing_drift" in out["metrics"] and 0.0 <= out["metrics"]["routing_drift"] <= 1.0


def _engine_samples(layers: int, top_k: int, num_experts: int, prompt_len: int, response_lens: list[int]):
    """One group as an engine returns it: int32 records, the prompt's rows shared by the group's samples."""
    from gspo_megatron.rollout.base import Sample

    gen = torch.Generator().manual_seed(0)

    def rows(n):
        return torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(n * layers)]).view(
            n, layers, top_k).to(torch.int32)

    prompt = rows(prompt_len - 1)
    return [Sample(prompt_index=0, response_ids=[1] * t, logprobs=[-1.0] * t, finish_reason="length",
                   routed_experts=rows(t), prompt_routed_experts=prompt) for t in response_lens]


@pytest.mark.parametrize("num_experts, dtype", [(128, torch.uint8), (256, torch.uint8), (257, torch.int16),
                                                (4096, torch.int16)])
def test_r3_payload_bytes_per_token(num_experts, dtype):
    """What the rollout's data-parallel gather pickles (all_gather_object) for R3: one id per (token, MoE layer,
    top-k slot) in the narrowest dtype, the group's prompt record once. Qwen3-30B-A3B's shape: 48 MoE layers, top-8."""
    import pickle

    from gspo_megatron.rollout.base import compact_routed_experts, expert_id_dtype

    assert expert_id_dtype(num_experts) == dtype
    layers, top_k, prompt_len, response_lens = 48, 8, 200, [300, 500, 700, 900]
    samples = _engine_samples(layers, top_k, min(num_experts, 256), prompt_len, response_lens)
    tokens = prompt_len - 1 + sum(response_lens)  # routed positions, the prompt's counted once
    compact = compact_routed_experts(samples, num_experts)
    assert all(s.routed_experts.dtype == dtype and s.prompt_routed_experts.dtype == dtype for s in compact)
    assert len({id(s.prompt_routed_experts) for s in compact}) == 1  # still one shared prompt record
    for before, after in zip(samples, compact):
        assert torch.equal(before.all_routed_experts().long(), after.all_routed_experts().long())
    import dataclasses

    bare = len(pickle.dumps([dataclasses.replace(s, routed_experts=None, prompt_routed_experts=None) for s in samples]))
    per_token = (len(pickle.dumps(compact)) - bare) / tokens  # what the routed experts add to the gathered payload
    ideal = layers * top_k * dtype.itemsize
    assert ideal <= per_token <= ideal * 1.01, (per_token, ideal)
    assert (len(pickle.dumps(samples)) - bare) / tokens >= layers * top_k * 4  # the engine's int32
    with pytest.raises(ValueError, match="outside"):
        compact_routed_experts(samples, 4)


def test_r3_config_checks():
    from gspo_megatron.trainer.config import load_config
    from gspo_megatron.typed_config import ConfigError

    assert load_config(DEMO, ["train.routing_replay=r3", "rollout.logprobs_from=engine"]).train.routing_replay == "r3"
    with pytest.raises(ConfigError, match=r"^train\.routing_replay: r2 records"):
        load_config(DEMO, ["train.routing_replay=r2", "rollout.logprobs_from=engine"])
    with pytest.raises(ConfigError, match=r"^train\.routing_replay: r3 replays MoE routing"):
        load_config(DEMO, ["train.routing_replay=r3", "model.config.num_experts=0"])


def auto_steps(rank, world_size, run_dir: str) -> dict:
    from gspo_megatron.trainer.config import load_config
    from gspo_megatron.trainer.loop import Trainer

    overrides = ["sft.steps=0", "train.steps=2", "logging.console=false", "logging.tensorboard=false",
                 "train.prompts_per_step=4", "train.routing_replay=auto", "train.routing_agreement_threshold=0.99"]
    trainer = Trainer(load_config(DEMO, overrides), run_dir)
    flags: list[list[bool]] = [[], []]
    real_train = trainer.policy.train_minibatch

    def train_minibatch(seqs, replay=False):
        flags[trainer.step].append(replay)
        return real_train(seqs, replay=replay)

    trainer.policy.train_minibatch = train_minibatch
    # the engine keeps the initial weights; moving the trainer's routers (not synced until step 7) makes the
    # two route differently on step 1: a stale engine, as in overlap mode
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in trainer.policy.module.named_parameters():
            if name.endswith("router.weight"):
                p.add_(torch.randn(p.shape, generator=generator) * p.std())
    steps = []
    for _ in range(2):
        steps.append({k: v for k, v in trainer.train_step().items() if k.startswith("routing_")})
        trainer.step += 1
    trainer.close()
    return {"steps": steps, "flags": flags}


@pytest.mark.slow
def test_auto_replays_the_engines_experts_only_while_agreement_is_low(tmp_path):
    out = run_distributed(auto_steps, 1, (str(tmp_path),))[0]
    first, second = out["steps"]
    for metrics in (first, second):
        assert set(metrics) >= {"routing_agreement", "routing_agreement/layer0", "routing_agreement/layer1",
                                "routing_replay_active"}
        assert metrics["routing_agreement"] == pytest.approx(
            (metrics["routing_agreement/layer0"] + metrics["routing_agreement/layer1"]) / 2, abs=0.02)
    # step 1: the moved routers disagree with the stale engine -> R3 in every update forward
    assert first["routing_agreement"] < 0.99 and first["routing_replay_active"] == 1.0 and all(out["flags"][0])
    # step 2: the weights were synced at the end of step 1, so both route alike -> free routing again
    assert second["routing_agreement"] == 1.0 and second["routing_replay_active"] == 0.0
    assert out["flags"][1] and not any(out["flags"][1])
