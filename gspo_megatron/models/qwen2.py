"""Qwen2 / Qwen2.5 dense (``Qwen2ForCausalLM``): biases on q/k/v only, no q/k norm."""
from __future__ import annotations

from gspo_megatron.models.base import EngineFacts, Family, dense_fields
from gspo_megatron.models.weights import ATTENTION, DENSE_MLP, EMBEDDING, FINAL, QKV_BIAS

FAMILY = Family(
    model_type="qwen2",
    hf_class="Qwen2ForCausalLM",
    engine=EngineFacts(qk_norm=False),
    weights=EMBEDDING + ATTENTION + QKV_BIAS + DENSE_MLP + FINAL,
    read_hf=dense_fields,
    write_hf=lambda config: dict(intermediate_size=config.ffn_hidden_size),
    must_be={"use_sliding_window": [False]},
    qkv_bias=True,
)
