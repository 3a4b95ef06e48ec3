"""SAPO, CISPO, dual clip and the rollout-mismatch masks (MIS, IcePop, OPSM) against their closed forms."""
import math

import pytest
import torch
from tests.algorithms.helpers import grad_of, random_raw

from gspo_megatron.algorithms import LossConfig, finalize_metrics, policy_loss, sequence_sums
from gspo_megatron.algorithms.rollout_correction import RolloutCorrectionConfig


def per_seq_mean(terms, raw):
    """(1/S) sum_i (1/|y_i|) sum_t terms_it, the seq-mean-token-mean of plain per-token terms."""
    return torch.stack([t.sum() / m.sum() for t, m in zip(terms.split(raw.lengths), raw.mask.split(raw.lengths))]).mean()


def seq_lengths(raw):
    return torch.tensor(raw.lengths).repeat_interleave(torch.tensor(raw.lengths)).to(torch.float32)


def token_adv(raw):
    return raw.advantages.repeat_interleave(torch.tensor(raw.lengths))


# ---------------------------------------------------------------- SAPO


def test_sapo_value_and_gradient_are_the_soft_gate():
    raw = random_raw([4, 7, 2, 5], seed=41, scale=0.5)
    loss, metrics = policy_loss(LossConfig(algorithm="sapo"), raw.batch(extras=False), raw.normalisers())
    ratio = torch.exp(raw.logprobs.detach() - raw.old)
    adv = token_adv(raw)
    tau = torch.where(adv > 0, 1.0, 1.05)
    gate = torch.sigmoid(tau * (ratio - 1))
    expected = per_seq_mean(-(4 / tau) * gate * adv, raw)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    (grad,) = grad_of(loss, raw.logprobs)
    # d/d log pi of -(4/tau) sigma(tau (r - 1)) A = -A 4 sigma (1 - sigma) r, per-sequence mean weight
    closed = -adv * 4 * gate * (1 - gate) * ratio / seq_lengths(raw) / len(raw.lengths)
    assert torch.allclose(grad, closed, rtol=1e-5, atol=1e-9)
    slope = 4 * gate * (1 - gate)
    assert finalize_metrics(metrics)["sapo_gate_slope_mean"].item() == pytest.approx(slope.mean().item(), rel=1e-5)


def test_sapo_gradient_weight_is_one_on_policy_and_decays_faster_for_negative_advantages():
    raw = random_raw([3, 5], seed=42, scale=0.0)  # pi_theta = pi_old: r = 1 everywhere
    loss, _ = policy_loss(LossConfig(algorithm="sapo"), raw.batch(extras=False), raw.normalisers())
    (grad,) = grad_of(loss, raw.logprobs)
    assert torch.allclose(grad, -token_adv(raw) / seq_lengths(raw) / 2, rtol=1e-6)  # the plain policy gradient
    # one token at r = 2: slope 4 sigma(tau)(1 - sigma(tau)) is smaller for tau_neg = 1.05 than tau_pos = 1
    slopes = {}
    for sign in (1.0, -1.0):
        raw = random_raw([1], seed=43, scale=0.0)
        with torch.no_grad():
            raw.logprobs.copy_(raw.old + math.log(2.0))
        raw.advantages.fill_(sign)
        loss, _ = policy_loss(LossConfig(algorithm="sapo"), raw.batch(extras=False), raw.normalisers())
        slopes[sign] = -grad_of(loss, raw.logprobs)[0].item() / sign / 2.0  # divide out A and r
    s = lambda tau: 4 * (1 / (1 + math.exp(-tau))) * (1 - 1 / (1 + math.exp(-tau)))  # noqa: E731
    assert slopes[1.0] == pytest.approx(s(1.0), rel=1e-6) and slopes[-1.0] == pytest.approx(s(1.05), rel=1e-6)
    assert slopes[-1.0] < slopes[1.0]


# ---------------------------------------------------------------- CISPO


def test_cispo_keeps_every_token_with_its_clipped_detached_weight():
    raw = random_raw([4, 9, 3], seed=44, scale=0.8, mask_frac=0.2)
    cfg = LossConfig(algorithm="cispo", clip_low=0.2, clip_high=0.28)
    assert cfg.aggregation == "token_mean"  # the paper's 1 / sum_i |y_i|
    loss, metrics = policy_loss(cfg, raw.batch(extras=False), raw.normalisers())
    log_r = torch.where(raw.mask, raw.logprobs.detach() - raw.old, 0.0)
    weight = log_r.exp().clamp(0.8, 1.28)
    adv = token_adv(raw)
    tokens = raw.mask.sum()
    assert loss.item() == pytest.approx((-(weight * adv * log_r).sum() / tokens).item(), rel=1e-5)
    (grad,) = grad_of(loss, raw.logprobs)
    # the paper's surrogate -sg(r_hat) A log pi_theta differentiated by autograd
    paper = -(torch.where(raw.mask, weight * adv * raw.logprobs, 0.0)).sum() / tokens
    (grad_paper,) = grad_of(paper, raw.logprobs)
    assert torch.allclose(grad, grad_paper, rtol=1e-5, atol=1e-9)
    clipped = (log_r.exp() != weight) & raw.mask
    assert clipped.any() and torch.count_nonzero(grad[clipped]) == clipped.sum()  # clipped tokens keep a gradient
    assert metrics["cispo_clipped_tokens"].item() == clipped.sum().item()


def test_cispo_paper_defaults_have_no_lower_bound():
    cfg = LossConfig(algorithm="cispo")
    assert (cfg.clip_low, cfg.clip_high) == (1.0, 4.0)  # weight in [0, 5]: ScaleRL's epsilon_max = 5
    raw = random_raw([6], seed=45, scale=3.0)
    loss, _ = policy_loss(cfg, raw.batch(extras=False), raw.normalisers())
    (grad,) = grad_of(loss, raw.logprobs)
    ratio = torch.exp(raw.logprobs.detach() - raw.old)
    assert (ratio < 0.1).any()  # never raised towards 1 - clip_low
    assert torch.allclose(grad, -ratio.clamp(max=5.0) * raw.advantages[0] / 6, rtol=1e-5)


# ---------------------------------------------------------------- dual clip


@pytest.mark.parametrize("algorithm", ["grpo", "gspo_token"])
def test_dual_clip_caps_negative_advantage_terms(algorithm):
    # one sequence per ratio so GSPO-token's s_i is the token ratio: r = 0.5, 1.1, 2.5, 4, 10 with A < 0 and > 0
    ratios = [0.5, 1.1, 2.5, 4.0, 10.0]
    raw = random_raw([1] * 10, seed=46, scale=0.0)
    with torch.no_grad():
        raw.logprobs.copy_(raw.old + torch.log(torch.tensor(ratios * 2)))
    raw.advantages.copy_(torch.tensor([-1.5] * 5 + [2.0] * 5))
    base = dict(algorithm=algorithm, clip_low=0.2, clip_high=0.27)
    loss, metrics = policy_loss(LossConfig(**base, dual_clip_c=3.0), raw.batch(extras=False), raw.normalisers())
    r, adv = torch.tensor(ratios * 2), raw.advantages
    objective = torch.minimum(r * adv, r.clamp(0.8, 1.27) * adv)
    objective = torch.where(adv < 0, torch.maximum(objective, 3.0 * adv), objective)  # verl / slime dual clip
    assert loss.item() == pytest.approx(-(objective.mean()).item(), rel=1e-6)
    (grad,) = grad_of(loss, raw.logprobs)
    flows = torch.tensor([False, True, True, False, False, True, True, False, False, False])
    # where it flows: -A r / 10; A < 0 with r > 3 (4 and 10) is capped at 3 A: no gradient, as for A > 0 with r > 1.27
    assert torch.allclose(grad, torch.where(flows, -adv * r / 10, 0.0), rtol=1e-5)
    assert metrics["clip_dual_tokens"].item() == 2
    plain, _ = policy_loss(LossConfig(**base), raw.batch(extras=False), raw.normalisers())
    assert plain.item() > loss.item()  # without the cap the two far-off negative tokens cost more


def test_dual_clip_on_gspo_sequences():
    raw = random_raw([3, 4], seed=47, scale=0.0)
    with torch.no_grad():
        raw.logprobs.copy_(raw.old + torch.tensor([1.5] * 3 + [0.5] * 4))  # s = e^1.5 = 4.48 > 3, e^0.5 = 1.65
    raw.advantages.copy_(torch.tensor([-1.0, -1.0]))
    loss, metrics = policy_loss(LossConfig(dual_clip_c=3.0), raw.batch(extras=False), raw.normalisers())
    # seq 0: max(min(s A, clip(s) A), 3 A) = -3; seq 1: min(-1.65, -1.0004) = -1.65 (unclipped, gradient flows)
    assert loss.item() == pytest.approx((3.0 + math.exp(0.5)) / 2, rel=1e-6)
    (grad,) = grad_of(loss, raw.logprobs)
    assert torch.count_nonzero(grad[:3]) == 0
    assert torch.allclose(grad[3:], torch.full((4,), math.exp(0.5) / 4 / 2), rtol=1e-5)
    assert metrics["clip_dual_tokens"].item() == 3


# ---------------------------------------------------------------- rollout-mismatch masks


def gapped(lengths, gaps, seed, scale=0.05):
    """A batch whose token t has log pi_old - log pi_rollout = gaps[t]."""
    raw = random_raw(lengths, seed=seed, scale=scale)
    with torch.no_grad():
        raw.rollout.copy_(raw.old - torch.tensor(gaps))
    return raw


def correction(**kwargs):
    return RolloutCorrectionConfig(**kwargs)


@pytest.mark.parametrize("mode", ["sequence", "geometric"])
def test_sequence_mask_drops_sequences_outside_the_band(mode):
    # sums of d_t: 0.3 (inside both), 1.2 over 4 tokens (product 3.3 out, geometric e^0.3 in), -2.0 (out of both)
    gaps = [0.1, 0.1, 0.1] + [0.3] * 4 + [-1.0, -1.0]
    raw = gapped([3, 4, 2], gaps, seed=48)
    rc = correction(seq_mask=mode, seq_mask_low=0.5, seq_mask_high=2.0)
    algo = dict(algorithm="gspo", clip_low=0.5, clip_high=0.5)
    loss, metrics = policy_loss(LossConfig(**algo, rollout_correction=rc), raw.batch(), raw.normalisers())
    plain, _ = policy_loss(LossConfig(**algo), raw.batch(), raw.normalisers())
    sums = sequence_sums(raw.batch())
    s = torch.exp(sums.log_ratio.detach() / sums.tokens)
    keep = torch.tensor([True, mode == "geometric", False])
    terms = -s * raw.advantages / 3
    assert loss.item() == pytest.approx(terms[keep].sum().item(), rel=1e-5)
    assert plain.item() == pytest.approx(terms.sum().item(), rel=1e-5)
    (grad,) = grad_of(loss, raw.logprobs)
    dropped_tokens = ~keep.repeat_interleave(torch.tensor([3, 4, 2]))
    assert torch.count_nonzero(grad[dropped_tokens]) == 0 and torch.count_nonzero(grad[~dropped_tokens]) > 0
    assert finalize_metrics(metrics)["rollout_seq_mask_frac"].item() == pytest.approx((~keep).sum().item() / 3)


@pytest.mark.parametrize("algorithm", ["grpo", "sapo", "cispo", "gspo_token"])
def test_icepop_weights_tokens_inside_the_band_and_drops_the_rest(algorithm):
    gaps = torch.tensor([0.0, 0.5, -1.0, 2.0, 0.2, -0.3, 1.7, 0.0])  # k = e^gap; band [0.5, 5]: e^-1, e^2, e^1.7 out
    raw = gapped([5, 3], gaps.tolist(), seed=49, scale=0.1)
    rc = correction(icepop=True, icepop_low=0.5, icepop_high=5.0)
    plain, _ = policy_loss(LossConfig(algorithm=algorithm), raw.batch(extras=False), raw.normalisers())
    (g_plain,) = grad_of(plain, raw.logprobs)
    loss, metrics = policy_loss(LossConfig(algorithm=algorithm, rollout_correction=rc), raw.batch(), raw.normalisers())
    (g_ice,) = grad_of(loss, raw.logprobs)
    k = gaps.exp()
    m = torch.where((k >= 0.5) & (k <= 5.0), k, 0.0)  # IcePop's M(k)
    assert torch.allclose(g_ice, g_plain * m, rtol=1e-5, atol=1e-10)
    assert metrics["rc_icepop_masked"].item() == 3
    if algorithm == "grpo":  # and in value: each token's term times M(k)
        ratio = torch.exp(raw.logprobs.detach() - raw.old)
        adv = token_adv(raw)
        terms = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.27) * adv) * m
        assert loss.item() == pytest.approx(per_seq_mean(terms, raw).item(), rel=1e-5)


def test_opsm_drops_negative_sequences_the_policy_left():
    # divergence_i = mean_t [log pi_rollout - log pi_theta] = -mean(lr_t + d_t)
    raw = random_raw([3, 3, 3, 3], seed=50, scale=0.0)
    lr = torch.tensor([-0.2] * 3 + [-0.2] * 3 + [0.0] * 3 + [-0.2] * 3)  # log pi_theta - log pi_old
    d = torch.tensor([0.0] * 3 + [0.0] * 3 + [-0.1] * 3 + [0.19] * 3)  # log pi_old - log pi_rollout
    with torch.no_grad():
        raw.logprobs.copy_(raw.old + lr)
        raw.rollout.copy_(raw.old - d)
    raw.advantages.copy_(torch.tensor([-1.0, 1.0, -1.0, -1.0]))  # divergences 0.2, 0.2, 0.1, 0.01
    rc = correction(opsm=True, opsm_delta=0.05)
    algo = dict(algorithm="grpo")
    loss, metrics = policy_loss(LossConfig(**algo, rollout_correction=rc), raw.batch(), raw.normalisers())
    (grad,) = grad_of(loss, raw.logprobs)
    (g_plain,) = grad_of(policy_loss(LossConfig(**algo), raw.batch(), raw.normalisers())[0], raw.logprobs)
    keep = torch.tensor([False, True, False, True]).repeat_interleave(3)  # A < 0 and divergence > 0.05: 0 and 2
    assert torch.count_nonzero(g_plain) == 12
    assert torch.allclose(grad, torch.where(keep, g_plain, 0.0), rtol=1e-6)
    assert metrics["rc_opsm_masked"].item() == 2
    assert finalize_metrics(metrics)["opsm_mask_frac"].item() == pytest.approx(0.5)


def test_corrections_need_the_engine_logprobs():
    raw = random_raw([3])
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_loss(LossConfig(rollout_correction=correction(opsm=True)), raw.batch(extras=False), raw.normalisers())
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_loss(LossConfig(algorithm="grpo", rollout_correction=correction(icepop=True)), raw.batch(extras=False),
                    raw.normalisers())


def test_opsm_with_per_token_advantages_drops_the_negative_tokens_of_divergent_sequences():
    raw = random_raw([4, 4], seed=51, scale=0.0)
    with torch.no_grad():
        raw.logprobs.copy_(raw.old - 0.1)  # r = 0.905: inside GRPO's clip range, so every token has a gradient
        raw.rollout.copy_(raw.old - torch.tensor([0.0] * 4 + [0.1] * 4))  # divergence log pi_rollout - log pi_theta: 0.1, 0
    raw.token_advantages.copy_(torch.tensor([1.0, -1.0, -2.0, 0.5, -1.0, -1.0, 1.0, 2.0]))
    rc = correction(opsm=True, opsm_delta=0.05)
    loss, metrics = policy_loss(LossConfig(algorithm="grpo", rollout_correction=rc), raw.batch(per_token=True), raw.normalisers())
    (grad,) = grad_of(loss, raw.logprobs)
    (g_plain,) = grad_of(policy_loss(LossConfig(algorithm="grpo"), raw.batch(per_token=True), raw.normalisers())[0], raw.logprobs)
    keep = torch.tensor([True, False, False, True, True, True, True, True])  # Eq. 9's M_it
    assert torch.count_nonzero(g_plain) == 8
    assert torch.allclose(grad, torch.where(keep, g_plain, 0.0), rtol=1e-6)
    assert metrics["rc_opsm_masked"].item() == pytest.approx(0.5)  # half of the first sequence's tokens
