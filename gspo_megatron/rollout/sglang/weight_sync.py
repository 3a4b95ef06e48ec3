"""Trainer-side pieces of SGLang's three refit paths (docs/advanced_features/sglang_for_rl.md).

- tensor (colocated): tensors stay on the trainer's GPU; the server gets CUDA IPC handles, pickled with
  torch's ForkingPickler and base64-encoded, one payload per server TP rank ("serialized_named_tensors:
  Per-TP serialized tensor payloads ... created with MultiprocessingSerializer.serialize", which is
  ForkingPickler + base64 in python/sglang/srt/utils).
- distributed (separate GPUs): the trainer is rank 0 of an NCCL group that every server GPU joins
  (/init_weights_update_group); per bucket the server is told names/dtypes/shapes
  (/update_weights_from_distributed) and receives one broadcast per tensor from rank 0, in order.
- disk: the trainer writes a safetensors checkpoint; the server reads it (/update_weights_from_disk).
"""
from __future__ import annotations

import base64
import contextlib
import datetime
import importlib
import importlib.util
import inspect
import io
import json
import logging
import os
import shutil
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from gspo_megatron.conversion.export import bucket_named_tensors, tensor_nbytes  # noqa: F401 (re-exported)

NamedTensors = list[tuple[str, torch.Tensor]]
log = logging.getLogger(__name__)

# Where SGLang keeps monkey_patch_torch_reductions: utils/patch_torch.py in 0.5.x, patch_torch.py before.
_PATCH_MODULES = ("sglang.srt.utils.patch_torch", "sglang.srt.patch_torch")
_reductions_state: dict[str, bool] = {}


# ----------------------------------------------------------------------------------------------------
# Buckets
# ----------------------------------------------------------------------------------------------------

def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: the server resolves dtypes with getattr(torch, name)."""
    return str(dtype).removeprefix("torch.")


def bucket_metadata(bucket: NamedTensors) -> dict[str, list]:
    return {"names": [name for name, _ in bucket],
            "dtypes": [dtype_name(t.dtype) for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket]}


# ----------------------------------------------------------------------------------------------------
# Request bodies (field names from python/sglang/srt/managers/io_struct.py and sglang_for_rl.md)
# ----------------------------------------------------------------------------------------------------

def _patch_module() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return None
    for name in _PATCH_MODULES:
        if importlib.util.find_spec(name.rsplit(".", 1)[0]) is not None and importlib.util.find_spec(name) is not None:
            return name
    return None


def uuid_reductions() -> bool:
    """Make CUDA IPC handles carry the GPU's UUID instead of this process's device index, with SGLang's own
    ``monkey_patch_torch_reductions`` (the server side rebuilds either form; a UUID survives a different
    CUDA_VISIBLE_DEVICES in the server). True when patched; without sglang importable here, the handles
    carry the index and the server must number the GPUs as this process does (--base-gpu-id)."""
    if "patched" not in _reductions_state:
        name = _patch_module()
        if name is not None:
            importlib.import_module(name).monkey_patch_torch_reductions()
        else:
            log.warning("sglang is not importable in the trainer: CUDA IPC handles carry device indices, so the "
                        "servers must see the GPUs numbered as the trainer does")
        _reductions_state["patched"] = name is not None
    return _reductions_state["patched"]


def serialize_named_tensors(bucket: NamedTensors) -> str:
    """A list of (name, tensor) pickled with ForkingPickler (CUDA tensors become IPC handles; nothing is
    copied) and base64-encoded so it travels inside JSON. The handles name the GPU by UUID when sglang is
    importable here (``uuid_reductions``). The caller keeps the tensors alive until the server has copied
    them (SGLang answers once the copies are enqueued)."""
    if any(t.is_cuda for _, t in bucket):
        uuid_reductions()
    buf = io.BytesIO()
    with _cpu_storage_by_file_name():
        ForkingPickler(buf).dump(list(bucket))
    return base64.b64encode(buf.getvalue()).decode("ascii")


@contextlib.contextmanager
def _cpu_storage_by_file_name() -> Iterator[None]:
    """Pickle CPU tensors as shared-memory file names instead of torch's default file descriptors.

    A descriptor travels through a multiprocessing connection that only a process holding this process's
    authkey may open; an SGLang server is not our child, so it fails with ``AuthenticationError: digest sent
    was rejected`` (torch/multiprocessing/reductions.py, met against SGLang 0.5.23 on CPU). A file name needs
    no handshake. The strategy is read when a storage is pickled, so it is set for this dump only."""
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        _start_shm_manager_without_stderr()
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(before)


_shm_manager = {"started": False}


def _start_shm_manager_without_stderr() -> None:
    """Start torch's ``torch_shm_manager`` (once per process) with its stderr on /dev/null.

    torch starts that daemon at the first ``file_system`` share, and it inherits the process's stderr; it
    exits only when every process that mapped our shared memory has exited. An SGLang server attached by
    URL outlives the trainer, so the daemon would keep the trainer's stderr open after it exited: a pipe
    (``gspo-megatron train ... 2>&1 | tee``, ``subprocess.run(capture_output=True)``) would wait for the
    server to stop. Sharing one tiny storage with fd 2 pointed at /dev/null starts it quietly; later shares
    reuse it. (For the moment of that share, this process's own stderr output is lost too.)"""
    if _shm_manager["started"]:
        return
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        torch.empty(1).share_memory_()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    _shm_manager["started"] = True


def deserialize_named_tensors(payload: str) -> NamedTensors:
    """Inverse of serialize_named_tensors, for tests on one machine (the server has its own)."""
    return ForkingPickler.loads(base64.b64decode(payload, validate=True))


def _version_fields(flush_cache: bool, weight_version: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"flush_cache": flush_cache}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


def update_from_tensor_body(payloads: Sequence[str], *, flush_cache: bool, weight_version: str | None) -> dict[str, Any]:
    """POST /update_weights_from_tensor (UpdateWeightsFromTensorReqInput)."""
    return {"serialized_named_tensors": list(payloads), "load_format": None,
            **_version_fields(flush_cache, weight_version)}


def update_from_distributed_body(bucket: NamedTensors, *, group_name: str, flush_cache: bool,
                                 weight_version: str | None) -> dict[str, Any]:
    """POST /update_weights_from_distributed (UpdateWeightsFromDistributedReqInput)."""
    return {**bucket_metadata(bucket), "group_name": group_name, **_version_fields(flush_cache, weight_version)}


def update_from_disk_body(model_path: str, *, weight_version: str | None) -> dict[str, Any]:
    """POST /update_weights_from_disk (UpdateWeightFromDiskReqInput). ``load_format`` is always sent: a
    missing one is filled with the server's launch value (0.5.9 tokenizer_manager.py:1355, 0.5.23 :2295),
    and a server launched with ``dummy`` cannot load from disk ("Failed to get model loader")."""
    body: dict[str, Any] = {"model_path": model_path, "load_format": "auto"}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


def rank_offsets(gpus_per_server: Sequence[int]) -> tuple[list[int], int]:
    """Group ranks: the trainer is rank 0, server i's TP ranks start at its offset. -> (offsets, world size)."""
    offsets, next_rank = [], 1
    for gpus in gpus_per_server:
        if gpus < 1:
            raise ValueError(f"a server has {gpus} GPUs")
        offsets.append(next_rank)
        next_rank += gpus
    return offsets, next_rank


def init_group_body(*, master_address: str, master_port: int, rank_offset: int, world_size: int,
                    group_name: str, backend: str) -> dict[str, Any]:
    """POST /init_weights_update_group (InitWeightsUpdateGroupReqInput)."""
    return {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}


# ----------------------------------------------------------------------------------------------------
# The trainer's side of the NCCL group
# ----------------------------------------------------------------------------------------------------

class TrainerBroadcastGroup:
    """Rank 0 of the weight-update group, created beside the trainer's own default group.

    The server joins with rendezvous("tcp://address:port") + PrefixStore(group_name) +
    _new_process_group_helper (SGLang's init_custom_process_group). We host the TCPStore (rank 0 of a tcp
    rendezvous is the store's server) and build the group the same way, so both sides agree on the store
    keys; torch has no public API for a second, independent world. Blocks until all ranks have joined.
    """

    def __init__(self, *, master_address: str, master_port: int, world_size: int, group_name: str,
                 backend: str, timeout_s: float):
        from torch.distributed import distributed_c10d as c10d

        if torch.distributed.is_initialized() and c10d._get_default_group().bound_device_id is not None:
            # torch would then build this group's communicator by splitting the default one (ncclCommSplit
            # over the trainer's ranks), which the servers cannot join: it would hang.
            raise RuntimeError("the trainer's default process group is bound to a device (init_process_group("
                               "device_id=...)); create it without device_id to use weight_sync 'distributed'")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.group_name = group_name
        self._store = torch.distributed.TCPStore(master_address, master_port, world_size, is_master=True,
                                                 timeout=timeout, wait_for_workers=False)
        prefix_store = torch.distributed.PrefixStore(group_name, self._store)
        # The options keyword was renamed between torch releases (pg_options -> backend_options).
        options_key = "backend_options" if "backend_options" in inspect.signature(c10d._new_process_group_helper).parameters else "pg_options"
        self.group, _ = c10d._new_process_group_helper(
            world_size, 0, [], c10d.Backend(backend), prefix_store, group_name=group_name,
            timeout=timeout, **{options_key: None})
        # Registering ranks lets torch.distributed.broadcast(..., group=self.group) map src=0.
        c10d._world.pg_group_ranks[self.group] = {i: i for i in range(world_size)}

    def broadcast_bucket(self, bucket: NamedTensors) -> None:
        """One broadcast per tensor from rank 0, in bucket order (the server receives in the same order)."""
        for _, tensor in bucket:
            torch.distributed.broadcast(tensor.contiguous(), src=0, group=self.group)

    def destroy(self) -> None:
        torch.distributed.destroy_process_group(self.group)


# ----------------------------------------------------------------------------------------------------
# Disk checkpoints
# ----------------------------------------------------------------------------------------------------

class DiskCheckpointWriter:
    """Writes one sync as a HF-style folder: model-<k>.safetensors shards, model.safetensors.index.json
    and the config files of ``config_dir``; built under '<name>.tmp' and renamed when complete."""

    CONFIG_FILES = ("config.json", "generation_config.json")

    def __init__(self, root: Path, name: str, config_dir: Path | None):
        self.final_path = Path(root) / name
        self.tmp_path = Path(root) / f"{name}.tmp"
        self.config_dir = config_dir
        if self.tmp_path.exists():
            shutil.rmtree(self.tmp_path)  # left by a crashed sync; never half-used
        self.tmp_path.mkdir(parents=True)
        self.weight_map: dict[str, str] = {}
        self.total_bytes = 0
        self.shards = 0

    def add_bucket(self, bucket: NamedTensors) -> None:
        from safetensors.torch import save_file

        self.shards += 1
        shard = f"model-{self.shards:05d}.safetensors"
        tensors = {}
        for name, tensor in bucket:
            if name in self.weight_map:
                raise ValueError(f"tensor {name!r} written twice in one disk sync")
            self.weight_map[name] = shard
            tensors[name] = tensor.detach().to("cpu").contiguous()
            self.total_bytes += tensor_nbytes(tensor)
        save_file(tensors, str(self.tmp_path / shard), metadata={"format": "pt"})

    def finish(self) -> Path:
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.tmp_path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        if self.config_dir is not None:
            for fname in self.CONFIG_FILES:
                if (self.config_dir / fname).exists():
                    shutil.copy2(self.config_dir / fname, self.tmp_path / fname)
        if self.final_path.exists():
            shutil.rmtree(self.final_path)
        os.replace(self.tmp_path, self.final_path)
        return self.final_path


__all__ = ["DiskCheckpointWriter", "NamedTensors", "TrainerBroadcastGroup", "bucket_metadata",
           "bucket_named_tensors", "deserialize_named_tensors", "dtype_name", "init_group_body", "rank_offsets",
           "serialize_named_tensors", "tensor_nbytes", "update_from_disk_body", "update_from_distributed_body",
           "update_from_tensor_body"]
