"""The policy as Megatron-Core runs it: a GPTModel under DDP with its optimizer, the GSPO loss inside
``get_forward_backward_func`` (forward_step / loss_func), global normalisers, and no-grad log-prob
forwards. Micro-batches come from ``gspo_megatron.batching`` (token alignment: see there).

Normalisation. The loss of a mini-batch is a mean over *all* its sequences (GSPO, Eq. 7), so each
micro-batch divides by the global counts (``LossNormalisers``) computed once per mini-batch with an
all-reduce over the data-parallel group. Megatron then divides each micro-batch loss by the number of
micro-batches and DDP averages gradients over DP ranks; ``loss_func`` multiplies both back, so the
gradient is exactly that of the mini-batch loss however it is split (tested at TP/PP/EP/DP = 2).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Sequence

import torch
import torch.distributed as dist

from gspo_megatron.algorithms.config import DistillConfig, LossConfig
from gspo_megatron.algorithms.layout import LossNormalisers, padded_batch
from gspo_megatron.algorithms.metrics import finalize_metrics, merge_metrics, METRICS
from gspo_megatron.algorithms.policy import policy_loss
from gspo_megatron.batching import TrainSequence, collate, pack_microbatches, present_fields
from gspo_megatron.megatron import optimizer as optimizer_module, sharding
from gspo_megatron.megatron.context_parallel import (cp_pad_multiple, cp_reduce_sequence_sums, gather_from_cp,
                                                     split_microbatch)
from gspo_megatron.megatron.device import to_device, to_host
from gspo_megatron.megatron.logprobs import vocab_parallel_logprobs
from gspo_megatron.megatron.optimizer import OptimizerConfig, build_optimizer, clip_and_step, warm_start_config


@dataclasses.dataclass(frozen=True)
class ModelGroups:
    """The process groups one model replica runs over, taken once from Megatron's parallel state (which
    ``initialize_model_parallel`` set up) and passed to everything the policy does."""

    data_parallel: object
    tensor_parallel: object
    pipeline: object
    dp_size: int
    dp_rank: int
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_last_rank: int  # global rank of the last pipeline stage of this rank's pipeline
    is_last_stage: bool
    sequence_parallel: object | None  # the TP group when sequence parallelism splits the sequence
    # context parallelism: every sequence is cut over the CP group (megatron/context_parallel.py); metrics
    # and the loss terms are share-weighted per rank, so they sum over data x context parallel ranks
    context_parallel: object = None
    cp_size: int = 1
    cp_rank: int = 0
    data_context_parallel: object = None

    @classmethod
    def from_parallel_state(cls, sequence_parallel: bool) -> "ModelGroups":
        from megatron.core import parallel_state as ps

        tp = ps.get_tensor_model_parallel_group()
        return cls(data_parallel=ps.get_data_parallel_group(), tensor_parallel=tp,
                   pipeline=ps.get_pipeline_model_parallel_group(), dp_size=ps.get_data_parallel_world_size(),
                   dp_rank=ps.get_data_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
                   tp_rank=ps.get_tensor_model_parallel_rank(),
                   pp_size=ps.get_pipeline_model_parallel_world_size(),
                   pp_last_rank=ps.get_pipeline_model_parallel_last_rank(), is_last_stage=ps.is_pipeline_last_stage(),
                   sequence_parallel=tp if sequence_parallel else None,
                   context_parallel=ps.get_context_parallel_group(), cp_size=ps.get_context_parallel_world_size(),
                   cp_rank=ps.get_context_parallel_rank(),
                   data_context_parallel=ps.get_data_parallel_group(with_context_parallel=True))


def causal_mask(seq_len: int, device: torch.device | None = None) -> torch.Tensor:
    """[1, 1, s, s] bool, True where attention is masked. Right padding needs nothing more: real tokens
    never attend to later (padding) positions."""
    return torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)


def _tp_info(model_config, groups: ModelGroups):
    v_local = model_config.padded_vocab_size(groups.tp_size) // groups.tp_size
    return groups.tensor_parallel, groups.tp_rank * v_local


LOGPROB_CHUNK_BYTES = 16 * 1024 * 1024


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, model_config, groups: ModelGroups, with_entropy: bool,
                   chunk_bytes: int = LOGPROB_CHUNK_BYTES, temperature: float = 1.0):
    """[b, s, V/TP] vocab-parallel logits -> log-probs (and entropy) of ``labels`` [b, s] under
    softmax(logits / temperature), the distribution the rollout sampled from.

    Tokens are processed in chunks whose float32 temporaries stay within ``chunk_bytes``: small enough
    to be reused by the allocator (large fresh temporaries page-fault on CPU: benchmarks/bench_logprobs.py),
    large enough to keep kernels efficient."""
    group, vocab_start = _tp_info(model_config, groups)
    b, s, v = logits.shape
    chunk_tokens = max(1, chunk_bytes // (4 * v))
    logp, entropy = vocab_parallel_logprobs(logits.reshape(b * s, v), labels.reshape(-1), tp_group=group,
                                            vocab_start=vocab_start, vocab_size=model_config.vocab_size,
                                            chunk_tokens=chunk_tokens, with_entropy=with_entropy,
                                            temperature=temperature)
    return logp.view(b, s), None if entropy is None else entropy.view(b, s)


def global_normalisers(seqs: Sequence[TrainSequence], dp_group) -> LossNormalisers:
    """Sequences with response tokens and response tokens of the whole mini-batch (all DP ranks)."""
    counts = torch.tensor([sum(1.0 for q in seqs if q.loss_tokens > 0), float(sum(q.loss_tokens for q in seqs))],
                          dtype=torch.float64)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(counts, group=dp_group)
    return LossNormalisers(num_seqs=float(counts[0]), num_tokens=float(counts[1]))


def _reduce_metrics(raw: dict[str, torch.Tensor], group) -> dict[str, torch.Tensor]:
    """All-reduce raw metrics over ``group`` with each key's op (sums, mins, maxes)."""
    if group is None or dist.get_world_size(group) == 1 or not raw:
        return raw
    ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    out = {}
    for op_name, op in ops.items():
        keys = sorted(k for k in raw if METRICS[k].op == op_name)
        if not keys:
            continue
        stacked = torch.stack([raw[k].float() for k in keys])
        dist.all_reduce(stacked, op=op, group=group)
        out.update(zip(keys, stacked))
    return out


def _from_last_stage(obj, groups: ModelGroups):
    """``obj`` as the last pipeline stage has it (losses and log-probs only exist there), on every stage."""
    if groups.pp_size == 1:
        return obj
    holder = [to_host(obj)]  # a pickled CUDA tensor would be rebuilt on the sender's device index
    dist.broadcast_object_list(holder, src=groups.pp_last_rank, group=groups.pipeline)
    return holder[0]


class PolicyModel:
    """A Megatron GPTModel under DDP with its optimizer and LR schedule, and the GSPO update on it.

    ``frozen=True`` builds the model alone (no DDP gradient buffers, no optimizer, parameters without
    gradients): the KL reference, which only runs ``compute_logprobs``.
    ``temperature``: the rollout's sampling temperature; every RL log-prob (old, update, reference,
    entropy) is of softmax(logits / temperature), so the importance ratio compares the distribution that
    sampled the data with the one being trained. The supervised warm start stays at temperature 1.
    Process groups come from Megatron's parallel state, which ``initialize_model_parallel`` set up.
    """

    def __init__(self, model_config, parallel, optim: OptimizerConfig, loss: LossConfig,
                 max_tokens_per_microbatch: int = 4096, logprob_chunk_bytes: int = LOGPROB_CHUNK_BYTES,
                 frozen: bool = False, temperature: float = 1.0, runtime=None, distill: DistillConfig | None = None):
        from gspo_megatron.megatron.model import ModelRuntime, build_model, resolve_layer_spec, wrap_ddp

        if not temperature > 0.0:
            raise ValueError(f"PolicyModel: temperature must be > 0 (the rollout's sampling temperature), "
                             f"got {temperature!r}")
        self.temperature = temperature

        self.model_config, self.parallel, self.optim_config, self.loss_config = model_config, parallel, optim, loss
        self.distill_config = distill  # on-policy distillation's loss term (None or teacher_dir unset: off)
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self.logprob_chunk_bytes = logprob_chunk_bytes
        # runtime: precision, recomputation and layer spec (model.ModelRuntime; default fp32, auto spec)
        self.runtime = runtime or ModelRuntime()
        self.layer_spec = resolve_layer_spec(self.runtime.layer_spec)
        self.module = build_model(model_config, parallel, runtime=self.runtime)
        self.groups = ModelGroups.from_parallel_state(parallel.use_sequence_parallel)
        self.module.config.variable_seq_lengths = True  # micro-batches differ in shape (packing)
        self.frozen = frozen
        self.skipped_steps = 0
        if frozen:
            self.module.requires_grad_(False)
            self.ddp = self.optimizer = self.scheduler = None
            return
        self.ddp = wrap_ddp(self.module, parallel, self.runtime.grad_reduce_in_fp32)
        self.reset_optimizer()

    def reset_optimizer(self, lr: float | None = None) -> None:
        """A fresh Megatron optimizer (Adam state empty) and LR schedule; ``lr`` overrides the config's
        (the supervised warm start uses its own rate, then RL starts from a clean state)."""
        optim = self.optim_config if lr is None else warm_start_config(self.optim_config, lr)
        self.active_optim = optim  # the settings of the optimizer in use (a loaded state takes them too)
        self.optimizer, self.scheduler = build_optimizer(optim, self.ddp, self.parallel.distributed_optimizer,
                                                         self.runtime.precision)

    def reload_main_weights(self) -> None:
        """Copy the parameters into the optimizer's fp32 main weights, after they were written outside the
        optimizer (an initialisation, a weights-only or Hugging Face load). Megatron's mixed-precision
        optimizers (bf16 / fp16: Float16OptimizerWithFloat16Params and the distributed optimizer) step fp32
        copies made when the optimizer was built and write them back over the parameters, so without this the
        first step returns the model to the weights it was built with (megatron-core 0.16.1
        optimizer/optimizer.py ``reload_model_params``, which Megatron's own training calls after a load
        without optimizer state). A frozen model has no optimizer."""
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    # ---- helpers -------------------------------------------------------------------------------
    @property
    def pad_multiple(self) -> int:
        # sequence parallelism splits the sequence dimension over TP ranks, context parallelism into 2 CP chunks
        return cp_pad_multiple(self.groups.cp_size,
                               self.parallel.tensor_parallel if self.parallel.use_sequence_parallel else 1)

    def _local_plan(self, seqs: Sequence[TrainSequence]) -> list[list[int]]:
        """This rank's micro-batches (sequence indices), in run order; deterministic in the lengths."""
        return pack_microbatches([int(q.tokens.numel()) for q in seqs], self.max_tokens_per_microbatch)

    def _microbatches(self, seqs: Sequence[TrainSequence], replay: bool = False) -> list[dict]:
        """Pack this rank's sequences, then align the plan over the data-parallel group.

        replay: attach each micro-batch's ``routed_experts`` [b, s, num_moe_layers, top_k] from the
        sequences' records (Routing Replay); padding rows and positions get placeholder experts.

        Expert parallelism spans DP ranks and every MoE forward is a collective over the EP group, so all
        DP ranks must run the same number of micro-batches (shapes are aligned too, keeping per-rank work
        equal). Missing micro-batches and rows are padding (loss mask all False).
        """
        bins = self._local_plan(seqs)
        shapes = [(len(m), max(int(seqs[i].tokens.numel()) for i in m)) for m in bins]
        group = self.groups.data_parallel
        if self.groups.dp_size > 1:
            count = torch.tensor([len(bins)])
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
            shapes += [(1, 1)] * (int(count) - len(bins))
            bins += [[] for _ in range(int(count) - len(bins))]
            table = torch.tensor(shapes, dtype=torch.long)
            dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
            shapes = [tuple(int(x) for x in row) for row in table]
        fields = present_fields(seqs)
        out = []
        for members, (rows, length) in zip(bins, shapes):
            mb = dict(collate([seqs[i] for i in members], self.pad_multiple, rows=rows, min_len=length, fields=fields),
                      indices=members)
            if replay:
                mb["routed_experts"] = self._experts_batch([seqs[i] for i in members], mb["input_ids"].shape)
            out.append(split_microbatch(mb, self.groups.cp_size, self.groups.cp_rank))
        return out

    def _experts_batch(self, members: Sequence[TrainSequence], shape) -> torch.Tensor:
        from gspo_megatron.megatron.routing import experts_to_batch, moe_layer_numbers

        missing = [i for i, q in enumerate(members) if q.routed_experts is None]
        if missing:
            raise ValueError(f"routing replay: {len(missing)} sequences have no routed_experts (R2: record_routing "
                             "after compute_logprobs; R3: the rollout engine must return routed experts)")
        b, s = shape
        empty = torch.empty(0, len(moe_layer_numbers(self.module.config)), self.model_config.moe_router_topk,
                            dtype=torch.long)
        rows = [q.routed_experts for q in members] + [empty] * (b - len(members))
        return experts_to_batch(rows, s, num_experts=self.model_config.num_experts)

    def sequence_routing(self, seqs: Sequence[TrainSequence], recorder) -> list[torch.Tensor]:
        """Per sequence, the [len(tokens), num_moe_layers, top_k] experts ``recorder`` (a RoutingRecorder
        around one ``compute_logprobs(seqs)`` or ``forward_backward(seqs)``) saw; layers of other pipeline
        stages hold NO_EXPERT."""
        plan, routed = self._local_plan(seqs), recorder.routed_experts()
        if len(routed) < len(plan):
            raise ValueError(f"sequence_routing: the recorder saw {len(routed)} forwards for {len(plan)} "
                             "micro-batches; wrap exactly one forward call on these sequences")
        out: list[torch.Tensor | None] = [None] * len(seqs)
        for members, batch in zip(plan, routed):
            for row, i in enumerate(members):
                out[i] = batch[row, :int(seqs[i].tokens.numel())]
        return out

    def record_routing(self, seqs: Sequence[TrainSequence], recorder) -> list[torch.Tensor]:
        """Routing Replay R2: store in each sequence the experts ``recorder`` (a RoutingRecorder around
        ``compute_logprobs(seqs)``) saw; later ``forward_backward(seqs, replay=True)`` forces them.
        Returns ``sequence_routing(seqs, recorder)``, the rows as recorded.

        Layers of other pipeline stages hold placeholder experts 0 .. top_k-1 (never replayed here)."""
        from gspo_megatron.megatron.routing import NO_EXPERT

        fill = torch.arange(self.model_config.moe_router_topk)
        recorded = self.sequence_routing(seqs, recorder)
        for q, rows in zip(seqs, recorded):
            q.routed_experts = torch.where(rows == NO_EXPERT, fill, rows)
        return recorded

    def _replay(self, replay: bool):
        """A RoutingReplay on this model (None when off); use with ``_microbatches(..., replay=True)``."""
        if not replay:
            return None
        from gspo_megatron.megatron.routing import RoutingReplay

        if not self.model_config.is_moe:
            raise ValueError("routing replay needs an MoE model (model.num_experts > 0)")
        return RoutingReplay(self.module, sequence_parallel_group=self.groups.sequence_parallel)

    # ---- routing: record, replay (``replay=True`` on the forwards), drift -------------------------
    def routing_recorder(self, active: bool = True):
        """A RoutingRecorder on this model (a no-op context when not ``active``): wrap one
        ``compute_logprobs`` or ``forward_backward`` call, then read it with ``sequence_routing``."""
        from gspo_megatron.megatron.routing import RoutingRecorder

        if not active:
            return contextlib.nullcontext()
        return RoutingRecorder(self.module, sequence_parallel_group=self.groups.sequence_parallel,
                               context_parallel_group=self._cp_group)

    def routing_drift(self, seqs: Sequence[TrainSequence], before: Sequence[torch.Tensor], after) -> dict[str, float]:
        """Routing drift of ``seqs`` over their response tokens, all DP ranks: ``before`` holds per sequence
        the rows ``sequence_routing`` gave for an earlier forward, ``after`` is a RoutingRecorder around a
        later forward of the same ``seqs`` (the same call, so that both have the same batch shapes).

        ``routing_drift``: the paper's fraction of activated experts that changed, the mean over (token,
        layer) of |E_before - E_after| / k (set difference); ``routing_drift_set``: the fraction of (token,
        layer) top-k sets that changed at all (up to k times larger); both also per layer."""
        from gspo_megatron.megatron.routing import (drift_fractions, moe_layer_index, moe_routers, reduce_drift,
                                                    routing_drift)

        index = moe_layer_index(self.module.config)
        layers = sorted(moe_routers(self.module))  # this pipeline stage's MoE layers
        # the response tokens' label positions: where the log-probs (and the loss) are read
        response = [slice(q.prompt_len - 1, int(q.tokens.numel()) - 1) for q in seqs]

        def by_layer(rows_per_seq):
            return {layer: torch.cat([rows[cut, index[layer]] for rows, cut in zip(rows_per_seq, response)])
                    for layer in layers}

        stats = routing_drift(by_layer(before), by_layer(self.sequence_routing(seqs, after)),
                              num_layers=self.model_config.num_layers)
        fractions = drift_fractions(reduce_drift(stats, self.groups.data_parallel))
        out = {"routing_drift": float(fractions["overall"]), "routing_drift_set": float(fractions["set_overall"])}
        out.update({f"routing_drift/layer{i}": float(v) for i, v in enumerate(fractions["per_layer"])})
        out.update({f"routing_drift_set/layer{i}": float(v) for i, v in enumerate(fractions["set_per_layer"])})
        return out

    def routing_agreement(self, seqs: Sequence[TrainSequence], recorder) -> dict[str, float]:
        """Per MoE layer, the fraction of the rollout engine's top-k experts (each sequence's
        ``routed_experts``, [R, num_moe_layers, top_k]) the trainer's forward ``recorder`` saw (a
        RoutingRecorder around one free ``compute_logprobs(seqs)``) shares, over the response tokens' label
        positions (the positions whose routing makes the response log-probs), every rank.

        Reduced over the whole world, not only DP: pipeline stages hold different layers, and every rank
        must read the same overall agreement (the ``auto`` replay decision is taken on it); ranks holding
        the same record (TP) scale both sums alike. ``routing_agreement``: the mean over (token, layer);
        ``routing_agreement/layerN`` for each MoE layer N."""
        from gspo_megatron.megatron.routing import (agreement_fractions, moe_layer_index, moe_routers, reduce_drift,
                                                    routing_agreement)

        missing = [i for i, q in enumerate(seqs) if q.routed_experts is None]
        if missing:
            raise ValueError(f"routing_agreement: sequences {missing[:5]} carry no engine experts "
                             "(the rollout must be asked for them: return_routed_experts)")
        index = moe_layer_index(self.module.config)
        layers = sorted(moe_routers(self.module))
        response = [slice(q.prompt_len - 1, int(q.tokens.numel()) - 1) for q in seqs]

        def by_layer(rows_per_seq):
            return {layer: torch.cat([rows[cut, index[layer]].to(torch.long) for rows, cut in zip(rows_per_seq, response)])
                    for layer in layers}

        stats = routing_agreement(by_layer([q.routed_experts for q in seqs]), by_layer(self.sequence_routing(seqs, recorder)),
                                  num_layers=self.model_config.num_layers)
        fractions = agreement_fractions(reduce_drift(stats))
        out = {"routing_agreement": float(fractions["overall"])}
        out.update({f"routing_agreement/layer{i}": float(v) for i, v in enumerate(fractions["per_layer"]) if v == v})
        return out

    def _require_trainable(self, what: str) -> None:
        if self.frozen:
            raise ValueError(f"{what}: this PolicyModel is frozen (the KL reference); it only runs forward-only "
                             "passes (compute_logprobs)")

    def _forward(self, model, mb: dict, router_replay=None):
        """One micro-batch (on the compute device: ``device.to_device``) through ``model`` (the chunk the
        schedule hands ``forward_step``); with Routing Replay its experts are queued first, right before the
        routers run. Transformer Engine's causal attention implies the mask (its ``attn_mask_type`` causal
        ignores ``attention_mask``), so only the local spec gets an [1, 1, s, s] one. Every spec gets the
        padding mask (``_padding_mask``)."""
        if router_replay is not None:
            router_replay.set_microbatch(mb["routed_experts"], model)
        ids = mb["input_ids"]
        padding = self._padding_mask(mb["padding_mask"])
        if self.layer_spec == "te" or self.groups.cp_size > 1:  # CP attention masks causally by global position
            return model(ids, mb["position_ids"], None, padding_mask=padding)
        return model(ids, mb["position_ids"], causal_mask(ids.shape[1], ids.device), padding_mask=padding)

    def _padding_mask(self, mask: torch.Tensor) -> torch.Tensor | None:
        """[b, s] bool (True on padding) -> what ``GPTModel.forward(padding_mask=...)`` gets. megatron-core
        0.16.1 hands it to every MoE layer (gpt_model.py -> TransformerLayer._forward_mlp -> MoELayer.route
        -> TopKRouter.routing), where it keeps padded tokens out of the aux-loss counts and the z-loss; the
        local spec's MoE layers also dispatch no padded token (cpu_modules.PaddingFreeMoELayer). Two 0.16.1
        limits are met here, the same on every spec:
        - GPTModel scatters the mask over sequence-parallel ranks only on the first pipeline stage (under
          ``pre_process``); later stages get this rank's [b, s / TP] slice;
        - with the expert bias on the router cannot take it (``routing.router_takes_padding_mask``): the
          Transformer Engine spec's plain MoELayer would hand it over, so it gets none."""
        from gspo_megatron.megatron.routing import router_takes_padding_mask

        if self.layer_spec == "te" and not router_takes_padding_mask(self.module.config):
            return None
        first_stage = self.groups.pp_size == 1 or dist.get_rank(self.groups.pipeline) == 0
        if self.groups.sequence_parallel is not None and not first_stage and self.groups.tp_size > 1:
            local = mask.shape[1] // self.groups.tp_size
            return mask[:, self.groups.tp_rank * local:(self.groups.tp_rank + 1) * local]
        return mask

    @property
    def _cp_group(self):
        """The CP group when sequences are split over more than one rank, else None."""
        return self.groups.context_parallel if self.groups.cp_size > 1 else None

    @property
    def _reduce_sequence_sums(self):
        """GSPO's per-sequence sums summed over the CP group before the ratio (None without CP)."""
        return cp_reduce_sequence_sums(self._cp_group) if self._cp_group is not None else None

    @property
    def _runner(self) -> torch.nn.Module:
        """What the schedule runs: the DDP wrapper, or the bare model when frozen."""
        return self.module if self.frozen else self.ddp

    def _run(self, microbatches: list[dict], forward_step, forward_only: bool, router_replay=None):
        """Megatron's schedule over ``microbatches``; inside ``router_replay`` (a RoutingReplay) when given."""
        if router_replay is not None:
            with router_replay:
                return self._run(microbatches, forward_step, forward_only)
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(microbatches), model=[self._runner],
            # the schedule's seq_length is the whole sequence's (it divides by CP for the pipeline buffers)
            num_microbatches=len(microbatches),
            seq_length=max(m["input_ids"].shape[1] for m in microbatches) * self.groups.cp_size,
            micro_batch_size=max(m["input_ids"].shape[0] for m in microbatches), forward_only=forward_only)

    # ---- no-grad forward: old-policy / reference log-probs ---------------------------------------
    @torch.no_grad()
    def compute_logprobs(self, seqs: Sequence[TrainSequence], with_entropy: bool = False,
                         replay: bool = False) -> list[dict]:
        """Per sequence, the response tokens' log-probs [L - P] (and entropy) under the current weights.

        replay: force each sequence's ``routed_experts`` (Routing Replay R3: the old policy's log-probs
        under the rollout engine's routing). Results are broadcast from the last pipeline stage so every
        rank of the DP group gets them.
        """
        microbatches = self._microbatches(seqs, replay)
        router_replay = self._replay(replay)
        collected: list[tuple[list[int], torch.Tensor, torch.Tensor | None]] = []

        def forward_step(data_iterator, model):
            mb = to_device(next(data_iterator))
            output = self._forward(model, mb, router_replay)

            def loss_func(logits):
                logp, entropy = token_logprobs(logits, mb["labels"], self.model_config, self.groups, with_entropy,
                                               self.logprob_chunk_bytes, self.temperature)
                if self.groups.cp_size > 1:  # back to position order before the per-sequence slices
                    logp = gather_from_cp(logp, 1, self.groups.context_parallel)
                    entropy = None if entropy is None else gather_from_cp(entropy, 1, self.groups.context_parallel)
                collected.append((mb["indices"], logp, entropy))
                return logits.new_zeros(()), {}

            return output, loss_func

        self._runner.eval()
        self._run(microbatches, forward_step, forward_only=True, router_replay=router_replay)
        self._runner.train()
        results: list[dict] = [dict() for _ in seqs]
        if self.groups.is_last_stage:
            for indices, logp, entropy in collected:
                logp, entropy = to_host((logp, entropy))  # one copy per micro-batch; results live on the host
                for row, i in enumerate(indices):
                    p, n = seqs[i].prompt_len, int(seqs[i].tokens.numel())
                    results[i]["logprobs"] = logp[row, p - 1:n - 1].clone()
                    if entropy is not None:
                        results[i]["entropy"] = entropy[row, p - 1:n - 1].clone()
        return _from_last_stage(results, self.groups)

    # ---- the update ------------------------------------------------------------------------------
    def forward_backward(self, seqs: Sequence[TrainSequence], normalisers: LossNormalisers | None = None,
                         replay: bool = False) -> dict:
        """Accumulate the gradient of the mini-batch loss for this rank's share ``seqs``; returns the raw
        metrics reduced over micro-batches and DP ranks.

        replay: Routing Replay -- the update forwards use exactly each sequence's ``routed_experts`` (R2:
        stored by ``record_routing`` from the old-policy forward; R3: the rollout engine's).
        """
        self._require_trainable("forward_backward")
        dp = self.groups.dp_size
        if normalisers is None:
            normalisers = global_normalisers(seqs, self.groups.data_parallel)
        microbatches = self._microbatches(seqs, replay)
        num_mb = len(microbatches)
        need_entropy = self.loss_config.entropy_coef > 0
        router_replay = self._replay(replay)

        def forward_step(data_iterator, model):
            mb = to_device(next(data_iterator))
            output = self._forward(model, mb, router_replay)

            def loss_func(logits):
                logp, entropy = token_logprobs(logits, mb["labels"], self.model_config, self.groups, need_entropy,
                                               self.logprob_chunk_bytes, self.temperature)
                old = mb.get("old_logprobs")
                if old is None:
                    raise ValueError("forward_backward: every sequence needs old_logprobs (compute_logprobs first)")
                advantages = mb["token_advantages"] if "token_advantages" in mb else mb["advantages"]
                batch = padded_batch(logp, old, mb["loss_mask"], advantages, ref_logprobs=mb.get("ref_logprobs"),
                                     entropy=entropy, rollout_logprobs=mb.get("rollout_logprobs"),
                                     teacher_logprobs=mb.get("teacher_logprobs"))
                loss, metrics = policy_loss(self.loss_config, batch, normalisers, self._reduce_sequence_sums,
                                            distill=self.distill_config)
                # Megatron divides by the number of micro-batches and DDP averages over DP: undo both.
                return loss * (num_mb * dp), metrics

            return output, loss_func

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run(microbatches, forward_step, forward_only=False, router_replay=router_replay)
        raw = merge_metrics(outputs) if outputs else {}
        return self._reduce_to_all(raw)

    def sft_forward_backward(self, seqs: Sequence[TrainSequence]) -> dict:
        """Gradient of the supervised loss: mean negative log-likelihood of the response tokens of the
        whole mini-batch (global token count), for the warm start before RL."""
        self._require_trainable("sft_forward_backward")
        normalisers = global_normalisers(seqs, self.groups.data_parallel)
        microbatches = self._microbatches(seqs)
        scale = len(microbatches) * self.groups.dp_size

        def forward_step(data_iterator, model):
            mb = to_device(next(data_iterator))
            output = self._forward(model, mb)

            def loss_func(logits):
                logp, _ = token_logprobs(logits, mb["labels"], self.model_config, self.groups, False, self.logprob_chunk_bytes)
                nll = -(logp * mb["loss_mask"]).sum() / max(normalisers.num_tokens, 1.0)
                return nll * scale, {"loss": nll.detach(), "tokens": mb["loss_mask"].sum().float()}

            return output, loss_func

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run(microbatches, forward_step, forward_only=False)
        return self._reduce_to_all(merge_metrics(outputs) if outputs else {})

    def _reduce_to_all(self, raw: dict) -> dict:
        """Metrics live on the last pipeline stage: reduce over DP (and CP: each rank's terms are its share)
        there, then share with every rank."""
        raw = _reduce_metrics(raw, self.groups.data_context_parallel) if self.groups.is_last_stage else raw
        return _from_last_stage(raw, self.groups)

    def grads_finite(self) -> bool:
        """True when every gradient on every rank is finite (one MIN all-reduce over the world, none in a
        world of one).

        Megatron DDP keeps all gradients in a few contiguous buffers. A buffer's sum is finite only if all
        its elements are (inf and NaN propagate), so one summing pass per buffer settles the usual case;
        only a non-finite sum (a NaN/inf, or finite values overflowing fp32) pays the element-wise test."""
        grads = [buffer.grad_data for buffer in (*self.ddp.buffers, *self.ddp.expert_parallel_buffers)]
        sums = torch.stack([g.sum(dtype=torch.float32) for g in grads]) if grads else torch.zeros(0)
        finite = bool(torch.isfinite(sums).all()) or all(bool(torch.isfinite(g).all()) for g in grads)
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return finite
        flag = torch.tensor([1.0 if finite else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def optimizer_step(self) -> dict:
        """Clip, step, advance the LR schedule. A non-finite gradient anywhere skips the update (counted)."""
        self._require_trainable("optimizer_step")
        if not self.grads_finite():
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            self.skipped_steps += 1
            return {"update_skipped": 1.0, "grad_norm": float("nan"), "lr": self.current_lr()}
        ok, grad_norm = clip_and_step(self.optimizer)
        if not ok:
            self.skipped_steps += 1
        self.scheduler.step(increment=1)
        return {"update_skipped": 0.0 if ok else 1.0, "grad_norm": float(grad_norm) if grad_norm is not None else 0.0,
                "lr": self.current_lr()}

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def train_minibatch(self, seqs: Sequence[TrainSequence], replay: bool = False) -> dict[str, float]:
        """One optimizer step on this rank's share of a mini-batch: loss, backward, step (``replay``: Routing
        Replay, see ``forward_backward``). Returns the finalised metrics (means) plus grad_norm, lr and
        update_skipped."""
        raw = self.forward_backward(seqs, replay=replay)
        step = self.optimizer_step()
        final = finalize_metrics(raw) if raw else {}
        # one host conversion for all the 0-d metrics (float() per key converts one at a time)
        metrics = dict(zip(final, torch.stack(list(final.values())).tolist())) if final else {}
        metrics.update(step)
        return metrics

    # ---- state -----------------------------------------------------------------------------------
    def sharded_state_dict(self, is_loading: bool = False) -> dict:
        """Model, optimizer and scheduler state for dist_checkpointing (loadable at another layout for the
        model; the optimizer state reshards across DP). ``is_loading`` makes the optimizer allocate its
        (lazily created) Adam state first, so the load has somewhere to put it."""
        model_state = sharding.sharded_state_dict(self.module, prefix="model.")  # loads into either spec
        optimizer_module.allocate_adam_state(self.optimizer)  # a fresh distributed optimizer has none
        # Name optimizer tensors by their parameters only (no "chained_N." prefix for the dense/expert
        # optimizer pair that EP creates) and, for the distributed optimizer, in a fully reshardable
        # format: the optimizer state then loads at another TP/EP/DP layout like the weights do.
        metadata = {"chained_optim_avoid_prefix": True}
        if self.parallel.distributed_optimizer:
            metadata["distrib_optim_sharding_type"] = "fully_reshardable"
        return {"model": model_state,
                "optimizer": self.optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=metadata),
                "scheduler": self.scheduler.state_dict()}

    def load_sharded_state_dict(self, state: dict) -> None:
        sharding.load_module_state(self.module, state["model"], prefix="model.")
        self.optimizer.load_state_dict(state["optimizer"])
        optimizer_module.separate_adam_steps(self.optimizer)
        # the loaded parameter groups carry the checkpoint's settings: the config's are in effect (a resume
        # applies changed optimizer.* settings, trainer/resume.py). The scheduler sets each group's lr from
        # its max_lr / min_lr, and takes the config's schedule too (override_opt_param_scheduler).
        optim = self.active_optim
        for group in self.optimizer.param_groups:
            group["betas"] = (optim.adam_beta1, optim.adam_beta2)
            group["eps"] = optim.adam_eps
            group["max_lr"], group["min_lr"] = optim.lr, optim.min_lr
        self.scheduler.load_state_dict(state["scheduler"])
