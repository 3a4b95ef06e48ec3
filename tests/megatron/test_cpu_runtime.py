"""The CPU runtime: each patch does what its comment says, refuses unknown versions, stays off on GPU."""
import subprocess
import sys
import textwrap

import pytest
import torch


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_refuses_unknown_megatron_version():
    proc = run_python("""
        from megatron.core import package_info
        package_info.__version__ = "0.99.0"
        from gspo_megatron.megatron import cpu_runtime
        cpu_runtime.activate()
    """)
    assert proc.returncode != 0
    assert "checked against megatron-core 0.16.1, 0.19.2, found 0.99.0" in proc.stderr


def test_version_suffix_from_git_is_ignored():
    # 0.19's package_info appends "+<git hash>" when installed inside a git work tree (a venv in a clone)
    proc = run_python("""
        from megatron.core import package_info
        from gspo_megatron.megatron import cpu_runtime
        release = cpu_runtime.megatron_core_version()
        package_info.__version__ = release + "+abc1234"
        assert cpu_runtime.megatron_core_version() == release
        print(release)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() in ("0.16.1", "0.19.2")


def test_every_version_names_known_patches_and_each_says_why():
    from gspo_megatron.megatron import cpu_runtime

    assert set(cpu_runtime.PATCHES_BY_VERSION) == {"0.16.1", "0.19.2"}
    for version, names in cpu_runtime.PATCHES_BY_VERSION.items():
        assert names and set(names) <= set(cpu_runtime.PATCHES), version
    used = {n for names in cpu_runtime.PATCHES_BY_VERSION.values() for n in names}
    assert used == set(cpu_runtime.PATCHES)  # no patch that no version applies
    assert all(len(p.why) > 40 for p in cpu_runtime.PATCHES.values())


def test_inactive_when_cuda_is_available():
    proc = run_python("""
        import torch
        torch.cuda.is_available = lambda: True
        original = torch.cuda.current_device
        from gspo_megatron.megatron import cpu_runtime
        assert cpu_runtime.activate() is False
        assert torch.cuda.current_device is original
        from megatron.core.pipeline_parallel import schedules
        assert schedules.torch is torch
        print("inactive")
    """)
    assert proc.returncode == 0, proc.stderr
    assert "inactive" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_patches_on_cpu():
    proc = run_python("""
        import torch
        from gspo_megatron.megatron import cpu_runtime
        assert cpu_runtime.activate() is True and cpu_runtime.activate() is True  # idempotent
        assert torch.cuda.current_device() == torch.device("cpu")
        x = torch.ones(2)
        assert x.cuda() is x
        assert x.type() == "torch.cuda.FloatTensor" and x.type(torch.float64).dtype == torch.float64
        from megatron.core.pipeline_parallel import schedules
        t = schedules.torch.zeros([], dtype=torch.int, device="cuda")
        assert t.device.type == "cpu"
        assert schedules.torch.Tensor is torch.Tensor
        from megatron.core.transformer.moe import moe_utils
        assert moe_utils.te_general_gemm is None
        # the alltoall dispatcher's side stream is the current stream (no record_stream on CPU tensors),
        # its event has completed; 0.19.2's start_grad_sync waits on the current stream
        stream = torch.cuda.Stream()
        assert stream is torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            stream.record_event().synchronize()
        from megatron.core.transformer.moe import token_dispatcher
        assert (torch.cuda.Stream | None) is not None  # transformers annotates with it (a class, not a function)
        sizes = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
        assert sizes.tolist() == [3, 1] and not torch.is_tensor(sizes)  # what all_to_all_single takes
        from megatron.core.tensor_parallel import random
        tracker = random.get_cuda_rng_tracker()
        tracker.add("a", 123)
        torch.manual_seed(0)
        outside_before = torch.rand(1)
        torch.manual_seed(0)
        with tracker.fork("a"):
            first = torch.rand(3)
        outside_after = torch.rand(1)
        assert torch.equal(outside_before, outside_after)  # the fork does not disturb the default stream
        assert torch.equal(first, torch.rand(3, generator=torch.Generator().manual_seed(123)))
        with tracker.fork("a"):
            second = torch.rand(3)
        assert not torch.equal(first, second)  # the named state advances
        print("ok")
    """)
    assert proc.returncode == 0, proc.stderr
    assert "ok" in proc.stdout


def test_sequence_parallel_norm_marks_its_weight():
    from types import SimpleNamespace

    from gspo_megatron.megatron.cpu_runtime import SequenceParallelRMSNorm

    norm = SequenceParallelRMSNorm(SimpleNamespace(normalization="RMSNorm", sequence_parallel=True,
                                                   params_dtype=torch.float32), 8, eps=1e-6)
    assert norm.weight.sequence_parallel is True
    bf16 = SequenceParallelRMSNorm(SimpleNamespace(normalization="RMSNorm", sequence_parallel=False,
                                                   params_dtype=torch.bfloat16), 8)
    assert bf16.weight.dtype == torch.bfloat16  # the parameter dtype, as TE's and apex's norms
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    with pytest.raises(ValueError, match="normalization='RMSNorm'"):
        SequenceParallelRMSNorm(SimpleNamespace(normalization="LayerNorm", sequence_parallel=False), 8)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU runtime is off on a GPU")
def test_cuda_only_tuning_advice_is_not_printed_on_cpu():
    """Megatron's tensor-parallel linear advises CUDA_DEVICE_MAX_CONNECTIONS=1 (a CUDA kernel-ordering setting);
    on CPU it means nothing, so with the CPU runtime active it is not printed. Other warnings still are."""
    proc = run_python("""
        import warnings
        import torch
        import torch.distributed as dist
        from gspo_megatron.megatron import cpu_runtime
        assert cpu_runtime.activate()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce as linear
        linear(torch.randn(2, 1, 4), torch.randn(3, 4), None, False, allreduce_dgrad=True, sequence_parallel=False,
               tp_group=dist.group.WORLD)
        warnings.warn("another warning")
        dist.destroy_process_group()
    """)
    assert proc.returncode == 0, proc.stderr
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in proc.stderr
    assert "another warning" in proc.stderr
