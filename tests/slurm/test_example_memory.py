"""Every GPU example config is one the memory plan says fits the GPUs it names, at a layout Megatron starts
(our ParallelConfig check: the dense and the expert grid each divide the GPUs), with the plan's own
assumptions (bf16, full recompute, the micro-batch tokens)."""
from __future__ import annotations

import pytest
import yaml

from gspo_megatron.megatron.parallel import ParallelConfig
from gspo_megatron.typed_config import build
from tests.slurm.cluster import REPO_ROOT
from tests.slurm.test_memory_plan import mp

GB = 1e9 / 2**30  # GiB per GB: the examples name GPUs in GB (H200 141 GB, A100/H100 80 GB)
# example -> (plan model, GPUs, GiB per GPU, SGLang TP and mem fraction where the sbatch script sets them)
PLANNED = {
    "qwen3_30b_a3b_gspo_1node.yaml": ("qwen3-30b-a3b", 8, 141 * GB, None, None),  # "one node of 8 x H200 (141 GB)"
    # "one node of 8 x 80 GB GPUs", optimizer.cpu_offload_fraction 0.75
    "qwen3_30b_a3b_gspo_1node_80gb.yaml": ("qwen3-30b-a3b", 8, 80 * GB, None, None),
    # "4 nodes x 8 x 80 GB"; qwen3_30b_a3b_gspo_multinode.sbatch starts TP4 servers at mem fraction 0.40
    "qwen3_30b_a3b_gspo_multinode.yaml": ("qwen3-30b-a3b", 32, 80 * GB, 4, 0.40),
    # "8 nodes x 8 x H200", one SGLang server per node (TP8) at GSPO_SGLANG_MEM_FRACTION=0.35
    "glm4_5_air_gspo_multinode.yaml": ("glm-4.5-air", 64, 141 * GB, 8, 0.35),
    # "2 nodes x 8 x H200", one SGLang server per node (TP8) at GSPO_SGLANG_MEM_FRACTION=0.35
    "moonlight_16b_a3b_gspo_multinode.yaml": ("moonlight-16b-a3b", 16, 141 * GB, 8, 0.35),
    "qwen1_5_moe_a2_7b_gspo_1node.yaml": ("qwen1.5-moe-a2.7b", 8, 141 * GB, None, None),  # "one node of 8 x H200"
}
GPU_EXAMPLES = sorted(p.name for p in (REPO_ROOT / "examples").glob("*.yaml") if not p.name.startswith("cpu_"))  # cpu_*: CPU runs, fp32


def test_every_gpu_example_has_a_plan() -> None:
    assert sorted(PLANNED) == GPU_EXAMPLES


@pytest.mark.parametrize("name", sorted(PLANNED))
def test_example_fits_the_gpus_it_names(name: str) -> None:
    config = yaml.safe_load((REPO_ROOT / "examples" / name).read_text())
    model, gpus, mem, sglang_tp, fraction = PLANNED[name]
    plan = mp.example_plan(config, model, gpus, mem, sglang_tp, fraction)
    # the update, the weight sync (buckets in flight beside SGLang's weights) and the rollout
    assert max(plan.train_phase_gib, plan.sync_phase_gib, plan.rollout_phase_gib) <= mem, (name, plan)
    assert plan.gpu_peak_gib <= mem
    if name.startswith("qwen3_30b"):
        assert config["train"]["max_tokens_per_microbatch"] == 8192  # docs/slurm.md's layouts table


@pytest.mark.parametrize("name", sorted(PLANNED))
def test_example_layout_starts_on_the_gpus_it_names(name: str) -> None:
    """The trainer's own check (Megatron's rule) accepts the layout at the example's GPU count, and the plan
    splits the experts as Megatron will (its expert-TP size, null meaning TP)."""
    config = yaml.safe_load((REPO_ROOT / "examples" / name).read_text())
    _, gpus, *_ = PLANNED[name]
    parallel = build(ParallelConfig, config["parallel"], "parallel")
    parallel.data_parallel(gpus)
    par = config["parallel"]
    layout = mp.Layout(gpus, parallel.tensor_parallel, parallel.pipeline_parallel, parallel.expert_parallel,
                       parallel.expert_tensor_parallel_size, parallel.context_parallel)
    assert (layout.dp, layout.expert_dp) == (parallel.data_parallel(gpus), parallel.expert_data_parallel(gpus))
    assert par.get("expert_tensor_parallel") is not None or par.get("tensor_parallel", 1) == 1, \
        f"{name}: with TP > 1 the example names its expert-TP size (null would be TP)"


def test_the_one_node_qwen3_layout_needs_whole_experts() -> None:
    """TP4 x EP8 on 8 GPUs starts only with expert_tensor_parallel: 1 (Megatron's default ETP = TP needs 32)."""
    config = yaml.safe_load((REPO_ROOT / "examples" / "qwen3_30b_a3b_gspo_1node.yaml").read_text())
    assert config["parallel"]["expert_tensor_parallel"] == 1
    default = {k: v for k, v in config["parallel"].items() if k != "expert_tensor_parallel"}
    with pytest.raises(ValueError, match="must divide the world size 8"):
        build(ParallelConfig, default, "parallel").data_parallel(8)


def test_the_plan_takes_the_longest_sequence_as_a_micro_batch() -> None:
    """A sequence beyond the micro-batch budget travels alone (batching.pack_microbatches): 2048 + 8192."""
    config = yaml.safe_load((REPO_ROOT / "examples" / "qwen3_30b_a3b_gspo_1node.yaml").read_text())
    assert mp.microbatch_tokens(config) == 2048 + 8192
    config["rollout"]["max_new_tokens"] = 1024
    assert mp.microbatch_tokens(config) == 8192


@pytest.mark.parametrize("name", GPU_EXAMPLES)
def test_gpu_examples_train_in_bf16_with_full_recompute(name: str) -> None:
    config = yaml.safe_load((REPO_ROOT / "examples" / name).read_text())
    assert config["rollout"]["engine"] == "sglang"
    assert (config["model"].get("precision"), config["model"].get("recompute")) == ("bf16", "full"), name


def test_the_plan_refuses_what_it_cannot_plan() -> None:
    config = yaml.safe_load((REPO_ROOT / "examples" / "qwen3_30b_a3b_gspo_1node.yaml").read_text())
    config["model"]["precision"] = "fp32"
    with pytest.raises(ValueError, match="model.precision: fp32"):
        mp.example_plan(config, "qwen3-30b-a3b", 8, 141 * GB)
    config["model"].update(precision="bf16", recompute="none")
    config["train"]["max_tokens_per_microbatch"] = 16384
    # bf16 gradients save 2 B per parameter held
    fp32 = mp.example_plan(config, "qwen3-30b-a3b", 8, 141 * GB)
    config["model"]["grad_reduce_in_fp32"] = False
    assert mp.example_plan(config, "qwen3-30b-a3b", 8, 141 * GB).grads_gib == pytest.approx(fp32.grads_gib / 2)


def test_qwen3_30b_fits_one_node_of_80_gb_only_with_the_optimizer_partly_on_the_host() -> None:
    """The 80 GB example is the 141 GB one's layout with ``optimizer.cpu_offload_fraction``: without it (or
    at half) the rollout phase does not fit 80 GB; with it the host holds the offloaded share beside a
    checkpoint save's gathered states, under 1 TB per node (the example's header asks for that much)."""
    name = "qwen3_30b_a3b_gspo_1node_80gb.yaml"
    config = yaml.safe_load((REPO_ROOT / "examples" / name).read_text())
    one_node = yaml.safe_load((REPO_ROOT / "examples" / "qwen3_30b_a3b_gspo_1node.yaml").read_text())
    assert config["parallel"] == one_node["parallel"] and config["parallel"]["distributed_optimizer"] is True
    fraction = config["optimizer"]["cpu_offload_fraction"]
    plan = mp.example_plan(config, "qwen3-30b-a3b", 8, 80 * GB)
    assert plan.gpu_peak_gib <= 80 * GB and plan.host_per_node_gib <= 1000 * GB
    assert plan.optimizer_host_gib > 0
    for less in (0.0, 0.5):
        config["optimizer"]["cpu_offload_fraction"] = less
        assert mp.example_plan(config, "qwen3-30b-a3b", 8, 80 * GB).gpu_peak_gib > 80 * GB, less
    assert fraction > 0.5
