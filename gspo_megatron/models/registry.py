"""Every model family, by HF ``model_type``. Adding a family: one module in this package, one line here."""
from __future__ import annotations

from gspo_megatron.models import deepseek_v3, glm4_moe, llama, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe
from gspo_megatron.models.base import Family
from gspo_megatron.typed_config import ConfigError

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    qwen3_moe.FAMILY,
    qwen3.FAMILY,
    qwen2.FAMILY,
    llama.FAMILY,
    mixtral.FAMILY,
    qwen2_moe.FAMILY,
    glm4_moe.FAMILY,
    deepseek_v3.FAMILY,
)}

# Families with a ModelConfig mapping and a weight table: converted, trained and exported.
TRAINABLE: tuple[str, ...] = tuple(name for name, f in FAMILIES.items() if f.trainable)
# Families the transformers rollout engine serves (a superset of TRAINABLE).
ENGINE_MODEL_TYPES: tuple[str, ...] = tuple(sorted(FAMILIES))


def trainable_family(model_type: object, source: str) -> Family:
    """The family of a trainable ``model_type``; ``source`` names where it was read (for the error)."""
    if model_type not in TRAINABLE:
        raise ConfigError(f"{source}: model_type: unsupported architecture {model_type!r} "
                          f"(supported: {sorted(TRAINABLE)})")
    return FAMILIES[model_type]
