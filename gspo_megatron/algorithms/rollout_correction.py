"""Masks for the train/rollout mismatch: the ``loss.rollout_correction`` section.

The rollout engine samples from pi_rollout; the loss assumes pi_old (the trainer's recomputation). Beside
truncated importance sampling (``loss.tis_mode``, which re-weights), these corrections *drop* the
sequences or tokens where the two disagree too much. Each multiplies a term of the loss by a detached
weight (0 where dropped), so the loss stays the same function of the log-probs elsewhere.

With d_t = log pi_old(y_t) - log pi_rollout(y_t) on the response tokens of sequence i:

* ``seq_mask: sequence`` (sequence-level masked IS, "MIS"): keep sequence i when
  rho_i = exp(sum_t d_t) lies in [seq_mask_low, seq_mask_high], drop it otherwise;
  ``seq_mask: geometric``: the same test on the geometric mean exp((1/|y_i|) sum_t d_t), which does not
  grow with the length (the band is then usually tight, e.g. [0.99, 1.01]).
* ``icepop`` (IcePop, Ring-1T report, arXiv 2510.18855): token weight M(k_t) = k_t when
  k_t = pi_old(y_t) / pi_rollout(y_t) lies in [icepop_low, icepop_high], else 0 -- the importance weight
  inside the band and no gradient at all outside it. Needs per-token terms (not ``gspo``).
* ``opsm`` (off-policy sequence masking, DeepSeek-V3.2, arXiv 2512.02556 Eq. 9): drop sequence i when
  A_i < 0 and (1/|y_i|) sum_t [log pi_rollout(y_t) - log pi_theta(y_t)] > opsm_delta: a negative sample
  the current policy has already moved far from. The divergence is measured against the policy that
  sampled (the engine's log-probs, as in the paper) and uses the current log-probs, detached. With
  per-token advantages the paper's mask M_it drops the tokens of such a sequence that have A_it < 0.

All read whole-sequence sums (``SequenceSums`` after the CP reduce), so a sequence split over
context-parallel ranks is kept or dropped as one. Every ratio is taken in log space and its exponent
clamped at +-LOG_RATIO_LIMIT, so no input gives inf or NaN.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from gspo_megatron.algorithms.layout import TokenBatch
from gspo_megatron.algorithms.metrics import raw
from gspo_megatron.algorithms.sequences import LOG_RATIO_LIMIT, SequenceSums, log_ratio_values
from gspo_megatron.typed_config import check

SeqMask = Literal["none", "sequence", "geometric"]


@dataclass
class RolloutCorrectionConfig:
    """seq_mask:                 none | sequence (product of the token ratios) | geometric (their mean
                                 in log space): drop a sequence whose ratio leaves the band;
    seq_mask_low, seq_mask_high: the band [low, high] of that ratio (0 <= low < 1 < high);
    icepop:                      IcePop token weights M(k) = k inside [icepop_low, icepop_high], else 0
                                 (the authors' band: 0.5, 5.0); not with gspo nor with tis_mode: token;
    opsm, opsm_delta:            drop A < 0 sequences whose mean log(pi_rollout / pi_theta) exceeds
                                 delta (DeepSeek-V3.2 publishes none; 1e-4 is slime's default).
    """

    seq_mask: SeqMask = "none"
    seq_mask_low: float = 0.5
    seq_mask_high: float = 2.0
    icepop: bool = False
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    opsm: bool = False
    opsm_delta: float = 1e-4

    def validate(self, path: str) -> None:
        for name in ("seq_mask", "icepop"):
            low, high = getattr(self, f"{name}_low"), getattr(self, f"{name}_high")
            check(math.isfinite(low) and 0.0 <= low < 1.0, f"{path}.{name}_low", f"must be in [0, 1), got {low}")
            check(math.isfinite(high) and high > 1.0, f"{path}.{name}_high", f"must be > 1, got {high}")
        check(math.isfinite(self.opsm_delta) and self.opsm_delta >= 0.0, f"{path}.opsm_delta", f"must be >= 0, got {self.opsm_delta}")

    def check_with(self, algorithm: str, tis_mode: str, path: str) -> None:
        """The constraints that involve the rest of the loss section (called by ``LossConfig.validate``)."""
        check(not (self.icepop and algorithm == "gspo"), f"{path}.icepop",
              "masks single tokens, so it needs per-token loss terms: use algorithm gspo_token, grpo, sapo or cispo")
        check(not (self.icepop and tis_mode == "token"), f"{path}.icepop",
              "already weights each token by pi_old / pi_rollout inside its band; set tis_mode: none (or sequence)")

    @property
    def active(self) -> bool:
        return self.seq_mask != "none" or self.icepop or self.opsm


def sequence_keep(total: SequenceSums, advantages: Tensor | None, config: RolloutCorrectionConfig,
                  share: Tensor) -> tuple[Tensor | None, dict[str, Tensor]]:
    """[S] detached 0/1 weights of the sequence-level masks (MIS, OPSM), or None when both are off, and
    their raw metrics (sequences dropped, each weighted by this rank's ``share`` of its tokens).

    total:      whole-sequence sums (``log_ratio`` = sum log pi_theta / pi_old, ``rollout_log_ratio`` =
                sum log pi_old / pi_rollout);
    advantages: [S] A_i (OPSM), or None for per-token advantages: then OPSM is left to
                ``opsm_token_keep``.
    """
    if config.seq_mask == "none" and not config.opsm:
        return None, {}
    if total.rollout_log_ratio is None:
        raise ValueError("loss.rollout_correction: the batch has no rollout_logprobs (the inference engine's log-probs)")
    with torch.no_grad():
        rollout = total.rollout_log_ratio.to(torch.float64)
        tokens = total.tokens.to(torch.float64)
        has_tokens = tokens > 0
        keep = torch.ones_like(rollout, dtype=torch.bool)
        metrics: dict[str, Tensor] = {}
        if config.seq_mask != "none":
            log_rho = rollout if config.seq_mask == "sequence" else rollout / tokens.clamp(min=1.0)
            # compare in log space: exp of a long sequence's summed log-ratio would overflow
            inside = (log_rho >= _log(config.seq_mask_low)) & (log_rho <= math.log(config.seq_mask_high))
            keep &= inside
            metrics["rc_seq_masked"] = raw(((~inside & has_tokens) * share).sum())
        if config.opsm and advantages is not None:
            dropped = (advantages.detach() < 0) & opsm_divergent(total, config.opsm_delta)
            keep &= ~dropped
            metrics["rc_opsm_masked"] = raw((dropped * share).sum())
    if config.seq_mask == "none" and advantages is None:
        return None, metrics
    return keep.to(total.tokens.dtype), metrics


def opsm_divergent(total: SequenceSums, delta: float) -> Tensor:
    """[S] bool: (1/|y_i|) sum_t [log pi_rollout - log pi_theta] > delta (DeepSeek-V3.2 Eq. 9), detached."""
    if total.rollout_log_ratio is None:
        raise ValueError("loss.rollout_correction.opsm: the batch has no rollout_logprobs (the inference engine's log-probs)")
    with torch.no_grad():
        tokens = total.tokens.to(torch.float64)
        # log pi_rollout - log pi_theta = -(log pi_theta - log pi_old) - (log pi_old - log pi_rollout)
        divergence = -(total.log_ratio.detach().to(torch.float64) + total.rollout_log_ratio.to(torch.float64)) / tokens.clamp(min=1.0)
        return (divergence > delta) & (tokens > 0)


def opsm_token_keep(batch: TokenBatch, divergent: Tensor, part: slice = slice(None)) -> Tensor:
    """[chunk] 0 for the tokens with A_it < 0 of a divergent sequence, else 1 (per-token advantages)."""
    negative = batch.token_advantages[part].detach() < 0
    return (~(negative & divergent.index_select(0, batch.segments.seq_ids[part]))).to(torch.float32)


def icepop_weights(batch: TokenBatch, low: float, high: float, part: slice = slice(None)) -> Tensor:
    """[chunk] IcePop's M(k_t) = k_t if low <= k_t <= high else 0, k_t = pi_old(y_t) / pi_rollout(y_t),
    on the tokens of ``part`` (1 off the mask, where the terms are 0 anyway), detached."""
    if batch.rollout_logprobs is None:
        raise ValueError("loss.rollout_correction.icepop: the batch has no rollout_logprobs (the inference engine's log-probs)")
    log_k, _ = log_ratio_values(batch.old_logprobs[part].detach(), batch.rollout_logprobs[part].detach(), batch.mask[part])
    inside = log_k.ge(_log(low)).logical_and_(log_k.le(math.log(high)))
    return log_k.clamp_(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp_().masked_fill_(~inside, 0.0)


def icepop_metrics(batch: TokenBatch, low: float, high: float, chunks) -> dict[str, Tensor]:
    """Raw count of response tokens IcePop drops (weight 0), chunk by chunk."""
    with torch.no_grad():
        dropped = torch.zeros((), device=batch.mask.device)
        for part in chunks:
            dropped += icepop_weights(batch, low, high, part).eq(0).logical_and_(batch.mask[part]).sum()
    return {"rc_icepop_masked": raw(dropped)}


def _log(x: float) -> float:
    return math.log(x) if x > 0 else float("-inf")
