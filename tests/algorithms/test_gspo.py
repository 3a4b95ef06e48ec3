"""GSPO (Eq. 5, 7, 10) and GSPO-token (Eq. 13-17): values, closed-form gradients, clipping, invariances."""
import math

import pytest
import torch
from tests.algorithms.helpers import grad_of, random_raw

from gspo_megatron.typed_config import build
from gspo_megatron.algorithms import (
    LossConfig,
    LossNormalisers,
    SequenceSums,
    gspo_loss,
    gspo_loss_from_sums,
    gspo_token_loss,
    packed_batch,
    policy_loss,
    sequence_sums,
)

PAPER = LossConfig(algorithm="gspo")  # the paper's clip range, 3e-4 / 4e-4
WIDE = LossConfig(algorithm="gspo", clip_low=0.5, clip_high=0.5)  # nothing clips: the pure Eq. 10 regime


def seq_batch(log_ratios: list[list[float]], advantages: list[float]):
    """A packed batch whose sequence i has exactly the given per-token log-ratios."""
    lr = torch.tensor([x for seq in log_ratios for x in seq])
    old = -torch.linspace(0.5, 3.0, lr.numel())
    new = (old + lr).requires_grad_(True)
    cu = torch.tensor([0] + torch.tensor([len(s) for s in log_ratios]).cumsum(0).tolist())
    return new, packed_batch(new, old, cu_seqlens=cu, advantages=torch.tensor(advantages))


def norm(num_seqs, num_tokens=1.0):
    return LossNormalisers(num_seqs=float(num_seqs), num_tokens=float(num_tokens))


def test_value_by_hand():
    # seq 0: mean log-ratio 0.0001 -> s = e^1e-4 inside [1-3e-4, 1+4e-4]; seq 1: mean 0.001 -> clipped at 1.0004
    _, batch = seq_batch([[0.0002, 0.0], [0.001, 0.002, 0.0]], [2.0, 3.0])
    loss, metrics = gspo_loss(batch, norm(2), PAPER)
    s0, s1 = math.exp(1e-4), math.exp(1e-3)
    expected = -(min(s0 * 2, s0 * 2) + min(s1 * 3, 1.0004 * 3)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["clip_high_seqs"].item() == 1 and metrics["clip_high_tokens"].item() == 3
    assert metrics["clip_low_seqs"].item() == 0


def test_gradient_is_eq10_on_unclipped_sequences():
    raw = random_raw([3, 7, 1, 12, 5], seed=1, scale=0.05)
    batch = raw.batch(extras=False)
    loss, _ = gspo_loss(batch, raw.normalisers(), WIDE)
    (grad,) = grad_of(loss, raw.logprobs)
    # Eq. 10: every token of sequence i gets  -(1/G) s_i A_i / |y_i|
    sums = sequence_sums(batch)
    s = torch.exp(sums.log_ratio.detach() / sums.tokens)
    per_seq = -(s * raw.advantages) / sums.tokens / len(raw.lengths)
    assert ((s > 0.5) & (s < 1.5)).all()
    assert torch.allclose(grad, batch.segments.expand(per_seq), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize(
    "mean_log_ratio, advantage, stopped",
    [
        (0.01, 1.0, True),  # s > 1 + eps_high with A > 0: clipped, no gradient
        (-0.01, -1.0, True),  # s < 1 - eps_low with A < 0: clipped, no gradient
        (0.01, -1.0, False),  # s > 1 + eps_high with A < 0: the min keeps s * A, gradient flows
        (-0.01, 1.0, False),  # s < 1 - eps_low with A > 0: gradient flows
    ],
)
def test_clipping_stops_the_gradient_on_one_side_only(mean_log_ratio, advantage, stopped):
    new, batch = seq_batch([[mean_log_ratio] * 4, [0.0] * 3], [advantage, 1.0])
    loss, metrics = gspo_loss(batch, norm(2), PAPER)
    (grad,) = grad_of(loss, new)
    if stopped:
        assert torch.count_nonzero(grad[:4]) == 0
        assert metrics["clip_low_seqs"].item() + metrics["clip_high_seqs"].item() == 1
    else:
        s = math.exp(mean_log_ratio)
        assert torch.allclose(grad[:4], torch.full((4,), -s * advantage / 4 / 2), rtol=1e-5)
        assert metrics["clip_low_seqs"].item() + metrics["clip_high_seqs"].item() == 0
    assert torch.allclose(grad[4:], torch.full((3,), -1.0 / 3 / 2), rtol=1e-5)  # the unclipped neighbour


def test_length_does_not_weight_a_sequence():
    # the same two sequence terms with their lengths swapped: a token mean would change, GSPO must not
    _, short_first = seq_batch([[0.01, -0.01, 0.0], [0.002] * 30], [1.0, -2.0])
    _, long_first = seq_batch([[0.01, -0.01, 0.0] * 10, [0.002] * 3], [1.0, -2.0])
    a, _ = gspo_loss(short_first, norm(2), WIDE)
    b, _ = gspo_loss(long_first, norm(2), WIDE)
    assert a.item() == pytest.approx(b.item(), rel=1e-6)
    grpo_like = LossConfig(algorithm="grpo", aggregation="token_mean", clip_low=0.5, clip_high=0.5)
    c, _ = policy_loss(grpo_like, short_first, norm(2, 33))
    d, _ = policy_loss(grpo_like, long_first, norm(2, 33))
    assert abs(c.item() - d.item()) > 1e-3  # the check above can tell the difference


def test_loss_from_sums_is_the_same_function():
    raw = random_raw([4, 2, 9], seed=2, scale=1e-3)
    batch = raw.batch(extras=False)
    loss, _ = gspo_loss(batch, raw.normalisers(), PAPER)
    again, _ = gspo_loss_from_sums(
        sequence_sums(batch), raw.advantages, raw.normalisers(), clip_low=PAPER.clip_low, clip_high=PAPER.clip_high
    )
    assert torch.allclose(loss, again)


def test_exponent_is_guarded():
    new, batch = seq_batch([[80.0, 90.0], [-1e4, -1e4, -1e4]], [-1.0, 1.0])
    loss, metrics = gspo_loss(batch, norm(2), PAPER)
    (grad,) = grad_of(loss, new)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert metrics["seq_ratio_max"].item() == pytest.approx(math.exp(20), rel=1e-5)
    tok_loss, _ = gspo_token_loss(batch, norm(2), PAPER)
    (tok_grad,) = grad_of(tok_loss, new)
    assert torch.allclose(loss, tok_loss) and torch.equal(grad, tok_grad)


# ---- GSPO-token ----------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1e-5, 3e-4, 0.05])  # none, some and most sequences clipped
def test_gspo_token_equals_gspo_with_constant_advantages(scale):
    raw = random_raw([5, 1, 9, 3, 14, 2, 7], seed=3, scale=scale, mask_frac=0.2)
    seq_batch_ = raw.batch(extras=False)
    tok_batch = packed_batch(
        raw.logprobs, raw.old, cu_seqlens=raw.cu_seqlens, mask=raw.mask, token_advantages=seq_batch_.segments.expand(raw.advantages)
    )
    a, ma = gspo_loss(seq_batch_, raw.normalisers(), PAPER)
    b, mb = gspo_token_loss(tok_batch, raw.normalisers(), PAPER)
    assert torch.allclose(a, b, rtol=1e-6, atol=1e-8)
    (ga,) = grad_of(a, raw.logprobs)
    (gb,) = grad_of(b, raw.logprobs)
    assert torch.allclose(ga, gb, rtol=1e-5, atol=1e-10)
    for key in ("clip_low_tokens", "clip_high_tokens", "clip_low_seqs", "clip_high_seqs"):
        assert torch.allclose(ma[key], mb[key], atol=1e-5), key
    if scale == 0.05:
        assert ma["clip_low_seqs"] + ma["clip_high_seqs"] > 0  # the clipped case was exercised


def test_gspo_token_weights_tokens_by_their_own_advantage():
    raw = random_raw([6, 4], seed=4, scale=0.05)
    batch = raw.batch(per_token=True, extras=False)
    loss, _ = gspo_token_loss(batch, raw.normalisers(), WIDE)
    (grad,) = grad_of(loss, raw.logprobs)
    sums = sequence_sums(batch)
    s = torch.exp(sums.log_ratio.detach() / sums.tokens)
    seg = batch.segments
    expected = -seg.expand(s / sums.tokens) * raw.token_advantages / 2  # Eq. 17 with A_it
    assert torch.allclose(grad, expected, rtol=1e-5, atol=1e-10)
    # GSPO with each sequence's mean advantage has a different gradient
    mean_adv = seg.sum(raw.token_advantages) / sums.tokens
    as_seq = packed_batch(raw.logprobs, raw.old, cu_seqlens=raw.cu_seqlens, advantages=mean_adv)
    (grad_seq,) = grad_of(gspo_loss(as_seq, raw.normalisers(), WIDE)[0], raw.logprobs)
    assert not torch.allclose(grad, grad_seq, atol=1e-4)


def test_gspo_needs_sequence_advantages():
    raw = random_raw([3, 3])
    with pytest.raises(ValueError, match="gspo_token"):
        gspo_loss(raw.batch(per_token=True), raw.normalisers(), PAPER)


@pytest.mark.parametrize("loss_fn", [gspo_loss, gspo_token_loss])
def test_gspo_refuses_a_token_aggregation(loss_fn):
    raw = random_raw([3, 3])
    batch = raw.batch(per_token=loss_fn is gspo_token_loss)
    with pytest.raises(ValueError, match="aggregation='token_mean' applies to grpo and cispo only"):
        loss_fn(batch, raw.normalisers(), LossConfig(aggregation="token_mean"))


# ---- the context-parallel seam ------------------------------------------------------------------


def split_halves(raw):
    """Give each rank about half of every sequence's tokens (what CP does), as two packed batches."""
    batch = raw.batch()
    seg = batch.segments
    position = torch.arange(seg.num_tokens) - raw.cu_seqlens[seg.seq_ids]
    lengths = torch.tensor(raw.lengths)[seg.seq_ids]
    on_rank0 = position < (lengths + 1) // 2
    parts = []
    for keep in (on_rank0, ~on_rank0):
        idx = keep.nonzero().squeeze(1)
        sub = dict(
            logprobs=raw.logprobs[idx],
            old_logprobs=raw.old[idx],
            mask=raw.mask[idx],
            segments=type(seg)(seg.seq_ids[idx], seg.num_seqs),
            advantages=raw.advantages,
            ref_logprobs=raw.ref[idx],
            entropy=raw.entropy[idx],
            rollout_logprobs=raw.rollout[idx],
        )
        parts.append(type(batch)(**sub))
    return parts


@pytest.mark.parametrize(
    "config",
    [
        {"algorithm": "gspo", "tis_mode": "sequence", "kl_coef": 0.1, "entropy_coef": 0.01},
        {"algorithm": "gspo_token", "clip_low": 0.01, "clip_high": 0.01, "kl_coef": 0.1},
        {"algorithm": "grpo", "tis_mode": "sequence", "entropy_coef": 0.01},
        {"algorithm": "sapo", "rollout_correction": {"seq_mask": "geometric", "seq_mask_low": 0.997, "seq_mask_high": 1.003,
                                                     "opsm": True, "opsm_delta": 0.0}},
        {"algorithm": "cispo", "kl_coef": 0.1, "rollout_correction": {"icepop": True, "icepop_low": 0.99, "icepop_high": 1.01}},
        {"algorithm": "gspo", "clip_low": 0.002, "clip_high": 0.002, "dual_clip_c": 1.001,
         "rollout_correction": {"seq_mask": "sequence", "seq_mask_low": 0.98, "seq_mask_high": 1.02, "opsm": True, "opsm_delta": 0.0}},
    ],
)
def test_context_parallel_split_reproduces_loss_and_gradient(config):
    cfg = build(LossConfig, config, "loss")
    raw = random_raw([5, 8, 1, 6, 11], seed=5, scale=3e-3, mask_frac=0.1)
    n = raw.normalisers()
    whole, whole_metrics = policy_loss(cfg, raw.batch(), n)
    grads_whole = grad_of(whole, raw.logprobs, raw.entropy)

    rank0, rank1 = split_halves(raw)
    sums0, sums1 = sequence_sums(rank0), sequence_sums(rank1)

    def all_reduce_with(other):  # single-process stand-in for an autograd SUM all-reduce over the CP group
        return lambda local: SequenceSums(
            local.log_ratio + other.log_ratio, local.tokens + other.tokens, local.rollout_log_ratio + other.rollout_log_ratio
        )

    loss0, m0 = policy_loss(cfg, rank0, n, reduce_sequence_sums=all_reduce_with(sums1))
    loss1, m1 = policy_loss(cfg, rank1, n, reduce_sequence_sums=all_reduce_with(sums0))
    assert torch.allclose(loss0 + loss1, whole, rtol=1e-5, atol=1e-8)
    grads_split = grad_of(loss0 + loss1, raw.logprobs, raw.entropy)
    for a, b in zip(grads_whole, grads_split):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-9)
    keys = ("seqs", "tokens", "clip_low_seqs", "clip_high_tokens", "seq_ratio_sum", "adv_sum", "clip_dual_tokens",
            "rc_seq_masked", "rc_opsm_masked", "rc_icepop_masked", "sapo_gate_slope_sum", "cispo_clipped_tokens")
    for key in keys:
        if key in whole_metrics:
            assert torch.allclose(m0[key] + m1[key], whole_metrics[key], rtol=1e-5, atol=1e-6), key
