"""The fused ops (clipped objective, KL, entropy, segment sums) against plain autograd of the unfused
formulas, float64 gradcheck, forced chunking, extreme values, and the memory target of issue #3."""
import importlib.util
from pathlib import Path

import pytest
import torch
from tests.algorithms.helpers import grad_of, random_raw

from gspo_megatron.algorithms import (
    RolloutCorrectionConfig,
    LossConfig,
    aggregate_token_terms,
    count_normalisers,
    entropy_bonus,
    kl_estimate,
    kl_penalty,
    layout,
    masked_log_ratio,
    packed_batch,
    policy_loss,
    sequence_sums,
)
from gspo_megatron.algorithms.sequences import segment_log_ratio_sums

LENGTHS = [3, 7, 1, 5, 9, 2]


@pytest.fixture(params=["whole", "tiny_chunks"])
def chunking(request, monkeypatch):
    """Run each test once with the default chunks (one chunk here) and once with chunks of 2 tokens."""
    if request.param == "tiny_chunks":
        monkeypatch.setattr(layout, "MIN_CHUNK_TOKENS", 2)
        monkeypatch.setattr(layout, "SCRATCH_CHUNKS", 10_000)
    return request.param


def batch64(log_ratios, *, seed=0, per_token=False, mask_frac=0.2, lengths=LENGTHS):
    """A float64 packed batch whose response tokens have exactly the given log-ratios; padding is NaN."""
    gen = torch.Generator().manual_seed(seed)
    n, s = sum(lengths), len(lengths)
    old = -torch.rand(n, generator=gen, dtype=torch.float64) * 3
    mask = torch.rand(n, generator=gen) >= mask_frac
    mask[torch.tensor(lengths).cumsum(0) - 1] = True  # every sequence keeps a token
    new = (old + torch.as_tensor(log_ratios, dtype=torch.float64)).requires_grad_(True)
    entropy = (torch.rand(n, generator=gen, dtype=torch.float64) * 2).requires_grad_(True)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5, 0.7, -0.3], dtype=torch.float64)[:s]
    token_adv = torch.randn(n, generator=gen, dtype=torch.float64)
    extras = {
        "ref_logprobs": old + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64),
        "rollout_logprobs": old + 0.2 * torch.randn(n, generator=gen, dtype=torch.float64),
        "entropy": entropy,
    }
    batch = packed_batch(
        new, old, cu_seqlens=cu, mask=mask,
        advantages=None if per_token else adv, token_advantages=token_adv if per_token else None, **extras,
    )
    return batch, count_normalisers(mask, batch.segments)


def spread_log_ratios(n, seed=0):
    """Log-ratios well inside and well outside GRPO's clip range [log 0.8, log 1.27], none near a bound."""
    gen = torch.Generator().manual_seed(seed)
    choices = torch.tensor([-0.6, -0.4, -0.1, -0.03, 0.0, 0.02, 0.1, 0.15, 0.4, 0.7], dtype=torch.float64)
    return choices[torch.randint(0, len(choices), (n,), generator=gen)]


# ---- plain-autograd references of the unfused formulas --------------------------------------------


def reference_grpo(batch, normalisers, clip_low, clip_high, aggregation="seq_mean_token_mean", constant=0, token_weights=None):
    """Eq. 2 per token with autograd through min / clamp / exp, then the public (unfused) aggregation."""
    log_r = masked_log_ratio(batch.logprobs, batch.old_logprobs, batch.mask)
    r = torch.exp(log_r.clamp(-20, 20))
    adv = batch.token_advantage().to(r.dtype)
    obj = torch.minimum(r * adv, r.clamp(1 - clip_low, 1 + clip_high) * adv)
    if token_weights is not None:
        obj = obj * token_weights
    terms = torch.where(batch.mask, -obj, 0.0)
    seq_tokens = batch.segments.sum(batch.mask.to(r.dtype))
    return aggregate_token_terms(terms, batch.segments, seq_tokens, normalisers, aggregation, constant)


def reference_gspo_token(batch, normalisers, clip_low, clip_high):
    """Eq. 13-14 literally: s_it = sg[s_i] * exp(log pi - sg[log pi]), gated where the exponent clamp is hit."""
    seg = batch.segments
    with torch.no_grad():
        sums = sequence_sums(batch)
        mean = sums.log_ratio / sums.tokens.clamp(min=1)
        log_s = seg.expand(mean.clamp(-20, 20))
        gate = seg.expand((mean.abs() <= 20).to(log_s.dtype))
    lp = batch.logprobs.to(log_s.dtype)
    s_it = torch.exp(log_s + gate * (lp - lp.detach()))
    adv = batch.token_advantage().to(s_it.dtype)
    obj = torch.minimum(s_it * adv, s_it.clamp(1 - clip_low, 1 + clip_high) * adv)
    terms = torch.where(batch.mask, -obj, 0.0)
    return aggregate_token_terms(terms, seg, sums.tokens, normalisers, "seq_mean_token_mean")


# ---- gradients ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, per_token",
    [
        ({"algorithm": "grpo"}, False),
        ({"algorithm": "grpo", "aggregation": "token_mean", "tis_mode": "token"}, True),
        ({"algorithm": "grpo", "aggregation": "token_sum", "constant_length_tokens": 12, "tis_mode": "sequence"}, False),
        ({"algorithm": "grpo", "kl_coef": 0.2, "kl_estimator": "k3", "entropy_coef": 0.05}, True),
        ({"algorithm": "gspo", "clip_low": 0.05, "clip_high": 0.05, "kl_coef": 0.1, "kl_estimator": "k2", "entropy_coef": 0.02}, False),
        ({"algorithm": "gspo", "clip_low": 0.05, "clip_high": 0.05, "tis_mode": "sequence", "kl_coef": 0.1, "kl_estimator": "k1"}, False),
        ({"algorithm": "grpo", "dual_clip_c": 1.5, "tis_mode": "sequence"}, False),
        ({"algorithm": "sapo", "tis_mode": "token", "kl_coef": 0.1}, False),
        ({"algorithm": "sapo", "entropy_coef": 0.02,
          "rollout_correction": RolloutCorrectionConfig(icepop=True, icepop_low=0.95, icepop_high=1.05)}, True),
    ],
)
def test_gradcheck_float64(config, per_token, chunking):
    """Numerical vs analytical Jacobian in float64 (GRPO, GSPO and SAPO are true gradients of their values;
    GSPO-token's stop-gradients make it one only in the sense of Eq. 14, checked in the next test, and
    CISPO's detached weight only in the sense of its surrogate, checked in test_stability.py)."""
    cfg = LossConfig(**config)
    n = sum(LENGTHS)
    scale = 1.0 if cfg.algorithm == "grpo" else 0.02  # GSPO: sequence means clear of the 0.05 clip bounds
    batch, normalisers = batch64(scale * spread_log_ratios(n, seed=1), seed=1, per_token=per_token)
    logprobs, entropy = batch.logprobs, batch.entropy

    def loss(lp, ent):
        b = packed_batch(
            lp, batch.old_logprobs, segments=batch.segments, mask=batch.mask, advantages=batch.advantages,
            token_advantages=batch.token_advantages, ref_logprobs=batch.ref_logprobs,
            rollout_logprobs=batch.rollout_logprobs, entropy=ent,
        )
        return policy_loss(cfg, b, normalisers)[0]

    _, metrics = policy_loss(cfg, batch, normalisers)
    if cfg.algorithm == "grpo":  # both the clipped and the unclipped branches are exercised
        clipped = metrics["clip_low_tokens"] + metrics["clip_high_tokens"]
        assert 0 < clipped < metrics["tokens"]
    assert torch.autograd.gradcheck(loss, (logprobs, entropy))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize(
    "aggregation, tis",
    [("seq_mean_token_mean", "none"), ("token_mean", "token"), ("token_sum", "sequence")],
)
def test_fused_grpo_equals_unfused_autograd(dtype, per_token, aggregation, tis, chunking):
    batch, normalisers = batch64(spread_log_ratios(sum(LENGTHS), seed=2), seed=2, per_token=per_token)
    lp = batch.logprobs.detach().to(dtype).requires_grad_(True)
    batch = packed_batch(
        lp, batch.old_logprobs.to(dtype), segments=batch.segments, mask=batch.mask,
        advantages=None if per_token else batch.advantages.to(dtype),
        token_advantages=batch.token_advantages.to(dtype) if per_token else None,
        rollout_logprobs=batch.rollout_logprobs.to(dtype),
    )
    cfg = LossConfig(algorithm="grpo", aggregation=aggregation, constant_length_tokens=12, tis_mode=tis)
    loss, _ = policy_loss(cfg, batch, normalisers)
    weights = None
    if tis == "token":
        weights = torch.exp(masked_log_ratio(batch.old_logprobs, batch.rollout_logprobs, batch.mask).clamp(-20, 20)).clamp(max=2.0)
    elif tis == "sequence":
        sums = sequence_sums(batch)
        weights = batch.segments.expand(torch.exp(sums.rollout_log_ratio / sums.tokens.clamp(min=1)).clamp(max=2.0))
    expected = reference_grpo(batch, normalisers, 0.2, 0.27, aggregation, 12, weights)
    tol = {"rtol": 1e-12, "atol": 1e-15} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-8}
    assert loss.dtype == dtype
    assert torch.allclose(loss, expected, **tol)
    (g_fused,) = grad_of(loss, lp)
    (g_plain,) = grad_of(expected, lp)
    assert torch.count_nonzero(g_plain) > 0 and torch.count_nonzero(g_plain) < batch.mask.sum()  # some clipped
    assert torch.allclose(g_fused, g_plain, **tol)


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("scale", [1e-4, 3e-3, 30.0])  # none, some, all sequences clipped or out of the clamp
def test_fused_gspo_token_equals_unfused_autograd(per_token, scale, chunking):
    gen = torch.Generator().manual_seed(3)
    log_ratios = scale * torch.randn(sum(LENGTHS), generator=gen, dtype=torch.float64)
    batch, normalisers = batch64(log_ratios, seed=3, per_token=per_token)
    loss, _ = policy_loss(LossConfig(algorithm="gspo_token"), batch, normalisers)
    expected = reference_gspo_token(batch, normalisers, 3e-4, 4e-4)
    assert torch.allclose(loss, expected, rtol=1e-12, atol=1e-15)
    (g_fused,) = grad_of(loss, batch.logprobs)
    (g_plain,) = grad_of(expected, batch.logprobs)
    assert torch.allclose(g_fused, g_plain, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("algorithm", ["grpo", "gspo_token"])
def test_huge_log_ratios_stay_finite_and_match_the_reference(algorithm, chunking):
    big = torch.finfo(torch.float32).max
    log_ratios = torch.tensor([25.0, -25.0, 1e4, -1e4, 3e4, 19.0, -19.0, 0.3, 20.0, -20.0, 0.0, 5.0] * 3)[: sum(LENGTHS)]
    gen = torch.Generator().manual_seed(4)
    old = -torch.rand(sum(LENGTHS), generator=gen)
    old[0] = -big / 2  # a finite but huge difference
    new = (old + log_ratios).requires_grad_(True)
    mask = torch.ones(sum(LENGTHS), dtype=torch.bool)
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist())
    for sign in (1.0, -1.0):
        adv = sign * torch.tensor([1.0, -1.0, 2.0, -3.0, 1e3, -1e3])
        batch = packed_batch(new, old, cu_seqlens=cu, advantages=adv, mask=mask)
        normalisers = count_normalisers(mask, batch.segments)
        loss, metrics = policy_loss(LossConfig(algorithm=algorithm), batch, normalisers)
        (grad,) = grad_of(loss, new)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert all(torch.isfinite(v) for k, v in metrics.items() if not k.startswith(("token_ratio_m", "seq_ratio_m", "adv_m")))
        if algorithm == "grpo":
            expected = reference_grpo(batch, normalisers, 0.2, 0.27)
        else:
            expected = reference_gspo_token(batch, normalisers, 3e-4, 4e-4)
        (g_plain,) = grad_of(expected, new)
        assert torch.allclose(loss, expected, rtol=1e-5)
        assert torch.allclose(grad, g_plain, rtol=1e-5, atol=1e-12)


def test_clip_metrics_match_the_unfused_masks(chunking):
    raw = random_raw([4, 9, 2, 6, 11], seed=5, scale=0.3, mask_frac=0.25)
    batch = raw.batch(per_token=True, extras=False)
    _, m = policy_loss(LossConfig(algorithm="grpo"), batch, raw.normalisers())
    ratio = torch.exp(raw.logprobs.detach() - raw.old)
    adv = raw.token_advantages
    low = (ratio < 0.8) & (adv < 0) & raw.mask
    high = (ratio > 1.27) & (adv > 0) & raw.mask
    lengths = batch.segments.count(raw.mask).clamp(min=1)
    assert low.any() and high.any()
    assert m["clip_low_tokens"].item() == low.sum().item() and m["clip_high_tokens"].item() == high.sum().item()
    assert torch.allclose(m["clip_low_seqs"], (batch.segments.count(low) / lengths).sum())
    assert torch.allclose(m["clip_high_seqs"], (batch.segments.count(high) / lengths).sum())


def test_no_grad_forward_gives_the_same_loss_and_metrics():
    raw = random_raw(LENGTHS, seed=6, scale=0.2, mask_frac=0.2)
    for algorithm in ("gspo", "gspo_token", "grpo"):
        cfg = LossConfig(algorithm=algorithm, kl_coef=0.1, entropy_coef=0.01)
        with_grad, m1 = policy_loss(cfg, raw.batch(), raw.normalisers())
        with torch.no_grad():
            without, m2 = policy_loss(cfg, raw.batch(), raw.normalisers())
        assert not without.requires_grad
        assert torch.equal(with_grad.detach(), without), algorithm
        assert all(torch.equal(m1[k], m2[k]) for k in m1), algorithm


# ---- KL, entropy, segment sums --------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "token_mean"])
def test_fused_kl_equals_autograd_of_kl_estimate(estimator, aggregation, chunking):
    batch, normalisers = batch64(0.1 * spread_log_ratios(sum(LENGTHS)), seed=7)
    on = batch.mask.nonzero().squeeze(1)[:5]
    with torch.no_grad():  # beyond the k3 exponent clamp (log r > 20), beyond the 1e4 clamp, and NaN padding
        batch.ref_logprobs[on] = batch.logprobs[on] + torch.tensor([25.0, 90.0, -30.0, 2e4, -2e4], dtype=torch.float64)
        batch.ref_logprobs[~batch.mask] = float("nan")
    seq_tokens = batch.segments.count(batch.mask)
    value, metrics = kl_penalty(batch, normalisers, estimator=estimator, aggregation=aggregation)
    kl = kl_estimate(batch.logprobs, batch.ref_logprobs, batch.mask, estimator)
    expected = aggregate_token_terms(kl, batch.segments, seq_tokens, normalisers, aggregation)
    assert torch.allclose(value, expected, rtol=1e-12)
    assert torch.allclose(metrics["kl_sum"], kl.sum().float())
    (g_fused,) = grad_of(value, batch.logprobs)
    (g_plain,) = grad_of(expected, batch.logprobs)
    assert torch.isfinite(g_fused).all()
    assert torch.allclose(g_fused, g_plain, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_and_entropy_gradcheck(estimator, chunking):
    batch, normalisers = batch64(0.3 * spread_log_ratios(sum(LENGTHS)), seed=8)

    def kl(lp):
        b = packed_batch(lp, batch.old_logprobs, segments=batch.segments, mask=batch.mask, advantages=batch.advantages,
                         ref_logprobs=batch.ref_logprobs)
        return kl_penalty(b, normalisers, estimator=estimator, aggregation="seq_mean_token_mean")[0]

    def entropy(ent):
        b = packed_batch(batch.logprobs, batch.old_logprobs, segments=batch.segments, mask=batch.mask,
                         advantages=batch.advantages, entropy=ent)
        return entropy_bonus(b, normalisers, aggregation="token_sum", constant_length_tokens=8)[0]

    assert torch.autograd.gradcheck(kl, (batch.logprobs,))
    assert torch.autograd.gradcheck(entropy, (batch.entropy,))


def test_segment_log_ratio_sums_equal_autograd_of_the_two_ops(chunking):
    gen = torch.Generator().manual_seed(9)
    n = sum(LENGTHS)
    lp = torch.randn(n, generator=gen, dtype=torch.float64).requires_grad_(True)
    old = torch.randn(n, generator=gen, dtype=torch.float64).requires_grad_(True)
    with torch.no_grad():
        old[2] = lp[2] - 2e4  # beyond TOKEN_LOG_RATIO_LIMIT: no gradient
    mask = torch.rand(n, generator=gen) > 0.2
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist())
    batch = packed_batch(lp, old, cu_seqlens=cu, mask=mask, advantages=torch.zeros(len(LENGTHS), dtype=torch.float64))
    weights = torch.randn(len(LENGTHS), generator=gen, dtype=torch.float64)
    fused = (segment_log_ratio_sums(batch) * weights).sum()
    plain = (batch.segments.sum(masked_log_ratio(lp, old, mask)) * weights).sum()
    assert torch.allclose(fused, plain, rtol=1e-12)
    for a, b in zip(grad_of(fused, lp, old), grad_of(plain, lp, old)):
        assert torch.allclose(a, b, rtol=1e-12, atol=0.0)
    with torch.no_grad():
        old[2] = lp[2] - 0.5
    assert torch.autograd.gradcheck(
        lambda x, y: segment_log_ratio_sums(packed_batch(x, y, segments=batch.segments, mask=mask, advantages=batch.advantages)),
        (lp, old),
    )


def test_token_chunks_cover_the_stream(monkeypatch):
    assert layout.token_chunks(0) == []
    monkeypatch.setattr(layout, "MIN_CHUNK_TOKENS", 3)
    monkeypatch.setattr(layout, "SCRATCH_CHUNKS", 4)
    for n in (1, 2, 3, 11, 12, 13, 100):
        parts = layout.token_chunks(n)
        covered = torch.cat([torch.arange(n)[p] for p in parts])
        assert torch.equal(covered, torch.arange(n))
        assert len(parts) <= 4 and all(p.stop - p.start >= min(3, n) for p in parts[:-1])


# ---- the memory target of issue #3 ------------------------------------------------------------------


def _bench_module():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_loss.py"
    spec = importlib.util.spec_from_file_location("bench_loss_for_tests", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("algorithm", ["gspo", "gspo_token", "grpo", "sapo", "cispo"])
def test_peak_memory_is_the_gradient_plus_at_most_two_token_tensors(algorithm):
    bench = _bench_module()
    tokens = 65536
    cu_seqlens, new, old, advantages = bench.make_batch(tokens, 512)
    config = LossConfig(algorithm=algorithm)
    batch = packed_batch(new, old, cu_seqlens=cu_seqlens, advantages=advantages)
    normalisers = count_normalisers(batch.mask, batch.segments)
    peak = bench.peak_units(lambda: policy_loss(config, batch, normalisers)[0], new, 4 * tokens)
    assert 1.0 <= peak <= 3.0, peak  # the gradient (1.0) is always part of it
