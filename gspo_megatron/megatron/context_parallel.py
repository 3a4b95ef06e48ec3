"""Context parallelism (CP), the project's part: which tokens a CP rank holds, how a micro-batch is cut
into them, and the autograd-aware all-reduce that joins per-sequence sums across the CP group before
GSPO's exponent.

Megatron-Core's CP splits every sequence of length s into 2 * CP chunks of s / (2 CP) tokens and gives CP
rank r chunks r and 2 CP - 1 - r, in that order (``megatron.core.utils.get_batch_on_this_cp_rank``): with
causal attention the early chunks are cheap and the late ones expensive, so pairing them balances the
work. For packed sequences (THD layout) every sequence is first padded to a multiple of 2 * CP and split
the same way, sequence by sequence (Transformer Engine's ``thd_get_partitioned_indices``).

GSPO's ratio s_i = exp((1/|y_i|) sum_t log(pi_theta / pi_old)(y_it)) (Eq. 7) is a function of a sum over
the *whole* sequence, so each CP rank's partial sum must be all-reduced before the exponent; the
per-token gradients then flow back through that all-reduce (``AllReduceSum``).

The trainer (``megatron/policy_model.py``) uses the [b, s] layout: ``cp_pad_multiple`` pads every
micro-batch, ``split_microbatch`` gives each CP rank its chunks of every per-position tensor (tokens,
labels, masks, per-token log-probs and advantages, Routing Replay's experts), and ``gather_from_cp`` puts
stored log-probs back in position order. The model's attention is Transformer Engine's on GPUs and the
all-gather attention of ``megatron/cp_attention.py`` on CPU; RoPE takes global positions itself.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from gspo_megatron.algorithms.sequences import ReduceSequenceSums, SequenceSums


def _check_cp(cp_size: int, cp_rank: int) -> None:
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"context parallel: need cp_size >= 1 and 0 <= cp_rank < cp_size, got cp_size={cp_size}, cp_rank={cp_rank}")


def cp_chunk_indices(seq_len: int, cp_size: int, cp_rank: int) -> Tensor:
    """[seq_len / cp_size] int64 positions held by CP rank ``cp_rank``: chunks r and 2 CP - 1 - r of 2 CP.

    seq_len must be a multiple of 2 * cp_size (pad the batch to it).
    """
    _check_cp(cp_size, cp_rank)
    if seq_len % (2 * cp_size):
        raise ValueError(f"context parallel: sequence length {seq_len} must be a multiple of 2 * cp_size = {2 * cp_size}")
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)
    return torch.cat([first, second])


def pad_cu_seqlens_for_cp(cu_seqlens: Tensor, cp_size: int) -> Tensor:
    """[S + 1] cumulative lengths -> [S + 1] cumulative lengths with each sequence rounded up to a multiple
    of 2 * cp_size (Megatron/TE's ``cu_seqlens_padded``)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    multiple = 2 * cp_size
    padded = (lengths + multiple - 1) // multiple * multiple
    return torch.cat([cu_seqlens.new_zeros(1), padded.cumsum(0)])


def pad_packed(tensor: Tensor, dim: int, cu_seqlens: Tensor, cu_seqlens_padded: Tensor, fill=0) -> Tensor:
    """Move each packed sequence of ``tensor`` (along ``dim``, boundaries ``cu_seqlens``) to its offset in
    the padded stream (``cu_seqlens_padded``); the gaps get ``fill`` (mask them out)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    n = int(cu_seqlens[-1])
    if tensor.shape[dim] != n:
        raise ValueError(f"pad_packed: tensor has {tensor.shape[dim]} tokens along dim {dim}, cu_seqlens says {n}")
    seq = torch.repeat_interleave(torch.arange(lengths.numel()), lengths, output_size=n)
    within = torch.arange(n) - cu_seqlens[:-1].long()[seq]
    target = cu_seqlens_padded[:-1].long()[seq] + within
    shape = list(tensor.shape)
    shape[dim] = int(cu_seqlens_padded[-1])
    out = torch.full(shape, fill, dtype=tensor.dtype, device=tensor.device)
    return out.index_copy(dim, target.to(tensor.device), tensor)


def packed_cp_indices(cu_seqlens_padded: Tensor, cp_size: int, cp_rank: int) -> Tensor:
    """Positions of the padded packed stream held by CP rank ``cp_rank``: of every sequence (its padded
    length L_i a multiple of 2 CP) chunks r and 2 CP - 1 - r of L_i / (2 CP) tokens, sequence by sequence.
    The rank's local stream has boundaries ``cu_seqlens_padded // cp_size``."""
    _check_cp(cp_size, cp_rank)
    starts = cu_seqlens_padded[:-1].long()
    lengths = cu_seqlens_padded[1:].long() - starts
    if bool((lengths % (2 * cp_size) != 0).any()):
        raise ValueError(f"context parallel: every padded sequence length must be a multiple of 2 * cp_size = {2 * cp_size}, "
                         f"got {lengths.tolist()} (use pad_cu_seqlens_for_cp)")
    half = lengths // (2 * cp_size)  # chunk length per sequence
    local_len = 2 * half
    n_local = int(local_len.sum())
    seq = torch.repeat_interleave(torch.arange(lengths.numel()), local_len, output_size=n_local)
    local_starts = torch.cat([local_len.new_zeros(1), local_len.cumsum(0)[:-1]])
    j = torch.arange(n_local) - local_starts[seq]  # position within this rank's share of the sequence
    c = half[seq]
    chunk = torch.where(j < c, torch.full_like(j, cp_rank), torch.full_like(j, 2 * cp_size - 1 - cp_rank))
    return starts[seq] + chunk * c + j % c.clamp(min=1)


def _indices(length: int, cp_size: int, cp_rank: int, cu_seqlens_padded: Tensor | None) -> Tensor:
    if cu_seqlens_padded is None:
        return cp_chunk_indices(length, cp_size, cp_rank)
    if int(cu_seqlens_padded[-1]) != length:
        raise ValueError(f"context parallel: packed stream has {length} tokens, cu_seqlens_padded[-1] = {int(cu_seqlens_padded[-1])}")
    return packed_cp_indices(cu_seqlens_padded, cp_size, cp_rank)


def split_for_cp(tensor: Tensor, dim: int, cp_size: int, cp_rank: int, *, cu_seqlens_padded: Tensor | None = None) -> Tensor:
    """This CP rank's part of ``tensor`` along the sequence dimension ``dim``.

    [b, s] layouts (tokens, labels, masks, position ids, log-probs: dim=1; Megatron's [b, 1, s, s]
    attention mask: dim=2): ``cp_chunk_indices``. Packed layouts ([1, N] or [N]) with
    ``cu_seqlens_padded``: ``packed_cp_indices``. Differentiable (an index_select).
    """
    if cp_size == 1:
        return tensor
    idx = _indices(tensor.shape[dim], cp_size, cp_rank, cu_seqlens_padded)
    return tensor.index_select(dim, idx.to(tensor.device))


def unsplit_from_cp(shards: Sequence[Tensor], dim: int, *, cu_seqlens_padded: Tensor | None = None) -> Tensor:
    """Inverse of ``split_for_cp``: the shards of all CP ranks (in rank order) -> the full tensor."""
    cp_size = len(shards)
    if cp_size == 1:
        return shards[0]
    length = sum(s.shape[dim] for s in shards)
    order = torch.cat([_indices(length, cp_size, r, cu_seqlens_padded) for r in range(cp_size)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(length)
    return torch.cat(list(shards), dim=dim).index_select(dim, inverse.to(shards[0].device))


def cp_pad_multiple(cp_size: int, tp_sequence_parallel: int = 1) -> int:
    """The multiple a micro-batch's sequence length is padded to: 2 CP equal chunks, each rank's two chunks
    then split over ``tp_sequence_parallel`` ranks (sequence parallelism, 1 without it)."""
    return (2 * cp_size if cp_size > 1 else 1) * tp_sequence_parallel


def split_microbatch(mb: dict, cp_size: int, cp_rank: int) -> dict:
    """This CP rank's part of a collated micro-batch (``batching.collate``): every tensor with 2 or more
    dimensions is [b, s, ...] and is cut to chunks r and 2 CP - 1 - r along dim 1 (``cp_chunk_indices``);
    [b] tensors (per-row advantages) and everything else are kept whole."""
    if cp_size == 1:
        return mb
    return {key: split_for_cp(value, 1, cp_size, cp_rank) if isinstance(value, Tensor) and value.dim() >= 2 else value
            for key, value in mb.items()}


def gather_from_cp(tensor: Tensor, dim: int, cp_group, *, cu_seqlens_padded: Tensor | None = None) -> Tensor:
    """All-gather every CP rank's part and return the full tensor in position order (no gradient:
    for records, metrics and log-probs to store)."""
    size = dist.get_world_size(cp_group)
    if size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.detach().contiguous(), group=cp_group)
    return unsplit_from_cp(parts, dim, cu_seqlens_padded=cu_seqlens_padded)


class AllReduceSum(torch.autograd.Function):
    """y = sum over the group's ranks of x (every rank gets y); gradient: the SUM all-reduce of dL/dy.

    Why the backward is a sum and not the identity: each rank r evaluates its own loss L_r(y) from the
    same total y, and the objective is sum_r L_r (the project's losses weight a sequence's term by the
    rank's ``share`` of its tokens, so the CP ranks' terms add up to the sequence's term once). Then
    d(sum_r' L_r') / d x_r = sum_r' dL_r'/dy -- the gradient of every rank's loss w.r.t. the total, summed.
    The identity would be right only if every rank computed the *whole* objective (share 1 on every CP
    rank, the objective counted CP times); with shares it would scale rank r's gradient by its share.
    """

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        g = grad.clone()
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.group)
        return g, None


def all_reduce_sum(x: Tensor, group) -> Tensor:
    """Differentiable SUM all-reduce over ``group`` (see ``AllReduceSum``); the identity for one rank."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return AllReduceSum.apply(x, group)


def cp_reduce_sequence_sums(cp_group) -> ReduceSequenceSums:
    """The ``reduce_sequence_sums`` argument of ``algorithms.policy.policy_loss`` under CP.

    log_ratio [S] goes through ``AllReduceSum`` (it carries the gradient); tokens and rollout_log_ratio
    (no gradient) share one plain all-reduce. With one CP rank it returns the sums unchanged.
    """

    def reduce(local: SequenceSums) -> SequenceSums:
        if cp_group is None or dist.get_world_size(cp_group) == 1:
            return local
        plain = [local.tokens.detach()]
        if local.rollout_log_ratio is not None:
            plain.append(local.rollout_log_ratio.detach().to(local.tokens.dtype))
        stacked = torch.stack(plain)
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=cp_group)
        rollout = stacked[1] if local.rollout_log_ratio is not None else None
        return SequenceSums(all_reduce_sum(local.log_ratio, cp_group), stacked[0], rollout)

    return reduce
