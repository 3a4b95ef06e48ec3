"""Functions run on spawned ranks by the distributed tests (module-level so spawn can import them)."""
from __future__ import annotations

import torch


from gspo_megatron.conversion.check import megatron_logits
from gspo_megatron.megatron import sharding
from gspo_megatron.megatron.model import build_model, wrap_ddp
from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel
from gspo_megatron.testing.models import canonical_weights, random_tokens


def causal_mask(seq_len: int) -> torch.Tensor:
    """[1, 1, s, s] bool, True where attention is masked (Megatron's convention)."""
    return torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool), diagonal=1)


def logits_and_grads(model_config, parallel: ParallelConfig, batch: int = 4, seq_len: int = 12,
                     num_microbatches: int = 2, seed: int = 0, replicate_batch: bool = False) -> dict:
    """Forward+backward of a cross-entropy loss through get_forward_backward_func at layout ``parallel``.

    Every layout sees the same canonical weights and tokens. The batch is split over DP ranks, then into
    micro-batches. ``replicate_batch`` gives every DP rank the whole batch instead: with all model-parallel
    sizes 1 that is the single-process reference inside a multi-rank world (DDP averages identical grads). Returns the full logits (on the last pipeline stage; gathered over TP and DP) and
    the canonical gradients (gathered to full shapes), so a test can compare layouts directly.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    initialize_model_parallel(parallel, seed=seed)
    model = build_model(model_config, parallel)
    sharding.load_full_state_dict(model, canonical_weights(model_config, seed))
    ddp = wrap_ddp(model, parallel)
    ddp.zero_grad_buffer()

    tokens = random_tokens(model_config, batch, seq_len + 1, seed)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    if replicate_batch:
        dp, dp_rank = 1, 0
    local = tokens.chunk(dp)[dp_rank]
    micro = list(local.chunk(num_microbatches))
    n_tokens_global = batch * seq_len
    position_ids = torch.arange(seq_len).unsqueeze(0)
    logits_out = []

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        inputs, labels = mb[:, :-1], mb[:, 1:]
        out = chunk(inputs, position_ids.expand_as(inputs), causal_mask(seq_len))

        def loss_func(logits):
            logits_out.append(logits.detach().clone())
            # the padded vocabulary (divisor x TP rows, so layout-dependent) takes no probability mass
            v_local = logits.shape[-1]
            start = ps.get_tensor_model_parallel_rank() * v_local
            padding = torch.arange(start, start + v_local) >= model_config.vocab_size
            logits = logits.masked_fill(padding, float("-inf"))
            # [b, s, v/TP] -> per-token CE over the vocab-parallel logits (Megatron's own kernel)
            ce = tensor_parallel.vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(),
                                                              labels.transpose(0, 1).contiguous())
            # The schedule divides by num_microbatches and DDP averages over DP; undo both so the total
            # gradient is that of sum(CE) / n_tokens_global, the same at every layout.
            loss = ce.sum() / n_tokens_global * num_microbatches * dp
            return loss, {"ce_sum": ce.sum().detach()}

        return out, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro), model=[ddp], num_microbatches=num_microbatches,
        seq_length=seq_len, micro_batch_size=micro[0].shape[0], forward_only=False)
    grads = sharding.full_state_dict(ddp, model_config.vocab_size, grads=True)
    result = {"grads": grads, "logits": None, "ce_sum": None}
    if ps.is_pipeline_last_stage():
        logits = torch.cat(logits_out)  # [b_local, s, v/TP]
        tp_group = ps.get_tensor_model_parallel_group()
        parts = [torch.empty_like(logits) for _ in range(ps.get_tensor_model_parallel_world_size())]
        torch.distributed.all_gather(parts, logits, group=tp_group)
        logits = torch.cat(parts, dim=-1)[..., :model_config.vocab_size]
        parts = [torch.empty_like(logits) for _ in range(dp)]
        if dp > 1:
            torch.distributed.all_gather(parts, logits, group=ps.get_data_parallel_group())
        else:
            parts = [logits]
        result["logits"] = torch.cat(parts)
        ce = torch.stack([l["ce_sum"] for l in losses]).sum()
        if dp > 1:
            torch.distributed.all_reduce(ce, group=ps.get_data_parallel_group())
        result["ce_sum"] = ce
    return result


LAYOUTS = {
    "reference": ParallelConfig(),
    "tp2_sp": ParallelConfig(tensor_parallel=2),
    "ep2": ParallelConfig(expert_parallel=2),
    # dense TP2 (DP1) while the experts are whole and split over EP2 across the same two ranks (expert DP1)
    "tp2_ep2_etp1": ParallelConfig(tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=1),
    "pp2": ParallelConfig(pipeline_parallel=2),
    "dp2": ParallelConfig(),  # all model-parallel sizes 1 in a 2-rank world: DP=2, batch split in two
    "dp2_distopt": ParallelConfig(distributed_optimizer=True),
}


def parallel_equivalence(rank: int, world_size: int, model_config, layouts: list[str]) -> dict:
    """Run several layouts in one spawn (Megatron's groups are re-created between them)."""
    return {name: logits_and_grads(model_config, LAYOUTS[name], replicate_batch=name == "reference")
            for name in layouts}


def checkpoint_across_layouts(rank: int, world_size: int, model_config, pairs: list[tuple[str, str]],
                              directory: str) -> dict:
    """For each (save layout, load layout): save canonical weights at one, load at the other, return
    the logits of both (they must be identical) and of a fresh model (must differ: the load did work)."""
    from gspo_megatron.megatron import checkpoint

    tokens = random_tokens(model_config, 2, 10, seed=7)
    results = {}
    for i, (save_name, load_name) in enumerate(pairs):
        path = f"{directory}/ckpt{i}"
        initialize_model_parallel(LAYOUTS[save_name])
        model = build_model(model_config, LAYOUTS[save_name])
        sharding.load_full_state_dict(model, canonical_weights(model_config, seed=3))
        saved = megatron_logits(model, model_config, tokens)
        checkpoint.save_model(model, path, common={"layout": save_name})
        initialize_model_parallel(LAYOUTS[load_name], seed=99)
        fresh = build_model(model_config, LAYOUTS[load_name])
        before = megatron_logits(fresh, model_config, tokens)
        checkpoint.load_model(fresh, path)
        after = megatron_logits(fresh, model_config, tokens)
        results[(save_name, load_name)] = {"saved": saved, "before": before, "after": after,
                                           "meta": checkpoint.read_meta(path)}
    return results
