"""GRPO: per-token ratios (Eq. 11-12), clip-higher, aggregation modes."""
import pytest
import torch
from tests.algorithms.helpers import grad_of, random_raw

from gspo_megatron.algorithms import LossConfig, grpo_loss, policy_loss

GRPO = LossConfig(algorithm="grpo")  # the paper's clip-higher range, 0.2 / 0.27


def reference_terms(raw, clip_low, clip_high, per_token=False):
    """Plain autograd expression of Eq. 2 per token (0 off the mask)."""
    ratio = torch.exp(raw.logprobs - raw.old)
    adv = raw.token_advantages if per_token else raw.advantages.repeat_interleave(torch.tensor(raw.lengths))
    obj = torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    return torch.where(raw.mask, -obj, 0.0)


def test_gradient_weights_each_token_by_its_own_ratio():
    raw = random_raw([4, 9, 2, 6], seed=11, scale=0.3, mask_frac=0.2)
    batch = raw.batch(per_token=True, extras=False)
    loss, metrics = grpo_loss(batch, raw.normalisers(), GRPO)
    (grad,) = grad_of(loss, raw.logprobs)
    ratio = torch.exp(raw.logprobs.detach() - raw.old)
    adv = raw.token_advantages
    active = ((ratio < 0.8) & (adv < 0)) | ((ratio > 1.27) & (adv > 0))
    lengths = batch.segments.expand(batch.segments.sum(raw.mask.float()))
    # Eq. 11-12: d/d log pi(y_t) = -(1/G)(1/|y_i|) * ratio_t * A_t for unclipped tokens, 0 where clipped
    expected = torch.where(raw.mask & ~active, -ratio * adv / lengths / len(raw.lengths), 0.0)
    assert active.any() and (~active & raw.mask).any()
    assert torch.allclose(grad, expected, rtol=1e-5, atol=1e-9)
    assert metrics["clip_low_tokens"].item() + metrics["clip_high_tokens"].item() == (active & raw.mask).sum().item()
    # unlike GSPO, tokens of one sequence get different weights
    seq0 = grad[:4][raw.mask[:4] & ~active[:4]]
    assert seq0.numel() < 2 or not torch.allclose(seq0, seq0[0].expand_as(seq0))


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize(
    "aggregation, divide",
    [
        ("seq_mean_token_mean", None),
        ("token_mean", "tokens"),
        ("token_sum", "constant"),
    ],
)
def test_aggregation_modes_match_the_reference(aggregation, divide, per_token):
    raw = random_raw([3, 10, 5], seed=12, scale=0.2, mask_frac=0.25)
    cfg = LossConfig(algorithm="grpo", aggregation=aggregation, constant_length_tokens=16)
    loss, _ = policy_loss(cfg, raw.batch(per_token=per_token, extras=False), raw.normalisers())
    terms = reference_terms(raw, 0.2, 0.27, per_token)
    if divide is None:
        per_seq = torch.stack([t.sum() / m.sum() for t, m in zip(terms.split(raw.lengths), raw.mask.split(raw.lengths))])
        expected = per_seq.mean()
    elif divide == "tokens":
        expected = terms.sum() / raw.mask.sum()
    else:
        expected = terms.sum() / (3 * 16)
    assert torch.allclose(loss, expected, rtol=1e-5)
    (g1,) = grad_of(loss, raw.logprobs)
    (g2,) = grad_of(expected, raw.logprobs)
    assert torch.allclose(g1, g2, rtol=1e-4, atol=1e-9)


def test_clip_higher_defaults_are_asymmetric():
    raw = random_raw([8], seed=13)
    with torch.no_grad():
        raw.logprobs.copy_(raw.old + torch.log(torch.tensor([0.79, 0.81, 1.0, 1.2, 1.26, 1.28, 1.5, 0.5])))
    raw.advantages.fill_(1.0)
    _, m_pos = grpo_loss(raw.batch(extras=False), raw.normalisers(), GRPO)
    raw.advantages.fill_(-1.0)
    _, m_neg = grpo_loss(raw.batch(extras=False), raw.normalisers(), GRPO)
    assert m_pos["clip_high_tokens"].item() == 2  # 1.28, 1.5 > 1.27 (a symmetric 0.2 would also clip 1.26)
    assert m_neg["clip_low_tokens"].item() == 2  # 0.79, 0.5 < 0.8
    assert m_pos["clip_low_tokens"].item() == 0 and m_neg["clip_high_tokens"].item() == 0


def test_exponent_guard_matches_clamped_reference():
    raw = random_raw([4], seed=14)
    with torch.no_grad():  # log-ratios beyond the +-20 guard on the side the clip does not stop (A < 0 above, A > 0 below)
        raw.logprobs.copy_(raw.old + torch.tensor([25.0, -25.0, 0.1, 19.0]))
    raw.token_advantages.copy_(torch.tensor([-1.0, 1.0, -1.0, -1.0]))
    loss, metrics = grpo_loss(raw.batch(per_token=True, extras=False), raw.normalisers(), GRPO)
    (grad,) = grad_of(loss, raw.logprobs)
    ratio = torch.exp((raw.logprobs - raw.old).clamp(-20, 20))
    adv = raw.token_advantages
    reference = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.27) * adv).mean()
    (ref_grad,) = grad_of(reference, raw.logprobs)
    assert torch.allclose(loss, reference, rtol=1e-6)
    assert torch.allclose(grad, ref_grad, rtol=1e-5)
    assert grad[0] == 0 and grad[1] == 0 and grad[3] != 0
    assert metrics["token_ratio_max"].item() == pytest.approx(torch.exp(torch.tensor(20.0)).item(), rel=1e-5)
