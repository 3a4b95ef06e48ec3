"""Declarative, two-way tables: Hugging Face tensor names <-> canonical Megatron names, per model family.

Each family's table is a tuple of ``Rule`` rows in its module under ``gspo_megatron/models/``: a canonical
Megatron name pattern, the HF name pattern(s) it is made of, and the transform between them
(``transforms.py``). Patterns use ``{layer}`` and ``{expert}``; both sides use *global* numbers (the
layout algebra that maps them to a rank's local numbers is ``megatron/sharding.py``).
``expand(config)`` turns a family's table into the concrete list of entries of one model, in HF order;
every other piece (offline conversion, live export, validation) works from that list, so a tensor can be
consumed and produced exactly once only if the table says so.

Canonical names are those of the *local* (non-Transformer-Engine) spec, which is what runs on CPU. On a
GPU the TE spec names a few parameters differently; ``megatron/te_names.py`` is that translation, as data.
"""
from __future__ import annotations

import dataclasses
import re

from gspo_megatron.conversion.errors import ConversionError
from gspo_megatron.conversion.transforms import FusedGateUp, FusedQKV, Identity, Transform
from gspo_megatron.megatron.model_config import ModelConfig
from gspo_megatron.models import registry
from gspo_megatron.models.weights import E, L, Rule

# Parameters whose rows are the vocabulary (padded inside Megatron: ModelConfig.padded_vocab_size; unpadded here).
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One canonical Megatron tensor of one model and the HF tensors it is made of."""

    megatron: str
    hf: tuple[str, ...]
    transform: Transform


def transform_for(kind: str, config: ModelConfig) -> Transform:
    if kind == "qkv":
        return FusedQKV(config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    if kind == "gate_up":
        return FusedGateUp()
    if kind == "identity":
        return Identity()
    raise ValueError(f"unknown transform {kind!r}")


def family_table(config: ModelConfig) -> tuple[Rule, ...]:
    family = registry.FAMILIES.get(config.architecture)
    if family is None or not family.trainable:
        raise ConversionError(f"model_type: no conversion table for architecture {config.architecture!r} "
                              f"(supported: {sorted(registry.TRAINABLE)})")
    return family.weights


def left_out(config: ModelConfig, hf_name: str) -> bool:
    """Whether HF tensor ``hf_name`` is one the conversion leaves out on purpose: a multi-token-prediction
    layer after the decoder (``model.layers.<num_layers + i>.*``) of a family whose checkpoints have them."""
    if not registry.FAMILIES[config.architecture].mtp_layers:
        return False
    match = _MTP_LAYER.match(hf_name)
    return match is not None and int(match.group(1)) >= config.num_layers


_MTP_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _fill(pattern: str, layer: int | None, expert: int | None) -> str:
    return pattern.replace("{layer}", str(layer)).replace("{expert}", str(expert))


def expand(config: ModelConfig) -> list[Entry]:
    """Every canonical tensor of ``config`` with its HF tensors, in HF order (embedding, layer by layer
    with experts in order inside each layer, final norm, output layer)."""
    rules = [r for r in family_table(config) if not (r.untied_only and config.tie_word_embeddings)
             and (r.when is None or getattr(config, r.when))]
    entries: list[Entry] = []

    def add(rule: Rule, layer: int | None = None, expert: int | None = None) -> None:
        entries.append(Entry(_fill(rule.megatron, layer, expert), tuple(_fill(h, layer, expert) for h in rule.hf),
                             transform_for(rule.transform, config)))

    for rule in rules:
        if "{layer}" not in rule.megatron and rule.megatron.startswith("embedding"):
            add(rule)
    for layer in range(config.num_layers):
        kind = "moe" if config.is_moe_layer(layer) else "dense"
        for rule in rules:
            if "{layer}" not in rule.megatron or rule.layers not in ("all", kind):
                continue
            if "{expert}" in rule.megatron:
                for expert in range(config.num_experts):
                    add(rule, layer, expert)
            else:
                add(rule, layer)
    for rule in rules:
        if "{layer}" not in rule.megatron and not rule.megatron.startswith("embedding"):
            add(rule)
    return entries


# ---- layouts -------------------------------------------------------------------------------------

def validate_layout(config: ModelConfig, tensor_parallel: int = 1, pipeline_parallel: int = 1,
                    expert_parallel: int = 1, source: str = "layout") -> None:
    """Raise naming the flag and the model field when a TP/PP/EP layout does not divide the model.

    The vocabulary need not divide: Megatron's is padded (``ModelConfig.padded_vocab_size``).
    """
    checks = [
        ("tp", tensor_parallel, "num_attention_heads", config.num_attention_heads),
        ("tp", tensor_parallel, "num_key_value_heads", config.num_key_value_heads),
        ("pp", pipeline_parallel, "num_layers", config.num_layers),
    ]
    if config.is_mla:  # the latent down-projections are column-parallel
        checks.append(("tp", tensor_parallel, "kv_down_proj_rows", config.kv_down_proj_rows))
        if config.q_lora_rank:
            checks.append(("tp", tensor_parallel, "q_lora_rank", config.q_lora_rank))
    if config.is_moe:
        checks += [("ep", expert_parallel, "num_experts", config.num_experts),
                   ("tp", tensor_parallel, "moe_ffn_hidden_size", config.moe_ffn_hidden_size)]
        if config.first_dense_layers:
            checks.append(("tp", tensor_parallel, "ffn_hidden_size", config.ffn_hidden_size))
        if config.moe_shared_expert_intermediate_size:
            checks.append(("tp", tensor_parallel, "moe_shared_expert_intermediate_size",
                           config.moe_shared_expert_intermediate_size))
    else:
        checks.append(("tp", tensor_parallel, "ffn_hidden_size", config.ffn_hidden_size))
        if expert_parallel != 1:
            raise ConversionError(f"{source}: --ep {expert_parallel}: the model is dense (num_experts=0); "
                                  f"expert parallelism needs an MoE model")
    for flag, size, field, value in checks:
        if size < 1:
            raise ConversionError(f"{source}: --{flag} must be >= 1, got {size}")
        if value % size:
            raise ConversionError(f"{source}: --{flag} {size} does not divide the model: {field}={value} "
                                  f"is not a multiple of {size}")
