"""DeepSeek-V3-style MoE (``DeepseekV3ForCausalLM``: DeepSeek-V3, Kimi-K2, Moonlight): multi-latent attention
(MLA), ``first_k_dense_replace`` dense layers, then MoE layers with ``n_shared_experts`` shared experts and a
sigmoid router whose ``e_score_correction_bias`` is added to the scores for choosing experts only; the top-k
sigmoid scores are renormalised (``norm_topk_prob``) and scaled by ``routed_scaling_factor``.

MLA per layer, with n heads: queries ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` ([n * (nope + rope)]), or one
``q_proj`` when ``q_lora_rank`` is null; keys and values from a shared latent, ``kv_a_proj_with_mqa(x)`` =
[kv_lora_rank latent; rope dims of one key shared by all heads], the latent normed (``kv_a_layernorm``) and
expanded by ``kv_b_proj`` to per-head [nope key dims; v_head_dim value dims]. RoPE covers only the rope dims.

Megatron-Core 0.16.1: ``MLATransformerConfig`` with the local spec's ``MLASelfAttention``
(``multi_latent_attention=True``): ``linear_q_down_proj`` / ``linear_q_up_proj`` / ``linear_q_proj`` /
``linear_kv_down_proj`` / ``linear_kv_up_proj`` hold the HF matrices row for row (identity transforms), the
norms are its ``q_layernorm`` / ``kv_layernorm``. RoPE: HF's ``rope_interleave=True`` (DeepSeek's layout,
rotary pairs (x0, x1), (x2, x3), ...) de-interleaves the rope dims before a half-rotation, and Megatron's
MLA does the same (``_apply_rotary_pos_emb_bshd`` with ``multi_latent_attention``), so the weights copy as
they are; ``rope_interleave=False`` is refused. The expert bias is a Megatron buffer, frozen during RL.

Group-limited routing (``n_group`` / ``topk_group``): Megatron's ``moe_router_num_groups`` /
``moe_router_group_topk``. Megatron ranks a group by the sum of its top ``topk / topk_group`` biased scores,
transformers by its top 2, so a restricting ``topk_group < n_group`` is accepted only where
``num_experts_per_tok == 2 * topk_group`` (DeepSeek-V3's 8 = 2 x 4), where both are the same.

YaRN RoPE scaling (DeepSeek-V3, Kimi-K2): Megatron's ``YarnRotaryEmbedding`` (``read_yarn``).

Not mapped, each an error naming the field: other group-limited routing, other RoPE types, attention biases. The
multi-token-prediction layers (``num_nextn_predict_layers``) are left out by the conversion, as transformers
does not run them.
"""
from __future__ import annotations

from typing import Any

from gspo_megatron.models.base import (EngineFacts, ExpertCheckpointNames, Family, HFReader, sigmoid_moe_fields,
                                       sigmoid_moe_hf)
from gspo_megatron.models.weights import (DENSE_MLP, EMBEDDING, EXPERT_BIAS, FINAL, H, L, Rule, optional,
                                          routed_experts, shared_expert)

EXPERTS = ExpertCheckpointNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")


def read_hf(reader: HFReader) -> dict[str, Any]:
    if not reader.get("rope_interleave", True):
        raise reader.error("rope_interleave", "must be true (DeepSeek's interleaved rope layout, which "
                           "Megatron's multi-latent attention assumes)")
    groups, chosen = reader.integer("n_group", 1), reader.integer("topk_group", 1)
    top_k = reader.integer("num_experts_per_tok")
    if chosen < groups and top_k != 2 * chosen:
        raise reader.error("topk_group", f"group-limited routing with num_experts_per_tok={top_k} != 2 x topk_group="
                           f"{chosen} is not supported: transformers ranks groups by the sum of their top 2 scores, "
                           "Megatron by their top num_experts_per_tok / topk_group (equal only at 2)")
    if reader.integer("n_shared_experts", 1) < 1:  # transformers would build a zero-width shared expert
        raise reader.error("n_shared_experts", f"must be >= 1, got {reader.get('n_shared_experts')}")
    heads = reader.integer("num_attention_heads")
    if reader.integer("num_key_value_heads", heads) != heads:
        raise reader.error("num_key_value_heads", f"must equal num_attention_heads={heads} (multi-latent "
                           "attention has no key/value groups)")
    rope, nope = reader.integer("qk_rope_head_dim"), reader.integer("qk_nope_head_dim")
    return dict(sigmoid_moe_fields(reader), **read_yarn(reader), moe_router_num_groups=groups, moe_router_group_topk=chosen,
                num_key_value_heads=heads, head_dim=nope + rope, qk_rope_head_dim=rope,
                q_lora_rank=reader.integer("q_lora_rank", 0), kv_lora_rank=reader.integer("kv_lora_rank"),
                v_head_dim=reader.integer("v_head_dim"), qkv_bias=False, qk_layernorm=True)


def read_yarn(reader: HFReader) -> dict[str, Any]:
    """ModelConfig's YaRN fields from ``rope_parameters`` (or the older ``rope_scaling``); none without YaRN.

    transformers multiplies cos/sin by get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) only
    when both are set, else by get_mscale(factor); Megatron always by the ratio, so an unset pair maps to
    (1, 0), and mscale_all_dim without mscale (which the two would treat differently) is refused.
    """
    params = dict(reader.hf.get("rope_parameters") or {})
    params.update(reader.hf.get("rope_scaling") or {})
    if params.get("rope_type", params.get("type")) != "yarn":
        return {}
    key = "rope_parameters."
    for field in ("factor", "original_max_position_embeddings"):
        if params.get(field) is None:
            raise reader.error(key + field, "required for YaRN RoPE scaling")
    if not params.get("truncate", True):
        raise reader.error(key + "truncate", "must be true (Megatron rounds YaRN's correction range to integers)")
    if params.get("attention_factor") is not None:
        raise reader.error(key + "attention_factor", "is not supported (Megatron derives it from mscale)")
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if all_dim and not mscale:
        raise reader.error(key + "mscale", f"must be set when mscale_all_dim={all_dim} is")
    return dict(rope_yarn_factor=float(params["factor"]),
                rope_yarn_original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                rope_yarn_beta_fast=float(params.get("beta_fast") or 32.0),
                rope_yarn_beta_slow=float(params.get("beta_slow") or 1.0),
                rope_yarn_mscale=float(mscale) if mscale and all_dim else 1.0,
                rope_yarn_mscale_all_dim=float(all_dim or 0.0))


def yarn_hf(config) -> dict[str, Any]:
    """``rope_parameters`` of ``read_yarn``'s fields (plain RoPE: none, the common entry stands)."""
    if not config.rope_yarn_factor:
        return {}
    return {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": config.rope_theta, "factor": config.rope_yarn_factor,
        "original_max_position_embeddings": config.rope_yarn_original_max_position_embeddings,
        "beta_fast": config.rope_yarn_beta_fast, "beta_slow": config.rope_yarn_beta_slow,
        "mscale": config.rope_yarn_mscale, "mscale_all_dim": config.rope_yarn_mscale_all_dim}}


def write_hf(config) -> dict[str, Any]:
    return dict(sigmoid_moe_hf(config, "deepseek_v3"), n_group=config.moe_router_num_groups,
                topk_group=config.moe_router_group_topk, q_lora_rank=config.q_lora_rank or None,
                kv_lora_rank=config.kv_lora_rank, qk_rope_head_dim=config.qk_rope_head_dim,
                qk_nope_head_dim=config.head_dim - config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
                head_dim=config.qk_rope_head_dim, rope_interleave=True, attention_bias=False, **yarn_hf(config))


def _rows(field: str | None, *pairs: tuple[str, str]) -> tuple[Rule, ...]:
    return tuple(Rule(L + "self_attention." + meg, (H + "self_attn." + hf,), when=field) for meg, hf in pairs)


MLA = (
    (Rule(L + "input_layernorm.weight", (H + "input_layernorm.weight",)),)
    + _rows("q_lora_rank", ("linear_q_down_proj.weight", "q_a_proj.weight"),
            ("q_layernorm.weight", "q_a_layernorm.weight"), ("linear_q_up_proj.weight", "q_b_proj.weight"))
    + _rows("plain_q_proj", ("linear_q_proj.weight", "q_proj.weight"))
    + _rows(None, ("linear_kv_down_proj.weight", "kv_a_proj_with_mqa.weight"),
            ("kv_layernorm.weight", "kv_a_layernorm.weight"), ("linear_kv_up_proj.weight", "kv_b_proj.weight"),
            ("linear_proj.weight", "o_proj.weight"))
    + (Rule(L + "pre_mlp_layernorm.weight", (H + "post_attention_layernorm.weight",)),)
)

FAMILY = Family(
    model_type="deepseek_v3",
    hf_class="DeepseekV3ForCausalLM",
    engine=EngineFacts(qk_norm=False, expert_names=EXPERTS, mla=True),
    weights=(EMBEDDING + MLA + DENSE_MLP + routed_experts(**vars(EXPERTS)) + EXPERT_BIAS
             + optional(shared_expert("mlp.shared_experts"), "moe_shared_expert_intermediate_size")
             + FINAL),
    read_hf=read_hf,
    write_hf=write_hf,
    # older config.json files (the hub's DeepSeek-V3, Moonlight) spell out the router; transformers ignores them
    must_be={"attention_bias": [False], "hidden_act": ["silu"], "scoring_func": ["sigmoid"],
             "topk_method": ["noaux_tc"], "moe_layer_freq": [1]},
    rope_types=("default", "yarn"),
    mtp_layers=True,
    moe_layer_list=True,
)
