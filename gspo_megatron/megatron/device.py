"""Where tensors live: the one rule for device placement and for collectives.

Placement. Sequences, rollout results and everything the trainer keeps between steps live on the host.
A micro-batch moves to ``compute_device()`` right before its forward (``to_device``), one at a time, so
device memory holds one micro-batch of inputs, never the whole mini-batch. Results a forward produces
(log-probs, recorded routing) come back to the host (``to_host``) before they are stored or shared.

Collectives. On a GPU the default process group is ``cpu:gloo,cuda:nccl`` (``process_group_backend``):
a collective runs on the backend of its tensor's device, so host scalars (failure and preemption flags,
counts, sums) travel over gloo and device tensors (gradients, logits, routing gathers) over NCCL. Groups
that Megatron creates without a backend inherit this string (torch 2.13 ``distributed_c10d.py``
``_new_group_with_tag``: "Default to the same backend as the global process group"), and object
collectives (``broadcast_object_list``, ``all_gather_object``) pick the CPU backend when one is present
(``_get_object_coll_device``). So no collective needs its tensor moved to the device first, and a host
tensor never meets NCCL, whose ``backend_capability`` is ``["cuda"]`` only.
"""
from __future__ import annotations

from typing import Any

import torch

HOST = torch.device("cpu")


def cuda_present() -> bool:
    """Whether this process has a CUDA device: the one question every device branch in the package asks.

    The rule (docs/gpu.md, "One configuration for both devices"): what Megatron-Core is configured with
    (process groups, optimizer, DDP, distributed optimizer, checkpoint format) never depends on the answer,
    so the CPU tests take the GPU's branches. A caller branches only where CUDA itself is what differs (a
    device to place tensors on, NCCL, a kernel that needs CUDA streams), and its comment says which;
    ``tests/megatron/test_device_rule.py`` holds the list and fails on a new branch."""
    return torch.cuda.is_available()


def compute_device() -> torch.device:
    """The device forwards, losses and device-side collectives run on: the current CUDA device (set from
    LOCAL_RANK by ``parallel.init_process_group``), else the CPU."""
    if cuda_present():  # device branch: placement is what differs
        return torch.device("cuda", torch.cuda.current_device())
    return HOST


def process_group_backend(cuda: bool) -> str:
    """The default group's backend string (see the module doc): host tensors over gloo everywhere."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def _move(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=device.type == "cuda")
    if isinstance(value, dict):
        return {k: _move(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_move(v, device) for v in value)
    return value


def to_device(batch: dict) -> dict:
    """``batch`` (a micro-batch: tensors, and lists of indices) with every tensor on ``compute_device()``.

    Host tensors are copied without blocking on CUDA (the forward waits on the same stream)."""
    return _move(batch, compute_device())


def to_host(value: Any) -> Any:
    """``value`` with every tensor (nested in dicts, lists, tuples) on the host: what is stored between
    steps or pickled for an object collective (a pickled CUDA tensor is rebuilt on the *sender's* device
    index on every receiver)."""
    return _move(value, HOST)


def release_cached_memory() -> None:
    """Give the blocks torch's CUDA caching allocator keeps free back to the driver (``torch.cuda.empty_cache``).

    Colocated SGLang servers take their memory back (``resume_memory``) by re-mapping pages through
    torch_memory_saver, which needs them free on the device, and the allocator otherwise keeps the update's
    activation peak and the sync's freed buckets reserved for this process. The trainer calls this after the
    update and after the weight sync, before each resume."""
    # device branch: the CPU allocator keeps no cache of its own (freed host memory goes back to malloc at
    # once), so there is nothing to give back; the callers take the same path on both.
    if cuda_present():
        torch.cuda.empty_cache()
