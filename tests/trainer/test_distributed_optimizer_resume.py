"""A run with Megatron's distributed optimizer resumes exactly, through the trainer, at 1 and 2 processes
(DP=2 and EP=2), with the process-group flags a CUDA run uses (issue 40, defects 0 and 1).

What failed before: megatron-core 0.16.1's ``DistributedOptimizer`` over torch AdamW (no apex / Transformer
Engine, as on CPU and on a GPU without TE) could not build the template a resume loads into (``assert
len(steps) == 1``), could not load its parameter state (``KeyError: 'step'``), and after a load shared one
step tensor between all parameters (each update then advanced it once per parameter). And the optimizer
asked for gloo groups that ``initialize_model_parallel`` no longer creates on either device.
"""
import json
from pathlib import Path

import pytest

from gspo_megatron.megatron.spawn import run_distributed

DEMO = Path(__file__).resolve().parents[2] / "examples" / "cpu_demo.yaml"
COMMON = ["sft.steps=40", "sft.batch_size=32", "rollout.temperature=0.8", "train.prompts_per_step=8", "rollout.samples_per_prompt=4",
          "train.minibatches_per_step=2", "eval.every_steps=0", "checkpoint.every_steps=2",
          "logging.console=false", "logging.tensorboard=false", "parallel.distributed_optimizer=true"]
KEYS = ("reward_mean", "pg_loss", "grad_norm", "seq_ratio_mean", "clip_frac_seq")


def _full_and_resumed(rank, world_size, base_dir, layouts):
    """Per layout: 4 steps uninterrupted, and 2 steps then a resume to 4; rank 0 returns both metrics."""
    from gspo_megatron.trainer.config import load_config
    from gspo_megatron.trainer.loop import Trainer

    def run(run_dir, steps, overrides, resume=False):
        trainer = Trainer(load_config(str(DEMO), COMMON + [f"train.steps={steps}"] + overrides), run_dir,
                          resume=resume)
        try:
            trainer.run()
        finally:
            trainer.close()

    out = {}
    for name, overrides in layouts.items():
        base = Path(base_dir) / name
        run(base / "full", 4, overrides)
        run(base / "split", 2, overrides)
        run(base / "split", 4, overrides, resume=True)
        if rank == 0:
            out[name] = {kind: [json.loads(line) for line in (base / kind / "metrics.jsonl").read_text().splitlines()]
                         for kind in ("full", "split")}
    return out


def _assert_resumed_exactly(runs):
    for name, run in runs.items():
        full, split = run["full"], run["split"]
        assert [m["step"] for m in split] == [m["step"] for m in full] == [0, 1, 2, 3, 4], name
        assert any(m["grad_norm"] > 0 for m in full[1:]), f"{name}: nothing was learned, the check is empty"
        for a, b in zip(split[3:], full[3:]):  # the steps after the resume
            for key in KEYS:
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (name, a["step"], key)


@pytest.mark.slow
def test_distributed_optimizer_run_resumes_exactly_on_one_process(tmp_path):
    _assert_resumed_exactly(run_distributed(_full_and_resumed, 1, (str(tmp_path), {"single": []}),
                                            timeout_s=600)[0])


@pytest.mark.slow
def test_distributed_optimizer_run_resumes_exactly_at_dp2_and_ep2(tmp_path):
    layouts = {"dp2": [], "ep2": ["parallel.expert_parallel=2"]}
    _assert_resumed_exactly(run_distributed(_full_and_resumed, 2, (str(tmp_path), layouts), timeout_s=880)[0])
