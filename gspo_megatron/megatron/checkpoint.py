"""Distributed checkpoints (Megatron dist_checkpointing, torch_dist format), written atomically.

A checkpoint saved at one TP/PP/EP layout loads at another: every ShardedTensor carries its global
offsets, and the loading model asks for the slices it needs. The folder appears under its final name
only once every rank has finished writing (save into ``<dir>.incomplete``, rename on rank 0).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gspo_megatron.megatron import cpu_runtime


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def model_sharded_state_dict(model: torch.nn.Module, prefix: str = "model.") -> dict:
    from gspo_megatron.megatron.sharding import _unwrap

    return _unwrap(model).sharded_state_dict(prefix=prefix)


def save(sharded_state_dict: dict, directory: str | Path, common: dict[str, Any] | None = None,
         overwrite: bool = False) -> Path:
    """Save a sharded state dict into ``directory`` atomically; ``common`` (plain JSON data: config,
    step, data position) goes into ``gspo_meta.json`` beside Megatron's files."""
    from megatron.core import dist_checkpointing

    cpu_runtime.activate()
    final = Path(directory)
    staging = final.with_name(final.name + ".incomplete")
    if _rank() == 0:
        if final.exists() and not overwrite:
            raise FileExistsError(f"{final}: checkpoint folder already exists (pass overwrite=True to replace it)")
        if staging.exists():
            shutil.rmtree(staging)  # left by a run killed mid-save; never a valid checkpoint
        staging.mkdir(parents=True)
    _barrier()
    dist_checkpointing.save(sharded_state_dict, str(staging))
    _barrier()
    if _rank() == 0:
        (staging / "gspo_meta.json").write_text(json.dumps(common or {}, indent=2, sort_keys=True))
        if final.exists():
            old = final.with_name(final.name + ".old")
            final.rename(old)
            staging.rename(final)
            shutil.rmtree(old)
        else:
            staging.rename(final)
    _barrier()
    return final


def load(sharded_state_dict: dict, directory: str | Path) -> dict:
    """Load the tensors ``sharded_state_dict`` asks for (any layout) from ``directory``."""
    from megatron.core import dist_checkpointing

    cpu_runtime.activate()
    path = Path(directory)
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{path}: not a dist_checkpointing checkpoint (no metadata.json)")
    return dist_checkpointing.load(sharded_state_dict, str(path))


def read_meta(directory: str | Path) -> dict:
    path = Path(directory) / "gspo_meta.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (checkpoint written by another tool or incomplete)")
    return json.loads(path.read_text())


def save_model(model: torch.nn.Module, directory: str | Path, common: dict | None = None,
               overwrite: bool = False) -> Path:
    return save(model_sharded_state_dict(model), directory, common, overwrite)


def load_model(model: torch.nn.Module, directory: str | Path) -> None:
    from gspo_megatron.megatron.sharding import _unwrap

    state = load(model_sharded_state_dict(model), directory)
    _unwrap(model).load_state_dict({k.removeprefix("model."): v for k, v in state.items()}, strict=True)
