"""GLM-4.5-style MoE (``Glm4MoeForCausalLM``, e.g. GLM-4.5-Air): grouped-query attention with q/k/v
biases (``attention_bias``), optional per-head q/k norm (``use_qk_norm``) and RoPE on the first
``partial_rotary_factor`` of each head; ``first_k_dense_replace`` dense layers, then MoE layers with a
sigmoid router whose ``e_score_correction_bias`` is added to the scores for choosing experts only, the
top-k sigmoid scores renormalised and scaled by ``routed_scaling_factor``, and a shared expert of
``n_shared_experts * moe_intermediate_size`` beside the routed ones.

Megatron-Core: ``rotary_percent``, ``moe_layer_freq``, ``moe_router_score_function="sigmoid"`` with
``moe_router_enable_expert_bias`` (the bias is a buffer, frozen during RL) and
``moe_router_topk_scaling_factor``, ``SharedExpertMLP`` without a gate. Group-limited routing is not
mapped (``n_group`` / ``topk_group`` must be 1, as in GLM-4.5), nor the multi-token-prediction layers
(``num_nextn_predict_layers``), which transformers does not run either: conversion leaves them out.
"""
from __future__ import annotations

from typing import Any

from gspo_megatron.models.base import (EngineFacts, ExpertCheckpointNames, Family, HFReader, sigmoid_moe_fields,
                                       sigmoid_moe_hf)
from gspo_megatron.models.weights import (ATTENTION, DENSE_MLP, EMBEDDING, EXPERT_BIAS, FINAL, QK_NORM, QKV_BIAS,
                                          optional, routed_experts, shared_expert)

EXPERTS = ExpertCheckpointNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")


def read_hf(reader: HFReader) -> dict[str, Any]:
    return dict(sigmoid_moe_fields(reader), qkv_bias=bool(reader.get("attention_bias", False)),
                qk_layernorm=bool(reader.get("use_qk_norm", False)))


def write_hf(config) -> dict[str, Any]:
    return dict(sigmoid_moe_hf(config, "glm4_moe"), attention_bias=config.qkv_bias, use_qk_norm=config.qk_layernorm)


FAMILY = Family(
    model_type="glm4_moe",
    hf_class="Glm4MoeForCausalLM",
    engine=EngineFacts(qk_norm="use_qk_norm", expert_names=EXPERTS),
    weights=(EMBEDDING + ATTENTION + optional(QKV_BIAS, "qkv_bias") + optional(QK_NORM, "qk_layernorm")
             + DENSE_MLP + routed_experts(**vars(EXPERTS)) + EXPERT_BIAS
             + optional(shared_expert("mlp.shared_experts"), "moe_shared_expert_intermediate_size") + FINAL),
    read_hf=read_hf,
    write_hf=write_hf,
    must_be={"n_group": [1], "topk_group": [1]},
    partial_rotary=True,
    mtp_layers=True,
    moe_layer_list=True,
)
