"""Qwen3-MoE (``Qwen3MoeForCausalLM``): q/k norm, no biases, every layer MoE, softmax top-k router."""
from __future__ import annotations

from typing import Any

from gspo_megatron.models.base import EngineFacts, ExpertCheckpointNames, Family, HFReader
from gspo_megatron.models.weights import ATTENTION, EMBEDDING, FINAL, QK_NORM, routed_experts

EXPERTS = ExpertCheckpointNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")


def read_hf(reader: HFReader) -> dict[str, Any]:
    key = "num_experts" if reader.hf.get("num_experts") is not None else "num_local_experts"
    if reader.hf.get(key) is None:
        raise reader.error("num_experts", "required field is missing for qwen3_moe")
    return dict(num_experts=reader.integer(key), moe_router_topk=reader.integer("num_experts_per_tok"),
                moe_ffn_hidden_size=reader.integer("moe_intermediate_size"),
                ffn_hidden_size=reader.integer("intermediate_size", 1),
                norm_topk_prob=bool(reader.get("norm_topk_prob", False)))


def write_hf(config) -> dict[str, Any]:
    return dict(num_experts=config.num_experts, num_experts_per_tok=config.moe_router_topk,
                moe_intermediate_size=config.moe_ffn_hidden_size, intermediate_size=config.ffn_hidden_size,
                norm_topk_prob=config.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
                router_aux_loss_coef=config.moe_aux_loss_coeff, attention_bias=False)


FAMILY = Family(
    model_type="qwen3_moe",
    hf_class="Qwen3MoeForCausalLM",
    engine=EngineFacts(qk_norm=True, expert_names=EXPERTS),
    weights=EMBEDDING + ATTENTION + QK_NORM + routed_experts(**vars(EXPERTS)) + FINAL,
    read_hf=read_hf,
    write_hf=write_hf,
    must_be={"attention_bias": [False], "use_sliding_window": [False], "decoder_sparse_step": [1],
             "mlp_only_layers": [[]], "shared_expert_intermediate_size": [0, None]},
    qk_layernorm=True,
)
