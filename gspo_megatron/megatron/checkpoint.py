"""Distributed checkpoints (Megatron dist_checkpointing, torch_dist format), written atomically.

A checkpoint saved at one TP/PP/EP layout loads at another: every ShardedTensor carries its global
offsets, and the loading model asks for the slices it needs. The folder appears under its final name
only once every rank has finished writing (save into ``<dir>.incomplete``, rename on rank 0).

A folder under its final name can still be damaged later (a truncated copy, a disk error): ``verify``
checks what can be checked without reading the tensors (every file the metadata names exists and is
long enough, the metadata files parse) so a resume can skip a damaged newest checkpoint. A save that
runs out of disk space raises ``CheckpointError`` saying so (Megatron's writer reports it as
"unexpected pos").
"""
from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from gspo_megatron.megatron import cpu_runtime


class CheckpointError(ValueError):
    """A checkpoint cannot be read or written; the message names the folder or file and the cause."""


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def model_sharded_state_dict(model: torch.nn.Module, prefix: str = "model.") -> dict:
    from gspo_megatron.megatron import sharding

    return sharding.sharded_state_dict(model, prefix=prefix)  # spec-neutral: loads into TE or local


def save(sharded_state_dict: dict, directory: str | Path, common: dict[str, Any] | None = None,
         overwrite: bool = False, rank_files: Callable[[Path], None] | None = None) -> Path:
    """Save a sharded state dict into ``directory`` atomically; ``common`` (plain JSON data: config,
    step, data position) goes into ``gspo_meta.json`` beside Megatron's files; ``rank_files(folder)``, on
    every rank, writes that rank's own files into the folder before it becomes the checkpoint."""
    from megatron.core import dist_checkpointing

    from gspo_megatron.processes import own_checkpoint_results_queue

    cpu_runtime.activate()
    own_checkpoint_results_queue()  # Megatron's writer helpers die with this rank (processes.py)
    final = Path(directory)
    staging = final.with_name(final.name + ".incomplete")
    if _rank() == 0:
        if final.exists() and not overwrite:
            raise FileExistsError(f"{final}: checkpoint folder already exists (pass overwrite=True to replace it)")
        if staging.exists():
            shutil.rmtree(staging)  # left by a run killed mid-save; never a valid checkpoint
        staging.mkdir(parents=True)
    _barrier()
    need = _all_ranks_sum(_tensor_bytes(sharded_state_dict))
    check_free_space(staging, need)
    try:
        dist_checkpointing.save(sharded_state_dict, str(staging))
    except Exception as err:
        if is_disk_full(err, staging, need):
            raise CheckpointError(f"{staging}: no space left on device (ENOSPC) while saving the checkpoint "
                                  f"(about {need / 2**20:.1f} MiB); free space and resume from the previous "
                                  f"checkpoint") from err
        raise
    if rank_files is not None:
        rank_files(staging)
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


def _tensor_bytes(sharded_state_dict: dict) -> int:
    """Bytes of this rank's tensors in a (nested) sharded state dict: what its save writes, roughly."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    total = 0
    for value in nested_values(sharded_state_dict):
        data = getattr(value, "data", value)  # ShardedTensor.data, or a plain tensor
        if isinstance(data, torch.Tensor):
            total += data.numel() * data.element_size()
    return total


def _all_ranks_sum(value: int) -> int:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def check_free_space(directory: Path, need: int) -> None:
    """Raise ENOSPC as such before writing when ``directory``'s file system has less than ``need`` bytes
    free (every rank sees the same figures, so every rank raises: none is left waiting in a collective)."""
    free = shutil.disk_usage(directory).free
    if free < need:
        raise CheckpointError(f"{directory}: no space left on device (ENOSPC): the checkpoint needs about "
                              f"{need / 2**20:.1f} MiB, {free / 2**20:.1f} MiB free; free space (or lower "
                              f"checkpoint.keep_last) and resume")


def is_disk_full(err: BaseException, directory: Path, need: int) -> bool:
    """Whether a failed write ran out of space: an ENOSPC anywhere in the exception chain, or (Megatron's
    writer loses the errno: "unexpected pos") a file system with less than ``need`` bytes free."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        seen = seen.__cause__ or seen.__context__
    return shutil.disk_usage(directory).free < need


def verify(directory: str | Path) -> None:
    """Check a saved checkpoint without reading its tensors: metadata.json, gspo_meta.json and DCP's
    ``.metadata`` parse, and every storage file the metadata names exists and holds the byte ranges it
    names. Raises CheckpointError naming the file and what is wrong."""
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(directory)
    for name in ("metadata.json", "gspo_meta.json"):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing")
        try:
            json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{file}: unreadable ({err})") from None
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # noqa: BLE001 - any unpickling failure means the same: a damaged .metadata
        raise CheckpointError(f"{path / '.metadata'}: unreadable ({type(err).__name__}: {err})") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (named in {path / '.metadata'})")
        size = os.path.getsize(file)
        if size < end:
            raise CheckpointError(f"{file}: truncated ({size} bytes, the metadata needs {end})")


def load(sharded_state_dict: dict, directory: str | Path) -> dict:
    """Load the tensors ``sharded_state_dict`` asks for (any layout) from ``directory``."""
    from megatron.core import dist_checkpointing

    cpu_runtime.activate()
    path = Path(directory)
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{path}: not a dist_checkpointing checkpoint (no metadata.json)")
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return dist_checkpointing.load(sharded_state_dict, str(path))
    except CheckpointException as err:
        # a BaseException holding each rank's traceback: name what this rank could not load instead
        causes = sorted({f"{type(exc).__name__}: {exc}" for exc, _ in err.failures.values()})
        raise CheckpointError(f"{path}: the checkpoint does not hold what this run loads ({'; '.join(causes)[:500]}); "
                              f"resume with the run's own config.yaml") from None


def read_meta(directory: str | Path) -> dict:
    path = Path(directory) / "gspo_meta.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (checkpoint written by another tool or incomplete)")
    return json.loads(path.read_text())


def save_model(model: torch.nn.Module, directory: str | Path, common: dict | None = None,
               overwrite: bool = False) -> Path:
    return save(model_sharded_state_dict(model), directory, common, overwrite)


def per_layer_keys(directory: str | Path) -> bool | None:
    """The layer keying of a torch_dist checkpoint (``sharding.stored_layer_keying``), from DCP's .metadata."""
    import torch.distributed.checkpoint as dcp

    from gspo_megatron.megatron import sharding

    return sharding.stored_layer_keying(dcp.FileSystemReader(str(directory)).read_metadata().state_dict_metadata)


def load_model(model: torch.nn.Module, directory: str | Path) -> None:
    """The model's weights from ``directory``, whichever layer keying it was saved with."""
    from gspo_megatron.megatron import sharding

    state = sharding.sharded_state_dict(model, prefix="model.", per_layer=per_layer_keys(directory))
    sharding.load_module_state(model, load(state, directory))
