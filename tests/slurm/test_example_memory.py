"""Every GPU example config is one the memory plan says fits the GPUs it names, with the plan's own
assumptions (bf16, full recompute, the micro-batch tokens), and the examples without a plan model state the
settings of their own header arithmetic."""
from __future__ import annotations

import pytest
import yaml

from tests.slurm.cluster import REPO_ROOT
from tests.slurm.test_memory_plan import mp

GB = 1e9 / 2**30  # GiB per GB: the examples name GPUs in GB (H200 141 GB, A100/H100 80 GB)
# example -> (plan model, GPUs, GiB per GPU, SGLang TP and mem fraction where the sbatch script sets them)
PLANNED = {
    "qwen3_30b_a3b_gspo_1node.yaml": ("qwen3-30b-a3b", 8, 141 * GB, None, None),  # "one node of 8 x H200 (141 GB)"
    # "4 nodes x 8 x 80 GB"; qwen3_30b_a3b_gspo_multinode.sbatch starts TP4 servers at mem fraction 0.40
    "qwen3_30b_a3b_gspo_multinode.yaml": ("qwen3-30b-a3b", 32, 80 * GB, 4, 0.40),
}
GPU_EXAMPLES = sorted(p.name for p in (REPO_ROOT / "examples").glob("*.yaml") if not p.name.startswith("cpu_"))  # cpu_*: CPU runs, fp32


@pytest.mark.parametrize("name", sorted(PLANNED))
def test_example_fits_the_gpus_it_names(name: str) -> None:
    config = yaml.safe_load((REPO_ROOT / "examples" / name).read_text())
    model, gpus, mem, sglang_tp, fraction = PLANNED[name]
    plan = mp.example_plan(config, model, gpus, mem, sglang_tp, fraction)
    assert plan.train_phase_gib <= mem and plan.rollout_phase_gib <= mem, (name, plan)
    assert config["train"]["max_tokens_per_microbatch"] == 8192  # docs/slurm.md's layouts table


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
