"""Small random Hugging Face checkpoints of every supported family, built locally with transformers."""
from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

from gspo_megatron.megatron.model_config import ModelConfig
from gspo_megatron.testing.models import tiny_moe_config

# name -> ModelConfig overrides of tiny_moe_config (2 layers, hidden 64, 4 heads in 2 KV groups, vocab 96)
FAMILIES = {
    "qwen3_moe": dict(architecture="qwen3_moe"),
    "qwen3_moe_tied": dict(architecture="qwen3_moe", tie_word_embeddings=True),
    "qwen3": dict(architecture="qwen3", num_experts=0, ffn_hidden_size=96),
    "qwen2_tied": dict(architecture="qwen2", num_experts=0, ffn_hidden_size=96, qkv_bias=True, qk_layernorm=False,
                       tie_word_embeddings=True),
    "llama": dict(architecture="llama", num_experts=0, ffn_hidden_size=96, qk_layernorm=False),
    "llama_tied": dict(architecture="llama", num_experts=0, ffn_hidden_size=96, qk_layernorm=False,
                       tie_word_embeddings=True),
    "mixtral": dict(architecture="mixtral", qk_layernorm=False, moe_ffn_hidden_size=48),
    # odd shapes (still dividing TP=2 / EP=2): head_dim 10 with hidden 72, 6 experts top-3 without
    # renormalisation, a shared expert 40 wide with its sigmoid gate
    "qwen2_moe": dict(architecture="qwen2_moe", qkv_bias=True, qk_layernorm=False, num_attention_heads=6,
                      num_key_value_heads=2, head_dim=10, hidden_size=72, num_experts=6, moe_router_topk=3,
                      norm_topk_prob=False, moe_ffn_hidden_size=20, moe_shared_expert_intermediate_size=40,
                      moe_shared_expert_gate=True),
    # layer 0 dense (ffn 56), layers 1-3 MoE: 6 experts top-2 with a sigmoid router, expert bias and scaling 2.5,
    # shared expert 24 wide; RoPE on half of each 12-dim head, q/k norm, q/k/v biases
    "glm4_moe": dict(architecture="glm4_moe", num_layers=4, first_dense_layers=1, ffn_hidden_size=56,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=6, moe_router_topk=2,
                     moe_ffn_hidden_size=24, moe_shared_expert_intermediate_size=24, moe_router_score_function="sigmoid",
                     moe_router_expert_bias=True, moe_router_topk_scaling_factor=2.5, rotary_percent=0.5,
                     qkv_bias=True, qk_layernorm=True),
    # multi-latent attention: q latent 24, kv latent 20, heads of 10 unrotated + 6 rotated query/key dims and
    # 14 value dims; layer 0 dense, layers 1-3 MoE (6 experts top-2, sigmoid router with expert bias, scaling
    # 2.5, two shared experts of 24)
    "deepseek_v3": dict(architecture="deepseek_v3", num_layers=4, first_dense_layers=1, ffn_hidden_size=56,
                        num_attention_heads=4, num_key_value_heads=4, head_dim=16, qk_rope_head_dim=6,
                        q_lora_rank=24, kv_lora_rank=20, v_head_dim=14, num_experts=6, moe_router_topk=2,
                        moe_ffn_hidden_size=24, moe_shared_expert_intermediate_size=48,
                        moe_router_score_function="sigmoid", moe_router_expert_bias=True,
                        moe_router_topk_scaling_factor=2.5, qk_layernorm=True),
    # group-limited routing: 8 experts in 4 groups of 2, the best 2 groups eligible, top-4 (= 2 x topk_group, where
    # Megatron's and transformers' group ranking agree)
    "deepseek_v3_grouped": dict(architecture="deepseek_v3", num_attention_heads=4, num_key_value_heads=4,
                                head_dim=12, qk_rope_head_dim=4, kv_lora_rank=16, v_head_dim=8, q_lora_rank=16,
                                num_experts=8, moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2,
                                moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
                                moe_router_score_function="sigmoid", moe_router_expert_bias=True, qk_layernorm=True),
    # YaRN RoPE as DeepSeek-V3 / Kimi-K2 (factor 8 over 32 original positions, mscale = mscale_all_dim = 1),
    # rope_theta 500, so that scaled and unscaled frequencies differ within the test's 16 positions
    "deepseek_v3_yarn": dict(architecture="deepseek_v3", num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                             qk_rope_head_dim=8, kv_lora_rank=16, v_head_dim=8, q_lora_rank=16, num_experts=4,
                             moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
                             moe_router_score_function="sigmoid", moe_router_expert_bias=True, qk_layernorm=True,
                             rope_theta=500.0, rope_yarn_factor=8.0, rope_yarn_original_max_position_embeddings=32,
                             rope_yarn_mscale=1.0, rope_yarn_mscale_all_dim=1.0),
    # Moonlight's shape: one plain q projection (q_lora_rank null), no dense layer
    "deepseek_v3_plain_q": dict(architecture="deepseek_v3", num_attention_heads=4, num_key_value_heads=4,
                                head_dim=12, qk_rope_head_dim=4, kv_lora_rank=16, v_head_dim=8, num_experts=4,
                                moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
                                moe_router_score_function="sigmoid", moe_router_expert_bias=True,
                                moe_router_topk_scaling_factor=1.5, qk_layernorm=True),
}

def _mla_supported() -> bool:
    from gspo_megatron.megatron.cpu_runtime import megatron_core_version
    from gspo_megatron.megatron.model import MLA_MEGATRON_CORE

    return megatron_core_version() in MLA_MEGATRON_CORE


if not _mla_supported():  # megatron.model.check_mla_supported refuses them (tested in test_model_config)
    FAMILIES = {name: overrides for name, overrides in FAMILIES.items() if not name.startswith("deepseek_v3")}

TOKENIZER_FILES = {"tokenizer.json": '{"version": "1.0", "model": {"type": "test"}}\n',
                   "tokenizer_config.json": '{"model_max_length": 256}\n'}


def family_config(name: str) -> ModelConfig:
    return tiny_moe_config(**FAMILIES[name])


def make_hf_dir(name: str, directory: Path, dtype: torch.dtype = torch.float32, max_shard_size: str | None = None,
                seed: int = 0, fused_experts: bool = False) -> Path:
    """save_pretrained of a random ``name`` model: matrices ~ N(0, 0.1^2), norms 1 + 0.1 N(0, 1), so that
    logits and routing vary visibly; plus stand-in tokenizer files (copied verbatim by the converters).
    ``fused_experts``: transformers 5's in-memory form (``save_original_format=False``: 3-D
    ``mlp.experts.gate_up_proj`` / ``down_proj``) instead of the hub's per-expert tensors."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(family_config(name).to_hf_config())
    with torch.no_grad():
        persistent = model.state_dict().keys()  # checkpointed buffers too (e.g. a router's expert bias)
        buffers = [(name, buf) for name, buf in model.named_buffers() if name in persistent]
        for pname, param in [*model.named_parameters(), *buffers]:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(pname.encode()))
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if "norm" in pname else 0.1 * noise)
    model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, save_original_format=not fused_experts, **kwargs)
    for file, text in TOKENIZER_FILES.items():
        (directory / file).write_text(text)
    return directory


def weight_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.safetensors"))


def read_all(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in weight_files(directory):
        out.update(load_file(directory / file))
    return out


def index_of(directory: Path) -> dict | None:
    path = directory / "model.safetensors.index.json"
    return json.loads(path.read_text()) if path.is_file() else None
