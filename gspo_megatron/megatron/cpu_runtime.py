"""Run megatron-core (0.16.1 or 0.19.2) on a CPU-only PyTorch build, over gloo.

Megatron-Core assumes CUDA in a handful of places. On a machine without CUDA, ``activate()`` applies the
smallest set of patches that lets the *real* parallel code (tensor, sequence, pipeline, expert and data
parallelism, DDP, the optimizer, dist_checkpointing) run on CPU tensors. Each patch below says what breaks
and why the substitute is faithful. On a GPU ``activate()`` does nothing, and the Transformer Engine spec
and fused kernels are used instead (see ``megatron/model.py``); the alltoall dispatcher runs on both.

``PATCHES_BY_VERSION`` lists, per megatron-core version the patches were checked against, which patches
that version needs; on any other version ``activate()`` refuses with a clear error naming the supported
versions rather than patching code it has not been checked against (docs/cpu-runtime.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import types
from typing import Any, Callable

import torch

from gspo_megatron.megatron.device import cuda_present

# Modules that build tensors with a literal ``device="cuda"`` (or call ``.cuda()``) on the code paths we
# use, with the reason each one is on the path.
_LITERAL_CUDA_MODULES = {
    # token counter in forward_backward_no_pipelining / pipelining schedules
    "megatron.core.pipeline_parallel.schedules": "total_num_tokens counter",
    # found_inf / overflow buffers of every MegatronOptimizer
    "megatron.core.optimizer.optimizer": "found_inf, _dummy_overflow_buf, _scale_one",
    # grad-norm and zero-count buffers
    "megatron.core.optimizer.clip_grads": "total_norm and overflow buffers",
    # loss scaler tensors (only with fp16/bf16 loss scaling)
    "megatron.core.optimizer.grad_scaler": "scale tensors",
    # default causal mask when no attention mask is passed
    "megatron.core.transformer.utils": "get_default_causal_mask",
    # MoE aux-loss / load-balancing tracker
    "megatron.core.transformer.moe.moe_utils": "aux loss tracker",
    # DDP warm-up tensor for the grad buffers
    "megatron.core.distributed.param_and_grad_buffer": "warm-up tensor",
    # rerun state machine validation counters
    "megatron.core.rerun_state_machine": "validation counters",
    # dist_checkpointing: result verification and shard exchange
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "reuse verification",
    "megatron.core.dist_checkpointing.exchange_utils": "shard exchange buffers",
    # broadcast_data of batches across TP ranks
    "megatron.core.tensor_parallel.data": "broadcast sizes buffer",
    # the torch fallback of multi_tensor_l2norm used for the gradient norm without apex/TE
    "megatron.core.utils": "local_multi_tensor_l2_norm result",
    # context parallelism: this CP rank's chunk indices of the rotary embedding (pinned host memory)
    "megatron.core.models.common.embeddings.rope_utils": "get_pos_emb_on_this_cp_rank chunk indices",
}

_FACTORY_FUNCTIONS = ("zeros", "ones", "empty", "full", "tensor", "arange", "empty_like", "zeros_like")

_state: dict[str, Any] = {"active": False}


def _to_cpu_device(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    if str(device).startswith("cuda"):
        return torch.device("cpu")
    return device


class _CpuTorch(types.ModuleType):
    """A view of the ``torch`` module whose tensor factories map ``device='cuda'`` to the CPU (and
    ``pin_memory=True`` to False).

    Installed as the module-global ``torch`` name of the modules in ``_LITERAL_CUDA_MODULES`` only, so
    no other code (and no hot path) pays for the redirection.
    """

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name in _FACTORY_FUNCTIONS:
            def factory(*args, __fn=attr, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _to_cpu_device(kwargs["device"])
                if kwargs.get("pin_memory"):  # pinning only speeds host-to-GPU copies; a CPU build has no pinned allocator
                    kwargs["pin_memory"] = False
                return __fn(*args, **kwargs)

            return factory
        return attr


class CpuRNGStatesTracker:
    """Megatron's named RNG-state tracker, holding CPU generator states instead of CUDA ones.

    Megatron forks named states (data-parallel, model-parallel, expert-parallel) around dropout and
    weight initialisation so that, e.g., TP ranks draw different dropout masks. The semantics are kept:
    ``fork(name)`` swaps the process's default CPU generator to the named state and back.
    Built as a subclass of Megatron's tracker in ``activate()`` so isinstance checks keep working.
    """

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} already tracked")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already tracked")
        self.seeds_.add(seed)
        generator = torch.Generator().manual_seed(seed)
        self.states_[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} is not tracked")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with Megatron's constructor, usable under sequence parallelism.

    Megatron's ``WrappedTorchNorm`` (used when neither apex nor Transformer Engine is installed) refuses
    ``sequence_parallel=True``, yet MoE with TP > 1 requires sequence parallelism. Under SP each TP rank
    normalises a different slice of the sequence with a replicated weight, so the weight's gradient must
    be summed over the TP group: marking it ``sequence_parallel`` makes ``finalize_model_grads`` do exactly
    that (the same contract the TE and apex norms follow).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        if config.normalization != "RMSNorm":
            raise ValueError(f"SequenceParallelRMSNorm needs normalization='RMSNorm', got {config.normalization!r}")
        # in the parameter dtype, as TE's and apex's norms are: bf16 models keep one dtype for every
        # parameter (Megatron's mixed-precision optimizer and its checkpoints expect that)
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


def _patch_current_device() -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")


def _patch_synchronize() -> None:
    torch.cuda.synchronize = lambda device=None: None


def _patch_tensor_cuda() -> None:
    torch.Tensor.cuda = lambda self, *args, **kwargs: self


def _patch_literal_cuda_factories() -> None:
    proxy = _CpuTorch()
    for module_name in _LITERAL_CUDA_MODULES:
        module = importlib.import_module(module_name)
        if module.__dict__.get("torch") is not torch:
            raise RuntimeError(f"{module_name} no longer imports torch as a module global; recheck the CPU runtime")
        module.torch = proxy


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mc_random

    tracker_cls = type("CpuRNGStatesTracker", (CpuRNGStatesTracker, mc_random.CudaRNGStatesTracker), {})
    mc_random.CudaRNGStatesTracker = tracker_cls
    mc_random.initialize_rng_tracker(force_reset=True)


def _patch_te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if "te_general_gemm" not in moe_utils.__dict__:
        moe_utils.te_general_gemm = None


_CPU_TO_CUDA_TYPE = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _patch_tensor_type() -> None:
    for module_name in ("megatron.core.optimizer.optimizer", "megatron.core.optimizer.distrib_optimizer"):
        importlib.import_module(module_name)
    original_type = torch.Tensor.type

    def tensor_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None:
            name = original_type(self)
            return _CPU_TO_CUDA_TYPE.get(name, name)
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = tensor_type


class _HostStream:
    """The one CPU "stream": CPU work runs in program order, so waits, events and stream switches are
    no-ops. ``torch.cuda.Stream`` becomes this class, and every instance is the same object, which is also
    ``torch.cuda.current_stream()``: code that compares them (the alltoall dispatcher's ``on_side_stream``)
    sees no side stream and never calls ``record_stream``, which CPU tensors lack. A class, not a function,
    so annotations such as transformers' ``torch.cuda.Stream | None`` still evaluate."""

    _one: "_HostStream | None" = None

    def __new__(cls, *args, **kwargs):
        if cls._one is None:
            cls._one = super().__new__(cls)
        return cls._one

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> "_HostStream":
        return self  # an event that has always completed

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


def _patch_cuda_streams() -> None:
    torch.cuda.Stream = _HostStream
    torch.cuda.current_stream = lambda device=None: _HostStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()


def _host_split_sizes(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron-core's ``maybe_move_tensor_to_cpu`` as a GPU run sees it: the result is on the host, and a
    NumPy array when ``as_numpy`` (the all-to-all split sizes). The original converts only CUDA tensors,
    so on CPU the split sizes stayed tensors, which ``all_to_all_single`` refuses."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def _patch_uneven_all_gather() -> None:
    original = torch.distributed.all_gather

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        """``torch.distributed.all_gather``; tensors of different lengths along dim 0 (which NCCL gathers
        and gloo refuses) are padded to the longest, gathered, and cut back."""
        if len({t.shape for t in tensor_list}) <= 1:
            return original(tensor_list, tensor, group=group, async_op=async_op)
        if async_op:
            raise NotImplementedError("CPU runtime: an uneven all_gather runs synchronously only")
        longest = max(t.shape[0] for t in tensor_list)
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        gathered = [torch.empty_like(padded) for _ in tensor_list]
        original(gathered, padded, group=group)
        for out, got in zip(tensor_list, gathered):
            out.copy_(got[: out.shape[0]])
        return None

    torch.distributed.all_gather = all_gather


def _patch_alltoall_split_sizes() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    if token_dispatcher.__dict__.get("maybe_move_tensor_to_cpu") is None:
        raise RuntimeError("megatron.core.transformer.moe.token_dispatcher no longer imports "
                           "maybe_move_tensor_to_cpu; recheck the CPU runtime")
    token_dispatcher.maybe_move_tensor_to_cpu = _host_split_sizes


def _patch_cuda_rng_state() -> None:
    from megatron.core.tensor_parallel import random as mc_random

    mc_random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    mc_random._set_cuda_rng_state = lambda *args, **kwargs: None


@dataclasses.dataclass(frozen=True)
class Patch:
    """One CPU substitute: what breaks without it (``why``) and the function that applies it."""

    why: str
    apply: Callable[[], None]


PATCHES: dict[str, Patch] = {
    "current_device": Patch(
        "torch.cuda.current_device() is used as a device argument (RoPE inv_freq, p2p shape buffers, DDP grad "
        "buffers); a CPU build raises 'Torch not compiled with CUDA enabled' (a CUDA build without a driver: "
        "'Found no NVIDIA driver'). It returns the CPU device; nothing can depend on the original, which "
        "always raises here.", _patch_current_device),
    "synchronize": Patch(
        "torch.cuda.synchronize() orders timing and communication; CPU work is already synchronous.",
        _patch_synchronize),
    "tensor_cuda": Patch(
        "Tensor.cuda() moves optimizer state, checkpoint shards and tied embeddings 'to the GPU'; on CPU the "
        "tensor already is where it must be, so it returns itself.", _patch_tensor_cuda),
    "literal_cuda_factories": Patch(
        "tensor factories with a literal device='cuda' (or pin_memory=True, which needs a CUDA allocator) in the "
        "modules of _LITERAL_CUDA_MODULES; those modules see a torch whose factories map 'cuda' to the CPU and "
        "do not pin (no other code pays for it).",
        _patch_literal_cuda_factories),
    "rng_tracker": Patch(
        "the named RNG-state tracker stores CUDA generator states; CpuRNGStatesTracker forks the CPU "
        "generator with the same semantics (a subclass, so isinstance checks hold).", _patch_rng_tracker),
    "te_general_gemm": Patch(
        "0.16.1's moe_utils refers to te_general_gemm, defined only when Transformer Engine imports "
        "(NameError in router_gating_linear); its own code falls back to torch when the name is None. "
        "0.19.2 defines it as None itself.", _patch_te_general_gemm),
    "tensor_type": Patch(
        "the optimizers pick fp32 params for main copies by param.type() == 'torch.cuda.FloatTensor'; CPU "
        "floats report the CUDA names so the same branches are taken (the dtype is what decides).",
        _patch_tensor_type),
    "cuda_rng_state": Patch(
        "activation recomputation (CheckpointFunction, _fork_rng) saves and restores the CUDA generator next to "
        "the CPU one and the tracker's; a CPU build has no CUDA generator. An empty state is exact: on CPU the "
        "CPU generator and the CPU tracker, which those functions save anyway, are all the randomness there "
        "is.", _patch_cuda_rng_state),
    "cuda_streams": Patch(
        "the alltoall token dispatcher (the one a GPU run uses: megatron/model.py) creates a torch.cuda.Stream "
        "for its device-to-host copies of the split sizes, switches to it and synchronises on its event "
        "(0.16.1 token_dispatcher.py ~445, ~870-900). One host stream whose waits and events are no-ops is "
        "exact (CPU work is synchronous), and it is also torch.cuda.current_stream(), so the dispatcher sees "
        "no side stream. 0.19.2's _ParamAndGradBucketGroup.start_grad_sync also waits on "
        "torch.cuda.current_stream() (CUDA-graph events) before reducing grads.", _patch_cuda_streams),
    "alltoall_split_sizes": Patch(
        "the alltoall dispatcher moves its split sizes to the host as NumPy arrays through "
        "maybe_move_tensor_to_cpu, which converts CUDA tensors only; on CPU they stayed tensors and "
        "all_to_all_single refused them. The substitute converts host tensors the same way.",
        _patch_alltoall_split_sizes),
    "uneven_all_gather": Patch(
        "with expert tensor parallelism the alltoall dispatcher all-gathers each TP rank's tokens, a different "
        "count per rank (tensor_parallel.mappings._gather_along_first_dim with output_split_sizes). NCCL "
        "gathers tensors of different lengths; gloo refuses them ('invalid tensor size'). The substitute pads "
        "to the longest, gathers and cuts back: the same values.", _patch_uneven_all_gather),
}

_COMMON = ("current_device", "synchronize", "tensor_cuda", "literal_cuda_factories", "rng_tracker", "tensor_type",
           "cuda_rng_state")
# Versions the patches were checked against (the test suite ran on each), and the patches each needs.
PATCHES_BY_VERSION: dict[str, tuple[str, ...]] = {
    "0.16.1": _COMMON + ("te_general_gemm", "cuda_streams", "alltoall_split_sizes", "uneven_all_gather"),
    "0.19.2": _COMMON + ("cuda_streams", "alltoall_split_sizes", "uneven_all_gather"),
}


def megatron_core_version() -> str:
    """The installed megatron-core release, without the ``+<git hash>`` that 0.19's package_info appends
    when it finds itself inside a git work tree."""
    from megatron.core import package_info

    return package_info.__version__.split("+")[0]


def _check_version() -> str:
    version = megatron_core_version()
    if version not in PATCHES_BY_VERSION:
        supported = ", ".join(PATCHES_BY_VERSION)
        raise RuntimeError(
            f"gspo_megatron's CPU runtime was checked against megatron-core {supported}, found {version}. "
            f"Install one of those (pip install megatron-core=={list(PATCHES_BY_VERSION)[-1]} on Python 3.12, "
            "megatron-core==0.16.1 on 3.11) to run on CPU; on a GPU machine the runtime is not needed."
        )
    return version


def cuda_available() -> bool:
    # device branch: this module exists to stand in for CUDA where it is absent
    return cuda_present()


def _quiet_cuda_only_advice() -> None:
    """Megatron's tensor-parallel linear warns that CUDA_DEVICE_MAX_CONNECTIONS should be 1 when it is unset
    (0.16.1 tensor_parallel/layers.py ``linear_with_grad_accumulation_and_async_allreduce``): the number of CUDA
    hardware queues, which orders TP communication with compute on a GPU. A CPU run has none, so the advice is
    noise here; on a GPU (where this is never called) it stays, and the sbatch examples set the variable."""
    import warnings

    warnings.filterwarnings("ignore", message=r".*CUDA_DEVICE_MAX_CONNECTIONS.*", category=UserWarning)


def activate() -> bool:
    """Apply the CPU patches of the installed version once per process when CUDA is absent.

    Returns True if they are active.
    """
    if cuda_available():
        return False
    _quiet_cuda_only_advice()
    if _state["active"]:
        return True
    version = _check_version()
    for name in PATCHES_BY_VERSION[version]:
        PATCHES[name].apply()
    _state["active"] = True
    _state["patches"] = PATCHES_BY_VERSION[version]
    return True


def is_active() -> bool:
    return _state["active"]


def local_norm_class() -> type:
    """The norm module to use in the local (non-TE) layer spec on CPU."""
    return SequenceParallelRMSNorm


def context_parallel_attention_class() -> type:
    """The core attention of the local (non-TE) layer spec under context parallelism > 1: Megatron's local
    attention asserts CP 1, so the CPU runtime swaps in the all-gather attention (``megatron/cp_attention.py``)."""
    from gspo_megatron.megatron.cp_attention import ContextParallelSDPAttention

    return ContextParallelSDPAttention
