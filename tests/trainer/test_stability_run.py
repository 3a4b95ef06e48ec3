"""One short CPU run through the whole trainer with the new loss and every rollout-mismatch mask on."""
import math

import pytest
from tests.runs import train


@pytest.mark.slow
def test_sapo_with_rollout_corrections_trains_and_logs_the_masked_fractions(tmp_path):
    metrics = train(tmp_path / "run", "train.steps=2", "sft.steps=5", "train.prompts_per_step=4", "eval.every_steps=2",
                    "eval.num_prompts=8", "eval.pass_k=1", "checkpoint.every_steps=0", "loss.algorithm=sapo",
                    "loss.rollout_correction.icepop=true", "loss.rollout_correction.seq_mask=geometric",
                    "loss.rollout_correction.opsm=true")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics[1:]:
        for key in ("sapo_gate_slope_mean", "icepop_mask_frac", "rollout_seq_mask_frac", "opsm_mask_frac", "pg_loss", "grad_norm"):
            assert key in m and math.isfinite(m[key]), key
        for key in ("icepop_mask_frac", "rollout_seq_mask_frac", "opsm_mask_frac"):
            assert 0.0 <= m[key] <= 1.0, key
        assert 0.0 < m["sapo_gate_slope_mean"] <= 1.0 + 1e-6  # the gate's slope peaks at 1 (r = 1)
