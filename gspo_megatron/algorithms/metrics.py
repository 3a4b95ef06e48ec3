"""Loss metrics that reduce exactly across micro-batches and ranks.

A loss returns *raw* metrics: 0-d detached float32 tensors that are sums, minima or maxima, never means,
so they combine exactly: ``merge_metrics`` adds the sums and takes min / max over micro-batches; across
ranks the caller all-reduces each key with the op in ``METRICS[key].op`` (SUM, MIN or MAX). Only then
does ``finalize_metrics`` divide each sum by its count (``tokens`` or ``seqs``) to give the means to log.

Every logged loss quantity has its one name here: ``METRICS`` (raw keys and how they reduce) and
``DERIVED`` (quantities computed from finalised ones, such as the total clip fractions).
``combine_minibatches`` turns the finalised metrics of a step's mini-batches into the step's.

Counts: ``tokens`` = response tokens; ``seqs`` = sequences, each weighted by its share of tokens on this
rank (so a sequence split over CP ranks adds up to 1). Loss keys are already divided by the global
normalisers, so their SUM over micro-batches and ranks is the mini-batch loss.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal, Mapping

import torch
from torch import Tensor


@dataclass(frozen=True)
class MetricSpec:
    """op: how raw values combine; per: the count a sum is divided by (None: logged as it is);
    name: the key of the finalised value; meaning: one line for the docs."""

    op: Literal["sum", "min", "max"]
    per: Literal["tokens", "seqs"] | None
    name: str
    meaning: str


METRICS: dict[str, MetricSpec] = {
    "tokens": MetricSpec("sum", None, "tokens", "response tokens"),
    "seqs": MetricSpec("sum", None, "seqs", "sequences with response tokens"),
    "loss": MetricSpec("sum", None, "loss", "total loss (policy + kl_coef * kl + distill.coef * distill - entropy_coef * entropy; no policy term with distill.only)"),
    "pg_loss": MetricSpec("sum", None, "pg_loss", "policy-gradient (clipped surrogate) loss"),
    "kl_loss": MetricSpec("sum", None, "kl_loss", "KL term before its coefficient, aggregated like the policy loss"),
    "entropy_loss": MetricSpec("sum", None, "entropy_loss", "entropy term before its coefficient, aggregated like the policy loss"),
    "clip_low_tokens": MetricSpec("sum", "tokens", "clip_frac_low_token", "fraction of tokens whose term is clipped below (ratio < 1 - clip_low, A < 0)"),
    "clip_high_tokens": MetricSpec("sum", "tokens", "clip_frac_high_token", "fraction of tokens whose term is clipped above (ratio > 1 + clip_high, A > 0)"),
    "clip_low_seqs": MetricSpec("sum", "seqs", "clip_frac_low_seq", "mean over sequences of the fraction of their tokens clipped below"),
    "clip_high_seqs": MetricSpec("sum", "seqs", "clip_frac_high_seq", "mean over sequences of the fraction of their tokens clipped above"),
    "seq_ratio_sum": MetricSpec("sum", "seqs", "seq_ratio_mean", "mean of the sequence ratio s_i (Eq. 7)"),
    "seq_ratio_min": MetricSpec("min", "seqs", "seq_ratio_min", "minimum s_i"),
    "seq_ratio_max": MetricSpec("max", "seqs", "seq_ratio_max", "maximum s_i"),
    "token_ratio_sum": MetricSpec("sum", "tokens", "token_ratio_mean", "mean per-token ratio pi_theta / pi_old"),
    "token_ratio_min": MetricSpec("min", "tokens", "token_ratio_min", "minimum per-token ratio"),
    "token_ratio_max": MetricSpec("max", "tokens", "token_ratio_max", "maximum per-token ratio"),
    "abs_log_ratio_sum": MetricSpec("sum", "tokens", "abs_log_ratio_mean", "mean |log pi_theta - log pi_old| per token"),
    "adv_sum": MetricSpec("sum", "tokens", "adv_mean", "token-weighted mean advantage"),
    "adv_sq_sum": MetricSpec("sum", "tokens", "adv_sq_mean", "token-weighted mean squared advantage (adv_std is derived)"),
    "adv_min": MetricSpec("min", "tokens", "adv_min", "minimum advantage"),
    "adv_max": MetricSpec("max", "tokens", "adv_max", "maximum advantage"),
    "zero_adv_seqs": MetricSpec("sum", "seqs", "zero_adv_seq_frac", "fraction of sequences whose advantage is 0 everywhere"),
    "kl_sum": MetricSpec("sum", "tokens", "kl_mean", "mean per-token KL(pi_theta || pi_ref) estimate"),
    "distill_kl_sum": MetricSpec("sum", "tokens", "distill_kl_mean", "on-policy distillation: mean per-token reverse KL(pi_theta || pi_teacher) estimate (distill.estimator)"),
    "distill_loss": MetricSpec("sum", None, "distill_loss", "distillation term before distill.coef, aggregated like the policy loss"),
    "entropy_sum": MetricSpec("sum", "tokens", "entropy_mean", "mean per-token entropy"),
    "logprob_gap_abs_sum": MetricSpec("sum", "tokens", "logprob_gap_mean", "train/rollout mismatch: mean |log pi_old - log pi_rollout| per response token"),
    "logprob_gap_signed_sum": MetricSpec("sum", "tokens", "logprob_gap_signed", "mean log pi_old - log pi_rollout per token (> 0: the training model gives the sampled tokens more probability)"),
    "logprob_gap_abs_max": MetricSpec("max", "tokens", "logprob_gap_max", "maximum |log pi_old - log pi_rollout| over response tokens"),
    "tis_seq_weight_sum": MetricSpec("sum", "seqs", "tis_seq_weight_mean", "mean sequence-level TIS weight"),
    "tis_seq_truncated": MetricSpec("sum", "seqs", "tis_seq_truncated_frac", "fraction of sequences whose TIS weight hit the cap"),
    "tis_token_weight_sum": MetricSpec("sum", "tokens", "tis_token_weight_mean", "mean token-level TIS weight"),
    "tis_token_truncated": MetricSpec("sum", "tokens", "tis_token_truncated_frac", "fraction of tokens whose TIS weight hit the cap"),
    "clip_dual_tokens": MetricSpec("sum", "tokens", "clip_frac_dual_token", "fraction of tokens whose A < 0 term the dual clip caps at c A (ratio > dual_clip_c)"),
    "sapo_gate_slope_sum": MetricSpec("sum", "tokens", "sapo_gate_slope_mean", "SAPO: mean slope 4 sigma (1 - sigma) of the soft gate (1 on-policy; the gradient's attenuation)"),
    "cispo_clipped_tokens": MetricSpec("sum", "tokens", "cispo_clip_frac", "CISPO: fraction of tokens whose importance weight is clipped to [1 - clip_low, 1 + clip_high]"),
    "rc_seq_masked": MetricSpec("sum", "seqs", "rollout_seq_mask_frac", "fraction of sequences seq_mask drops (their pi_old / pi_rollout ratio leaves the band)"),
    "rc_opsm_masked": MetricSpec("sum", "seqs", "opsm_mask_frac", "fraction of sequences OPSM drops (A < 0 and mean log pi_rollout / pi_theta > opsm_delta)"),
    "rc_icepop_masked": MetricSpec("sum", "tokens", "icepop_mask_frac", "fraction of tokens IcePop drops (pi_old / pi_rollout outside [icepop_low, icepop_high])"),
}


@dataclass(frozen=True)
class DerivedSpec:
    """A logged quantity computed from finalised ones: ``formula(*[final[name] for name in inputs])``."""

    inputs: tuple[str, ...]
    formula: Callable[..., Tensor]
    meaning: str


DERIVED: dict[str, DerivedSpec] = {
    "clip_frac_seq": DerivedSpec(("clip_frac_low_seq", "clip_frac_high_seq"), lambda low, high: low + high,
                                 "mean over sequences of the fraction of their tokens clipped (below + above)"),
    "clip_frac_token": DerivedSpec(("clip_frac_low_token", "clip_frac_high_token"), lambda low, high: low + high,
                                   "fraction of tokens whose term is clipped (below + above)"),
    "adv_std": DerivedSpec(("adv_mean", "adv_sq_mean"), lambda mean, sq: (sq - mean**2).clamp(min=0.0).sqrt(),
                           "token-weighted standard deviation of the advantage"),
}

# finalised name -> how a step combines its mini-batches' values (extremes stay extremes; the rest is averaged)
_FINAL_OP = {spec.name: spec.op for spec in METRICS.values()}


def raw(value: Tensor) -> Tensor:
    """A raw metric value: 0-d, float32, detached."""
    return value.detach().to(torch.float32).reshape(())


def merge_metrics(parts: list[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Combine raw metrics of several micro-batches with each key's op (what an all-reduce does over ranks)."""
    merged: dict[str, Tensor] = {}
    for part in parts:
        for key, value in part.items():
            op = _spec(key).op
            if key not in merged:
                merged[key] = value
            elif op == "sum":
                merged[key] = merged[key] + value
            elif op == "min":
                merged[key] = torch.minimum(merged[key], value)
            else:
                merged[key] = torch.maximum(merged[key], value)
    return merged


def finalize_metrics(raw_metrics: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Means to log, from reduced raw metrics: each sum divided by its count; min / max as they are.

    A statistic over an empty set (no tokens anywhere) is reported as 0, never as inf or NaN.
    """
    out: dict[str, Tensor] = {}
    for key, value in raw_metrics.items():
        spec = _spec(key)
        if spec.per is None:
            out[spec.name] = value
            continue
        count = raw_metrics[spec.per]
        if spec.op == "sum":
            value = value / count.clamp(min=1e-12)
        out[spec.name] = torch.where(count > 0, value, 0.0)
    for name, derived in DERIVED.items():
        if all(key in out for key in derived.inputs):
            out[name] = derived.formula(*(out[key] for key in derived.inputs))
    return out


def combine_minibatches(parts: list[Mapping[str, float]]) -> dict[str, float]:
    """A step's metrics from its mini-batches' finalised ones: min / max for extremes, else the mean over
    the mini-batches that report the key. Non-finite values are left out (a skipped update's NaN grad
    norm); a key with none left is NaN. Keys outside the registry (grad_norm, lr, ...) are averaged."""
    out: dict[str, float] = {}
    for key in sorted({k for part in parts for k in part}):
        values = [part[key] for part in parts if key in part and math.isfinite(part[key])]
        op = _FINAL_OP.get(key, "sum")
        if not values:
            out[key] = float("nan")
        elif op == "min":
            out[key] = min(values)
        elif op == "max":
            out[key] = max(values)
        else:
            out[key] = sum(values) / len(values)
    return out


def _spec(key: str) -> MetricSpec:
    if key not in METRICS:
        raise KeyError(f"metrics: unknown metric key {key!r} (known: {sorted(METRICS)})")
    return METRICS[key]
