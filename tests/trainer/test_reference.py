"""The KL reference: a frozen model (no DDP buffers, no optimizer) holding the policy RL starts from."""
from pathlib import Path

import pytest
import torch

from gspo_megatron.megatron.spawn import run_distributed

DEMO = Path(__file__).resolve().parents[2] / "examples" / "cpu_demo.yaml"


def kl_steps(rank, world_size, run_dir: str) -> dict:
    from gspo_megatron.trainer.config import load_config
    from gspo_megatron.trainer.loop import Trainer

    config = load_config(DEMO, ["sft.steps=5", "train.steps=2", "logging.console=false", "logging.tensorboard=false",
                                "train.prompts_per_step=4", "loss.kl_coef=0.1", "optimizer.lr=0.01",
                                "loss.entropy_coef=0.5"])  # rewards may all be 0 this early: entropy moves the policy
    trainer = Trainer(config, run_dir)
    ref = trainer.reference
    out = {"frozen": ref.frozen and ref.ddp is None and ref.optimizer is None,
           "no_grad": not any(p.requires_grad for p in ref.module.parameters()),
           "same_start": all(torch.equal(a, b) for a, b in zip(ref.module.parameters(),
                                                                 trainer.policy.module.parameters()))}
    out["metrics"] = [trainer.train_step() for _ in range(2)]
    out["moved"] = any(not torch.equal(a, b) for a, b in zip(ref.module.parameters(), trainer.policy.module.parameters()))
    trainer.close()
    for call in (lambda: ref.forward_backward([]), ref.optimizer_step):
        with pytest.raises(ValueError, match="frozen"):
            call()
    return out


@pytest.mark.slow
def test_reference_is_frozen_and_kl_grows_from_zero(tmp_path):
    out = run_distributed(kl_steps, 1, (str(tmp_path),))[0]
    assert out["frozen"] and out["no_grad"] and out["same_start"]
    assert out["moved"]  # the policy trained away from the reference
    first, second = out["metrics"]
    # before any update the policy equals the reference: the first mini-batch's KL is 0; the step's mean
    # over four mini-batches is positive once updates have moved the policy, and grows over steps
    assert first["kl_mean"] >= 0.0 and second["kl_mean"] > 0.0
