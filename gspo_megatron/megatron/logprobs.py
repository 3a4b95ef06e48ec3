"""Token log-probs and entropy from vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for a contiguous slice of the vocabulary, [N, V/TP]. For target token y:

    log p(y) = z_y - logsumexp(z),   logsumexp(z) = m + log sum_j exp(z_j - m),   m = max_j z_j
    H        = logsumexp(z) - sum_j p_j z_j

m is all-reduced with MAX, the sums with SUM, and z_y comes from the rank that owns y (all-reduced SUM
of a masked pick). The work is chunked over tokens so that, besides the logits themselves and the
gradient buffer autograd must return, the extra memory is one chunk of [chunk, V/TP] temporaries.
Vocabulary rows beyond the true vocabulary (Megatron's padding to a multiple of the divisor x TP,
``ModelConfig.padded_vocab_size``; on the last TP rank(s)) are excluded from the softmax.

Sampling temperature T: every quantity is of softmax(x / T) for raw logits x, i.e. z = x / T above (the
distribution the rollout engines sample from and report). The scaling is applied chunk by chunk, so no
scaled copy of the logits is kept; the gradient w.r.t. x is the one w.r.t. z times 1 / T.

Gradients (per token, upstream g_lp for log p(y), g_h for H):
    d log p(y) / d z_j = 1[j = y] - p_j
    d H / d z_j        = -p_j (z_j - sum_i p_i z_i)
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(tensor: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 z = x / T of one chunk of raw logits (a copy only when T != 1). A division, not a multiply
    by 1 / T, so the values round exactly as the engines' ``logits / T`` do."""
    z = x.float()
    return z / temperature if temperature != 1.0 else z


def _chunk_stats(z: torch.Tensor, local_targets: torch.Tensor, in_slice: torch.Tensor, valid_cols: int, group,
                 want_entropy: bool):
    """For one chunk of (temperature-scaled, float32) logits z [n, Vl]: (target logit, logsumexp, sum p*z)
    after the TP reductions."""
    if valid_cols < z.shape[1]:
        z = z.clone()
        z[:, valid_cols:] = float("-inf")
    m = z.max(dim=1).values
    m = _all_reduce(m, dist.ReduceOp.MAX, group)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a rank whose slice is all padding
    e = torch.exp(z - m[:, None])
    sums = [e.sum(dim=1)]
    if want_entropy:
        sums.append((e * torch.where(torch.isfinite(z), z, torch.zeros_like(z))).sum(dim=1))
    picked = torch.where(in_slice, z.gather(1, local_targets[:, None]).squeeze(1), torch.zeros_like(m))
    stacked = _all_reduce(torch.stack([*sums, picked]), dist.ReduceOp.SUM, group)
    lse = m + torch.log(stacked[0])
    target_logit = stacked[-1]
    mean_z = stacked[1] / stacked[0] if want_entropy else None
    return target_logit, lse, mean_z


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, valid_cols, group, chunk_tokens, want_entropy, temperature):
        n, vocab_local = logits.shape
        local = targets - vocab_start
        in_slice = (local >= 0) & (local < valid_cols)
        local = local.clamp(0, vocab_local - 1)
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if want_entropy else None
        mean_z = torch.empty_like(logp) if want_entropy else None
        for start in range(0, n, chunk_tokens):
            sl = slice(start, start + chunk_tokens)
            z = _scaled(logits[sl], temperature)
            tz, lse_c, mz = _chunk_stats(z, local[sl], in_slice[sl], valid_cols, group, want_entropy)
            logp[sl] = tz - lse_c
            lse[sl] = lse_c
            if want_entropy:
                entropy[sl] = lse_c - mz
                mean_z[sl] = mz
        ctx.save_for_backward(logits, local, in_slice, lse, mean_z if want_entropy else lse)
        ctx.valid_cols, ctx.chunk_tokens, ctx.want_entropy = valid_cols, chunk_tokens, want_entropy
        ctx.temperature = temperature
        if want_entropy:
            return logp, entropy
        return logp, torch.zeros(0, device=logits.device)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, local, in_slice, lse, mean_z = ctx.saved_tensors
        grad = torch.empty_like(logits)
        valid = ctx.valid_cols
        for start in range(0, logits.shape[0], ctx.chunk_tokens):
            sl = slice(start, start + ctx.chunk_tokens)
            z = _scaled(logits[sl], ctx.temperature)
            p = torch.exp(z - lse[sl, None])
            if valid < z.shape[1]:
                p[:, valid:] = 0.0
            g = -p * grad_logp[sl, None]
            if ctx.want_entropy and grad_entropy.numel():
                g -= p * (z - mean_z[sl, None]) * grad_entropy[sl, None]  # p = 0 on padding columns
            rows = torch.nonzero(in_slice[sl], as_tuple=True)[0]
            g[rows, local[sl][rows]] += grad_logp[sl][rows]
            if ctx.temperature != 1.0:
                g /= ctx.temperature  # d z / d x = 1 / T
            grad[sl] = g.to(grad.dtype)
        return grad, None, None, None, None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, tp_group=None, vocab_start: int = 0,
                            vocab_size: int | None = None, chunk_tokens: int = 1024, with_entropy: bool = False,
                            temperature: float = 1.0):
    """Log-probs (and entropy) of ``targets`` under softmax(logits / temperature) for vocab-parallel logits.

    logits:      [N, V_local] this rank's vocabulary slice [vocab_start, vocab_start + V_local);
    targets:     [N] int64 global token ids;
    tp_group:    the tensor-parallel group (None: the whole vocabulary is local);
    vocab_size:  the true vocabulary; columns at or beyond it (padding) are excluded;
    temperature: the rollout's sampling temperature T > 0 (1: the unmodified policy).
    Returns (logp [N] float32, entropy [N] float32 or None). Differentiable w.r.t. ``logits``.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"vocab_parallel_logprobs: expected logits [N, V] and targets [N], got "
                         f"{tuple(logits.shape)} and {tuple(targets.shape)}")
    if not temperature > 0.0:
        raise ValueError(f"vocab_parallel_logprobs: temperature must be > 0, got {temperature!r}")
    vocab_local = logits.shape[1]
    valid_cols = vocab_local if vocab_size is None else max(0, min(vocab_local, vocab_size - vocab_start))
    logp, entropy = _VocabParallelLogProbs.apply(logits, targets.long(), vocab_start, valid_cols, tp_group,
                                                 max(1, chunk_tokens), with_entropy, float(temperature))
    return logp, (entropy if with_entropy else None)


def naive_logprobs(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool = False, temperature: float = 1.0):
    """Reference: full-vocabulary ``log_softmax(logits / temperature)`` + gather (TP=1 only). For tests and
    benchmarks."""
    logsm = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logsm.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logsm.exp() * logsm).sum(-1) if with_entropy else None
    return logp, entropy
