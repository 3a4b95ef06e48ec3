"""The optimizer of the policy: its config (Adam with decoupled weight decay, gradient clipping, a
warm-up + decay LR schedule) and its construction through Megatron-Core's ``get_megatron_optimizer`` and
``OptimizerParamScheduler``."""
from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.distributed as dist

from gspo_megatron.megatron.device import cuda_present
from gspo_megatron.typed_config import ConfigError, check


HOST_DEVICE = torch.device("cpu")
PARAMS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass
class OptimizerConfig:
    """Adam with decoupled weight decay, gradient-norm clipping and a warm-up + decay LR schedule."""

    lr: float = 1e-6
    min_lr: float = 0.0
    warmup_steps: int = 0
    decay_steps: int = 0  # 0: constant after warm-up
    decay_style: str = "constant"  # constant | linear | cosine
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    # fraction of the fp32 main weights and both Adam moments kept and stepped on the host (megatron-core's
    # optimizer_cpu_offload / optimizer_offload_fraction); needs parallel.distributed_optimizer
    cpu_offload_fraction: float = 0.0

    def validate(self, path: str) -> None:
        check(self.lr > 0, f"{path}.lr", f"must be > 0, got {self.lr}")
        check(0 <= self.min_lr <= self.lr, f"{path}.min_lr", f"must be in [0, lr], got {self.min_lr}")
        check(self.warmup_steps >= 0, f"{path}.warmup_steps", "must be >= 0")
        check(self.decay_steps >= 0, f"{path}.decay_steps", "must be >= 0")
        check(self.decay_style in ("constant", "linear", "cosine"), f"{path}.decay_style",
              f"must be constant, linear or cosine, got {self.decay_style!r}")
        check(self.clip_grad >= 0, f"{path}.clip_grad", "must be >= 0 (0 disables clipping)")
        check(self.weight_decay >= 0, f"{path}.weight_decay", f"must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            check(0 <= getattr(self, name) < 1, f"{path}.{name}", f"must be in [0, 1), got {getattr(self, name)}")
        check(self.adam_eps > 0, f"{path}.adam_eps", f"must be > 0, got {self.adam_eps}")
        check(0.0 <= self.cpu_offload_fraction <= 1.0, f"{path}.cpu_offload_fraction",
              f"must be in [0, 1], got {self.cpu_offload_fraction}")


def offload_refusal(fraction: float, distributed_optimizer: bool, precision: str) -> str | None:
    """Why ``optimizer.cpu_offload_fraction`` cannot be ``fraction`` with these settings, or None."""
    if fraction == 0:
        return None
    if not distributed_optimizer:
        return "needs parallel.distributed_optimizer: true (megatron-core offloads the distributed optimizer's shards)"
    if precision == "fp32":
        # megatron-core 0.16.1: the distributed optimizer's fp32 shards are views of the parameters, which
        # HybridDeviceOptimizer's torch.optim constructor refuses ("can't optimize a non-leaf Tensor");
        # with bf16 / fp16 parameters it offloads the fp32 main copies, which is where the memory is
        return ("needs model.precision bf16 or fp16 (the offloaded state is the fp32 main weights and Adam "
                "moments of a mixed-precision model)")
    return None


def build_optimizer(optim: OptimizerConfig, ddp, distributed_optimizer: bool, precision: str = "fp32"):
    """Megatron's optimizer over the DDP-wrapped model ``ddp`` and its LR schedule: (optimizer, scheduler).

    ``precision`` bf16 / fp16 (the model's parameter dtype, ``model.ModelRuntime``): Megatron's
    mixed-precision optimizer (Float16OptimizerWithFloat16Params, or the distributed optimizer) keeps fp32
    main weights and steps them from the fp32 gradient buffers; fp16 adds dynamic loss scaling, installed as
    the model config's ``grad_scale_func`` so the schedule scales every micro-batch loss."""
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from gspo_megatron.megatron.parallel import CREATE_GLOO_PROCESS_GROUPS

    refusal = offload_refusal(optim.cpu_offload_fraction, distributed_optimizer, precision)
    if refusal is not None:
        raise ConfigError(f"optimizer.cpu_offload_fraction: {refusal}")
    offload = optim.cpu_offload_fraction > 0
    optimizer = get_megatron_optimizer(
        MegatronOptimizerConfig(optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
                                adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
                                clip_grad=optim.clip_grad, params_dtype=PARAMS_DTYPES[precision],
                                bf16=precision == "bf16", fp16=precision == "fp16",
                                use_distributed_optimizer=distributed_optimizer,
                                optimizer_cpu_offload=offload, optimizer_offload_fraction=optim.cpu_offload_fraction,
                                # device branch: pinned host buffers need CUDA; CPU tensors are host memory already
                                pin_cpu_grads=offload and cuda_present(), pin_cpu_params=offload and cuda_present()),
        [ddp], use_gloo_process_groups=CREATE_GLOO_PROCESS_GROUPS)
    if precision == "fp16":
        ddp.config.grad_scale_func = optimizer.scale_loss
    decay_steps = max(optim.decay_steps, optim.warmup_steps + 1)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if optim.warmup_steps else optim.lr, max_lr=optim.lr, min_lr=optim.min_lr,
        lr_warmup_steps=optim.warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style=optim.decay_style if optim.decay_steps else "constant",
        start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant",
        # a resume with changed optimizer.* settings applies them (trainer/resume.py): the schedule's
        # values come from the config, only its step count from the checkpoint
        override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False)
    for inner in _torch_adams(optimizer):
        # Without apex/TE Megatron steps with torch.optim.AdamW, a per-tensor loop by default; its fused
        # kernel (CPU and CUDA) computes the same update in one pass. Decided by the optimizer Megatron
        # built, not by the device (with TE/apex the inner optimizer is their fused Adam already).
        for group in inner.param_groups:
            group["fused"] = True
    for chained in _distributed_with_torch_adam(optimizer):
        _keep_step_when_loading(chained)
    return optimizer, scheduler


def chained_parts(optimizer) -> list:
    """The optimizers a (possibly) ChainedOptimizer holds: one per parameter kind (dense, expert)."""
    from megatron.core.optimizer import ChainedOptimizer

    return optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]


def _torch_adams(optimizer) -> list[torch.optim.Optimizer]:
    """The inner torch Adam/AdamW optimizers under Megatron's wrappers (none with TE/apex fused Adam or
    the CPU-offloading HybridDeviceOptimizer)."""
    inner = [chained.optimizer for chained in chained_parts(optimizer)]  # None for a stub (no parameters)
    return [o for o in inner if isinstance(o, (torch.optim.Adam, torch.optim.AdamW))]


def _distributed_with_torch_adam(optimizer) -> list:
    """The DistributedOptimizers that step with a torch Adam/AdamW (megatron-core's no-apex/TE branch)."""
    from megatron.core.optimizer import DistributedOptimizer

    return [chained for chained in chained_parts(optimizer) if isinstance(chained, DistributedOptimizer)
            and isinstance(chained.optimizer, (torch.optim.Adam, torch.optim.AdamW))]


def _distributed_torch_adams(optimizer) -> list[torch.optim.Optimizer]:
    return [chained.optimizer for chained in _distributed_with_torch_adam(optimizer)]


def _keep_step_when_loading(distributed) -> None:
    """Let ``distributed`` (a DistributedOptimizer over torch Adam) load its parameter state.

    Why: megatron-core 0.16.1 loads every sharding type through ``_set_main_param_and_optimizer_states``,
    which copies each key of the live Adam state from the loaded tensors; the loaders leave torch's ``step``
    out of those tensors (it comes from the common state, ``load_state_dict`` ~825) while the live state
    has it, so the copy raises ``KeyError: 'step'`` (``distrib_optimizer.py`` ~940). The step keeps the
    value ``load_state_dict`` just gave it: it is copied onto itself."""
    original = distributed._set_main_param_and_optimizer_states

    def set_states(model_param, tensors):
        live = distributed._get_main_param_and_optimizer_states(model_param)
        if "step" in live and "step" not in tensors:
            tensors = {**tensors, "step": live["step"]}
        original(model_param, tensors)

    distributed._set_main_param_and_optimizer_states = set_states


def allocate_adam_state(optimizer) -> None:
    """Give the distributed optimizer's inner torch Adam its per-parameter state before a checkpoint is
    saved or loaded, as torch would allocate it at the first step (step 0, zero moments: the next update
    is the same as from no state).

    Why: megatron-core 0.16.1 ``DistributedOptimizer.state_dict`` without apex/TE reads the step count from
    the inner optimizer's state and asserts it is a single value (``distrib_optimizer.py`` ~640). A freshly
    built optimizer has no state, so the template a resume loads into cannot be made (issue 40, defect 0);
    ``load_state_dict`` then keeps this state and overwrites it in place."""
    for inner in _distributed_torch_adams(optimizer):
        for group in inner.param_groups:
            # torch.optim.AdamW._init_group (torch 2.13): a 0-d float32 step, on the parameter's device
            # for the fused / capturable kernels, on the host otherwise
            on_param = group["fused"] or group["capturable"]
            for p in group["params"]:
                if inner.state[p]:
                    continue
                inner.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32, device=p.device if on_param else HOST_DEVICE),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
                if group["amsgrad"]:
                    inner.state[p]["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def separate_adam_steps(optimizer) -> None:
    """After a checkpoint load, give each parameter its own step tensor.

    Why: megatron-core 0.16.1 ``DistributedOptimizer.load_state_dict`` without apex/TE assigns one step
    tensor to every parameter's state (``s["step"] = step``, ``distrib_optimizer.py`` ~825), and torch's
    ``load_state_dict`` keeps it shared. AdamW increments each parameter's step in place, so a shared
    tensor advances once per parameter per update and the bias correction of a resumed run is wrong."""
    for inner in _distributed_torch_adams(optimizer):
        for state in inner.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()


# megatron-core releases whose ChainedOptimizer.step ``clip_and_step`` follows line for line (0.19 adds
# per-group clipping, grad_norm_groups, and keeps its own step).
STEP_MIRRORED_IN = ("0.16.1",)


@functools.cache  # the installed release and Megatron's clipping backend are fixed at import
def _fast_step_applies() -> bool:
    """True on a megatron-core release of ``STEP_MIRRORED_IN`` whose gradient clipping runs its local (no
    apex / TE) multi-tensor fallback, the CPU case: one small op and a host round trip per parameter,
    which ``clip_and_step`` does in bulk."""
    from gspo_megatron.megatron.cpu_runtime import megatron_core_version

    if megatron_core_version() not in STEP_MIRRORED_IN:
        return False
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    return clip_grads.l2_norm_impl is local_multi_tensor_l2_norm


def _l2_norm(grads: list[torch.Tensor], group) -> float:
    """Megatron's ``get_grad_norm_fp32`` (norm type 2) with its local l2-norm fallback, the same float:
    per-tensor norms, the norm of those, squared in fp32, summed over ``group``, square root in Python.
    The per-tensor norms come from one foreach call, and a group of one rank needs no all-reduce."""
    l2 = torch.norm(torch.stack(torch._foreach_norm(grads))) if grads else torch.zeros(())
    total = torch.tensor([float(l2)], dtype=torch.float) ** 2.0
    if dist.get_world_size(group) > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total.item() ** 0.5


def grad_norm(optimizer) -> float:
    """What Megatron's ``ChainedOptimizer.get_grad_norm`` returns (one norm over all chained optimizers'
    gradients), computed with ``_l2_norm``."""
    chained = optimizer.chained_optimizers
    if len(chained) == 1 or optimizer.grads_states_parallel_group_is_shared():
        grads = [g for o in chained for g in o.get_main_grads_for_grad_norm()]
        return _l2_norm(grads, chained[0].get_grad_stats_parallel_group())
    norms = [_l2_norm(o.get_main_grads_for_grad_norm(), o.get_grad_stats_parallel_group()) for o in chained]
    return math.sqrt(sum((n if n else 0.0) ** 2 for n in norms))


def clip_and_step(optimizer) -> tuple[bool, float | None]:
    """Megatron's ``ChainedOptimizer.step`` (prepare the gradients, their norm, clip to ``clip_grad``,
    step), the same arithmetic; returns (update done, grad norm or None when the mixed-precision
    optimizer found inf/NaN). Where Megatron clips with its local fallback (CPU, ``_fast_step_applies``)
    the norm and the scaling run as foreach ops (``grad_norm``; ``g *= coeff`` is the fallback's
    ``g.copy_(g * coeff)``), which removes most of the per-step overhead of the demo's small model;
    elsewhere this is Megatron's step."""
    from megatron.core.optimizer import ChainedOptimizer

    if not (isinstance(optimizer, ChainedOptimizer) and _fast_step_applies()) or optimizer.config.log_num_zeros_in_grad:
        ok, norm, _ = optimizer.step()
        return ok, norm
    if optimizer.prepare_grads():
        return False, None
    norm = grad_norm(optimizer)
    for chained in optimizer.chained_optimizers:
        if getattr(chained, "is_stub_optimizer", False) or chained.config.clip_grad <= 0.0:  # as Megatron reads it
            continue
        if chained.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            raise ValueError("clip_and_step: the precision-aware optimizer (decoupled grads) is not supported")
        coeff = chained.config.clip_grad / (norm + 1.0e-6)
        grads = [p.grad for p in chained.get_parameters() if p.grad is not None]
        if coeff < 1.0 and grads:
            torch._foreach_mul_(grads, coeff)
    return optimizer.step_with_ready_grads(), norm


def warm_start_config(optim: OptimizerConfig, lr: float) -> OptimizerConfig:
    """``optim`` at a constant rate ``lr`` (the supervised warm start's own schedule)."""
    return dataclasses.replace(optim, lr=lr, min_lr=0.0, warmup_steps=0, decay_steps=0)
