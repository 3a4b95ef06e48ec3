"""MoE routing statistics and Routing Replay on Megatron-Core's TopKRouter.

Three pieces, all keyed by the *global* transformer layer index (0-based, the same on every pipeline
stage):

* ``RoutingRecorder``: a context manager that records, through forward hooks on the routers, the top-k
  experts every token was sent to during one or more forwards (micro-batches).
* ``routing_drift``: how the activated experts of the same tokens differ between two records. The
  headline is the paper's statistic, the fraction of *activated experts* that change ("about 10% of the
  experts activated for the same rollout change after one gradient update", GSPO section 5.3): per
  (token, layer) |E_before - E_after| / k, averaged over tokens and layers. The fraction of (token,
  layer) top-k *sets* that changed at all is kept as a second statistic; it is up to k times larger.
  Returned as sums and counts so both reduce over ranks.
* ``RoutingReplay``: forces recorded experts in later forwards through Megatron-Core's own
  ``RouterReplay`` (megatron/core/transformer/moe/router_replay.py, >= 0.16): "R2" replays the experts of
  the old-policy forward in the update forwards, "R3" replays the experts the rollout engine chose.

Token order. Megatron's router sees hidden states [s_local, b, h] and returns a routing map
[s_local * b, num_experts] in sequence-major order; under sequence parallelism (SP) each TP rank holds a
contiguous 1/TP slice of the sequence, under context parallelism (CP) each rank holds chunks r and
2CP-1-r. The recorder hands out **batch-major, position-ordered** tensors [b, s, ...] -- the layout of
the ``input_ids`` the caller fed -- by all-gathering the SP slices (and, when a CP group is given, the CP
chunks). ``RoutingReplay`` takes the same layout and slices it back into the router's order.

Per-sample contract (R2 storage and R3 input): ``[R, num_moe_layers, top_k]`` int expert ids, row p the
experts of model input position p of the sample (prompt + response tokens, starting at 0), with
R = len(tokens) - 1 (what an inference engine routes: the last token is never fed) or len(tokens).
Layer j is the j-th MoE layer in model order (``moe_layer_numbers``). See ``experts_to_batch``.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from gspo_megatron.megatron.device import HOST

# Marks a layer (or position) with no recorded experts, e.g. a layer on another pipeline stage.
NO_EXPERT = -1


# ---- model introspection -------------------------------------------------------------------------


def _chunks(model) -> list[torch.nn.Module]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def moe_routers(model) -> dict[int, torch.nn.Module]:
    """Global layer index (0-based) -> TopKRouter, for the layers of ``model`` (a module or a list of
    virtual-pipeline chunks, DDP-wrapped or not) that live on this rank's pipeline stage."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers: dict[int, torch.nn.Module] = {}
    for chunk in _chunks(model):
        for name, module in chunk.named_modules():
            if isinstance(module, TopKRouter):
                if module.layer_number is None:
                    raise ValueError(f"moe_routers: router {name} has no layer_number (build the model through TransformerBlock)")
                routers[module.layer_number - 1] = module  # Megatron numbers layers from 1, across stages
    return routers


def moe_layer_numbers(config) -> list[int]:
    """Global indices (0-based) of the MoE layers, in model order, from Megatron's ``moe_layer_freq``
    (an int N: every N-th layer from 0; a list: a 0/1 pattern) -- the rule of ``get_gpt_decoder_block_spec``.
    Index j of the result is MoE layer j of the per-sample ``[R, num_moe_layers, top_k]`` layout."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [i for i in range(config.num_layers) if i % freq == 0]
    if len(freq) != config.num_layers:
        raise ValueError(f"moe_layer_freq: pattern of length {len(freq)}, expected num_layers={config.num_layers}")
    return [i for i, is_moe in enumerate(freq) if is_moe]


def moe_layer_index(config) -> dict[int, int]:
    """Global layer index -> its index j among the MoE layers (the per-sample layout's layer axis)."""
    return {layer: j for j, layer in enumerate(moe_layer_numbers(config))}


def router_takes_padding_mask(config) -> bool:
    """Whether megatron-core 0.16.1's TopKRouter can be given ``GPTModel.forward``'s padding mask (which keeps
    padded tokens out of its aux-loss token counts and z-loss). Not with the expert bias on (DeepSeek-V3,
    GLM-4.5): ``TopKRouter._apply_expert_bias`` (transformer/moe/router.py, 0.16.1) computes
    ``routing_map [tokens, experts] & ~padding_mask [tokens]`` in every training forward and fails.
    config: the model's TransformerConfig."""
    return not config.moe_router_enable_expert_bias


def _in_backward() -> bool:
    """True while the autograd engine runs a backward pass: a forward seen then is an activation
    recomputation (Megatron's recompute, torch checkpoint), not a new micro-batch."""
    return torch._C._current_graph_task_id() != -1


# ---- recording -----------------------------------------------------------------------------------


def _all_gather_pieces(pieces: list[Tensor], group) -> list[list[Tensor]]:
    """All-gather many tensors (the same shapes on every rank of ``group``) in one collective; returns,
    per piece, the list of every rank's copy in rank order."""
    size = dist.get_world_size(group)
    if size == 1 or not pieces:
        return [[t] for t in pieces]
    flat = torch.cat([t.reshape(-1) for t in pieces])
    gathered = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(gathered, flat, group=group)
    out, offset = [], 0
    for t in pieces:
        out.append([g[offset:offset + t.numel()].view(t.shape) for g in gathered])
        offset += t.numel()
    return out


def topk_from_routing_map(routing_map: Tensor, top_k: int) -> Tensor:
    """[N, E] bool routing map -> [N, top_k] int64 expert ids, ascending per token (a set, comparable).

    Every token must have exactly top_k experts (no capacity dropping / padding, which this project
    does not use): anything else would make a "set changed" statistic meaningless.
    """
    counts = routing_map.sum(dim=1)
    if not bool((counts == top_k).all()):
        raise ValueError(f"routing map: every token must select exactly top_k={top_k} experts, found counts "
                         f"{sorted(set(counts.tolist()))} (expert capacity / padding is not supported here)")
    # nonzero lists each row's columns in ascending order, rows in order
    return routing_map.nonzero()[:, 1].view(-1, top_k)


class RoutingRecorder:
    """Record each MoE layer's top-k experts during the forwards run inside the ``with`` block.

        with RoutingRecorder(model, sequence_parallel_group=tp_group_if_sp) as rec:
            ... forward micro-batches (forward_backward_func or model(...)) ...
        rec.experts            # {global layer: [num_tokens, top_k] int64, ids ascending per token}
        rec.routed_experts()   # per forward: [b, s, num_moe_layers, top_k], NO_EXPERT on other stages' layers

    ``experts`` concatenates the forwards in call order, each flattened batch-major (token b * s + t), the
    order of ``mask[b, s].reshape(-1)``. Forwards that run inside a backward pass (activation
    recomputation) are not recorded.

    sequence_parallel_group: the TP group when sequence parallelism is on (each TP rank routes a 1/TP slice
        of the sequence; the slices are all-gathered on exit), else None (every TP rank routes every token).
    context_parallel_group: when given, CP chunks are all-gathered and put back in position order
        ([b, s] layout only); when None, a CP rank keeps its own tokens in its chunk order (split masks
        with ``context_parallel.split_for_cp`` to match).
    The gathers are collectives: every rank of those groups must leave the block together.
    """

    def __init__(self, model, *, sequence_parallel_group=None, context_parallel_group=None):
        self._routers = moe_routers(model)
        self._sp_group = sequence_parallel_group
        self._cp_group = context_parallel_group
        self._handles: list = []
        self._local: dict[int, list[Tensor]] = {layer: [] for layer in self._routers}  # [s_local, b, k] each
        self.experts: dict[int, Tensor] = {}
        self._per_forward: dict[int, list[Tensor]] = {}
        config = next(iter(self._routers.values())).config if self._routers else None
        self._moe_index = moe_layer_index(config) if config is not None else {}
        self.top_k = config.moe_router_topk if config is not None else 0

    def __enter__(self) -> "RoutingRecorder":
        for layer, router in self._routers.items():
            self._handles.append(router.register_forward_hook(self._hook(layer)))
        return self

    def _hook(self, layer: int):
        def hook(router, args, output):
            if _in_backward():
                return
            hidden = args[0]  # [s_local, b, h]
            _, routing_map = output
            ids = topk_from_routing_map(routing_map, router.topk)
            self._local[layer].append(ids.view(hidden.shape[0], hidden.shape[1], router.topk).detach())
        return hook

    def __exit__(self, exc_type, exc, tb) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if exc_type is not None:
            return
        counts = {len(v) for v in self._local.values()}
        if len(counts) > 1:
            raise RuntimeError(f"RoutingRecorder: layers saw different numbers of forwards {sorted(counts)}")
        layers = sorted(self._local)
        pieces = [t for layer in layers for t in self._local[layer]]
        if self._sp_group is not None:  # SP slices are contiguous along the sequence (dim 0 of [s, b, k])
            pieces = [torch.cat(parts, dim=0) for parts in _all_gather_pieces(pieces, self._sp_group)]
        pieces = [t.transpose(0, 1).contiguous() for t in pieces]  # [b, s, k]
        if self._cp_group is not None:
            from gspo_megatron.megatron.context_parallel import unsplit_from_cp

            pieces = [unsplit_from_cp(parts, 1) for parts in _all_gather_pieces(pieces, self._cp_group)]
        it = iter(pieces)
        self._per_forward = {layer: [next(it) for _ in self._local[layer]] for layer in layers}
        self.experts = {layer: torch.cat([t.reshape(-1, t.shape[-1]) for t in self._per_forward[layer]])
                        if self._per_forward[layer] else torch.empty(0, self.top_k, dtype=torch.long)
                        for layer in layers}
        self._local = {layer: [] for layer in self._routers}

    @property
    def num_forwards(self) -> int:
        return len(next(iter(self._per_forward.values()))) if self._per_forward else 0

    def routed_experts(self, num_moe_layers: int | None = None) -> list[Tensor]:
        """Per recorded forward: [b, s, num_moe_layers, top_k] int64 in the per-sample layer order;
        layers not on this pipeline stage hold NO_EXPERT. Slice rows per sample to store them for R2."""
        if not self._per_forward:
            return []
        config = next(iter(self._routers.values())).config
        n_moe = len(moe_layer_numbers(config)) if num_moe_layers is None else num_moe_layers
        out = []
        for i in range(self.num_forwards):
            first = next(iter(self._per_forward.values()))[i]
            b, s, k = first.shape
            # on the host, like every record kept between forwards (megatron/device.py); the copies below
            # bring the device records over
            stacked = torch.full((b, s, n_moe, k), NO_EXPERT, dtype=torch.long, device=HOST)
            for layer, pieces in self._per_forward.items():
                stacked[:, :, self._moe_index[layer]] = pieces[i]
            out.append(stacked)
        return out


# ---- drift ---------------------------------------------------------------------------------------


def moved_experts(before: Tensor, after: Tensor) -> Tensor:
    """[N] |E_before - E_after| per token: how many of its k experts in ``before`` [N, k] are not in
    ``after`` [N, k] (expert ids, any order; the k ids of a token are distinct, as top-k's are)."""
    kept = (before.to(after.device)[:, :, None] == after[:, None, :]).any(dim=2)
    return (~kept).sum(dim=1)


def routing_drift(before: Mapping[int, Tensor], after: Mapping[int, Tensor], token_mask: Tensor | None = None,
                  *, num_layers: int | None = None) -> dict[str, Tensor]:
    """How the activated experts of the same tokens changed between two records, per layer.

    before, after: {global layer: [N, top_k] expert ids} (``RoutingRecorder.experts``; any order per token);
    token_mask:    [N] (or any shape with N elements, flattened) bool, True on tokens that count
                   (response tokens); None counts every token;
    num_layers:    length of the per-layer vectors (default: highest layer + 1); give the model's
                   num_layers so that vectors of different pipeline stages line up for a reduce.
    Returns float64 sums, reducible with ``reduce_drift`` before ``drift_fractions``:
        moved:   [num_layers] sum over masked tokens of |E_before - E_after| (experts that changed);
        slots:   [num_layers] masked tokens x k (activated experts compared);
        changed: [num_layers] masked tokens whose expert set differs at all;
        tokens:  [num_layers] masked tokens compared, per layer (0 for layers not recorded here).
    """
    if set(before) != set(after):
        raise ValueError(f"routing_drift: records cover different layers, before {sorted(before)} vs after {sorted(after)}")
    size = (max(before) + 1 if before else 0) if num_layers is None else num_layers
    stats = {key: torch.zeros(size, dtype=torch.float64) for key in DRIFT_SUMS}
    for layer in sorted(before):
        a, b = before[layer], after[layer]
        if a.shape != b.shape:
            raise ValueError(f"routing_drift: layer {layer}: before {tuple(a.shape)} vs after {tuple(b.shape)} -- not the same tokens")
        if layer >= size:
            raise ValueError(f"routing_drift: layer {layer} >= num_layers={size}")
        moved = moved_experts(a, b)  # set comparison: an engine's top-k order does not matter
        mask = torch.ones_like(moved, dtype=torch.bool) if token_mask is None else token_mask.reshape(-1).to(torch.bool)
        if mask.numel() != moved.numel():
            raise ValueError(f"routing_drift: token_mask has {mask.numel()} elements for {moved.numel()} recorded tokens")
        stats["moved"][layer] = moved[mask].sum().double()
        stats["slots"][layer] = mask.sum().double() * a.shape[1]
        stats["changed"][layer] = ((moved > 0) & mask).sum().double()
        stats["tokens"][layer] = mask.sum().double()
    return stats


DRIFT_SUMS = ("moved", "slots", "changed", "tokens")


def reduce_drift(stats: Mapping[str, Tensor], group=None) -> dict[str, Tensor]:
    """All-reduce (SUM) the drift sums over ``group`` (one collective).

    Reduce over the ranks that hold *different* tokens or layers (data-parallel and pipeline ranks). Ranks
    that hold the same record (TP ranks, and CP ranks when the recorder gathered over CP) only multiply
    both sums by the same factor, which leaves the fractions unchanged; reducing over the whole world is
    therefore fine for the fractions.
    """
    if not dist.is_initialized() or (group is not None and dist.get_world_size(group) == 1):
        return dict(stats)
    stacked = torch.stack([stats[key] for key in DRIFT_SUMS])
    dist.all_reduce(stacked, group=group)
    return dict(zip(DRIFT_SUMS, stacked))


def _ratio(numerator: Tensor, denominator: Tensor) -> Tensor:
    return torch.where(denominator > 0, numerator / denominator.clamp(min=1.0), 0.0)


def drift_fractions(stats: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The paper's per-expert rate and the set rate, per layer and overall (0 where nothing was compared):

        per_layer / overall:         sum |E_before - E_after| / (tokens x k) -- the fraction of activated
                                     experts that changed (the headline; overall weights every (token,
                                     layer) pair alike, i.e. the mean over tokens and layers);
        set_per_layer / set_overall: the fraction of (token, layer) pairs whose top-k set changed at all.
    """
    return {"per_layer": _ratio(stats["moved"], stats["slots"]),
            "overall": _ratio(stats["moved"].sum(), stats["slots"].sum()),
            "set_per_layer": _ratio(stats["changed"], stats["tokens"]),
            "set_overall": _ratio(stats["changed"].sum(), stats["tokens"].sum())}


# ---- agreement between the rollout engine and the trainer -----------------------------------------


def routing_agreement(engine: Mapping[int, Tensor], trainer: Mapping[int, Tensor], *,
                      num_layers: int | None = None) -> dict[str, Tensor]:
    """Per layer, how many of the engine's top-k experts the trainer's forward of the same tokens also chose.

    engine, trainer: {global layer: [N, top_k] expert ids} of the same N tokens (any order per token);
    num_layers:      length of the per-layer vectors (as ``routing_drift``).
    Returns float64 sums, reducible with ``reduce_drift`` (the drift sums of engine -> trainer: an expert
    the trainer did not choose is one that "moved"); ``agreement_fractions`` turns them into
    sum_tokens |E_engine & E_trainer| / (tokens x k) per layer.
    """
    return routing_drift(engine, trainer, num_layers=num_layers)


def agreement_fractions(stats: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """From ``routing_agreement`` sums (reduced): ``per_layer`` [num_layers], the fraction of the engine's
    top-k experts the trainer shares (1 - the engine -> trainer drift; NaN on a layer nothing was compared
    on: a dense layer or one routed by no token), and ``overall``, the mean over every (token, layer)."""
    slots = stats["slots"]
    per_layer = torch.where(slots > 0, 1.0 - stats["moved"] / slots.clamp(min=1.0), float("nan"))
    total = slots.sum()
    overall = 1.0 - stats["moved"].sum() / total if total > 0 else torch.tensor(float("nan"), dtype=torch.float64)
    return {"per_layer": per_layer, "overall": overall}


def replay_for_step(mode: str, agreement: float, threshold: float) -> str:
    """The Routing Replay of one step under ``train.routing_replay`` ``mode``: ``auto`` replays the engine's
    experts (``r3``) when the step's engine/trainer ``agreement`` (``agreement_fractions``' overall) is
    below ``threshold``, else routes freely (``off``); off, r2 and r3 are returned as they are. A NaN
    agreement (no token compared) never switches."""
    if mode != "auto":
        return mode
    return "r3" if agreement < threshold else "off"


# ---- replay --------------------------------------------------------------------------------------


def enable_router_replay(model) -> dict[int, torch.nn.Module]:
    """Give every TopKRouter of ``model`` a Megatron ``RouterReplay`` (what ``moe_enable_routing_replay=True``
    in the TransformerConfig does at construction); routers that already have one keep it.

    Returns {global layer: router}. With no replay action set, a RouterReplay is inert: routing is free.
    Note: each new RouterReplay also appends itself to Megatron's class-level
    ``RouterReplay.global_router_replay_instances``; this module never uses that global list (it would mix
    the routers of every model built in the process, e.g. a frozen reference model), only per-router calls.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplay

    routers = moe_routers(model)
    for router in routers.values():
        if router.router_replay is None:
            router.router_replay = RouterReplay()
    return routers


def padding_experts(num_tokens: int, top_k: int, num_experts: int) -> Tensor:
    """[num_tokens, top_k] int64 experts for tokens that carry no record (padding): token t gets experts
    (t * top_k + j) % num_experts, j < top_k -- distinct within a token (top_k <= num_experts), and over
    consecutive tokens a walk around all experts, so each expert receives the same count to within one.

    Replay routes padding tokens like real ones, and an EP rank holds a contiguous block of experts: one
    fixed set (0 .. top_k-1) would send every padded token to EP rank 0 and its dispatch buffers. Deterministic:
    a pure function of the count."""
    if not 0 < top_k <= num_experts:
        raise ValueError(f"padding_experts: top_k={top_k} must be in [1, num_experts={num_experts}]")
    return (torch.arange(num_tokens).unsqueeze(1) * top_k + torch.arange(top_k)) % num_experts


def experts_to_batch(samples: Sequence[Tensor], seq_len: int, *, num_experts: int) -> Tensor:
    """Pad per-sample expert records into one micro-batch: [b, seq_len, num_moe_layers, top_k] int64.

    samples: b tensors [R_i, num_moe_layers, top_k] (any int dtype), row p = model input position p of sample i
             (the per-sample contract in the module doc: R3 from the rollout engine, or R2 rows sliced from
             ``RoutingRecorder.routed_experts``), right-aligned with padding like ``input_ids``.
    Positions p >= R_i (the last token, which an engine never feeds, and right padding) get
    ``padding_experts`` in batch-major order, the same on every layer: under causal attention they
    influence no earlier position, so no response log-prob depends on them.
    """
    if not samples:
        raise ValueError("experts_to_batch: no samples")
    _, n_layers, k = samples[0].shape
    out = torch.empty(len(samples), seq_len, n_layers, k, dtype=torch.long)
    padded = torch.ones(len(samples), seq_len, dtype=torch.bool)
    for i, rows in enumerate(samples):
        if rows.dim() != 3 or rows.shape[1:] != (n_layers, k):
            raise ValueError(f"experts_to_batch: sample {i} has shape {tuple(rows.shape)}, expected [R, {n_layers}, {k}]")
        if rows.shape[0] > seq_len:
            raise ValueError(f"experts_to_batch: sample {i} has {rows.shape[0]} rows, more than seq_len={seq_len}")
        rows = rows.to(torch.long)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= num_experts):
            raise ValueError(f"experts_to_batch: sample {i} has expert ids outside [0, {num_experts}) "
                             f"(min {int(rows.min())}, max {int(rows.max())}); NO_EXPERT rows cannot be replayed")
        out[i, :rows.shape[0]] = rows
        padded[i, :rows.shape[0]] = False
    fill = padding_experts(int(padded.sum()), k, num_experts)  # [padded tokens, k]
    out[padded] = fill.unsqueeze(1).expand(-1, n_layers, k)
    return out


def _check_replayable(config) -> None:
    """Megatron routes around RouterReplay in these modes (topk_routing_with_score_function returns before
    the replayable top-k, or the router is not top-k): refuse instead of silently routing freely."""
    if config.moe_router_fusion:
        raise ValueError("RoutingReplay: moe_router_fusion=True uses TE's fused top-k, which ignores RouterReplay; set it False")
    if config.moe_router_load_balancing_type == "sinkhorn":
        raise ValueError("RoutingReplay: sinkhorn routing does not go through RouterReplay")
    if config.moe_expert_capacity_factor is not None:
        raise ValueError("RoutingReplay: moe_expert_capacity_factor drops tokens after the top-k; replay needs it None")


def to_router_order(experts_bs: Tensor, sequence_parallel_group=None) -> Tensor:
    """[b, s, top_k] (one layer, caller layout) -> [s_local * b, top_k] int64: this TP rank's sequence-
    parallel slice, sequence-major -- the token order of Megatron's router (and of RouterReplay's records)."""
    seq_major = experts_bs.transpose(0, 1)
    if sequence_parallel_group is not None and dist.get_world_size(sequence_parallel_group) > 1:
        tp, rank = dist.get_world_size(sequence_parallel_group), dist.get_rank(sequence_parallel_group)
        if seq_major.shape[0] % tp:
            raise ValueError(f"to_router_order: sequence length {seq_major.shape[0]} not divisible by TP={tp} (sequence parallel)")
        seq_major = seq_major.chunk(tp, dim=0)[rank]
    return seq_major.reshape(-1, seq_major.shape[-1]).to(torch.long).contiguous()


class RoutingReplay:
    """Force given experts in the forwards run inside the ``with`` block (Megatron's RouterReplay).

        replay = RoutingReplay(model, sequence_parallel_group=tp_group_if_sp)
        with replay:
            def forward_step(data_iterator, chunk):
                mb = next(data_iterator)
                replay.set_microbatch(mb["routed_experts"], chunk)   # [b, s, num_moe_layers, top_k]
                return chunk(...), loss_func
            forward_backward_func(...)

    ``set_microbatch`` must run right before each micro-batch's forward of that model chunk (inside
    forward_step is the place: the schedule calls it once per micro-batch and chunk, on every stage). The
    tensor is in the caller's [b, s] layout -- split it over CP like the tokens (``split_for_cp(x, 1, ...)``);
    sequence-parallel slicing and Megatron's sequence-major order are done here.

    Forward: RouterReplayAction.REPLAY_FORWARD -- the router's top-k is replaced by the given ids; the
    probabilities are the router's scores gathered at those ids, so the router still gets a gradient.
    Backward: without activation recomputation nothing is re-routed (saved tensors are used). With it,
    the recomputed forward runs inside the backward pass; a forward pre-hook then switches the router to
    REPLAY_BACKWARD, which pops the targets in micro-batch order (backward runs micro-batches in forward
    order in Megatron's schedules).
    """

    def __init__(self, model, *, sequence_parallel_group=None):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._actions = RouterReplayAction
        self._model = _chunks(model)
        self._routers = enable_router_replay(self._model)
        self._sp_group = sequence_parallel_group
        self._handles: list = []
        self._pending: dict[int, list[int]] = {}  # layer -> expected token counts of queued targets
        config = next(iter(self._routers.values())).config if self._routers else None
        self._moe_index = moe_layer_index(config) if config is not None else {}
        self._num_experts = config.num_moe_experts if config is not None else 0
        if config is not None:
            _check_replayable(config)

    def __enter__(self) -> "RoutingReplay":
        for layer, router in self._routers.items():
            router.router_replay.clear_indices()
            router.router_replay.set_router_replay_action(self._actions.REPLAY_FORWARD)
            self._handles.append(router.register_forward_pre_hook(self._pre_hook(layer)))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for router in self._routers.values():
            router.router_replay.clear_router_replay_action()
            router.router_replay.clear_indices()
        self._pending.clear()

    def _pre_hook(self, layer: int):
        def hook(router, args):
            replay = router.router_replay
            if _in_backward():
                replay.set_router_replay_action(self._actions.REPLAY_BACKWARD)
                target = replay.replay_backward_list[0] if replay.replay_backward_list else None
            else:
                replay.set_router_replay_action(self._actions.REPLAY_FORWARD)
                target = replay.target_topk_idx
            hidden = args[0]
            tokens = hidden.shape[0] * hidden.shape[1]
            if target is None:
                raise RuntimeError(f"RoutingReplay: layer {layer} ran a forward with no replay target; call "
                                   "set_microbatch(experts, chunk) in forward_step before the model")
            if target.shape[0] != tokens:
                raise ValueError(f"RoutingReplay: layer {layer} routes {tokens} tokens ([s_local={hidden.shape[0]}, "
                                 f"b={hidden.shape[1]}]) but the replay target has {target.shape[0]} rows; "
                                 "the experts tensor must be [b, s, num_moe_layers, top_k] like input_ids (CP-split)")
        return hook

    def set_microbatch(self, experts: Tensor, model_chunk=None) -> None:
        """Queue the experts of the next micro-batch for the routers of ``model_chunk`` (default: all chunks).

        experts: [b, s, num_moe_layers, top_k] expert ids (``experts_to_batch``), CP-split like input_ids.
        """
        if experts.dim() != 4:
            raise ValueError(f"RoutingReplay.set_microbatch: expected [b, s, num_moe_layers, top_k], got {tuple(experts.shape)}")
        routers = self._routers if model_chunk is None else moe_routers(model_chunk)
        for layer, router in routers.items():
            if layer not in self._routers:
                raise ValueError(f"RoutingReplay.set_microbatch: chunk has layer {layer} outside the replayed model")
            j = self._moe_index[layer]
            if j >= experts.shape[2]:
                raise ValueError(f"RoutingReplay.set_microbatch: no experts for MoE layer {j} (global layer {layer}); "
                                 f"got {experts.shape[2]} layers")
            ids = to_router_order(experts[:, :, j], self._sp_group)
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self._num_experts):
                raise ValueError(f"RoutingReplay.set_microbatch: MoE layer {j} has expert ids outside [0, {self._num_experts})")
            if ids.shape[1] > 1 and bool((ids.sort(dim=1).values.diff(dim=1) == 0).any()):
                raise ValueError(f"RoutingReplay.set_microbatch: MoE layer {j} repeats an expert within a token")
            router.router_replay.set_target_indices(ids.to(router.weight.device))


def recorded_rows(routed: Iterable[Tensor], lengths: Sequence[Sequence[int]]) -> list[Tensor]:
    """Split ``RoutingRecorder.routed_experts()`` into per-sample records (the R2 storage).

    routed:  per forward [b, s, num_moe_layers, top_k];
    lengths: per forward, the token count of each of its b rows (prompt + response).
    Returns one [length, num_moe_layers, top_k] tensor per sample, forwards in order.
    """
    out = []
    for batch, row_lengths in zip(routed, lengths, strict=True):
        if batch.shape[0] != len(row_lengths):
            raise ValueError(f"recorded_rows: a forward has {batch.shape[0]} rows but {len(row_lengths)} lengths")
        out.extend(batch[row, :n].clone() for row, n in enumerate(row_lengths))
    return out
