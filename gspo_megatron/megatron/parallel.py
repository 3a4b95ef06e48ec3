"""Parallel layout and process-group initialisation (gloo on CPU; on GPU ``cpu:gloo,cuda:nccl``, see
``device.py`` for the rule)."""
from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

from gspo_megatron.megatron import cpu_runtime
from gspo_megatron.megatron.device import cuda_present, process_group_backend
from gspo_megatron.typed_config import ConfigError, check


# Transformer Engine's context-parallel attention algorithms (Megatron's TransformerConfig.cp_comm_type);
# "a2a+p2p" also needs Megatron's hierarchical CP groups, which initialize_model_parallel does not create
CP_COMM_TYPES = ("p2p", "all_gather", "a2a")

# Megatron's separate gloo process groups: one flag for initialize_model_parallel and get_megatron_optimizer
# (megatron-core 0.16.1: with the groups absent, an optimizer built with use_gloo_process_groups=True asks
# parallel_state.get_data_parallel_group_gloo(..., partial_data_parallel=True) and asserts "Intra partial
# data parallel group is not initialized"; Megatron-LM passes one enable_gloo_process_groups to both).
CREATE_GLOO_PROCESS_GROUPS = False


@dataclasses.dataclass
class ParallelConfig:
    """How the model is split over ``world_size`` processes.

    Data parallelism is what is left: ``dp = world_size / (tp * pp * cp)``. The MoE layers have a grid of
    their own over the same ranks (Megatron's expert folding): ``etp * ep * pp`` must divide
    ``world_size`` and expert data parallelism is what is left, ``world_size / (etp * ep * pp)``.
    ``expert_tensor_parallel`` (etp) splits each expert's weights; null keeps Megatron's default, the
    tensor-parallel size. With TP > 1, ``expert_tensor_parallel: 1`` keeps experts whole and lets EP
    reach across the TP ranks (TP4 x EP8 on 8 GPUs). Sequence parallelism is switched on with TP > 1
    (Megatron requires it for MoE under TP, and it saves activation memory for dense models too).

    Context parallelism splits every sequence over ``cp`` ranks (``megatron/context_parallel.py``).
    ``cp_comm_type`` is Transformer Engine's CP attention algorithm on GPUs: ``p2p`` (ring), ``all_gather``
    or ``a2a`` (Ulysses, heads split over CP); the CPU spec always all-gathers keys and values.
    """

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    expert_parallel: int = 1
    expert_tensor_parallel: int | None = None  # None: Megatron's default, tensor_parallel
    context_parallel: int = 1
    sequence_parallel: bool | None = None  # None: on exactly when tensor_parallel > 1
    distributed_optimizer: bool = False
    cp_comm_type: str = "p2p"

    def validate(self, path: str) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "expert_parallel", "context_parallel"):
            check(getattr(self, name) >= 1, f"{path}.{name}", f"must be >= 1, got {getattr(self, name)}")
        if self.expert_tensor_parallel is not None:
            check(self.expert_tensor_parallel >= 1, f"{path}.expert_tensor_parallel",
                  f"must be >= 1 (or null: tensor_parallel), got {self.expert_tensor_parallel}")
        check(self.cp_comm_type in CP_COMM_TYPES, f"{path}.cp_comm_type",
              f"must be one of {', '.join(CP_COMM_TYPES)}, got {self.cp_comm_type!r}")
        if self.sequence_parallel is False and self.tensor_parallel > 1:
            check(False, f"{path}.sequence_parallel", "must be on (or null) when tensor_parallel > 1")

    @property
    def use_sequence_parallel(self) -> bool:
        return self.tensor_parallel > 1 if self.sequence_parallel is None else self.sequence_parallel

    @property
    def expert_tensor_parallel_size(self) -> int:
        """The expert-TP size Megatron runs with (``expert_tensor_parallel``, null meaning TP)."""
        return self.tensor_parallel if self.expert_tensor_parallel is None else self.expert_tensor_parallel

    def data_parallel(self, world_size: int) -> int:
        """The dense data-parallel size at ``world_size``; raises naming the fields when either of Megatron's
        grids (dense TP x CP x PP, expert ETP x EP x PP; parallel_state.initialize_model_parallel in
        megatron-core 0.16.1) does not divide the world."""
        model_parallel = self.tensor_parallel * self.pipeline_parallel * self.context_parallel
        if world_size % model_parallel:
            raise ConfigError(f"parallel: world size {world_size} is not divisible by tensor_parallel x "
                             f"pipeline_parallel x context_parallel = {model_parallel}")
        self.expert_data_parallel(world_size)
        return world_size // model_parallel

    def expert_data_parallel(self, world_size: int) -> int:
        """The expert data-parallel size: what ``world_size`` leaves after ETP x EP x PP."""
        etp = self.expert_tensor_parallel_size
        expert_grid = etp * self.expert_parallel * self.pipeline_parallel
        if world_size % expert_grid:
            # the default (ETP = TP) is the surprise worth naming: TP4 x EP8 then needs 32 ranks
            null = "" if self.expert_tensor_parallel is not None or etp == 1 else \
                f"; expert_tensor_parallel is null, which means tensor_parallel={etp}: 1 keeps each expert whole"
            raise ConfigError(f"parallel.expert_tensor_parallel x expert_parallel x pipeline_parallel = {etp} x "
                             f"{self.expert_parallel} x {self.pipeline_parallel} = {expert_grid} must divide the world "
                             f"size {world_size} (Megatron's expert grid{null})")
        return world_size // expert_grid


def default_backend() -> str:
    # device branch: a CPU build of torch has no NCCL; either way host tensors go over gloo
    return process_group_backend(cuda_present())


def init_process_group(rank: int, world_size: int, master_addr: str = "127.0.0.1", master_port: int = 29500,
                       timeout_s: float = 600.0) -> None:
    """Initialise torch.distributed with env:// semantics: gloo on CPU; on GPU NCCL for device tensors and
    gloo for host tensors (``device.process_group_backend``), in every group Megatron derives from it."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", master_addr)
    os.environ.setdefault("MASTER_PORT", str(master_port))
    if cuda_present():  # device branch: NCCL binds each rank to its GPU before the group exists
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
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        # The same on both devices (docs/gpu.md, "One configuration"): no extra gloo copies of Megatron's
        # groups. On CPU the default groups are gloo already; on GPU host tensors take the default group's
        # gloo side (``cpu:gloo,cuda:nccl``). build_optimizer passes the matching use_gloo_process_groups.
        create_gloo_process_groups=CREATE_GLOO_PROCESS_GROUPS,
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
