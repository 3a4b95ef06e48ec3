"""Qwen2-MoE (``Qwen2MoeForCausalLM``, e.g. Qwen1.5-MoE-A2.7B): q/k/v biases, every layer MoE with a
softmax top-k router (renormalised only with ``norm_topk_prob``) and one shared expert whose output is
scaled by its own sigmoid gate, ``sigmoid(x . w_gate) * mlp(x)``: Megatron's ``SharedExpertMLP`` with
``moe_shared_expert_gate``."""
from __future__ import annotations

from typing import Any

from gspo_megatron.models.base import EngineFacts, ExpertCheckpointNames, Family, HFReader
from gspo_megatron.models.weights import ATTENTION, EMBEDDING, FINAL, QKV_BIAS, routed_experts, shared_expert

EXPERTS = ExpertCheckpointNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")


def read_hf(reader: HFReader) -> dict[str, Any]:
    shared = reader.integer("shared_expert_intermediate_size")
    if shared < 1:
        raise reader.error("shared_expert_intermediate_size", f"must be >= 1 (Qwen2-MoE always has a shared "
                           f"expert), got {shared}")
    return dict(num_experts=reader.integer("num_experts"), moe_router_topk=reader.integer("num_experts_per_tok"),
                moe_ffn_hidden_size=reader.integer("moe_intermediate_size"),
                ffn_hidden_size=reader.integer("intermediate_size", 1),
                norm_topk_prob=bool(reader.get("norm_topk_prob", False)),
                moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)


def write_hf(config) -> dict[str, Any]:
    return dict(num_experts=config.num_experts, num_experts_per_tok=config.moe_router_topk,
                moe_intermediate_size=config.moe_ffn_hidden_size, intermediate_size=config.ffn_hidden_size,
                shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
                norm_topk_prob=config.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
                router_aux_loss_coef=config.moe_aux_loss_coeff, qkv_bias=True, use_sliding_window=False)


FAMILY = Family(
    model_type="qwen2_moe",
    hf_class="Qwen2MoeForCausalLM",
    engine=EngineFacts(qk_norm=False, expert_names=EXPERTS),
    weights=(EMBEDDING + ATTENTION + QKV_BIAS + routed_experts(**vars(EXPERTS))
             + shared_expert("mlp.shared_expert", gate="mlp.shared_expert_gate") + FINAL),
    read_hf=read_hf,
    write_hf=write_hf,
    must_be={"qkv_bias": [True], "use_sliding_window": [False], "decoder_sparse_step": [1], "mlp_only_layers": [[]]},
    qkv_bias=True,
)
