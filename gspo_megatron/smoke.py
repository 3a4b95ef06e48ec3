"""A quick end-to-end check of the Megatron seam: a tiny Qwen3-MoE at EP=2 on two gloo processes,
one forward and backward, compared with the same model in one process."""
from __future__ import annotations

import time

import torch

from gspo_megatron.megatron import sharding
from gspo_megatron.megatron.model import build_model, wrap_ddp
from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel
from gspo_megatron.testing.models import canonical_weights, random_tokens, tiny_moe_config


def _forward_backward(rank: int, world_size: int, expert_parallel: int) -> dict:
    from megatron.core import tensor_parallel

    config = tiny_moe_config()
    parallel = ParallelConfig(expert_parallel=expert_parallel)
    initialize_model_parallel(parallel)
    model = build_model(config, parallel)
    sharding.load_full_state_dict(model, canonical_weights(config))
    tokens = random_tokens(config, 4, 17)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    seq = inputs.shape[1]
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), 1)
    ddp = wrap_ddp(model, parallel)
    logits = ddp(inputs, torch.arange(seq).expand_as(inputs), mask)
    loss = tensor_parallel.vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(),
                                                        labels.transpose(0, 1).contiguous()).mean()
    loss.backward()
    # DDP averages over the data-parallel ranks; both ranks saw the same batch, so the average is the
    # single-process gradient. finalize_model_grads also scales expert grads for expert parallelism.
    model.config.finalize_model_grads_func([ddp])
    grads = sharding.full_state_dict(ddp, config.vocab_size, grads=True)
    grad_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()
    return {"loss": loss.item(), "grad_norm": grad_norm}


def run() -> dict:
    from rich.console import Console

    from gspo_megatron.megatron.spawn import run_distributed

    console = Console()
    start = time.time()
    with console.status("EP=2 forward/backward on two gloo processes"):
        ep2 = run_distributed(_forward_backward, 2, (2,))
    with console.status("the same model in one process"):
        single = run_distributed(_forward_backward, 1, (1,))[0]
    for rank, out in enumerate(ep2):
        console.print(f"EP=2 rank {rank}: loss {out['loss']:.6f}  grad norm {out['grad_norm']:.6f}")
    console.print(f"1 process    : loss {single['loss']:.6f}  grad norm {single['grad_norm']:.6f}")
    ok = all(abs(o["loss"] - single["loss"]) < 1e-5 and abs(o["grad_norm"] - single["grad_norm"]) < 1e-4 for o in ep2)
    console.print(f"{'OK' if ok else 'MISMATCH'} in {time.time() - start:.1f} s")
    if not ok:
        raise SystemExit(1)
    return {"ep2": ep2, "single": single}
