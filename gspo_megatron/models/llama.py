"""Llama (``LlamaForCausalLM``), including Llama 3's RoPE frequency scaling."""
from __future__ import annotations

from gspo_megatron.models.base import EngineFacts, Family, dense_fields
from gspo_megatron.models.weights import ATTENTION, DENSE_MLP, EMBEDDING, FINAL

FAMILY = Family(
    model_type="llama",
    hf_class="LlamaForCausalLM",
    engine=EngineFacts(qk_norm=False),
    weights=EMBEDDING + ATTENTION + DENSE_MLP + FINAL,
    read_hf=dense_fields,
    write_hf=lambda config: dict(intermediate_size=config.ffn_hidden_size, attention_bias=False, mlp_bias=False),
    must_be={"attention_bias": [False], "mlp_bias": [False], "pretraining_tp": [1]},
    rope_types=("default", "llama3"),
)
