"""Transformer Engine spec names, as data: on GPU the TE layer spec names a few parameters differently from
the local spec, whose names are this project's canonical Megatron names (conversion tables, checkpoints).
Translated once, where a model's parameters are enumerated (``sharding.shard_infos``), and back where a
TE model is written to (``canonical_to_te``).
"""
from __future__ import annotations

import re
from functools import lru_cache

from gspo_megatron.models.weights import E, L


def global_expert(local: int, ep_rank: int, num_local_experts: int) -> int:
    """Megatron gives EP rank r the contiguous experts [r * n_local, (r + 1) * n_local)."""
    return ep_rank * num_local_experts + local


def local_expert(global_index: int, num_local_experts: int) -> tuple[int, int]:
    """(EP rank, local index) holding global expert ``global_index``."""
    return divmod(global_index, num_local_experts)


# (TE-spec parameter name, local-spec canonical name). Layers are global on both sides (sharding.py
# renumbers them); TE's grouped experts carry the *local* expert number, glued to the name.
_MLP_NAMES: tuple[tuple[str, str], ...] = (
    (L + "mlp.linear_fc1.layer_norm_weight", L + "pre_mlp_layernorm.weight"),  # dense layers only
    (L + "mlp.experts.linear_fc1.weight{local_expert}", E + "linear_fc1.weight"),
    (L + "mlp.experts.linear_fc2.weight{local_expert}", E + "linear_fc2.weight"),
)
# grouped-query attention: the input norm is fused into linear_qkv (q/k norms stay modules of their own)
TE_SPEC_NAMES: tuple[tuple[str, str], ...] = (
    (L + "self_attention.linear_qkv.layer_norm_weight", L + "input_layernorm.weight"),
) + _MLP_NAMES
# multi-latent attention (megatron-core 0.16.1's TE MLA spec, with q/k norms): the input norm stays a TENorm of
# its own; the latent norms are fused into the up-projections that read them
MLA_TE_SPEC_NAMES: tuple[tuple[str, str], ...] = (
    (L + "self_attention.linear_q_up_proj.layer_norm_weight", L + "self_attention.q_layernorm.weight"),
    (L + "self_attention.linear_kv_up_proj.layer_norm_weight", L + "self_attention.kv_layernorm.weight"),
) + _MLP_NAMES


def spec_names(mla: bool) -> tuple[tuple[str, str], ...]:
    return MLA_TE_SPEC_NAMES if mla else TE_SPEC_NAMES


@lru_cache(maxsize=None)
def _pattern(template: str) -> re.Pattern:
    parts = re.split(r"\{(\w+)\}", template)
    regex = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>\\d+)" for i, p in enumerate(parts))
    return re.compile(f"^{regex}$")


def te_to_canonical(name: str, ep_rank: int, num_local_experts: int, mla: bool = False) -> str:
    """A TE-spec parameter name (global layer) -> the local-spec canonical name (global expert); ``mla``:
    the model has multi-latent attention."""
    for te, canonical in spec_names(mla):
        match = _pattern(te).match(name)
        if match:
            fields = match.groupdict()
            if "local_expert" in fields:
                fields["expert"] = str(global_expert(int(fields.pop("local_expert")), ep_rank, num_local_experts))
            return canonical.format(**fields)
    return name


def canonical_to_te(name: str, num_local_experts: int, dense: bool, mla: bool = False) -> tuple[int | None, str]:
    """The local-spec canonical name -> (EP rank holding it or None, TE-spec name). ``dense`` says
    whether the layer is dense (only then is pre_mlp_layernorm fused into linear_fc1 under TE); ``mla``
    whether the model has multi-latent attention."""
    for te, canonical in spec_names(mla):
        match = _pattern(canonical).match(name)
        if not match:
            continue
        fields = match.groupdict()
        if "expert" in fields:
            ep_rank, local = local_expert(int(fields.pop("expert")), num_local_experts)
            return ep_rank, te.format(local_expert=local, **fields)
        if te.endswith("mlp.linear_fc1.layer_norm_weight") and not dense:
            return None, name
        return None, te.format(**fields)
    return None, name
