"""Mixtral (``MixtralForCausalLM``): every layer MoE (``block_sparse_moe``, experts w1/w3/w2), top-k renormalised."""
from __future__ import annotations

from typing import Any

from gspo_megatron.models.base import EngineFacts, ExpertCheckpointNames, Family, HFReader
from gspo_megatron.models.weights import ATTENTION, EMBEDDING, FINAL, routed_experts

EXPERTS = ExpertCheckpointNames(block="block_sparse_moe", gate="w1", up="w3", down="w2")


def read_hf(reader: HFReader) -> dict[str, Any]:
    return dict(num_experts=reader.integer("num_local_experts"), moe_router_topk=reader.integer("num_experts_per_tok"),
                moe_ffn_hidden_size=reader.integer("intermediate_size"),
                ffn_hidden_size=reader.integer("intermediate_size"), norm_topk_prob=True)


def write_hf(config) -> dict[str, Any]:
    return dict(num_local_experts=config.num_experts, num_experts_per_tok=config.moe_router_topk,
                intermediate_size=config.moe_ffn_hidden_size, router_aux_loss_coef=config.moe_aux_loss_coeff,
                router_jitter_noise=0.0, sliding_window=None)


FAMILY = Family(
    model_type="mixtral",
    hf_class="MixtralForCausalLM",
    engine=EngineFacts(qk_norm=False, expert_names=EXPERTS),
    weights=EMBEDDING + ATTENTION + routed_experts(**vars(EXPERTS)) + FINAL,
    read_hf=read_hf,
    write_hf=write_hf,
    must_be={"sliding_window": [None], "router_jitter_noise": [0.0, 0]},
)
