"""One Megatron-Core configuration for both devices (docs/gpu.md, "One configuration for both devices").

The flags handed to initialize_model_parallel, get_megatron_optimizer, DDP and the distributed optimizer do
not depend on the device, so these CPU tests take the GPU's branches. What is pinned here:
- every device branch in the package asks ``device.cuda_present()`` and says why; a new one fails the list;
- the process groups a CUDA run creates (no extra gloo groups) build the plain and the distributed
  optimizer, and both step; megatron-core 0.16.1 asserts when the optimizer asks for gloo groups that
  were not created (the upstream fact behind issue 40, defect 1);
- the MoE token dispatcher is the GPU's (alltoall) on CPU as well.
"""
import re
from pathlib import Path

import pytest
import torch

from gspo_megatron.megatron.spawn import run_distributed
from gspo_megatron.testing.models import tiny_moe_config

PACKAGE = Path(__file__).resolve().parents[2] / "gspo_megatron"


def _package_sources():
    """The package's modules but ``testing/`` (test tooling: the GPU check reports what torch says)."""
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] != "testing"]

# Every remaining device branch, by file: each line says in its comment (or the line above) why CUDA itself
# is what differs there. Adding one means adding it here, with its reason in the code.
DEVICE_BRANCHES = {
    "megatron/device.py": 2,        # compute_device: where tensors are placed; the CUDA caching allocator
    "megatron/parallel.py": 2,      # NCCL exists only in CUDA builds; set_device before NCCL
    "megatron/model.py": 2,         # TE needs CUDA; CPU initialisation / jit fusion
    "megatron/optimizer.py": 1,     # pinned host buffers of the offloaded optimizer need CUDA
    "megatron/cpu_runtime.py": 1,   # the CPU stand-ins themselves
    "trainer/entry.py": 1,          # CPU intra-op threads
    "trainer/rollout_setup.py": 1,  # GPU-index placement rule for colocated servers
    "rollout/sglang/engine.py": 1,  # torch.cuda.ipc_collect after a tensor sync
}


def _branch_sites() -> dict[str, list[tuple[int, str]]]:
    sites: dict[str, list[tuple[int, str]]] = {}
    for path in _package_sources():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            code = line.split("#", 1)[0]
            if "cuda_present()" in code and not code.lstrip().startswith("def "):
                sites.setdefault(str(path.relative_to(PACKAGE)), []).append((i, line))
    return sites


def test_torch_cuda_is_available_is_asked_in_one_place():
    callers = [f"{p.relative_to(PACKAGE)}:{i + 1}" for p in _package_sources()
               for i, line in enumerate(p.read_text().splitlines())
               if "torch.cuda.is_available()" in line.split("#", 1)[0]]
    assert callers == ["megatron/device.py:" + str(next(
        i + 1 for i, line in enumerate((PACKAGE / "megatron/device.py").read_text().splitlines())
        if "return torch.cuda.is_available()" in line))], callers


def test_every_device_branch_is_listed_and_says_why():
    sites = _branch_sites()
    assert {f: len(s) for f, s in sites.items()} == DEVICE_BRANCHES
    for name, found in sites.items():
        lines = (PACKAGE / name).read_text().splitlines()
        for i, line in found:
            said = line + "\n" + lines[i - 1] + ("\n" + lines[i - 2] if i >= 2 else "")
            assert re.search(r"#\s*device branch:", said), f"{name}:{i + 1} has no '# device branch:' reason"


def _gpu_flags_build_both_optimizers(rank, world_size, model_config):
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    from gspo_megatron.algorithms.config import LossConfig
    from gspo_megatron.megatron.optimizer import OptimizerConfig
    from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel
    from gspo_megatron.megatron.policy_model import PolicyModel
    from tests.megatron.train_workers import make_sequences

    out = {}
    for distributed in (False, True):
        parallel = ParallelConfig(expert_parallel=2, distributed_optimizer=distributed)
        initialize_model_parallel(parallel, seed=0)
        # the groups a CUDA run has: Megatron's own, no gloo copies
        out["gloo_groups"] = [ps._DATA_PARALLEL_GROUP_GLOO, ps._DATA_PARALLEL_GROUP_WITH_CP_GLOO,
                              ps._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO]
        policy = PolicyModel(model_config, parallel, OptimizerConfig(lr=1e-2), LossConfig())
        seqs = make_sequences(model_config)
        for q, o in zip(seqs, policy.compute_logprobs(seqs)):
            q.old_logprobs = o["logprobs"] + 0.05
        before = [p.detach().clone() for p in policy.module.parameters()]
        step = policy.train_minibatch(seqs)
        out[f"distributed={distributed}"] = {
            "kind": type(policy.optimizer.chained_optimizers[0]).__name__, "update_skipped": step["update_skipped"],
            "changed": any(not torch.equal(p, b) for p, b in zip(policy.module.parameters(), before))}
        if distributed:
            # the control: megatron-core's default (gloo groups wanted) fails against these groups
            with pytest.raises(AssertionError, match="Intra partial data parallel group is not initialized"):
                get_megatron_optimizer(MegatronOptimizerConfig(optimizer="adam", lr=1e-2,
                                                               use_distributed_optimizer=True), [policy.ddp])
    return out


@pytest.mark.slow
def test_gpu_process_groups_build_and_step_the_plain_and_the_distributed_optimizer():
    for out in run_distributed(_gpu_flags_build_both_optimizers, 2, (tiny_moe_config(),)):
        assert out["gloo_groups"] == [None, None, None]
        assert out["distributed=False"]["kind"] == "FP32Optimizer"
        assert out["distributed=True"]["kind"] == "DistributedOptimizer"
        for key in ("distributed=False", "distributed=True"):
            assert out[key]["update_skipped"] == 0.0 and out[key]["changed"], key


def test_the_moe_dispatcher_is_the_gpus_on_cpu():
    from gspo_megatron.megatron.model import transformer_config
    from gspo_megatron.megatron.parallel import ParallelConfig

    assert transformer_config(tiny_moe_config(), ParallelConfig()).moe_token_dispatcher_type == "alltoall"


def _offloaded_optimizer(rank, world_size, model_config, precision, distributed):
    from gspo_megatron.megatron.model import ModelRuntime, build_model, wrap_ddp
    from gspo_megatron.megatron.optimizer import OptimizerConfig, build_optimizer
    from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel

    parallel = ParallelConfig(distributed_optimizer=distributed)
    initialize_model_parallel(parallel, seed=0)
    runtime = ModelRuntime(precision=precision)
    ddp = wrap_ddp(build_model(model_config, parallel, runtime=runtime), parallel)
    optimizer, _ = build_optimizer(OptimizerConfig(lr=1e-2, cpu_offload_fraction=0.75), ddp, distributed,
                                   precision=precision)
    inner = optimizer.chained_optimizers[0].optimizer
    return {"inner": type(inner).__name__, "fraction": inner.defaults["offload_fraction"]}


def test_the_offloaded_optimizer_builds_for_a_bf16_model_and_refuses_what_megatron_cannot_offload():
    """megatron-core's HybridDeviceOptimizer under the distributed optimizer (optimizer.cpu_offload_fraction).
    Its step copies gradients from CUDA parameters to their host copies (0.16.1 hybrid_optimizer.py ~101:
    every host parameter is assumed to be such a copy), so on CPU it builds but cannot step: stepping and
    resuming it is the GPU check's work (docs/gpu.md)."""
    out = run_distributed(_offloaded_optimizer, 1, (tiny_moe_config(), "bf16", True))[0]
    assert out == {"inner": "HybridDeviceOptimizer", "fraction": 0.75}
    with pytest.raises(Exception, match=r"optimizer.cpu_offload_fraction: needs model.precision bf16"):
        run_distributed(_offloaded_optimizer, 1, (tiny_moe_config(), "fp32", True))
    with pytest.raises(Exception, match=r"needs parallel.distributed_optimizer: true"):
        run_distributed(_offloaded_optimizer, 1, (tiny_moe_config(), "bf16", False))


@pytest.mark.parametrize("overrides, refusal", [
    (["optimizer.cpu_offload_fraction=0.5"], "needs parallel.distributed_optimizer: true"),
    (["optimizer.cpu_offload_fraction=0.5", "parallel.distributed_optimizer=true"], "needs model.precision bf16"),
    (["optimizer.cpu_offload_fraction=1.5"], r"must be in \[0, 1\]"),
])
def test_offload_settings_megatron_cannot_run_are_refused_at_start_up(overrides, refusal):
    from gspo_megatron.trainer.config import load_config
    from gspo_megatron.typed_config import ConfigError

    with pytest.raises(ConfigError, match=r"optimizer.cpu_offload_fraction.*" + refusal):
        load_config(str(PACKAGE.parent / "examples" / "cpu_demo.yaml"), overrides)
    load_config(str(PACKAGE.parent / "examples" / "cpu_demo.yaml"),
                ["optimizer.cpu_offload_fraction=0.5", "parallel.distributed_optimizer=true", "model.precision=bf16"])
