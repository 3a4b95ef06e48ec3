"""Small deterministic models and batches for tests and benchmarks.

``canonical_weights(model_config)`` gives full (unsharded) tensors keyed by canonical Megatron names,
generated from a seed per name, so every parallel layout can load *the same* model.
"""
from __future__ import annotations

import zlib

import torch

from gspo_megatron.megatron.model_config import ModelConfig


def tiny_moe_config(**overrides) -> ModelConfig:
    """A 2-layer, 64-wide Qwen3-MoE-shaped model: 4 experts, top-2, 4 query heads in 2 KV groups."""
    base = dict(architecture="qwen3_moe", vocab_size=96, hidden_size=64, num_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
                norm_topk_prob=True, rope_theta=10000.0, max_position_embeddings=256)
    base.update(overrides)
    config = ModelConfig(**base)
    config.validate("tiny_moe_config")
    return config


def _mla_shapes(config: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """Multi-latent attention parameters of layer prefix ``p`` (Megatron's MLASelfAttention)."""
    h, n, d, a = config.hidden_size, config.num_attention_heads, config.head_dim, p + "self_attention."
    nope, lq, lkv = d - config.qk_rope_head_dim, config.q_lora_rank, config.kv_lora_rank
    shapes = {a + "linear_q_down_proj.weight": (lq, h), a + "q_layernorm.weight": (lq,),
              a + "linear_q_up_proj.weight": (n * d, lq)} if lq else {a + "linear_q_proj.weight": (n * d, h)}
    shapes.update({a + "linear_kv_down_proj.weight": (lkv + config.qk_rope_head_dim, h), a + "kv_layernorm.weight": (lkv,),
                   a + "linear_kv_up_proj.weight": (n * (nope + config.v_head_dim), lkv),
                   a + "linear_proj.weight": (h, n * config.v_head_dim)})
    return shapes


def canonical_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical Megatron parameter names and full shapes of ``config`` (TP=PP=EP=1)."""
    h, d = config.hidden_size, config.head_dim
    qkv_rows = d * (config.num_attention_heads + 2 * config.num_key_value_heads)
    shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (config.vocab_size, h)}
    for layer in range(config.num_layers):
        p = f"decoder.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        if config.is_mla:
            shapes.update(_mla_shapes(config, p))
            shapes[p + "pre_mlp_layernorm.weight"] = (h,)
        else:
            shapes[p + "self_attention.linear_qkv.weight"] = (qkv_rows, h)
            if config.qkv_bias:
                shapes[p + "self_attention.linear_qkv.bias"] = (qkv_rows,)
            if config.qk_layernorm:
                shapes[p + "self_attention.q_layernorm.weight"] = (d,)
                shapes[p + "self_attention.k_layernorm.weight"] = (d,)
            shapes[p + "self_attention.linear_proj.weight"] = (h, config.num_attention_heads * d)
            shapes[p + "pre_mlp_layernorm.weight"] = (h,)
        if config.is_moe_layer(layer):
            shapes[p + "mlp.router.weight"] = (config.num_experts, h)
            if config.moe_router_expert_bias:
                shapes[p + "mlp.router.expert_bias"] = (config.num_experts,)
            for e in range(config.num_experts):
                q = f"{p}mlp.experts.local_experts.{e}."
                shapes[q + "linear_fc1.weight"] = (2 * config.moe_ffn_hidden_size, h)
                shapes[q + "linear_fc2.weight"] = (h, config.moe_ffn_hidden_size)
            shared = config.moe_shared_expert_intermediate_size
            if shared:
                shapes[p + "mlp.shared_experts.linear_fc1.weight"] = (2 * shared, h)
                shapes[p + "mlp.shared_experts.linear_fc2.weight"] = (h, shared)
            if config.moe_shared_expert_gate:
                shapes[p + "mlp.shared_experts.gate_weight"] = (1, h)
        else:
            shapes[p + "mlp.linear_fc1.weight"] = (2 * config.ffn_hidden_size, h)
            shapes[p + "mlp.linear_fc2.weight"] = (h, config.ffn_hidden_size)
    shapes["decoder.final_layernorm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["output_layer.weight"] = (config.vocab_size, h)
    return shapes


def canonical_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random canonical weights; each tensor drawn from its own seed so the result is layout-free.

    Norm weights are 1 + noise (so a wrong norm placement shows in the logits); matrices ~ N(0, 0.1^2)
    (larger than the usual 0.02 so that routing and logits vary visibly across tokens).
    """
    weights = {}
    for name, shape in canonical_shapes(config).items():
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        is_norm = "norm" in name
        weights[name] = 1.0 + 0.1 * noise if is_norm else 0.1 * noise
    return weights


def random_tokens(config: ModelConfig, batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, seq_len), generator=gen)
