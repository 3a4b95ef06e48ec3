"""Core attention with context parallelism (CP) for the CPU layer spec: all-gather of keys and values.

Megatron-Core's local ``DotProductAttention`` asserts ``context_parallel_size == 1`` ("only supported by
TEDotProductAttention"); on GPUs CP goes through Transformer Engine's attention (ring / all-gather /
all-to-all, ``TransformerConfig.cp_comm_type``). This module is the CPU counterpart, the simplest exact
algorithm:

    K_full, V_full = all_gather_cp(K_local), all_gather_cp(V_local)      [S, b, ng, hn], S = CP x s_local
    out_local      = softmax(scale * Q_local K_full^T + mask) V_full      masked by *global* position

Each CP rank holds chunks r and 2 CP - 1 - r of the 2 CP chunks of the sequence (Megatron's layout,
``context_parallel.cp_chunk_indices``); the gathered keys come in rank order (their global positions are
``gathered_positions``) and are put in position order, and the mask is built (or selected) on global
positions, never by local index. The all-gather's backward is a reduce-scatter: rank r's keys were read by
every rank's queries, so dL/dK_r is the sum over ranks of their gradient at r's rows.

Masks. ``attention_mask=None``: causal by global position (the trainer's padded rows need no more: real
tokens never attend to later padding). A given mask is over the whole sequence, bool [b|1, 1, S, S],
True = masked (Megatron's convention), e.g. the block-diagonal causal mask of several sequences packed
into one row, whose boundaries may fall anywhere, also inside a chunk; this rank takes its query rows
and the gathered keys' columns. RoPE needs nothing here: Megatron's rotary embedding already takes this
rank's chunks of the global positions (``get_pos_emb_on_this_cp_rank``).

Memory: every rank holds the whole sequence's keys and values (2 S ng hn per layer, saved for backward);
the scores are computed in blocks of query rows under checkpointing (``cp_core_attention``), so no
s_local x S tensor is kept; the activations that scale with the sequence elsewhere (hidden states, MLP/MoE,
logits) are 1 / CP per rank.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from gspo_megatron.megatron.context_parallel import cp_chunk_indices
from gspo_megatron.megatron.cpu_modules import SDPAttention, sdpa_core_attention

_THIS = "gspo_megatron/megatron/cp_attention.py"


class _GatherSequence(torch.autograd.Function):
    """[s_local, ...] on each rank -> [CP x s_local, ...], the ranks' parts in rank order; backward: the
    reduce-scatter (SUM) of the gradient, each rank keeping its own rows."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        # all_gather_into_tensor / reduce_scatter_tensor exist in every torch setup.py admits (>= 2.6; NCCL
        # implements both, gloo does on the CPU tests' torch 2.13); their successors all_gather_single /
        # reduce_scatter_single first appear in torch 2.13, which only deprecates the old names (the
        # FutureWarning is silenced in reporting.py). test_context_parallel.py runs this without the new names.
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        size = dist.get_world_size(ctx.group)
        out = torch.empty((grad.shape[0] // size, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(out, grad.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


def gather_sequence(x: Tensor, group) -> Tensor:
    """Differentiable all-gather along dim 0 over ``group`` (see ``_GatherSequence``)."""
    return _GatherSequence.apply(x, group)


def gathered_positions(local_len: int, cp_size: int) -> Tensor:
    """[CP x local_len] global positions of the rows of an all-gathered [CP x s_local] tensor: rank r's
    chunks r and 2 CP - 1 - r, ranks in order."""
    seq_len = local_len * cp_size
    return torch.cat([cp_chunk_indices(seq_len, cp_size, r) for r in range(cp_size)])


def cp_attention_mask(attention_mask: Optional[Tensor], local_len: int, cp_size: int, cp_rank: int,
                      device=None, rows: slice = slice(None), keys: int | None = None) -> Tensor:
    """This rank's bool mask [b|1, 1, r, K] (True = masked) for its query ``rows`` (default all s_local)
    against the all-gathered keys in position order, the first ``keys`` of them (default all S).

    attention_mask: None (causal by global position) or the whole sequence's mask [b|1, 1, S, S] / [S, S].
    """
    seq_len = local_len * cp_size
    q_pos = cp_chunk_indices(seq_len, cp_size, cp_rank)[rows]
    keys = seq_len if keys is None else keys
    if attention_mask is None:
        k_pos = torch.arange(keys)
        return (k_pos[None, :] > q_pos[:, None]).to(device).view(1, 1, q_pos.numel(), keys)
    if attention_mask.dtype != torch.bool:
        raise ValueError(f"{_THIS}: attention_mask must be bool (True = masked), got {attention_mask.dtype}")
    if attention_mask.shape[-2:] != (seq_len, seq_len):
        raise ValueError(f"{_THIS}: under context parallelism the attention mask covers the whole sequence "
                         f"[..., {seq_len}, {seq_len}] (CP={cp_size} x {local_len} local positions), got "
                         f"{tuple(attention_mask.shape)}")
    mask = attention_mask if attention_mask.dim() == 4 else attention_mask.view(1, 1, seq_len, seq_len)
    return mask.index_select(2, q_pos.to(mask.device))[..., :keys]


# float32 bytes of one block's attention scores (b x heads x rows x S): small enough that the scores of a
# long sequence are never held whole, large enough to keep the matrix products efficient
SCORE_BLOCK_BYTES = 16 * 1024 * 1024


def block_rows(batch: int, heads: int, seq_len: int, block_bytes: int = SCORE_BLOCK_BYTES) -> int:
    """Query rows per block so that one block's float32 scores [b, heads, rows, S] fit ``block_bytes``."""
    return max(1, block_bytes // (4 * batch * heads * seq_len))


def cp_core_attention(query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor], scale: float,
                      cp_group, dropout_p: float = 0.0, block_bytes: int | None = None) -> Tensor:
    """Context-parallel attention of this rank's queries over the whole sequence's keys and values.

    query [s_local, b, np, hn]; key, value [s_local, b, ng, hn] (value: hv under MLA), this rank's chunks in
    Megatron's CP layout; attention_mask as ``cp_attention_mask``. Returns [s_local, b, np * hv], equal to
    the CP = 1 attention's rows at this rank's positions (fp32: up to summation order).

    With a mask SDPA materialises the scores, s_local x S per head. The queries are therefore taken in
    blocks of ``block_rows`` whose scores fit ``block_bytes`` (default ``SCORE_BLOCK_BYTES``), each under
    activation checkpointing: the forward keeps only the blocks' outputs, and the backward recomputes one
    block's scores at a time (attention's forward runs twice; memory stays O(S) per row block instead of
    O(s_local x S)). Under the causal default a block reads only the keys up to its last position.
    """
    cp_size, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    local_len, batch, heads = query.shape[0], query.shape[1], query.shape[2]
    if key.shape[0] != local_len or value.shape[0] != local_len:
        raise ValueError(f"{_THIS}: queries, keys and values must hold the same positions, got "
                         f"{query.shape[0]}, {key.shape[0]}, {value.shape[0]}")
    if local_len % 2:
        raise ValueError(f"{_THIS}: {local_len} local positions are not two equal chunks (pad the sequence to a "
                         f"multiple of 2 x CP = {2 * cp_size})")
    # one collective for keys and values: [s, b * ng * (hn + hv)], then position order (a differentiable
    # index_select), so that a block of queries reads only the keys up to its last position
    k_width = key[0].numel()
    kv = torch.cat([key.reshape(local_len, -1), value.reshape(local_len, -1)], dim=1)
    seq_len = cp_size * local_len
    order = torch.empty(seq_len, dtype=torch.long)
    order[gathered_positions(local_len, cp_size)] = torch.arange(seq_len)
    kv = gather_sequence(kv, cp_group).index_select(0, order.to(kv.device))
    k_full = kv[:, :k_width].reshape(seq_len, *key.shape[1:])
    v_full = kv[:, k_width:].reshape(seq_len, *value.shape[1:])
    q_pos = cp_chunk_indices(seq_len, cp_size, cp_rank)
    rows = block_rows(batch, heads, seq_len, SCORE_BLOCK_BYTES if block_bytes is None else block_bytes)

    def block(start: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        mask = cp_attention_mask(attention_mask, local_len, cp_size, cp_rank, device=q.device,
                                 rows=slice(start, start + q.shape[0]), keys=k.shape[0])
        return sdpa_core_attention(q, k, v, mask, default_causal=False, scale=scale, dropout_p=dropout_p)

    outs = []
    for start in range(0, local_len, rows):
        q = query[start:start + rows]
        # causal: no query of the block reads a key past the block's last position (a given mask may be
        # anything, so it gets every key)
        keys = int(q_pos[start:start + rows].max()) + 1 if attention_mask is None else seq_len
        k, v = k_full[:keys], v_full[:keys]
        if torch.is_grad_enabled() and rows < local_len:
            outs.append(checkpoint(block, start, q, k, v, use_reentrant=False))
        else:
            outs.append(block(start, q, k, v))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


class ContextParallelSDPAttention(SDPAttention):
    """``SDPAttention`` (the CPU spec's core attention) for ``context_parallel_size`` >= 1, with the CP
    group of the ``pg_collection`` Megatron's ``SelfAttention`` passes (``pg_collection.cp``).

    Megatron's ``DotProductAttention.__init__`` refuses CP > 1 with an assert, and that assert is its only
    use of ``context_parallel_size``: the parent is built on a shallow copy of the config with CP 1, then
    the real config is put back. No parameters, the parent's (empty) state dict: checkpoints do not see CP.
    ``cp_comm_type`` (Transformer Engine's choice of ring / all-gather / all-to-all) is accepted and
    ignored: this module always all-gathers.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
        built_with = copy.copy(config)
        built_with.context_parallel_size = 1
        super().__init__(built_with, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection,
                         k_channels=k_channels, v_channels=v_channels)
        self.config = config
        if pg_collection is None:
            from megatron.core import parallel_state

            self.cp_group = parallel_state.get_context_parallel_group()
        else:
            self.cp_group = pg_collection.cp
        if dist.get_world_size(self.cp_group) != config.context_parallel_size:
            raise ValueError(f"{_THIS}: the CP group has {dist.get_world_size(self.cp_group)} ranks, "
                             f"TransformerConfig.context_parallel_size={config.context_parallel_size}")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query [s_local, b, np, hn], key / value [s_local, b, ng, hn] -> context [s_local, b, np * hn]."""
        if self.config.context_parallel_size == 1:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        if packed_seq_params is not None:
            raise ValueError(f"{_THIS}: packed_seq_params (THD) is not supported on the CPU spec; pack sequences "
                             "into a row and pass their block-diagonal causal mask over the whole row")
        if attention_bias is not None:
            raise ValueError(f"{_THIS}: attention_bias is not supported")
        self._check_heads(query, key)
        dropout_p = self.attention_dropout.p if self.training else 0.0
        if dropout_p == 0.0 or self.config.sequence_parallel:
            return cp_core_attention(query, key, value, attention_mask, self.sdpa_scale, self.cp_group, dropout_p)
        from megatron.core import tensor_parallel

        with tensor_parallel.get_cuda_rng_tracker().fork():
            return cp_core_attention(query, key, value, attention_mask, self.sdpa_scale, self.cp_group, dropout_p)
