"""KL estimators, entropy bonus and truncated importance sampling."""
import math

import pytest
import torch
from tests.algorithms.helpers import grad_of, random_raw

from gspo_megatron.algorithms import (
    LossConfig,
    LossNormalisers,
    finalize_metrics,
    gspo_loss,
    kl_estimate,
    merge_metrics,
    packed_batch,
    policy_loss,
    sequence_sums,
)


def test_kl_estimators_by_hand():
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.5])
    mask = torch.tensor([True, True, False])
    log_r = torch.tensor([-0.5, 1.0, 0.0])  # ref - logp, 0 off the mask
    assert torch.allclose(kl_estimate(logp, ref, mask, "k1"), -log_r)
    assert torch.allclose(kl_estimate(logp, ref, mask, "k2"), 0.5 * log_r**2)
    k3 = kl_estimate(logp, ref, mask, "k3")
    assert torch.allclose(k3, torch.exp(log_r) - 1 - log_r)
    assert (k3 >= 0).all()
    (g,) = torch.autograd.grad(k3.sum(), logp)
    assert torch.allclose(g, torch.where(mask, 1 - torch.exp(log_r), 0.0))  # d k3 / d logp = 1 - r


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_term_enters_the_loss_with_its_coefficient(estimator):
    raw = random_raw([4, 6, 3], seed=31, mask_frac=0.2)
    raw.ref = raw.old + 0.5 * torch.randn(raw.old.shape, generator=torch.Generator().manual_seed(0))
    base = LossConfig(kl_estimator=estimator)
    with_kl = LossConfig(kl_coef=0.3, kl_estimator=estimator)
    l0, m0 = policy_loss(base, raw.batch(), raw.normalisers())
    l1, m1 = policy_loss(with_kl, raw.batch(), raw.normalisers())
    kl = kl_estimate(raw.logprobs, raw.ref, raw.mask, estimator)
    seq_mean = torch.stack([k.sum() / m.sum() for k, m in zip(kl.split(raw.lengths), raw.mask.split(raw.lengths))]).mean()
    assert torch.allclose(l1 - l0, 0.3 * seq_mean, rtol=1e-4, atol=1e-7)
    assert torch.allclose(m0["kl_sum"], kl.sum().detach())  # reported even when the coefficient is 0
    (g0,) = grad_of(l0, raw.logprobs)
    (g1,) = grad_of(l1, raw.logprobs)
    (gk,) = grad_of(0.3 * seq_mean, raw.logprobs)
    assert torch.allclose(g1 - g0, gk, rtol=1e-4, atol=1e-9)


def test_entropy_bonus():
    raw = random_raw([5, 2], seed=32)
    loss0, _ = policy_loss(LossConfig(), raw.batch(), raw.normalisers())
    loss1, m = policy_loss(LossConfig(entropy_coef=0.1), raw.batch(), raw.normalisers())
    mean_entropy = (raw.entropy[:5].mean() + raw.entropy[5:].mean()) / 2
    assert torch.allclose(loss0 - loss1, 0.1 * mean_entropy, rtol=1e-5)
    (g,) = grad_of(loss1, raw.entropy)
    assert torch.allclose(g, torch.tensor([-0.1 / 5 / 2] * 5 + [-0.1 / 2 / 2] * 2))
    assert m["entropy_sum"].item() == pytest.approx(raw.entropy.sum().item(), rel=1e-6)


def test_sequence_tis_weights_each_sequence_term():
    raw = random_raw([4, 6], seed=33, scale=0.05)
    with torch.no_grad():  # sequence 0: pi_old / pi_rollout = e^0.1 per token; sequence 1: e^2 -> capped at 2
        raw.rollout.copy_(raw.old - torch.tensor([0.1] * 4 + [2.0] * 6))
    batch = raw.batch()
    plain, _ = gspo_loss(batch, raw.normalisers(), LossConfig(clip_low=0.5, clip_high=0.5))
    corrected, m = gspo_loss(batch, raw.normalisers(), LossConfig(clip_low=0.5, clip_high=0.5, tis_mode="sequence", tis_cap=2.0))
    sums = sequence_sums(batch)
    s = torch.exp(sums.log_ratio.detach() / sums.tokens)
    terms = -s * raw.advantages / 2
    assert torch.allclose(plain, terms.sum(), rtol=1e-5)
    assert torch.allclose(corrected, (terms * torch.tensor([math.exp(0.1), 2.0])).sum(), rtol=1e-5)
    assert m["tis_seq_truncated"].item() == 1
    assert m["tis_seq_weight_sum"].item() == pytest.approx(math.exp(0.1) + 2.0, rel=1e-5)
    assert m["logprob_gap_abs_sum"].item() == pytest.approx(0.4 + 12.0, rel=1e-5)


def test_logprob_gap_by_hand_ignores_masked_positions_and_merges_across_microbatches():
    # d_t = log pi_old - log pi_rollout: 0.5, 0, -1 | -0.25, 0.5 and a masked 200 (padding)
    old = torch.tensor([-1.0, -2.0, -3.0, -0.5, -0.25, 100.0])
    rollout = torch.tensor([-1.5, -2.0, -2.0, -0.25, -0.75, -100.0])
    mask = torch.tensor([True, True, True, True, True, False])
    config = LossConfig()

    def microbatch(tokens):
        return packed_batch(old[tokens].clone(), old[tokens], cu_seqlens=torch.tensor([0, 3]),
                            advantages=torch.ones(1), mask=mask[tokens], rollout_logprobs=rollout[tokens])

    parts = [policy_loss(config, microbatch(t), LossNormalisers(2.0, 5.0))[1] for t in (slice(0, 3), slice(3, 6))]
    final = finalize_metrics(merge_metrics(parts))
    assert final["logprob_gap_mean"].item() == pytest.approx((0.5 + 0 + 1 + 0.25 + 0.5) / 5)
    assert final["logprob_gap_signed"].item() == pytest.approx((0.5 + 0 - 1 - 0.25 + 0.5) / 5)
    assert final["logprob_gap_max"].item() == pytest.approx(1.0)
    assert parts[1]["logprob_gap_abs_max"].item() == pytest.approx(0.5)  # the second half alone


def test_token_tis_weights_each_token_gradient():
    raw = random_raw([5, 3], seed=34, scale=0.05)
    gaps = torch.tensor([0.0, 0.5, 1.0, -0.5, 3.0, 0.2, -1.0, 0.0])
    with torch.no_grad():
        raw.rollout.copy_(raw.old - gaps)
    cfg = LossConfig(algorithm="grpo", tis_mode="token", tis_cap=2.0)
    plain, _ = policy_loss(LossConfig(algorithm="grpo"), raw.batch(), raw.normalisers())
    corrected, m = policy_loss(cfg, raw.batch(), raw.normalisers())
    (g_plain,) = grad_of(plain, raw.logprobs)
    (g_tis,) = grad_of(corrected, raw.logprobs)
    weights = torch.exp(gaps).clamp(max=2.0)
    assert torch.allclose(g_tis, g_plain * weights, rtol=1e-5, atol=1e-10)
    assert m["tis_token_truncated"].item() == 2  # e^1 and e^3 exceed the cap of 2
    assert m["tis_token_weight_sum"].item() == pytest.approx(weights.sum().item(), rel=1e-5)


def test_tis_without_rollout_logprobs_is_an_error():
    raw = random_raw([3])
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_loss(LossConfig(tis_mode="sequence"), raw.batch(extras=False), raw.normalisers())
