"""The train/rollout log-prob gap over response tokens."""
from __future__ import annotations

import pytest
import torch

from gspo_megatron.rollout.logprob_gap import finalize, gap_sums, logprob_gap, GapSums


def test_gap_by_hand_ignores_masked_positions():
    train = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, 100.0]])
    rollout = torch.tensor([[-1.5, -2.0, -2.0], [-0.25, -0.75, -100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the 100 vs -100 position is padding
    gap = logprob_gap(train, rollout, mask)
    # differences: 0.5, 0, -1, -0.25, 0.5
    assert gap.num_tokens == 5
    assert gap.mean_abs == pytest.approx((0.5 + 0 + 1 + 0.25 + 0.5) / 5)
    assert gap.max_abs == pytest.approx(1.0)
    assert gap.mean_signed == pytest.approx((0.5 + 0 - 1 - 0.25 + 0.5) / 5)


def test_sums_of_parts_reduce_to_the_whole():
    torch.manual_seed(0)
    train, rollout = torch.randn(6, 9), torch.randn(6, 9)
    mask = torch.rand(6, 9) > 0.3
    parts = [gap_sums(train[s], rollout[s], mask[s]) for s in (slice(0, 2), slice(2, 6))]
    merged = GapSums(  # what all-reduce SUM / MAX across two ranks computes
        sum_abs=parts[0].sum_abs + parts[1].sum_abs,
        sum_signed=parts[0].sum_signed + parts[1].sum_signed,
        max_abs=torch.maximum(parts[0].max_abs, parts[1].max_abs),
        num_tokens=parts[0].num_tokens + parts[1].num_tokens,
    )
    whole = logprob_gap(train, rollout, mask)
    split = finalize(merged)
    assert split.num_tokens == whole.num_tokens == int(mask.sum())
    assert split.mean_abs == pytest.approx(whole.mean_abs)
    assert split.max_abs == pytest.approx(whole.max_abs)
    assert split.mean_signed == pytest.approx(whole.mean_signed)
    assert whole.max_abs == pytest.approx(float((train - rollout).abs()[mask].max()))


def test_bad_inputs_are_errors():
    with pytest.raises(ValueError, match=r"shapes differ.*\(2, 3\).*\(2, 4\)"):
        logprob_gap(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="selects no tokens"):
        logprob_gap(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3))
