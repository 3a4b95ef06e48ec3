"""Parallel layout and process-group initialisation (gloo on CPU; on GPU ``cpu:gloo,cuda:nccl``, see
``device.py`` for the rule)."""
from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

from gspo_megatron.megatron import cpu_runtime
from gspo_megatron.megatron.device import process_group_backend
from gspo_megatron.typed_config import ConfigError, check


# Transformer Engine's context-parallel attention algorithms (Megatron's TransformerConfig.cp_comm_type);
# "a2a+p2p" also needs Megatron's hierarchical CP groups, which initialize_model_parallel does not create
CP_COMM_TYPES = ("p2p", "all_gather", "a2a")


@dataclasses.dataclass
class ParallelConfig:
    """How the model is split over ``world_size`` processes.

    Data parallelism is what is left: ``dp = world_size / (tp * pp * cp)``. Expert parallelism splits
    the experts over ranks of the data x context parallel group (Megatron's "expert data" folding), so
    ``ep`` must divide ``dp * cp``. Sequence parallelism is switched on with TP > 1 (Megatron requires it
    for MoE under TP, and it saves activation memory for dense models too).

    Context parallelism splits every sequence over ``cp`` ranks (``megatron/context_parallel.py``).
    ``cp_comm_type`` is Transformer Engine's CP attention algorithm on GPUs: ``p2p`` (ring), ``all_gather``
    or ``a2a`` (Ulysses, heads split over CP); the CPU spec always all-gathers keys and values.
    """

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1
    context_parallel: int = 1
    sequence_parallel: bool | None = None  # None: on exactly when tensor_parallel > 1
    distributed_optimizer: bool = False
    cp_comm_type: str = "p2p"

    def validate(self, path: str) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "expert_parallel", "context_parallel"):
            check(getattr(self, name) >= 1, f"{path}.{name}", f"must be >= 1, got {getattr(self, name)}")
        check(self.cp_comm_type in CP_COMM_TYPES, f"{path}.cp_comm_type",
              f"must be one of {', '.join(CP_COMM_TYPES)}, got {self.cp_comm_type!r}")
        if self.sequence_parallel is False and self.tensor_parallel > 1:
            check(False, f"{path}.sequence_parallel", "must be on (or null) when tensor_parallel > 1")

    @property
    def use_sequence_parallel(self) -> bool:
        return self.tensor_parallel > 1 if self.sequence_parallel is None else self.sequence_parallel

    def data_parallel(self, world_size: int) -> int:
        model_parallel = self.tensor_parallel * self.pipeline_parallel * self.context_parallel
        if world_size % model_parallel:
            raise ConfigError(f"parallel: world size {world_size} is not divisible by tensor_parallel x "
                             f"pipeline_parallel x context_parallel = {model_parallel}")
        dp = world_size // model_parallel
        if (dp * self.context_parallel) % self.expert_parallel:
            raise ConfigError(f"parallel.expert_parallel={self.expert_parallel} must divide data_parallel x "
                             f"context_parallel = {dp * self.context_parallel} at world size {world_size}")
        return dp


def default_backend() -> str:
    return process_group_backend(torch.cuda.is_available())


def init_process_group(rank: int, world_size: int, master_addr: str = "127.0.0.1", master_port: int = 29500,
                       timeout_s: float = 600.0) -> None:
    """Initialise torch.distributed with env:// semantics: gloo on CPU; on GPU NCCL for device tensors and
    gloo for host tensors (``device.process_group_backend``), in every group Megatron derives from it."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", master_addr)
    os.environ.setdefault("MASTER_PORT", str(master_port))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    dist.init_process_group(backend=default_backend(), rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def initialize_model_parallel(parallel: ParallelConfig, seed: int = 1234) -> None:
    """Create Megatron's process groups for ``parallel`` and seed its RNG tracker.

    Requires torch.distributed to be initialised (a single process uses world size 1).
    """
    from megatron.core import parallel_state, tensor_parallel

    cpu_runtime.activate()
    world = dist.get_world_size()
    parallel.data_parallel(world)  # raises with the field name when the layout does not divide the world
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        context_parallel_size=parallel.context_parallel,
        expert_model_parallel_size=parallel.expert_parallel,
        create_gloo_process_groups=not torch.cuda.is_available(),
    )
    # Megatron seeds the default stream through torch.cuda.manual_seed, a silent no-op on a CPU build;
    # the CPU generator drives initialisation there, so seed it too (same seed on every rank, as Megatron's
    # data-parallel stream is).
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def destroy() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
