"""Qwen2-MoE (``Qwen2MoeForCausalLM``): served by the rollout engine only, not yet converted or trained."""
from __future__ import annotations

from gspo_megatron.models.base import EngineFacts, ExpertCheckpointNames, Family

EXPERTS = ExpertCheckpointNames(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")

FAMILY = Family(
    model_type="qwen2_moe",
    hf_class="Qwen2MoeForCausalLM",
    engine=EngineFacts(qk_norm=False, expert_names=EXPERTS),
    weights=None,
)
