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

from gspo_megatron.models.base import EngineFacts, ExpertCheckpointNames, Family, HFReader
from gspo_megatron.models.weights import (ATTENTION, DENSE_MLP, EMBEDDING, EXPERT_BIAS, FINAL, QK_NORM, QKV_BIAS,
                                          Rule, routed_experts, shared_expert)

EXPERTS = ExpertCheckpointNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")


def read_hf(reader: HFReader) -> dict[str, Any]:
    moe_ffn = int(reader.get("moe_intermediate_size"))
    if not reader.get("norm_topk_prob", True):
        raise reader.error("norm_topk_prob", "must be true: Megatron renormalises the sigmoid router's top-k")
    return dict(num_experts=int(reader.get("n_routed_experts")), moe_router_topk=int(reader.get("num_experts_per_tok")),
                moe_ffn_hidden_size=moe_ffn, ffn_hidden_size=int(reader.get("intermediate_size")),
                moe_shared_expert_intermediate_size=int(reader.get("n_shared_experts", 0)) * moe_ffn,
                first_dense_layers=int(reader.get("first_k_dense_replace", 0)), norm_topk_prob=True,
                moe_router_score_function="sigmoid", moe_router_expert_bias=True,
                moe_router_topk_scaling_factor=float(reader.get("routed_scaling_factor", 1.0)),
                qkv_bias=bool(reader.get("attention_bias", False)), qk_layernorm=bool(reader.get("use_qk_norm", False)))


def write_hf(config) -> dict[str, Any]:
    shared, width = config.moe_shared_expert_intermediate_size, config.moe_ffn_hidden_size
    if shared % width:
        raise ValueError(f"glm4_moe: moe_shared_expert_intermediate_size={shared} is not a multiple of "
                         f"moe_ffn_hidden_size={width} (config.json counts whole shared experts)")
    return dict(n_routed_experts=config.num_experts, num_experts_per_tok=config.moe_router_topk,
                moe_intermediate_size=width, intermediate_size=config.ffn_hidden_size, n_shared_experts=shared // width,
                first_k_dense_replace=config.first_dense_layers, norm_topk_prob=True,
                routed_scaling_factor=config.moe_router_topk_scaling_factor, n_group=1, topk_group=1,
                attention_bias=config.qkv_bias, use_qk_norm=config.qk_layernorm, num_nextn_predict_layers=0)


def _optional(rows: tuple[Rule, ...], field: str) -> tuple[Rule, ...]:
    """Rows present only when the ModelConfig field is true (the table itself is static)."""
    return tuple(Rule(r.megatron, r.hf, r.transform, r.untied_only, r.layers, when=field) for r in rows)


FAMILY = Family(
    model_type="glm4_moe",
    hf_class="Glm4MoeForCausalLM",
    engine=EngineFacts(qk_norm="use_qk_norm", expert_names=EXPERTS),
    weights=(EMBEDDING + ATTENTION + _optional(QKV_BIAS, "qkv_bias") + _optional(QK_NORM, "qk_layernorm")
             + DENSE_MLP + routed_experts(**vars(EXPERTS)) + EXPERT_BIAS
             + _optional(shared_expert("mlp.shared_experts"), "moe_shared_expert_intermediate_size") + FINAL),
    read_hf=read_hf,
    write_hf=write_hf,
    must_be={"n_group": [1], "topk_group": [1]},
    partial_rotary=True,
    mtp_layers=True,
)
