"""Packed vs padded layouts, micro-batch splits with global normalisers, empty and masked batches."""
import pytest
import torch
from tests.algorithms.helpers import grad_of, random_raw

from gspo_megatron.algorithms import (
    LossConfig,
    LossNormalisers,
    Segments,
    TokenBatch,
    finalize_metrics,
    merge_metrics,
    packed_batch,
    padded_batch,
    policy_loss,
)
from gspo_megatron.typed_config import build

CONFIGS = [
    {"algorithm": "gspo"},
    {"algorithm": "gspo", "clip_low": 0.2, "clip_high": 0.2, "kl_coef": 0.05, "entropy_coef": 0.01, "tis_mode": "sequence"},
    {"algorithm": "gspo_token", "kl_coef": 0.05, "kl_estimator": "k2", "tis_mode": "token"},
    {"algorithm": "grpo", "entropy_coef": 0.01, "tis_mode": "token"},
    {"algorithm": "grpo", "aggregation": "token_mean", "kl_coef": 0.1, "kl_estimator": "k1"},
    {"algorithm": "grpo", "aggregation": "token_sum", "constant_length_tokens": 32},
    {"algorithm": "sapo", "kl_coef": 0.05, "tis_mode": "sequence"},
    {"algorithm": "cispo", "entropy_coef": 0.01, "rollout_correction": {"icepop": True, "icepop_low": 0.99, "icepop_high": 1.01}},
    {"algorithm": "grpo", "dual_clip_c": 1.01, "clip_low": 0.005, "clip_high": 0.005,
     "rollout_correction": {"seq_mask": "geometric", "seq_mask_low": 0.997, "seq_mask_high": 1.003, "opsm": True, "opsm_delta": 0.0}},
    {"algorithm": "gspo", "clip_low": 0.2, "clip_high": 0.2, "dual_clip_c": 1.5,
     "rollout_correction": {"seq_mask": "sequence", "seq_mask_low": 0.98, "seq_mask_high": 1.02, "opsm": True, "opsm_delta": 0.0}},
]
LENGTHS = [3, 9, 1, 6, 12, 4, 7, 2]


def to_padded(raw, x, fill):
    out = torch.full((len(raw.lengths), max(raw.lengths)), fill, dtype=x.dtype)
    for i, part in enumerate(x.split(raw.lengths)):
        out[i, : part.numel()] = part
    return out


@pytest.mark.parametrize(
    "config, per_token",
    [(c, False) for c in CONFIGS] + [(c, True) for c in CONFIGS if c["algorithm"] != "gspo"],  # gspo: one advantage per sequence
)
def test_packed_equals_padded(config, per_token):
    cfg = build(LossConfig, config, "loss")
    raw = random_raw(LENGTHS, seed=21, scale=0.01, mask_frac=0.2)
    packed_loss, packed_m = policy_loss(cfg, raw.batch(per_token=per_token), raw.normalisers())
    # padding holds garbage (inf / NaN) that must never reach a value or a gradient
    lp = to_padded(raw, raw.logprobs.detach(), float("nan")).requires_grad_(True)
    ent = to_padded(raw, raw.entropy.detach(), float("inf")).requires_grad_(True)
    padded = padded_batch(
        lp,
        to_padded(raw, raw.old, float("-inf")),
        to_padded(raw, raw.mask, False),
        to_padded(raw, raw.token_advantages, float("nan")) if per_token else raw.advantages,
        ref_logprobs=to_padded(raw, raw.ref, float("inf")),
        entropy=ent,
        rollout_logprobs=to_padded(raw, raw.rollout, float("nan")),
    )
    padded_loss, padded_m = policy_loss(cfg, padded, raw.normalisers())
    assert torch.allclose(packed_loss, padded_loss, rtol=1e-5, atol=1e-8)
    g_packed = grad_of(packed_loss, raw.logprobs, raw.entropy)
    g_padded = grad_of(padded_loss, lp, ent)
    for a, b in zip(g_packed, g_padded):
        assert torch.isfinite(b).all()
        assert torch.allclose(to_padded(raw, a, 0.0), b, rtol=1e-5, atol=1e-9)
    for key, value in finalize_metrics(packed_m).items():
        assert torch.allclose(value, finalize_metrics(padded_m)[key], rtol=1e-5, atol=1e-6), key


@pytest.mark.parametrize("config", CONFIGS)
def test_micro_batch_split_with_global_normalisers(config):
    cfg = build(LossConfig, config, "loss")
    raw = random_raw(LENGTHS, seed=22, scale=0.01, mask_frac=0.2)
    n = raw.normalisers()
    whole, whole_m = policy_loss(cfg, raw.batch(), n)
    grads_whole = grad_of(whole, raw.logprobs, raw.entropy)

    total, parts = 0.0, []
    cuts = [0, 3, 4, 8]  # sequences [0,3), [3,4), [4,8)
    starts = raw.cu_seqlens
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        t0, t1 = int(starts[lo]), int(starts[hi])
        micro = packed_batch(
            raw.logprobs[t0:t1],
            raw.old[t0:t1],
            cu_seqlens=starts[lo : hi + 1] - t0,
            advantages=raw.advantages[lo:hi],
            mask=raw.mask[t0:t1],
            ref_logprobs=raw.ref[t0:t1],
            entropy=raw.entropy[t0:t1],
            rollout_logprobs=raw.rollout[t0:t1],
        )
        loss, m = policy_loss(cfg, micro, n)
        total = total + loss
        parts.append(m)
    assert torch.allclose(total, whole, rtol=1e-5, atol=1e-8)
    for a, b in zip(grads_whole, grad_of(total, raw.logprobs, raw.entropy)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-9)
    merged, reference = finalize_metrics(merge_metrics(parts)), finalize_metrics(whole_m)
    assert merged.keys() == reference.keys()
    for key in reference:
        assert torch.allclose(merged[key], reference[key], rtol=1e-5, atol=1e-6), key


def test_local_normalisers_would_break_the_split():
    """The split test can fail: per-micro-batch normalisers give a different total."""
    raw = random_raw(LENGTHS, seed=23, scale=0.01)
    cfg = LossConfig()
    whole, _ = policy_loss(cfg, raw.batch(extras=False), raw.normalisers())
    halves = []
    for lo, hi in ((0, 3), (3, 8)):
        t0, t1 = int(raw.cu_seqlens[lo]), int(raw.cu_seqlens[hi])
        micro = packed_batch(raw.logprobs[t0:t1], raw.old[t0:t1], cu_seqlens=raw.cu_seqlens[lo : hi + 1] - t0, advantages=raw.advantages[lo:hi])
        halves.append(policy_loss(cfg, micro, LossNormalisers(hi - lo, t1 - t0))[0])
    assert not torch.allclose(halves[0] + halves[1], whole, rtol=1e-3)


@pytest.mark.parametrize("config", CONFIGS)
def test_all_masked_and_empty_micro_batches(config):
    cfg = build(LossConfig, config, "loss")
    raw = random_raw([4, 3], seed=24)
    raw.mask[:] = False
    n = LossNormalisers(num_seqs=5.0, num_tokens=40.0)  # the rest of the mini-batch lives elsewhere
    loss, m = policy_loss(cfg, raw.batch(), n)
    g = grad_of(loss, raw.logprobs, raw.entropy)
    assert loss.item() == 0.0 and all(torch.count_nonzero(x) == 0 for x in g)
    assert all(torch.isfinite(v) for v in finalize_metrics(m).values())
    assert m["tokens"].item() == 0 and m["seqs"].item() == 0

    empty = torch.zeros(0, requires_grad=True)
    zero = torch.zeros(0)
    batch = TokenBatch(empty, zero, torch.zeros(0, dtype=torch.bool), Segments(torch.zeros(0, dtype=torch.long), 0),
                       advantages=torch.zeros(0), ref_logprobs=zero, entropy=zero, rollout_logprobs=zero)
    loss, m = policy_loss(cfg, batch, LossNormalisers(0.0, 0.0))
    assert loss.item() == 0.0 and all(torch.isfinite(v) for v in finalize_metrics(m).values())


def test_unsorted_sequence_ids():
    raw = random_raw([3, 5, 2], seed=25, scale=0.05)
    batch = raw.batch(extras=False)
    perm = torch.randperm(batch.segments.num_tokens, generator=torch.Generator().manual_seed(0))
    shuffled = TokenBatch(raw.logprobs[perm], raw.old[perm], raw.mask[perm], Segments(batch.segments.seq_ids[perm], 3), advantages=raw.advantages)
    for algorithm in ("gspo", "gspo_token", "grpo"):
        a, _ = policy_loss(LossConfig(algorithm=algorithm), batch, raw.normalisers())
        b, _ = policy_loss(LossConfig(algorithm=algorithm), shuffled, raw.normalisers())
        assert torch.allclose(a, b, rtol=1e-6), algorithm


def test_bfloat16_logprobs_get_a_bfloat16_gradient():
    raw = random_raw([3, 5], seed=26, scale=0.05)
    lp = raw.logprobs.detach().to(torch.bfloat16).requires_grad_(True)
    for algorithm in ("gspo", "gspo_token", "grpo"):
        batch = packed_batch(lp, raw.old, cu_seqlens=raw.cu_seqlens, advantages=raw.advantages)
        loss, _ = policy_loss(LossConfig(algorithm=algorithm, clip_low=0.5, clip_high=0.5), batch, raw.normalisers())
        (g,) = grad_of(loss, lp)
        assert g.dtype == torch.bfloat16 and torch.count_nonzero(g) > 0, algorithm


def test_shape_errors_name_the_field():
    raw = random_raw([3, 5])
    with pytest.raises(ValueError, match="TokenBatch.old_logprobs"):
        packed_batch(raw.logprobs, raw.old[:-1], cu_seqlens=raw.cu_seqlens, advantages=raw.advantages)
    with pytest.raises(ValueError, match="TokenBatch.advantages"):
        packed_batch(raw.logprobs, raw.old, cu_seqlens=raw.cu_seqlens, advantages=raw.advantages[:1])
    with pytest.raises(ValueError, match="exactly one"):
        packed_batch(raw.logprobs, raw.old, cu_seqlens=raw.cu_seqlens)
    with pytest.raises(ValueError, match="kl_coef"):
        policy_loss(LossConfig(kl_coef=0.1), raw.batch(extras=False), raw.normalisers())
