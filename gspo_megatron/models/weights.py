"""The rows shared by every family's weight table: Hugging Face names <-> canonical Megatron names.

One ``Rule`` per row: a canonical Megatron name pattern, the HF name pattern(s) it is made of, and the
transform between them (``conversion/transforms.py``). Patterns use ``{layer}`` and ``{expert}`` with
*global* numbers. Canonical names are those of Megatron-Core's local (non-Transformer-Engine) spec.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Rule:
    megatron: str
    hf: tuple[str, ...]
    transform: str = "identity"  # "identity" | "qkv" | "gate_up"
    untied_only: bool = False  # absent when the output layer shares the embedding
    layers: str = "all"  # per-layer rows: "all", "dense" (dense-MLP layers only) or "moe" (MoE layers only)
    when: str | None = None  # a ModelConfig field that must be true (non-zero) for the row to exist


def optional(rows: tuple[Rule, ...], field: str) -> tuple[Rule, ...]:
    """``rows`` present only when the ModelConfig field ``field`` is true (the table itself is static)."""
    return tuple(dataclasses.replace(r, when=field) for r in rows)


L = "decoder.layers.{layer}."
H = "model.layers.{layer}."
E = L + "mlp.experts.local_experts.{expert}."

EMBEDDING = (Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),)
ATTENTION = (
    Rule(L + "input_layernorm.weight", (H + "input_layernorm.weight",)),
    Rule(L + "self_attention.linear_qkv.weight",
         (H + "self_attn.q_proj.weight", H + "self_attn.k_proj.weight", H + "self_attn.v_proj.weight"), "qkv"),
    Rule(L + "self_attention.linear_proj.weight", (H + "self_attn.o_proj.weight",)),
    Rule(L + "pre_mlp_layernorm.weight", (H + "post_attention_layernorm.weight",)),
)
QKV_BIAS = (
    Rule(L + "self_attention.linear_qkv.bias",
         (H + "self_attn.q_proj.bias", H + "self_attn.k_proj.bias", H + "self_attn.v_proj.bias"), "qkv"),
)
QK_NORM = (
    Rule(L + "self_attention.q_layernorm.weight", (H + "self_attn.q_norm.weight",)),
    Rule(L + "self_attention.k_layernorm.weight", (H + "self_attn.k_norm.weight",)),
)
DENSE_MLP = (
    Rule(L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), "gate_up",
         layers="dense"),
    Rule(L + "mlp.linear_fc2.weight", (H + "mlp.down_proj.weight",), layers="dense"),
)
FINAL = (
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",), untied_only=True),
)


def routed_experts(block: str, gate: str, up: str, down: str) -> tuple[Rule, ...]:
    """Router and routed experts of an MoE block named ``block`` in HF checkpoints, with per-expert
    projections ``gate`` / ``up`` / ``down`` (``{block}.experts.{E}.{gate}.weight``)."""
    x = H + block + ".experts.{expert}."
    return (
        Rule(L + "mlp.router.weight", (H + block + ".gate.weight",), layers="moe"),
        Rule(E + "linear_fc1.weight", (x + gate + ".weight", x + up + ".weight"), "gate_up", layers="moe"),
        Rule(E + "linear_fc2.weight", (x + down + ".weight",), layers="moe"),
    )


# The router's selection-only expert bias (a Megatron buffer, frozen during RL), stored as fp32 in HF.
EXPERT_BIAS = (Rule(L + "mlp.router.expert_bias", (H + "mlp.gate.e_score_correction_bias",), layers="moe"),)


def shared_expert(block: str, gate: str | None = None) -> tuple[Rule, ...]:
    """A shared expert (an MLP every token goes through beside the routed experts), checkpointed as
    ``{block}.{gate,up,down}_proj``, and with ``gate`` the name of its [1, hidden] sigmoid gate."""
    rows = (
        Rule(L + "mlp.shared_experts.linear_fc1.weight",
             (H + block + ".gate_proj.weight", H + block + ".up_proj.weight"), "gate_up", layers="moe"),
        Rule(L + "mlp.shared_experts.linear_fc2.weight", (H + block + ".down_proj.weight",), layers="moe"),
    )
    if gate is not None:
        rows += (Rule(L + "mlp.shared_experts.gate_weight", (H + gate + ".weight",), layers="moe"),)
    return rows


# ---- how releases store the HF tensors above -----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Stacked:
    """One stored tensor [experts, rows of every part, cols] holding per-expert HF tensors: expert e's
    matrix is ``stored[e]``, whose rows are ``parts`` one after another in equal blocks (transformers 5's
    fused experts: ``gate_up_proj`` [E, 2F, h] = [gate; up] per expert, ``down_proj`` [E, h, F])."""

    stored: str  # pattern with {layer}
    parts: tuple[str, ...]  # per-expert HF patterns with {layer} and {expert}


@dataclasses.dataclass(frozen=True)
class Renamed:
    """A stored tensor under another name than the table's (``stored`` -> ``name``, patterns with {layer})."""

    stored: str
    name: str


def fused_experts(block: str, gate: str, up: str, down: str) -> tuple[Stacked | Renamed, ...]:
    """The fused form of ``routed_experts(block, gate, up, down)`` that transformers 5 holds in memory and
    writes with ``save_pretrained(save_original_format=False)``: the MoE block is always ``mlp`` there."""
    x = H + block + ".experts.{expert}."
    forms: tuple[Stacked | Renamed, ...] = (
        Stacked(H + "mlp.experts.gate_up_proj", (x + gate + ".weight", x + up + ".weight")),
        Stacked(H + "mlp.experts.down_proj", (x + down + ".weight",)),
    )
    if block != "mlp":
        forms += (Renamed(H + "mlp.gate.weight", H + block + ".gate.weight"),)
    return forms
