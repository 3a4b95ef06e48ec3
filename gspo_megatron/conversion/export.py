"""Live export: Hugging Face tensors from a running, sharded Megatron model, in bounded buckets.

For the rollout engine's weight sync. Every rank calls ``export_hf_tensors`` and receives the same
sequence of buckets (HF names, full unpadded tensors, HF order), so whichever rank talks to an engine
can feed ``engine.update_weights(bucket, final=...)`` directly. Per canonical tensor, in table order:

1. the pipeline stage that holds it assembles it: TP shards are gathered with ``sharding.unshard``
   (over the expert-TP group for experts); an expert lives on one EP rank (experts
   [r * E/EP, (r + 1) * E/EP) on EP rank r) and is broadcast from it over the expert-parallel group;
2. it is broadcast from that stage over the pipeline group;
3. the table's transform turns it into its HF tensors (q/k/v split, gate/up split).

At most one canonical tensor plus one bucket is alive per rank. Collectives follow the same order on
every rank, so they pair up without coordination; the price is one broadcast per tensor.
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from gspo_megatron.conversion.tables import expand
from gspo_megatron.megatron import sharding
from gspo_megatron.megatron.model_config import ModelConfig

NamedTensors = list[tuple[str, torch.Tensor]]

_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def _stage_key(name: str) -> str:
    """Experts of a layer share one key (each EP rank holds different ones, all on the same stage)."""
    return _EXPERT.sub(".mlp.experts.local_experts.*.", name)


def _local_tensors(model, config: ModelConfig) -> dict[str, tuple[sharding.ShardInfo, torch.Tensor]]:
    """This rank's parameters by canonical (local-spec, global-numbered) name (``shard_infos`` translates
    TE-spec names)."""
    local = {}
    for info, param in sharding.shard_infos(model):
        name = info.canonical_name
        if config.tie_word_embeddings and name == "output_layer.weight":
            continue  # the last stage's copy of the tied embedding
        local[name] = (info, param.detach())
    return local


def _owners(local: dict, config: ModelConfig) -> dict[str, tuple[int, tuple[int, ...], torch.dtype]]:
    """stage key -> (pipeline stage holding it, full shape, dtype), agreed over the pipeline group."""
    from megatron.core import parallel_state as ps

    mine = {_stage_key(name): (sharding.full_shape(info, t, config.vocab_size), t.dtype) for name, (info, t) in local.items()}
    stages = [mine]
    if ps.get_pipeline_model_parallel_world_size() > 1:
        stages = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(stages, mine, group=ps.get_pipeline_model_parallel_group())
    owners: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
    for stage, held in enumerate(stages):
        for key, (shape, dtype) in held.items():
            owners.setdefault(key, (stage, shape, dtype))  # a tied embedding is held by the first stage
    return owners


def _assemble(name: str, local: dict, owner_stage: int, shape, dtype, device, config: ModelConfig) -> torch.Tensor:
    """The full canonical tensor ``name``, on every rank (collectives in the order described above)."""
    from megatron.core import parallel_state as ps

    on_stage = ps.get_pipeline_model_parallel_rank() == owner_stage
    expert = _EXPERT.search(name)
    full = None
    if on_stage and expert is None:
        info, tensor = local[name]
        full = sharding.unshard(tensor, info, config.vocab_size)
    elif on_stage:
        ep_size = ps.get_expert_model_parallel_world_size()
        owner_ep = int(expert.group(1)) // (config.num_experts // ep_size)
        if ps.get_expert_model_parallel_rank() == owner_ep:
            info, tensor = local[name]
            full = sharding.unshard(tensor, info)
        if ep_size > 1:
            full = full.contiguous() if full is not None else torch.empty(shape, dtype=dtype, device=device)
            group = ps.get_expert_model_parallel_group()
            dist.broadcast(full, src=dist.get_global_rank(group, owner_ep), group=group)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        full = full.contiguous() if full is not None else torch.empty(shape, dtype=dtype, device=device)
        group = ps.get_pipeline_model_parallel_group()
        dist.broadcast(full, src=dist.get_global_rank(group, owner_stage), group=group)
    return full


def export_hf_tensors(model, model_config: ModelConfig, bucket_bytes: int,
                      dtype: torch.dtype | None = None) -> Iterator[NamedTensors]:
    """Yield lists of (HF name, tensor) of at most ``bucket_bytes`` each (a larger tensor travels alone),
    identical on every rank, covering every HF tensor of the model exactly once. Collective: call it on
    every rank of the job and consume the iterator to the end on all of them. ``dtype`` casts
    (default: the parameters' dtype). ``model`` may be wrapped (DDP); its canonical names are those of
    ``megatron/sharding.py`` (TE-spec names are translated with ``megatron/te_names.py``)."""
    for bucket, _ in export_hf_buckets(model, model_config, bucket_bytes, dtype):
        yield bucket


@torch.no_grad()
def export_hf_buckets(model, model_config: ModelConfig, bucket_bytes: int,
                      dtype: torch.dtype | None = None) -> Iterator[tuple[NamedTensors, bool]]:
    """``export_hf_tensors``'s buckets as (bucket, is_last): the last one is known without holding a
    second bucket back, so a consumer that drops each bucket after use keeps at most one of them alive
    (plus the next bucket's first tensor and the canonical tensor being assembled)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    local = _local_tensors(model, model_config)
    owners = _owners(local, model_config)
    device = next(iter(local.values()))[1].device

    def named() -> Iterator[tuple[str, torch.Tensor]]:
        for entry in expand(model_config):
            stage_key = _stage_key(entry.megatron)
            if stage_key not in owners:
                raise KeyError(f"export_hf_tensors: no pipeline stage holds {entry.megatron}")
            stage, shape, param_dtype = owners[stage_key]
            full = _assemble(entry.megatron, local, stage, shape, param_dtype, device, model_config)
            for name, tensor in zip(entry.hf, entry.transform.to_hf(full)):
                # A copy: the engine may keep it while training changes the parameters, and a transform's
                # output is often a view (a q/k/v or gate/up slice) whose IPC handle would share, and pin, the
                # whole gathered tensor. The engine drops it once its post is answered, so the copies alive
                # are bounded by its buckets in flight (SGLangConfig.tensor_buckets_in_flight).
                yield name, tensor.to(dtype=dtype or tensor.dtype, copy=True)

    yield from bucket_named_tensors_marked(named(), bucket_bytes)


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def bucket_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[NamedTensors]:
    """Group tensors, in order, into buckets of at most ``bucket_bytes`` each.

    A tensor larger than ``bucket_bytes`` travels alone. Names must be unique within a sync: a repeated
    name would load the same parameter twice and hide a conversion bug.
    """
    for bucket, _ in bucket_named_tensors_marked(named_tensors, bucket_bytes):
        yield bucket


def bucket_named_tensors_marked(named_tensors: Iterable[tuple[str, torch.Tensor]],
                                bucket_bytes: int) -> Iterator[tuple[NamedTensors, bool]]:
    """``bucket_named_tensors`` as (bucket, is_last): a bucket is yielded when the next tensor does not fit
    (so it is not the last) or when the input ends (so it is)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    seen: set[str] = set()
    bucket: NamedTensors = []
    size = 0
    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in one weight sync")
        seen.add(name)
        nbytes = tensor_nbytes(tensor)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket, False
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket, True
