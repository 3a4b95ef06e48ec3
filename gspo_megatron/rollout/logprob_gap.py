"""The training/rollout log-prob gap: how far the engine's token log-probs are from the training model's.

GSPO may use the rollout engine's log-probs as pi_old (paper section 5.4, "training-inference mismatch");
the trainer reports this gap every step. Over the response tokens of a batch (mask = 1):

    d_t = logp_train(y_t) - logp_rollout(y_t)
    mean_abs = sum_t |d_t| / N,   max_abs = max_t |d_t|,   mean_signed = sum_t d_t / N

``gap_sums`` returns the additive / max-able parts so a data-parallel trainer can all-reduce them (SUM for
the sums and the count, MAX for ``max_abs``) before ``finalize``; ``logprob_gap`` does both on one rank.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class LogprobGap:
    """Per-token gap over response tokens (nats)."""

    mean_abs: float
    max_abs: float
    mean_signed: float  # > 0: the training model gives the sampled tokens more probability than the engine
    num_tokens: int


@dataclasses.dataclass
class GapSums:
    """Reducible parts of ``LogprobGap``: 0-dim float64 tensors (all-reduce sum_abs, sum_signed and
    num_tokens with SUM, max_abs with MAX)."""

    sum_abs: torch.Tensor
    sum_signed: torch.Tensor
    max_abs: torch.Tensor
    num_tokens: torch.Tensor


def gap_sums(train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor) -> GapSums:
    """Sums of the per-token differences over masked tokens.

    train_logprobs, rollout_logprobs: [B, T] log-probs of the same tokens, aligned position by position;
    response_mask: [B, T] bool or 0/1, true on response tokens (padding and prompt excluded).
    """
    if train_logprobs.shape != rollout_logprobs.shape or train_logprobs.shape != response_mask.shape:
        raise ValueError(
            "logprob gap: shapes differ: train_logprobs "
            f"{tuple(train_logprobs.shape)}, rollout_logprobs {tuple(rollout_logprobs.shape)}, "
            f"response_mask {tuple(response_mask.shape)}"
        )
    mask = response_mask.bool()
    diff = (train_logprobs.double() - rollout_logprobs.double().to(train_logprobs.device))[mask]
    abs_diff = diff.abs()
    return GapSums(
        sum_abs=abs_diff.sum(),
        sum_signed=diff.sum(),
        max_abs=abs_diff.max() if diff.numel() else torch.zeros((), dtype=torch.float64, device=diff.device),
        num_tokens=torch.tensor(float(diff.numel()), dtype=torch.float64, device=diff.device),
    )


def finalize(sums: GapSums) -> LogprobGap:
    """Turn (possibly all-reduced) sums into the reported gap; an empty mask is an error."""
    count = int(sums.num_tokens.item())
    if count == 0:
        raise ValueError("logprob gap: response_mask selects no tokens")
    return LogprobGap(
        mean_abs=float(sums.sum_abs) / count,
        max_abs=float(sums.max_abs),
        mean_signed=float(sums.sum_signed) / count,
        num_tokens=count,
    )


def logprob_gap(
    train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> LogprobGap:
    """Mean and max |logp_train - logp_rollout| per response token on one rank (shapes as ``gap_sums``)."""
    return finalize(gap_sums(train_logprobs, rollout_logprobs, response_mask))


__all__ = ["GapSums", "LogprobGap", "finalize", "gap_sums", "logprob_gap"]
