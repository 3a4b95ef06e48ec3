"""Functions run on spawned gloo ranks by test_routing.py and test_context_parallel.py (module level so
``spawn`` can import them). Each returns a dict of named results; the tests assert on them."""
from __future__ import annotations

import torch
import torch.distributed as dist

from gspo_megatron.megatron import routing, sharding
from gspo_megatron.megatron.model import build_model
from gspo_megatron.megatron.parallel import ParallelConfig, initialize_model_parallel
from gspo_megatron.testing.models import canonical_weights, random_tokens
from tests.distributed.workers import causal_mask

ROUTING_LAYOUTS = {
    "reference": ParallelConfig(),  # EP=1 (two DP ranks, each with the whole batch)
    "ep2": ParallelConfig(expert_parallel=2),
    "tp2_sp": ParallelConfig(tensor_parallel=2),
}


def _forward(model, model_config, micro: list[torch.Tensor], replay=None, experts=None) -> list[torch.Tensor]:
    """Forward-only through Megatron's schedule; full logits per micro-batch (gathered over TP).

    With ``replay``, forward_step queues each micro-batch's experts first -- the integration pattern.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    seq_len = micro[0].shape[1]
    logits_out, index = [], iter(range(len(micro)))

    def forward_step(data_iterator, chunk):
        tokens = next(data_iterator)
        i = next(index)
        if replay is not None:
            replay.set_microbatch(experts[i], chunk)
        out = chunk(tokens, torch.arange(seq_len).unsqueeze(0).expand_as(tokens), causal_mask(seq_len))

        def loss_func(logits):
            logits_out.append(logits.detach().clone())
            return logits.sum() * 0, {}

        return out, loss_func

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micro), model=[model],
                                num_microbatches=len(micro), seq_length=seq_len, micro_batch_size=micro[0].shape[0],
                                forward_only=True)
    full = []
    for logits in logits_out:
        parts = [torch.empty_like(logits) for _ in range(ps.get_tensor_model_parallel_world_size())]
        dist.all_gather(parts, logits, group=ps.get_tensor_model_parallel_group())
        full.append(torch.cat(parts, dim=-1)[..., :model_config.vocab_size])
    return full


def _perturb_routers(model, scale: float) -> None:
    """Add the same seeded noise to every router on every rank (routers are replicated over TP and EP)."""
    with torch.no_grad():
        for layer, router in routing.moe_routers(model).items():
            gen = torch.Generator().manual_seed(100 + layer)
            router.weight.add_(scale * torch.randn(router.weight.shape, generator=gen))


def _megatron_record_matches(model, sp_group, micro, model_config, recorder_last: torch.Tensor) -> bool:
    """Megatron's own RouterReplay RECORD action (an independent path: torch.topk inside the router) gives
    the same expert sets as the hook recorder, for the last micro-batch, in router order."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = routing.enable_router_replay(model)
    for router in routers.values():
        router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    _forward(model, model_config, micro)
    ok = True
    for layer, router in routers.items():
        theirs = router.router_replay.get_recorded_indices().sort(dim=1).values
        j = routing.moe_layer_numbers(router.config).index(layer)
        ours = routing.to_router_order(recorder_last[:, :, j], sp_group)
        ok &= torch.equal(theirs, ours)
        router.router_replay.clear_router_replay_action()
        router.router_replay.clear_indices()
    return ok


def _layout_checks(model_config, parallel: ParallelConfig) -> dict:
    from megatron.core import parallel_state as ps

    initialize_model_parallel(parallel, seed=0)
    model = build_model(model_config, parallel)
    sharding.load_full_state_dict(model, canonical_weights(model_config, 0))
    model.eval()
    sp_group = ps.get_tensor_model_parallel_group() if parallel.use_sequence_parallel else None
    tokens = random_tokens(model_config, 4, 12, seed=3)
    micro = list(tokens.chunk(2))
    out: dict = {}

    with routing.RoutingRecorder(model, sequence_parallel_group=sp_group) as rec:
        out["logits_free"] = _forward(model, model_config, micro)
    recorded, routed = rec.experts, rec.routed_experts()
    out["recorded"] = recorded
    out["routed_shapes"] = [tuple(r.shape) for r in routed]
    out["megatron_record_matches"] = _megatron_record_matches(model, sp_group, micro, model_config, routed[-1])

    with routing.RoutingRecorder(model, sequence_parallel_group=sp_group) as again:
        _forward(model, model_config, micro)
    out["drift_same_weights"] = routing.routing_drift(recorded, again.experts)

    original = {layer: r.weight.detach().clone() for layer, r in routing.moe_routers(model).items()}
    _perturb_routers(model, 0.5)
    with routing.RoutingRecorder(model, sequence_parallel_group=sp_group) as free:
        _forward(model, model_config, micro)
    mask = torch.zeros(tokens.shape, dtype=torch.bool)
    mask[:, 4:] = True  # "response" tokens: positions 4.. of every row, micro-batches in order
    out["drift_perturbed"] = routing.routing_drift(recorded, free.experts, num_layers=model_config.num_layers)
    out["drift_perturbed_masked"] = routing.routing_drift(recorded, free.experts, mask, num_layers=model_config.num_layers)
    out["free_perturbed"] = free.experts

    replay = routing.RoutingReplay(model, sequence_parallel_group=sp_group)
    with replay, routing.RoutingRecorder(model, sequence_parallel_group=sp_group) as replayed:
        out["logits_replay_perturbed"] = _forward(model, model_config, micro, replay, routed)
    out["replayed"] = replayed.experts
    out["replay_inert_after_exit"] = all(r.router_replay.router_replay_action is None
                                         for r in routing.moe_routers(model).values())

    with torch.no_grad():
        for layer, router in routing.moe_routers(model).items():
            router.weight.copy_(original[layer])
    with replay:
        out["logits_replay_original"] = _forward(model, model_config, micro, replay, routed)

    # R3 path: per-sample rows as an engine returns them (all positions but the last), padded back.
    lengths = [[12] * m.shape[0] for m in micro]
    samples = routing.recorded_rows(routed, lengths)
    engine_rows = [s[:-1] for s in samples]
    r3 = [routing.experts_to_batch(engine_rows[2 * i:2 * i + 2], 12, num_experts=model_config.num_experts)
          for i in range(len(micro))]
    _perturb_routers(model, 0.5)
    with replay, routing.RoutingRecorder(model, sequence_parallel_group=sp_group) as r3_rec:
        _forward(model, model_config, micro, replay, r3)
    out["r3_replayed"] = r3_rec.experts
    out["drift_stats_world"] = routing.reduce_drift(out["drift_perturbed"], dist.group.WORLD)
    return out


def _checkpointed(forward):
    """``forward`` (an MoE layer's) recomputed in backward by torch's reentrant checkpoint: Megatron's own
    recompute (tensor_parallel.checkpoint) saves CUDA RNG states and does not run on a CPU build."""
    import torch.utils.checkpoint as checkpoint

    def run(hidden, padding_mask=None):
        return checkpoint.checkpoint(lambda h: forward(h, padding_mask=padding_mask), hidden, use_reentrant=True)

    return run


def _replay_gradients(model_config, checkpoint_moe: bool) -> dict:
    """Forward mb0, forward mb1, backward mb0, backward mb1 (1F1B order) under replay with perturbed
    routers; with ``checkpoint_moe`` the MoE layers are recomputed in backward (reentrant checkpoint, like
    Megatron's recompute), so the recomputation must replay the right micro-batch's experts."""
    initialize_model_parallel(ParallelConfig(), seed=0)
    model = build_model(model_config, ParallelConfig())
    sharding.load_full_state_dict(model, canonical_weights(model_config, 0))
    tokens = random_tokens(model_config, 4, 12, seed=3)
    micro = list(tokens.chunk(2))
    positions = torch.arange(12).unsqueeze(0).expand(2, 12)
    with routing.RoutingRecorder(model) as rec:
        with torch.no_grad():
            for mb in micro:
                model(mb, positions, causal_mask(12))
    routed = rec.routed_experts()
    _perturb_routers(model, 0.5)
    if checkpoint_moe:
        for layer in model.decoder.layers:
            layer.mlp.forward = _checkpointed(layer.mlp.forward)
    replay = routing.RoutingReplay(model)
    with replay, routing.RoutingRecorder(model) as during:
        losses = []
        for i, mb in enumerate(micro):
            replay.set_microbatch(routed[i])
            logits = model(mb, positions, causal_mask(12))
            losses.append(torch.log_softmax(logits.float(), dim=-1)[..., 0].mean())
        for loss in losses:
            loss.backward()
    grads = {layer: r.weight.grad.clone() for layer, r in routing.moe_routers(model).items()}
    return {"router_grads": grads, "forwards_recorded": during.num_forwards,
            "replayed": during.experts, "recorded": rec.experts}


def routing_checks(rank: int, world_size: int, model_config) -> dict:
    results = {name: _layout_checks(model_config, parallel) for name, parallel in ROUTING_LAYOUTS.items()}
    results["grads_plain"] = _replay_gradients(model_config, checkpoint_moe=False)
    results["grads_recompute"] = _replay_gradients(model_config, checkpoint_moe=True)
    return results


# ---- context parallelism -------------------------------------------------------------------------


class _IdentityBackwardAllReduce(torch.autograd.Function):
    """The tempting wrong adjoint (forward all-reduce, backward identity): kept here only so the test can
    show that it gives different gradients under the project's share-weighted losses."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _identity_reduce(cp_group):
    from gspo_megatron.algorithms.sequences import SequenceSums

    def reduce(local):
        tokens = local.tokens.detach().clone()
        dist.all_reduce(tokens, group=cp_group)
        rollout = None
        if local.rollout_log_ratio is not None:
            rollout = local.rollout_log_ratio.detach().clone()
            dist.all_reduce(rollout, group=cp_group)
        return SequenceSums(_IdentityBackwardAllReduce.apply(local.log_ratio, cp_group), tokens, rollout)

    return reduce


def _gspo_inputs(batch: int, seq_len: int, seed: int) -> dict:
    """Per-token inputs of a loss, the same on every rank: responses start at a per-row prompt length."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, seq_len, generator=gen) * 3
    prompt = torch.randint(1, seq_len // 2, (batch,), generator=gen)
    end = torch.randint(seq_len // 2 + 1, seq_len + 1, (batch,), generator=gen)
    pos = torch.arange(seq_len)
    return {
        "logprobs": old + 0.05 * torch.randn(batch, seq_len, generator=gen),
        "old_logprobs": old,
        "rollout_logprobs": old + 0.02 * torch.randn(batch, seq_len, generator=gen),
        "ref_logprobs": old + 0.1 * torch.randn(batch, seq_len, generator=gen),
        "mask": (pos >= prompt[:, None]) & (pos < end[:, None]),
        "advantages": torch.randn(batch, generator=gen),
    }


def _loss_configs():
    from gspo_megatron.algorithms.config import LossConfig

    # clip 0.2 keeps most random sequences unclipped, so the gradients are not trivially 0
    return {
        "gspo": LossConfig(algorithm="gspo", clip_low=0.2, clip_high=0.27, tis_mode="sequence", kl_coef=0.1),
        "gspo_token": LossConfig(algorithm="gspo_token", clip_low=0.2, clip_high=0.27),
        "grpo": LossConfig(algorithm="grpo"),
    }


def _padded_loss(config, inputs: dict, normalisers, reduce=None):
    from gspo_megatron.algorithms.layout import padded_batch
    from gspo_megatron.algorithms.policy import policy_loss

    logp = inputs["logprobs"].clone().requires_grad_(True)
    batch = padded_batch(logp, inputs["old_logprobs"], inputs["mask"], inputs["advantages"],
                         ref_logprobs=inputs["ref_logprobs"], rollout_logprobs=inputs["rollout_logprobs"])
    loss, _ = policy_loss(config, batch, normalisers, reduce)
    loss.backward()
    return loss.detach(), logp.grad


def _packed_loss(config, inputs: dict, cu_seqlens, normalisers, reduce=None):
    from gspo_megatron.algorithms.layout import packed_batch
    from gspo_megatron.algorithms.policy import policy_loss

    logp = inputs["logprobs"].clone().requires_grad_(True)
    batch = packed_batch(logp, inputs["old_logprobs"], cu_seqlens=cu_seqlens, mask=inputs["mask"],
                         advantages=inputs["advantages"], ref_logprobs=inputs["ref_logprobs"],
                         rollout_logprobs=inputs["rollout_logprobs"])
    loss, _ = policy_loss(config, batch, normalisers, reduce)
    loss.backward()
    return loss.detach(), logp.grad


def context_parallel_checks(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from gspo_megatron.algorithms.layout import Segments, count_normalisers
    from gspo_megatron.megatron import context_parallel as cp
    from gspo_megatron.megatron.cpu_runtime import megatron_core_version

    initialize_model_parallel(ParallelConfig(context_parallel=2), seed=0)
    group = ps.get_context_parallel_group()
    cp_size, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    out: dict = {"cp_size": cp_size, "cp_rank": cp_rank}

    # 1. our split is Megatron's split, for every tensor of a batch (attention mask along dim 2)
    b, s = 3, 16
    full = {"tokens": torch.arange(b * s).view(b, s), "labels": torch.arange(b * s).view(b, s) + 1000,
            "loss_mask": torch.rand(b, s) > 0.5, "position_ids": torch.arange(s).expand(b, s).contiguous(),
            "attention_mask": causal_mask(s).expand(b, 1, s, s).contiguous()}
    # megatron-core 0.19 added a required is_hybrid_cp; False is plain CP, 0.16.1's per-sequence zigzag
    hybrid = {} if megatron_core_version() == "0.16.1" else {"is_hybrid_cp": False}
    theirs = get_batch_on_this_cp_rank({k: v.clone() for k, v in full.items()}, cp_group=group, **hybrid)
    ours = {k: cp.split_for_cp(v, 2 if k == "attention_mask" else 1, cp_size, cp_rank) for k, v in full.items()}
    out["split_matches_megatron"] = {k: torch.equal(ours[k], theirs[k]) for k in full}
    out["gather_restores"] = torch.equal(cp.gather_from_cp(ours["tokens"], 1, group), full["tokens"])

    # 2. padded [B, s] GSPO / GSPO-token / GRPO: CP=2 against the unsplit computation
    inputs = _gspo_inputs(4, 16, seed=11)
    normalisers = count_normalisers(inputs["mask"].reshape(-1), Segments.from_padded(4, 16))
    local = {k: cp.split_for_cp(v, 1, cp_size, cp_rank) if v.dim() == 2 else v for k, v in inputs.items()}
    out["padded"] = {}
    for name, config in _loss_configs().items():
        ref_loss, ref_grad = _padded_loss(config, inputs, normalisers)
        loss, grad = _padded_loss(config, local, normalisers, cp.cp_reduce_sequence_sums(group))
        _, wrong_grad = _padded_loss(config, local, normalisers, _identity_reduce(group))
        total = loss.clone()
        dist.all_reduce(total, group=group)
        out["padded"][name] = {"ref_loss": ref_loss, "loss_sum": total, "grad": grad,
                               "ref_grad_split": cp.split_for_cp(ref_grad, 1, cp_size, cp_rank),
                               "grad_gathered": cp.gather_from_cp(grad, 1, group), "ref_grad": ref_grad,
                               "identity_backward_grad": wrong_grad}

    # 3. packed (THD) sequences: each padded to a multiple of 2 CP, split per sequence
    lengths = torch.tensor([5, 9, 3, 7])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    n = int(cu[-1])
    gen = torch.Generator().manual_seed(5)
    old = -torch.rand(n, generator=gen) * 3
    packed = {"logprobs": old + 0.05 * torch.randn(n, generator=gen), "old_logprobs": old,
              "rollout_logprobs": old + 0.02 * torch.randn(n, generator=gen),
              "ref_logprobs": old + 0.1 * torch.randn(n, generator=gen), "mask": torch.rand(n, generator=gen) > 0.3}
    advantages = torch.randn(4, generator=gen)
    cu_padded = cp.pad_cu_seqlens_for_cp(cu, cp_size)
    padded = {k: cp.pad_packed(v, 0, cu, cu_padded, fill=False if v.dtype == torch.bool else 0.0) for k, v in packed.items()}
    local = {k: cp.split_for_cp(v, 0, cp_size, cp_rank, cu_seqlens_padded=cu_padded) for k, v in padded.items()}
    normalisers = count_normalisers(packed["mask"], Segments.from_cu_seqlens(cu))
    out["packed"] = {"cu_padded": cu_padded}
    for name, config in _loss_configs().items():
        ref_loss, ref_grad = _packed_loss(config, {**packed, "advantages": advantages}, cu, normalisers)
        loss, grad = _packed_loss(config, {**local, "advantages": advantages}, cu_padded // cp_size, normalisers,
                                  cp.cp_reduce_sequence_sums(group))
        total = loss.clone()
        dist.all_reduce(total, group=group)
        ref_local = cp.split_for_cp(cp.pad_packed(ref_grad, 0, cu, cu_padded), 0, cp_size, cp_rank,
                                    cu_seqlens_padded=cu_padded)
        out["packed"][name] = {"ref_loss": ref_loss, "loss_sum": total, "grad": grad, "ref_grad_split": ref_local}
    out["packed"]["tokens_restored"] = torch.equal(
        cp.gather_from_cp(local["old_logprobs"], 0, group, cu_seqlens_padded=cu_padded), padded["old_logprobs"])

    # 4. a shared parameter: per-rank gradients summed over CP (what DDP's reduction does) equal CP=1's
    gen = torch.Generator().manual_seed(9)
    hidden, labels = torch.randn(4, 16, 8, generator=gen), torch.randint(0, 12, (4, 16), generator=gen)
    theta0 = 0.3 * torch.randn(12, 8, generator=gen)
    inputs = _gspo_inputs(4, 16, seed=12)
    normalisers = count_normalisers(inputs["mask"].reshape(-1), Segments.from_padded(4, 16))
    config = _loss_configs()["gspo"]

    def param_grad(h, y, tensors, reduce):
        from gspo_megatron.algorithms.layout import padded_batch
        from gspo_megatron.algorithms.policy import policy_loss

        theta = theta0.clone().requires_grad_(True)
        logp = torch.log_softmax(h @ theta.T, dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        batch = padded_batch(logp, tensors["old_logprobs"], tensors["mask"], tensors["advantages"],
                             ref_logprobs=tensors["ref_logprobs"], rollout_logprobs=tensors["rollout_logprobs"])
        policy_loss(config, batch, normalisers, reduce)[0].backward()
        return theta.grad

    inputs["old_logprobs"] = torch.log_softmax(hidden @ theta0.T, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1) \
        + 0.05 * torch.randn(4, 16, generator=gen)
    ref = param_grad(hidden, labels, inputs, None)
    local = {k: cp.split_for_cp(v, 1, cp_size, cp_rank) if v.dim() == 2 else v for k, v in inputs.items()}
    mine = param_grad(cp.split_for_cp(hidden, 1, cp_size, cp_rank), cp.split_for_cp(labels, 1, cp_size, cp_rank),
                      local, cp.cp_reduce_sequence_sums(group))
    summed = mine.clone()
    dist.all_reduce(summed, group=group)
    out["param"] = {"ref": ref, "summed": summed, "local": mine}
    return out
