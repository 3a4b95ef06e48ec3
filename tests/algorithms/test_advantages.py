"""Group advantages (GSPO Eq. 6 and variants) against hand-computed values."""
import math

import pytest
import torch

from gspo_megatron.algorithms import Segments, group_advantages

REWARDS = torch.tensor([[1.0, 0.5, 0.0, 0.0]])
# mean 0.375; deviations 0.625, 0.125, -0.375, -0.375; sum of squares 0.6875
SAMPLE_STD = math.sqrt(0.6875 / 3)  # 0.478714 (Bessel, the documented choice)
POPULATION_STD = math.sqrt(0.6875 / 4)  # 0.414578 (not used)


def test_grpo_estimator_uses_sample_std():
    adv = group_advantages(REWARDS, estimator="grpo", eps=0.0).advantages[0]
    expected = torch.tensor([1.305582, 0.261116, -0.783349, -0.783349])
    assert torch.allclose(adv, expected, atol=1e-5)
    assert torch.allclose(adv, (REWARDS[0] - 0.375) / SAMPLE_STD, atol=1e-6)
    assert not torch.allclose(adv, (REWARDS[0] - 0.375) / POPULATION_STD, atol=1e-3)


def test_eps_enters_the_denominator():
    adv = group_advantages(REWARDS, estimator="grpo", eps=0.5).advantages[0]
    assert torch.allclose(adv, (REWARDS[0] - 0.375) / (SAMPLE_STD + 0.5), atol=1e-6)


def test_dr_grpo_has_no_std():
    adv = group_advantages(REWARDS, estimator="dr_grpo").advantages[0]
    assert torch.allclose(adv, torch.tensor([0.625, 0.125, -0.375, -0.375]), atol=1e-7)


def test_leave_one_out_baseline():
    adv = group_advantages(REWARDS, estimator="loo").advantages[0]
    # r_i minus the mean of the other three
    expected = torch.tensor([1 - 0.5 / 3, 0.5 - 1 / 3, 0 - 1.5 / 3, 0 - 1.5 / 3])
    assert torch.allclose(adv, expected, atol=1e-6)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "loo"])
def test_zero_variance_groups_are_exactly_zero_and_counted(estimator):
    rewards = torch.tensor([[0.1, 0.1, 0.1], [1.0, 0.0, 1.0], [0.7, 0.7, 0.7], [0.0, 0.0, 0.0]])
    out = group_advantages(rewards, estimator=estimator)
    assert torch.equal(out.zero_variance, torch.tensor([True, False, True, True]))
    assert torch.count_nonzero(out.advantages[[0, 2, 3]]) == 0
    assert torch.count_nonzero(out.advantages[1]) == 3
    assert out.metrics["zero_adv_groups"].item() == 3
    assert out.metrics["zero_adv_group_frac"].item() == pytest.approx(0.75)
    assert out.metrics["num_groups"].item() == 4


def test_batch_norm_is_lite_ppo_group_mean_over_the_batch_std_of_the_rewards():
    rewards = torch.tensor([[1.0, 0.5, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    # Lite-PPO (arXiv 2508.08221): A = (r - group mean) / sample std of all 12 rewards, by hand
    flat = [x for row in rewards.tolist() for x in row]
    mean = sum(flat) / 12
    batch_std = math.sqrt(sum((x - mean) ** 2 for x in flat) / 11)
    expected = torch.tensor([[(x - sum(row) / 4) / batch_std for x in row] for row in rewards.tolist()])
    for estimator in ("grpo", "dr_grpo"):  # the batch std replaces the group std: both give the same
        normed = group_advantages(rewards, estimator=estimator, batch_norm=True, eps=0.0).advantages
        assert torch.allclose(normed, expected, atol=1e-6), estimator
        assert torch.count_nonzero(normed[1]) == 0
    # the old form divided the group z-scores by their own batch std: a different scale
    z = group_advantages(rewards, estimator="grpo", eps=0.0).advantages
    assert (z / z.reshape(-1).std() - expected).abs().max() > 0.1
    loo = group_advantages(rewards, estimator="loo", batch_norm=True, eps=0.0).advantages
    assert torch.allclose(loo, expected * 4 / 3, atol=1e-6)


def test_unequal_groups_by_id_match_rows_and_single_response_is_zero():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.25, 1.0, 0.3])
    ids = torch.tensor([0, 0, 0, 1, 1, 1, 2])
    ungrouped = group_advantages(rewards, group_ids=ids, num_groups=3)
    by_rows = group_advantages(torch.tensor([[1.0, 0.0, 0.5], [0.0, 0.25, 1.0]])).advantages.reshape(-1)
    assert torch.allclose(ungrouped.advantages[:6], by_rows, atol=1e-6)
    assert ungrouped.advantages[6] == 0 and bool(ungrouped.zero_variance[2])
    shuffled = torch.tensor([6, 3, 0, 5, 1, 4, 2])
    again = group_advantages(rewards[shuffled], group_ids=ids[shuffled], num_groups=3).advantages
    assert torch.allclose(again, ungrouped.advantages[shuffled], atol=1e-6)


def test_broadcast_to_tokens():
    adv = torch.tensor([0.5, -1.0, 2.0])
    seg = Segments.from_cu_seqlens(torch.tensor([0, 2, 3, 6]))
    assert torch.equal(seg.expand(adv), torch.tensor([0.5, 0.5, -1.0, 2.0, 2.0, 2.0]))


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(torch.zeros(4))
    with pytest.raises(ValueError, match="estimator"):
        group_advantages(torch.zeros(1, 4), estimator="mean")


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "loo"])
def test_rounding_residue_of_an_all_equal_group_is_removed(estimator):
    # float32: 0.3 - mean(0.3 x 7) is ~3e-8, not 0; divided by (std ~1e-8) + eps it would be ~0.03
    rewards = torch.tensor([[0.3] * 7, [0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]])
    assert (rewards[0] - rewards[0].mean()).abs().max() > 0  # the residue this test is about exists
    out = group_advantages(rewards, estimator=estimator)
    assert torch.count_nonzero(out.advantages[0]) == 0
