"""Property-based: random shapes and extreme finite values never give inf / NaN; fractions stay in [0, 1]."""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gspo_megatron.algorithms import (
    LossConfig,
    LossNormalisers,
    RolloutCorrectionConfig,
    finalize_metrics,
    group_advantages,
    packed_batch,
    policy_loss,
)

# Any finite float32 as a log-prob (even positive ones), mixed with realistic values so both regimes occur.
LOGPROB = st.one_of(st.floats(width=32, allow_nan=False, allow_infinity=False), st.floats(min_value=-30.0, max_value=0.0, width=32))
# Advantages are bounded (|A| <= 1e3; normalised ones are O(1)); rewards by 2^50 (their squares stay finite).
ADVANTAGE = st.floats(-1e3, 1e3, width=32)
REWARD = st.floats(-(2.0**50), 2.0**50, width=32)
CONFIGS = [
    LossConfig(),
    LossConfig(algorithm="gspo", tis_mode="sequence", kl_coef=0.1, entropy_coef=0.01),
    LossConfig(algorithm="gspo_token", kl_coef=0.1, kl_estimator="k1", tis_mode="token"),
    LossConfig(algorithm="grpo", aggregation="token_mean", kl_coef=1.0, kl_estimator="k2", entropy_coef=0.1),
    LossConfig(algorithm="grpo", aggregation="token_sum", constant_length_tokens=4, tis_mode="token"),
    LossConfig(algorithm="sapo", kl_coef=0.1, tis_mode="token"),
    LossConfig(algorithm="cispo", entropy_coef=0.1, rollout_correction=RolloutCorrectionConfig(icepop=True, seq_mask="sequence")),
    LossConfig(algorithm="grpo", dual_clip_c=3.0, rollout_correction=RolloutCorrectionConfig(icepop=True, seq_mask="geometric")),
    LossConfig(algorithm="gspo", dual_clip_c=3.0, rollout_correction=RolloutCorrectionConfig(opsm=True, seq_mask="sequence")),
]
FRACTIONS = ("clip_frac_low_token", "clip_frac_high_token", "clip_frac_low_seq", "clip_frac_high_seq", "zero_adv_seq_frac",
             "clip_frac_dual_token", "cispo_clip_frac", "rollout_seq_mask_frac", "opsm_mask_frac", "icepop_mask_frac")


@st.composite
def batches(draw):
    lengths = draw(st.lists(st.integers(1, 6), min_size=1, max_size=5))
    n = sum(lengths)
    tokens = lambda strategy: torch.tensor(draw(st.lists(strategy, min_size=n, max_size=n)), dtype=torch.float32)  # noqa: E731
    return dict(
        lengths=lengths,
        logprobs=tokens(LOGPROB),
        old=tokens(LOGPROB),
        ref=tokens(LOGPROB),
        rollout=tokens(LOGPROB),
        entropy=tokens(st.floats(0.0, 12.0, width=32)),
        mask=torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n))),
        advantages=torch.tensor(draw(st.lists(ADVANTAGE, min_size=len(lengths), max_size=len(lengths)))),
        token_advantages=tokens(ADVANTAGE),
        config=draw(st.sampled_from(CONFIGS)),
        per_token=draw(st.booleans()),
    )


def test_largest_finite_values():
    big = torch.finfo(torch.float32).max
    logprobs = torch.tensor([big, -big, 0.0, -big, big, -1.0], requires_grad=True)
    old = torch.tensor([-big, big, -big, 0.0, big, -big])
    for cfg in CONFIGS:
        for per_token in (False, True):
            batch = packed_batch(
                logprobs, old, cu_seqlens=torch.tensor([0, 1, 4, 6]),
                advantages=None if per_token and cfg.algorithm != "gspo" else torch.tensor([1e3, -1e3, 0.5]),
                token_advantages=torch.full((6,), -1e3) if per_token and cfg.algorithm != "gspo" else None,
                ref_logprobs=-old, entropy=torch.full((6,), 12.0), rollout_logprobs=-logprobs.detach(),
            )
            loss, metrics = policy_loss(cfg, batch, LossNormalisers(3.0, 6.0))
            (grad,) = torch.autograd.grad(loss, logprobs)
            assert torch.isfinite(loss) and torch.isfinite(grad).all(), cfg
            assert all(torch.isfinite(v) for v in finalize_metrics(metrics).values()), cfg


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_losses_and_gradients_are_finite(b):
    cfg = b["config"]
    per_token = b["per_token"] and cfg.algorithm != "gspo"
    logprobs = b["logprobs"].clone().requires_grad_(True)
    entropy = b["entropy"].clone().requires_grad_(True)
    cu = torch.tensor([0] + torch.tensor(b["lengths"]).cumsum(0).tolist())
    batch = packed_batch(
        logprobs,
        b["old"],
        cu_seqlens=cu,
        mask=b["mask"],
        advantages=None if per_token else b["advantages"],
        token_advantages=b["token_advantages"] if per_token else None,
        ref_logprobs=b["ref"],
        entropy=entropy,
        rollout_logprobs=b["rollout"],
    )
    mask_tokens = b["mask"].float()
    seqs = sum(float(m.any()) for m in b["mask"].split(b["lengths"]))
    loss, metrics = policy_loss(cfg, batch, LossNormalisers(seqs, float(mask_tokens.sum())))
    grads = torch.autograd.grad(loss, (logprobs, entropy), allow_unused=True)
    assert torch.isfinite(loss)
    for g in grads:
        assert g is None or torch.isfinite(g).all()
    final = finalize_metrics(metrics)
    for key, value in final.items():
        assert torch.isfinite(value), key
    for key in FRACTIONS:
        if key in final:  # each algorithm and option reports its own
            assert 0.0 <= final[key].item() <= 1.0 + 1e-6, key
    if not b["mask"].any():
        assert loss.item() == 0.0


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(REWARD, min_size=1, max_size=6), min_size=1, max_size=4),
    st.sampled_from(["grpo", "dr_grpo", "loo"]),
    st.booleans(),
)
def test_advantages_are_finite(groups, estimator, batch_norm):
    size = min(len(g) for g in groups)
    rewards = torch.tensor([g[:size] for g in groups])
    out = group_advantages(rewards, estimator=estimator, batch_norm=batch_norm)
    assert torch.isfinite(out.advantages).all()
    assert all(torch.isfinite(v) for v in out.metrics.values())
    assert torch.count_nonzero(out.advantages[out.zero_variance]) == 0
