"""Spawned-rank functions for test_cp_model.py: the model, the policy and checkpoints at context parallel 2
against the one-process computation, in one spawn of two gloo ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist

from gspo_megatron.megatron import sharding
from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel
from gspo_megatron.testing.models import canonical_weights, random_tokens


def packed_mask(lengths: list[int]) -> torch.Tensor:
    """[1, 1, S, S] bool (True = masked): causal within each of the sequences packed into one row."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(seq.numel())
    allowed = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    return (~allowed).view(1, 1, seq.numel(), seq.numel())


def _model_run(model_config, parallel: ParallelConfig, tokens: torch.Tensor, mask, weight_seed: int = 1) -> dict:
    """Logits [b, S, vocab] in position order and the parameter gradients of sum(logits * probe) for one
    forward of ``tokens`` [b, S + 1] (labels unused: the probe reads every logit); at CP > 1 each rank feeds
    its chunks, the logits are all-gathered and the gradients summed over the CP group."""
    from megatron.core import parallel_state as ps

    from gspo_megatron.megatron import context_parallel as cp
    from gspo_megatron.megatron.model import build_model

    initialize_model_parallel(parallel, seed=0)
    model = build_model(model_config, parallel)
    sharding.load_full_state_dict(model, canonical_weights(model_config, seed=weight_seed))
    cp_size, cp_rank, group = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank(), ps.get_context_parallel_group()
    inputs = tokens[:, :-1]
    s = inputs.shape[1]
    probe = torch.randn(inputs.shape[0], s, model_config.vocab_size, generator=torch.Generator().manual_seed(3))
    ids = cp.split_for_cp(inputs, 1, cp_size, cp_rank)
    positions = cp.split_for_cp(torch.arange(s).expand_as(inputs), 1, cp_size, cp_rank)
    logits = model(ids, positions, mask)[..., :model_config.vocab_size]  # [b, s_local, V]
    (logits * cp.split_for_cp(probe, 1, cp_size, cp_rank)).sum().backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        if cp_size > 1:
            dist.all_reduce(g, group=group)
        grads[name] = g
    full = cp.gather_from_cp(logits.detach(), 1, group) if cp_size > 1 else logits.detach()
    return {"logits": full, "grads": grads}


def model_checks(model_config) -> dict:
    """Padded rows (odd lengths, right padding, causal mask by position) and one packed row (three
    sequences of odd lengths whose boundaries fall inside CP chunks, block-diagonal mask)."""
    s = 20  # 2 CP = 4 chunks of 5 positions
    tokens = random_tokens(model_config, 2, s + 1, seed=11)
    lengths = [7, 3, 10]  # boundaries at 7 and 10: inside chunk 1 and at the start of chunk 2
    out = {}
    for name, mask in (("padded", None), ("packed", packed_mask(lengths))):
        ref_mask = mask if mask is not None else torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1)
        out[name] = {"ref": _model_run(model_config, ParallelConfig(), tokens, ref_mask),
                     "cp2": _model_run(model_config, ParallelConfig(context_parallel=2), tokens, mask)}
    # query blocks of 3 rows (the scores of a long sequence are never held whole): blocks straddle the
    # chunk and sequence boundaries, causal blocks read only the keys up to their last position, and the
    # backward recomputes each block under checkpointing
    from gspo_megatron.megatron import cp_attention

    default = cp_attention.SCORE_BLOCK_BYTES
    cp_attention.SCORE_BLOCK_BYTES = 3 * 4 * 4 * s * tokens.shape[0]  # 3 rows x 4 heads x S x b float32
    try:
        for name, mask in (("padded", None), ("packed", packed_mask(lengths))):
            out[f"{name}_blocks"] = {"ref": out[name]["ref"],
                                     "cp2": _model_run(model_config, ParallelConfig(context_parallel=2), tokens, mask)}
    finally:
        cp_attention.SCORE_BLOCK_BYTES = default
    # the packed mask changes the result: the test would notice attention across a boundary
    out["packed_differs"] = float((out["packed"]["ref"]["logits"] - out["padded"]["ref"]["logits"]).abs().max())
    return out


def cp_suite(rank: int, world_size: int, model_config, directory: str) -> dict:
    """Everything test_cp_model.py checks, in one spawn of two ranks."""
    from tests.megatron.train_workers import all_layouts, replay_after_update, training_state_across_layouts

    out = {"model": model_checks(model_config)}
    gspo = {"algorithm": "gspo"}
    out["policy"] = all_layouts(rank, world_size, model_config, ["cp2", "dp2"], gspo, optimizer_steps=2)
    out["policy_entropy"] = all_layouts(rank, world_size, model_config, ["cp2", "dp2"],
                                    {"algorithm": "gspo", "kl_coef": 0.0, "entropy_coef": 0.01})
    out["replay"] = replay_after_update(rank, world_size, model_config, "cp2")
    out["checkpoint"] = {pair: training_state_across_layouts(rank, world_size, model_config, *pair,
                                                             f"{directory}/{pair[0]}_{pair[1]}")
                         for pair in (("cp2", "dp2"), ("dp2", "cp2"))}
    return out


def cp_attention_without_torch_213_names(rank: int, world_size: int) -> dict:
    """CP = 2 core attention (causal, GQA) and its gradients on a torch without ``all_gather_single`` /
    ``reduce_scatter_single`` (first in torch 2.13; the GPU machines run older torch): the names are removed
    from ``torch.distributed`` before the attention runs. Returns this rank's output and the gathered
    query / key / value gradients beside the one-process reference's."""
    from gspo_megatron.megatron import context_parallel as cp
    from gspo_megatron.megatron.cp_attention import cp_core_attention
    from gspo_megatron.megatron.cpu_modules import sdpa_core_attention

    for name in ("all_gather_single", "reduce_scatter_single"):
        if hasattr(dist, name):  # absent on torch < 2.13 already
            delattr(dist, name)
    s, b, heads, groups, hn = 16, 2, 4, 2, 8  # S = 2 CP x 2 chunks of 4
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(s, b, n, hn, generator=g) for n in (heads, groups, groups))
    probe = torch.randn(s, b, heads * hn, generator=g)
    scale = hn ** -0.5

    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = sdpa_core_attention(*ref, None, default_causal=True, scale=scale)
    (ref_out * probe).sum().backward()

    group = dist.group.WORLD
    local = [cp.split_for_cp(t, 0, world_size, rank).requires_grad_() for t in (q, k, v)]
    out = cp_core_attention(*local, None, scale, group)
    (out * cp.split_for_cp(probe, 0, world_size, rank)).sum().backward()
    return {"names_present": [hasattr(dist, n) for n in ("all_gather_single", "reduce_scatter_single")],
            "out": out.detach(), "ref_out": cp.split_for_cp(ref_out.detach(), 0, world_size, rank),
            "grads": [cp.gather_from_cp(t.grad, 0, group) for t in local], "ref_grads": [t.grad for t in ref]}
