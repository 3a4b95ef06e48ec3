"""Qwen3 dense (``Qwen3ForCausalLM``): q/k norm, no biases."""
from __future__ import annotations

from gspo_megatron.models.base import EngineFacts, Family, dense_fields
from gspo_megatron.models.weights import ATTENTION, DENSE_MLP, EMBEDDING, FINAL, QK_NORM

FAMILY = Family(
    model_type="qwen3",
    hf_class="Qwen3ForCausalLM",
    engine=EngineFacts(qk_norm=True),
    weights=EMBEDDING + ATTENTION + QK_NORM + DENSE_MLP + FINAL,
    read_hf=dense_fields,
    write_hf=lambda config: dict(intermediate_size=config.ffn_hidden_size, attention_bias=False),
    must_be={"attention_bias": [False], "use_sliding_window": [False]},
    qk_layernorm=True,
)
