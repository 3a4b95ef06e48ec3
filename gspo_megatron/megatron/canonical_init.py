"""Layout-independent random initialisation: every layout holds the same weights for the same seed.

Megatron-Core initialises each rank's *local* shard from that rank's RNG state, so a TP=2, PP=2 or EP=2
model starts from other weights than the one-process model (a layer on another pipeline stage, an expert
on another EP rank, half a matrix on a TP rank all draw different numbers). Here each *canonical* tensor
(``sharding``'s names: global layer and expert numbers, full shapes, unpadded vocabulary) is drawn from a
generator seeded by (seed, name) alone, then cut into this rank's slice with ``sharding.shard``; so the
weights are a function of the seed and the model config only.

Distributions follow Megatron-Core 0.16.1's defaults (TransformerConfig.__post_init__): matrices
N(0, init_method_std^2); the output projections of attention and MLP (``linear_proj``, ``linear_fc2``)
N(0, init_method_std^2 / (2 * num_layers)) (``scaled_init_method_normal``); norm weights 1, biases 0.

Cost: one full tensor at a time per local parameter (an expert-parallel rank draws only its own experts).
"""
from __future__ import annotations

import dataclasses
import math
import zlib

import torch

from gspo_megatron.megatron import sharding

_SCALED = ("linear_proj.weight", "linear_fc2.weight")


def _is_norm(name: str) -> bool:
    """A norm's parameter: its module's name says so (input_layernorm, q_layernorm, final_layernorm)."""
    parts = name.split(".")
    return len(parts) >= 2 and "norm" in parts[-2]


def canonical_std(name: str, init_method_std: float, num_layers: int) -> float:
    """The normal distribution's std of canonical tensor ``name`` (0 for norms and biases: constants)."""
    if name.endswith(".bias") or _is_norm(name):
        return 0.0
    if name.endswith(_SCALED):
        return init_method_std / math.sqrt(2.0 * num_layers)
    return init_method_std


def canonical_tensor(name: str, shape: tuple[int, ...], *, seed: int, init_method_std: float,
                     num_layers: int) -> torch.Tensor:
    """Canonical tensor ``name`` [shape] float32 drawn from a generator seeded by (seed, name) only."""
    if _is_norm(name) and name.endswith(".weight"):
        return torch.ones(shape)
    std = canonical_std(name, init_method_std, num_layers)
    if std == 0.0:
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator) * std


@torch.no_grad()
def initialise_canonical(model: torch.nn.Module, model_config, seed: int) -> None:
    """Overwrite this rank's parameters of ``model`` (a GPTModel, possibly DDP-wrapped) with their slices
    of the canonical random weights of ``seed`` (see the module docstring). No communication."""
    tied = sharding._unwrap(model).share_embeddings_and_output_weights  # noqa: SLF001 - same package
    for info, param in sharding.shard_infos(model):
        if tied and info.canonical_name == "output_layer.weight":
            info = dataclasses.replace(info, canonical_name="embedding.word_embeddings.weight")
        shape = sharding.full_shape(info, param, model_config.vocab_size)
        full = canonical_tensor(info.canonical_name, shape, seed=seed, init_method_std=model_config.init_method_std,
                                num_layers=model_config.num_layers)
        param.copy_(sharding.shard(full, info, local_rows=param.shape[0]))
