"""Group advantages from per-response rewards (GSPO paper Eq. 6 and its common variants).

Each prompt x gets a group of G responses with scalar rewards r_1..r_G. Estimators:

* ``grpo``    (Eq. 6):    A_i = (r_i - mean_j r_j) / (std_j r_j + eps)
* ``dr_grpo`` (no std):   A_i =  r_i - mean_j r_j
* ``loo``     (leave-one-out baseline): A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_j r_j)

``std`` is the **sample** standard deviation (Bessel's correction, divide by G - 1), as ``torch.std``
computes by default; the paper writes "std" without saying which. For rewards 1, 0.5, 0, 0 the mean is
0.375, the sample std is sqrt(0.6875 / 3) = 0.47871 and A = (1.30558, 0.26112, -0.78335, -0.78335).

A group whose rewards are all exactly equal (including a group of one) carries no learning signal: its
advantages are exactly 0 under every estimator, and it is counted (``zero_variance``) so the caller can
report or filter it. ``batch_norm`` is Lite-PPO's "group mean, batch std" (Liu et al., arXiv 2508.08221):
the baseline-centred rewards divided by the sample std of *all the rewards* in the batch,

    A_i = (r_i - mean_{j in group} r_j) / (std_{all k in batch} r_k + eps)      (``loo``: its own centring)

in place of the group std (so ``grpo`` and ``dr_grpo`` give the same advantages with it). Zero-variance
groups stay exactly 0.

Advantages are computed once per rollout batch, before it is split over ranks, so groups are whole.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from gspo_megatron.algorithms.layout import Segments

AdvantageEstimator = Literal["grpo", "dr_grpo", "loo"]


@dataclass(frozen=True)
class GroupAdvantages:
    """advantages:    same shape as the rewards, float32;
    zero_variance: [num_groups] bool, True where every reward of the group is equal (advantage 0);
    metrics:       0-d detached float tensors (means over the whole rollout batch, nothing to reduce)."""

    advantages: Tensor
    zero_variance: Tensor
    metrics: dict[str, Tensor]


def group_advantages(
    rewards: Tensor,
    *,
    group_ids: Tensor | None = None,
    num_groups: int | None = None,
    estimator: AdvantageEstimator = "grpo",
    eps: float = 1e-6,
    batch_norm: bool = False,
) -> GroupAdvantages:
    """Advantages of every response from its group's rewards.

    rewards: [P, G] (row p is the group of prompt p), or [R] with ``group_ids`` [R] int64 in
             [0, num_groups) for groups of unequal size.
    Returns advantages of the same shape as ``rewards``.
    """
    if rewards.dim() == 2:
        if group_ids is not None:
            raise ValueError("group_advantages: group_ids is only for 1-D rewards; rows of a [P, G] tensor are the groups")
        segments = Segments.from_padded(rewards.shape[0], rewards.shape[1], rewards.device)
    elif rewards.dim() == 1:
        if group_ids is None or num_groups is None:
            raise ValueError("group_advantages: 1-D rewards need group_ids and num_groups")
        segments = Segments(group_ids, num_groups)
    else:
        raise ValueError(f"group_advantages.rewards: expected [P, G] or [R], got shape {tuple(rewards.shape)}")
    if estimator not in ("grpo", "dr_grpo", "loo"):
        raise ValueError(f"group_advantages.estimator: must be one of grpo, dr_grpo, loo, got {estimator!r}")

    if rewards.numel() == 0:
        raise ValueError("group_advantages.rewards: empty; a rollout batch needs at least one response")
    r = rewards.reshape(-1).to(torch.float32)
    size = segments.sum(torch.ones_like(r))
    mean = segments.sum(r) / size.clamp(min=1)
    centred = r - segments.expand(mean)
    zero_variance = segments.amax(r) == segments.amin(r)  # a single-response group is zero-variance too
    if estimator == "loo":
        centred = centred * segments.expand(size / (size - 1).clamp(min=1))
    if batch_norm:  # one scale for the whole batch: the std of the rewards themselves, not of the z-scores
        adv = centred / (_sample_std(r) + eps)
    elif estimator == "grpo":
        var = segments.sum(centred * centred) / (size - 1).clamp(min=1)  # sample variance (Bessel)
        adv = centred / (segments.expand(var.sqrt()) + eps)
    else:
        adv = centred
    # Rounding in the mean can leave ~1e-8 residues in an all-equal group; that group has no signal.
    adv = torch.where(segments.expand(zero_variance), 0.0, adv)

    num_groups_t = torch.tensor(float(segments.num_seqs), device=r.device)
    zero_groups = zero_variance.sum().to(torch.float32)
    metrics = {
        "reward_mean": r.mean(),
        "reward_std": _sample_std(r),
        "adv_mean": adv.mean(),
        "adv_std": _sample_std(adv),
        "adv_abs_mean": adv.abs().mean(),
        "adv_min": adv.min(),
        "adv_max": adv.max(),
        "num_groups": num_groups_t,
        "zero_adv_groups": zero_groups,
        "zero_adv_group_frac": zero_groups / num_groups_t.clamp(min=1),
    }
    return GroupAdvantages(
        advantages=adv.reshape(rewards.shape),
        zero_variance=zero_variance,
        metrics={k: v.detach() for k, v in metrics.items()},
    )


def _sample_std(x: Tensor) -> Tensor:
    """Sample std of a 1-D tensor, 0 for fewer than two values (torch.std would give NaN)."""
    if x.numel() < 2:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return x.std()


def turn_ids(response_mask: Tensor) -> Tensor:
    """[T] int64: the model turn each response token belongs to (0, 1, ...), -1 on inserted (tool and
    chat-template) tokens. response_mask: [T] bool, True on the tokens the model sampled (a multi-turn
    trajectory, ``batching.TrainSequence.response_mask``); a turn is a maximal run of True."""
    mask = response_mask.to(torch.bool)
    starts = mask & ~torch.cat([mask.new_zeros(1), mask[:-1]])
    return torch.where(mask, starts.long().cumsum(0) - 1, -1)


def turn_token_advantages(response_mask: Tensor, turn_advantages: Tensor) -> Tensor:
    """[T] per-token advantages A_it for GSPO-token (Eq. 15-17) from one advantage per model turn: token t of
    turn k gets ``turn_advantages[k]``, inserted tokens 0 (they are off the loss mask anyway).
    response_mask: [T] bool; turn_advantages: [K] float, K = the number of model turns.

    With every turn at the trajectory's A_i, GSPO-token equals GSPO in value and gradient (tested), so a
    per-turn credit rule (e.g. a penalty on the turn whose tool call failed) is a change of these K numbers."""
    turns = turn_ids(response_mask)
    count = int(turns.max()) + 1 if turns.numel() else 0
    if turn_advantages.numel() != count:
        raise ValueError(f"turn_token_advantages: {turn_advantages.numel()} advantages for {count} model turns")
    values = turn_advantages.to(torch.float32)[turns.clamp(min=0)]
    return torch.where(turns >= 0, values, 0.0)
