"""Map a Megatron GPTModel's local (sharded) parameters to and from *canonical* full tensors.

Canonical names are the model's own parameter names as a single process (TP=PP=EP=1) would have them:
global layer numbers and global expert numbers, full (unsharded) shapes, unpadded vocabulary rows. The
conversion tables translate canonical names to Hugging Face names; this module is the other half, the
layout algebra, written once:

* TP: a parameter marked ``tensor_model_parallel`` is split along its ``partition_dim`` over the TP group
  (the expert-TP group for expert weights). SwiGLU's fused ``linear_fc1`` = [gate; up] is split per
  half, each rank holding [gate_r; up_r].
* EP: ``local_experts.e`` on EP rank r is global expert ``r * num_local_experts + e``.
* PP: ``decoder.layers.i`` on a stage is global layer ``layer_number - 1`` of that module.
* Vocabulary: embedding and output rows are padded (``ModelConfig.padded_vocab_size``, zero rows on the
  last TP rank(s)); canonical tensors are not.
* Spec: canonical names are the *local* spec's. A Transformer Engine model's few differing names
  (``megatron/te_names.py``) are translated here, once, in ``shard_infos``.

Checkpoints are spec-neutral: the TE MoE layer reads and writes its pre-MLP norm under the local spec's
key (``TE_MOE_KEYS_MAP``), and TE's ``_extra_state`` entries (FP8 scaling metadata, unused here) are
neither saved nor required (``sharded_state_dict`` / ``load_module_state``). Megatron-Core 0.16.1.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Iterator

import torch
import torch.distributed as dist

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")
# SwiGLU's fused [gate; up]: "linear_fc1.weight" (local spec) or "linear_fc1.weight{e}" (TE grouped experts)
_FUSED_FC1 = re.compile(r"linear_fc1\.weight\d*$")
_EXPERT_BIAS = ".mlp.router.expert_bias"


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """How one local parameter relates to its canonical tensor."""

    local_name: str
    canonical_name: str
    split: str  # "replicated" | "dim0" | "dim1" | "glu"
    is_expert: bool
    tp_rank: int
    tp_size: int


def _groups(is_expert: bool):
    from megatron.core import parallel_state as ps

    if is_expert:
        return ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_rank(), \
            ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank(), \
        ps.get_tensor_model_parallel_world_size()


def canonical_name(local_name: str, model: torch.nn.Module) -> str:
    """Local parameter name -> canonical name (global layer and expert numbers)."""
    from megatron.core import parallel_state as ps

    name = local_name
    match = _LAYER.match(name)
    if match:
        layer = model.decoder.layers[int(match.group(1))]
        name = f"decoder.layers.{layer.layer_number - 1}." + name[match.end():]
    match = _EXPERT.search(name)
    if match:
        # from the config: layer 0 may be dense (first_dense_layers)
        num_local = _unwrap(model).config.num_moe_experts // ps.get_expert_model_parallel_world_size()
        global_expert = ps.get_expert_model_parallel_rank() * num_local + int(match.group(1))
        name = name[:match.start()] + f".mlp.experts.local_experts.{global_expert}." + name[match.end():]
    return name


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model


def _spec_canonical(local_name: str, gpt: torch.nn.Module) -> str:
    """``canonical_name``, then TE-spec names -> local-spec names (global expert numbers)."""
    from megatron.core import parallel_state as ps

    from gspo_megatron.megatron.te_names import te_to_canonical

    config = gpt.config
    num_local = (config.num_moe_experts or 0) // ps.get_expert_model_parallel_world_size()
    return te_to_canonical(canonical_name(local_name, gpt), ps.get_expert_model_parallel_rank(), num_local,
                           mla=config.multi_latent_attention)


def shard_infos(model: torch.nn.Module) -> Iterator[tuple[ShardInfo, torch.nn.Parameter]]:
    """(ShardInfo, parameter) for every parameter of this rank's model chunk; canonical names are the
    local spec's whichever spec built the model."""
    gpt = _unwrap(model)
    gated = gpt.config.gated_linear_unit
    # the routers' expert bias is a buffer (frozen during RL) but a weight of the model all the same
    expert_bias = [(name, buf) for name, buf in gpt.named_buffers() if name.endswith(_EXPERT_BIAS)]
    for local_name, param in [*gpt.named_parameters(), *expert_bias]:
        is_expert = ".mlp.experts." in local_name
        _, tp_rank, tp_size = _groups(is_expert)
        if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
            split = "replicated"
        elif gated and _FUSED_FC1.search(local_name):
            split = "glu"
        else:
            split = f"dim{param.partition_dim}"
        yield ShardInfo(local_name, _spec_canonical(local_name, gpt), split, is_expert, tp_rank, tp_size), param


def shard(full: torch.Tensor, info: ShardInfo, local_rows: int | None = None) -> torch.Tensor:
    """This rank's slice of canonical tensor ``full`` (padding vocabulary rows to ``local_rows * TP``)."""
    if info.canonical_name in _VOCAB_PARAMS and local_rows is not None:
        padded = local_rows * info.tp_size
        if full.shape[0] < padded:
            full = torch.cat([full, full.new_zeros(padded - full.shape[0], *full.shape[1:])])
    if info.split == "replicated":
        return full
    if info.split == "glu":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(info.tp_size, 0)[info.tp_rank], up.chunk(info.tp_size, 0)[info.tp_rank]])
    dim = int(info.split[-1])
    return full.chunk(info.tp_size, dim=dim)[info.tp_rank]


def full_shape(info: ShardInfo, local: torch.Tensor, vocab_size: int) -> tuple[int, ...]:
    """The canonical (unsharded, unpadded) shape of the tensor ``local`` is this rank's slice of."""
    shape = list(local.shape)
    if info.split in ("glu", "dim0"):
        shape[0] *= info.tp_size
    elif info.split == "dim1":
        shape[1] *= info.tp_size
    if info.canonical_name in _VOCAB_PARAMS:
        shape[0] = vocab_size
    return tuple(shape)


def unshard(local: torch.Tensor, info: ShardInfo, vocab_size: int | None = None) -> torch.Tensor:
    """Gather ``local`` over its TP group into the canonical tensor (collective over that group)."""
    if info.split == "replicated":
        full = local
    else:
        group, _, size = _groups(info.is_expert)
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        if info.split == "glu":
            halves = [p.chunk(2, dim=0) for p in parts]
            full = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            full = torch.cat(parts, dim=int(info.split[-1]))
    if info.canonical_name in _VOCAB_PARAMS and vocab_size is not None:
        full = full[:vocab_size]
    return full


def _grad_of(param: torch.nn.Parameter) -> torch.Tensor:
    grad = getattr(param, "main_grad", None)  # Megatron DDP accumulates into main_grad
    if grad is None:
        grad = param.grad
    if grad is None:
        return torch.zeros_like(param)
    return grad


def full_state_dict(model: torch.nn.Module, vocab_size: int, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every canonical tensor (or its gradient), assembled on every rank. For tests and small models:
    the whole model passes through each rank's memory. Bounded-memory export lives in ``conversion``."""
    from megatron.core import parallel_state as ps

    dense: dict[str, torch.Tensor] = {}
    experts: dict[str, torch.Tensor] = {}
    tied = _unwrap(model).share_embeddings_and_output_weights
    for info, param in shard_infos(model):
        if tied and info.canonical_name == "output_layer.weight":
            continue  # the last stage's copy of the tied embedding (kept in sync by Megatron)
        tensor = _grad_of(param) if grads else param.detach()
        full = unshard(tensor.detach(), info, vocab_size).clone()
        (experts if info.is_expert else dense)[info.canonical_name] = full
    if ps.get_expert_model_parallel_world_size() > 1:
        gathered = [None] * ps.get_expert_model_parallel_world_size()
        dist.all_gather_object(gathered, experts, group=ps.get_expert_model_parallel_group())
        experts = {k: v for part in gathered for k, v in part.items()}
    dense.update(experts)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        gathered = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(gathered, dense, group=ps.get_pipeline_model_parallel_group())
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            for key, value in part.items():
                # tied embeddings live on the first and last stage; both copies are identical
                merged.setdefault(key, value)
        dense = merged
    return dense


@torch.no_grad()
def load_full_state_dict(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy this rank's slices of canonical tensors ``full`` into the model's parameters."""
    tied = _unwrap(model).share_embeddings_and_output_weights
    for info, param in shard_infos(model):
        if tied and info.canonical_name == "output_layer.weight":
            info = dataclasses.replace(info, canonical_name="embedding.word_embeddings.weight")
        if info.canonical_name not in full:
            raise KeyError(f"load_full_state_dict: missing canonical tensor {info.canonical_name!r} "
                           f"(local parameter {info.local_name})")
        local = shard(full[info.canonical_name], info, local_rows=param.shape[0])
        if local.shape != param.shape:
            raise ValueError(f"load_full_state_dict: {info.canonical_name}: slice shape {tuple(local.shape)} "
                             f"!= parameter shape {tuple(param.shape)}")
        param.copy_(local)


# ---- spec-neutral checkpoints --------------------------------------------------------------------

# The local spec (get_gpt_layer_local_spec, 0.16.1) saves every layer's pre-MLP norm as TE's fused
# dense name; the TE MoE layer has a separate TENorm ``pre_mlp_layernorm`` and no mapping for it. Given
# to the TE MoE spec, this map makes both specs read and write the same key.
TE_MOE_KEYS_MAP = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
_EXTRA_STATE = "_extra_state"


def _is_extra_state(key: str) -> bool:
    # TE names them "<module>._extra_state" and, per grouped GEMM, "_extra_state<i>" (TEGroupedLinear)
    return key.rsplit(".", 1)[-1].startswith(_EXTRA_STATE)


def drop_extra_state(state: dict) -> dict:
    """``state`` (a possibly nested sharded state dict) without TE's ``_extra_state`` entries."""
    return {k: drop_extra_state(v) if isinstance(v, dict) else v for k, v in state.items()
            if not _is_extra_state(k)}


def sharded_state_dict(model: torch.nn.Module, prefix: str = "model.", per_layer: bool | None = None) -> dict:
    """The model's sharded state dict as either spec loads it: no ``_extra_state`` objects. ``per_layer``:
    the layer keying of the checkpoint it is for (``layer_keys``); None keeps the model's own."""
    with layer_keys(model, per_layer):
        return drop_extra_state(_unwrap(model).sharded_state_dict(prefix=prefix))


_PER_LAYER_KEY = re.compile(r"(^|\.)decoder\.layers\.\d+\.")
_STACKED_KEY = re.compile(r"(^|\.)decoder\.layers\.[a-z_]")


def stored_layer_keying(keys) -> bool | None:
    """Whether checkpoint ``keys`` hold the decoder's layers per layer (``decoder.layers.3.mlp...``: True) or
    stacked under one key (``decoder.layers.mlp...``: False); None when they hold no decoder layer."""
    per_layer = any(_PER_LAYER_KEY.search(k) for k in keys)
    stacked = any(_STACKED_KEY.search(k) for k in keys)
    if per_layer and stacked:
        raise ValueError("checkpoint keys mix per-layer and stacked decoder layers")
    return True if per_layer else False if stacked else None


@contextlib.contextmanager
def layer_keys(model: torch.nn.Module, per_layer: bool | None) -> Iterator[None]:
    """Megatron keys a decoder's MoE layers per layer when ``moe_layer_freq`` is a list (Megatron-Bridge's and
    Megatron-LM's DeepSeek-V3 / GLM-4.5) and stacked when it is an int; the layers themselves are the same.
    Inside, the model's sharded state dict uses the keying ``per_layer`` asks for (None: its own), so a
    checkpoint written with either keying loads into a model configured either way."""
    config = _unwrap(model).config
    freq = config.moe_layer_freq
    if per_layer is None or not config.num_moe_experts or isinstance(freq, list) == per_layer:
        yield
        return
    pattern = freq if isinstance(freq, list) else [int(i % freq == 0) for i in range(config.num_layers)]
    if not per_layer and not all(pattern):
        raise ValueError(f"a checkpoint with stacked layer keys cannot hold this model: its layers are not all MoE "
                         f"(moe_layer_freq={freq})")
    config.moe_layer_freq = pattern if per_layer else 1
    try:
        yield
    finally:
        config.moe_layer_freq = freq


def load_module_state(model: torch.nn.Module, state: dict, prefix: str = "model.") -> None:
    """Load a (spec-neutral) state dict strictly, except that TE's ``_extra_state`` may be missing."""
    result = _unwrap(model).load_state_dict({k.removeprefix(prefix): v for k, v in state.items()}, strict=False)
    missing = [k for k in result.missing_keys if not _is_extra_state(k)]
    unexpected = [k for k in result.unexpected_keys if not _is_extra_state(k)]
    if missing or unexpected:
        raise KeyError(f"load_module_state: missing keys {missing[:8]}, unexpected keys {unexpected[:8]} "
                       f"({len(missing)} / {len(unexpected)} in all)")
