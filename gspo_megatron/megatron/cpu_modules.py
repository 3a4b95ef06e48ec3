"""Faster drop-ins for two modules of Megatron-Core's local (non-Transformer-Engine) layer spec, used on CPU.

At the CPU demo size (hidden 64, 4 experts) a forward is dominated by per-call overhead, not arithmetic:
Megatron's ``SequentialMLP`` runs each expert as an ``MLP`` module whose two linears go through
``ColumnParallelLinear`` / ``RowParallelLinear`` and a custom autograd function, and the local
``DotProductAttention`` is unfused (baddbmm, masked softmax, bmm). Both replacements below are
subclasses of the Megatron module they replace: same constructor, same submodules and parameters, same
``state_dict`` / ``sharded_state_dict``, so checkpoints, ``megatron/sharding.py``, the conversion tables and
weight sync see no difference. Only ``forward`` changes, and it computes the same function (fp32: equal up
to summation order; ``tests/megatron/test_cpu_modules.py``). ``megatron/model.py`` puts them into the
local spec through Megatron's spec seam; the GPU (Transformer Engine) spec does not use them.

- ``SDPAttention``: ``torch.nn.functional.scaled_dot_product_attention`` as the core attention.
- ``FunctionalSequentialMLP``: the experts as direct ``torch.nn.functional.linear`` calls on each local
  expert's own weights (one Python frame per expert instead of a dozen).
- ``PaddingFreeMoELayer``: padded positions are routed to no expert, so the experts compute only real tokens
  (a right-padded RL batch is often a quarter padding). Real tokens get exactly the parent's result.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer

_THIS = "gspo_megatron/megatron/cpu_modules.py"


def is_plain_causal_mask(mask: torch.Tensor, sq: int, sk: int) -> bool:
    """True when ``mask`` ([s, s] or [1, 1, s, s] bool, True = masked) is exactly the causal mask, so SDPA's
    ``is_causal`` path (which also skips the masked blocks) gives the same result. The reference is built
    per call, not cached: it is no larger than the mask the caller already holds."""
    if sq != sk or mask.shape[-2:] != (sq, sk) or any(d != 1 for d in mask.shape[:-2]):
        return False
    causal = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).triu_(1)
    return torch.equal(mask.reshape(sq, sk), causal)


def sdpa_core_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: Optional[torch.Tensor], default_causal: bool, scale: float,
                        dropout_p: float = 0.0) -> torch.Tensor:
    """softmax(scale * q k^T + mask) v in Megatron's layout, via SDPA.

    query [sq, b, np, hn]; key, value [sk, b, ng, hn] with np a multiple of ng (GQA: query head j reads
    KV group j // (np / ng), as Megatron's ``repeat_interleave``); attention_mask bool, True = masked,
    broadcastable to [b, np, sq, sk] ([1, 1, sq, sk], [b, 1, sq, sk] or [sq, sk]), or None: causal when
    ``default_causal`` and sq > 1 (Megatron's default mask), else none. Returns [sq, b, np * hn].

    Rows whose every key is masked (padding queries) get Megatron's result too: Megatron fills masked
    scores with -10000, so such a row is the uniform mean of all values (SDPA alone would give zeros);
    here the row's query is zeroed and all its keys unmasked, which is that same mean, with no gradient
    into the query or the keys, as in Megatron. In partly masked rows Megatron's -10000 and SDPA's -inf
    give identical fp32 probabilities unless the unmasked scores are below about -9900.
    """
    sq, b, np_, _ = query.shape
    sk, ng = key.shape[0], key.shape[2]
    if np_ % ng:
        raise ValueError(f"{_THIS}: {np_} query heads are not a multiple of {ng} key/value groups")
    # [s, b, n, hn] -> [b, n, s, hn] views; SDPA's CPU kernel reads strided inputs.
    q, k, v = query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)
    keep, is_causal = None, False
    if attention_mask is None:
        if default_causal and sq > 1:
            if sq != sk:
                raise ValueError(f"{_THIS}: the default causal mask needs sq == sk, got sq={sq}, sk={sk}")
            is_causal = True
    elif attention_mask.dtype != torch.bool:
        raise ValueError(f"{_THIS}: attention_mask must be bool (True = masked, Megatron's convention), "
                         f"got {attention_mask.dtype}")
    elif is_plain_causal_mask(attention_mask, sq, sk):
        is_causal = True
    else:
        keep = ~attention_mask  # SDPA's bool mask means "may attend"
        dead = attention_mask.all(dim=-1, keepdim=True)  # [..., sq, 1]
        if bool(dead.any()):
            keep = keep | dead
            q = q.masked_fill(dead, 0.0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p, is_causal=is_causal,
                                         scale=scale, enable_gqa=ng != np_)
    # [b, np, sq, hv] -> [sq, b, np * hv] (hv: the values' head dim, hn's except under MLA)
    return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * value.shape[-1])


class SDPAttention(DotProductAttention):
    """Megatron's local ``DotProductAttention`` computed by SDPA; constructor, attributes and
    ``sharded_state_dict`` are the parent's (only vanilla softmax is accepted, so there are no parameters).

    Receives this TP rank's heads ([sq, b, np/TP, hn] queries, [sk, b, ng/TP, hn] keys and values), like the
    parent. Masking: as the parent, the mask passed to ``forward`` is used as given and the constructor's
    ``attn_mask_type`` only decides what ``attention_mask=None`` means (the ``attn_mask_type`` argument of
    ``forward`` is ignored by the parent too). Attention dropout is applied in training mode, under the
    same RNG-tracker fork as the parent (SDPA draws its own dropout pattern, so a dropout run is not
    bit-identical to the parent's; our configs use 0).

    Refused with an error: context parallelism > 1 (``cp_attention.ContextParallelSDPAttention`` is this
    module for CP), packed sequences (``packed_seq_params``), attention
    bias, sliding-window attention, non-vanilla softmax (off-by-one / learnable sinks).
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None):
        # k_channels / v_channels: multi-latent attention's query-key and value head dims (they differ); SDPA
        # reads both from the tensors, so they are accepted for MLASelfAttention's call and not stored
        if config.context_parallel_size != 1:
            raise ValueError(f"{_THIS}: SDPAttention (the CPU layer spec) does not support context "
                             f"parallelism; TransformerConfig.context_parallel_size={config.context_parallel_size} "
                             "takes cp_attention.ContextParallelSDPAttention (the CPU spec swaps it in at CP > 1)")
        if config.softmax_type != "vanilla":
            raise ValueError(f"{_THIS}: SDPAttention supports TransformerConfig.softmax_type='vanilla' only, "
                             f"got {config.softmax_type!r}")
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if self.scale_mask_softmax.window_size is not None:
            raise ValueError(f"{_THIS}: SDPAttention does not support sliding-window attention "
                             f"(TransformerConfig.window_size={config.window_size})")
        # The parent divides its baddbmm scale by the layer number under query-key layer scaling and
        # multiplies it back in the softmax; the product is the softmax scale.
        coeff = self.layer_number if config.apply_query_key_layer_scaling else 1
        self.sdpa_scale = self.softmax_scale * coeff

    def _check_heads(self, query, key) -> None:
        """This TP rank's share of the heads, as Megatron's attention hands them over."""
        if query.shape[2] != self.num_attention_heads_per_partition or \
                key.shape[2] != self.num_query_groups_per_partition:
            raise ValueError(f"{_THIS}: expected {self.num_attention_heads_per_partition} query heads and "
                             f"{self.num_query_groups_per_partition} key/value groups on this TP rank, got "
                             f"query {tuple(query.shape)}, key {tuple(key.shape)}")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query [sq, b, np, hn], key / value [sk, b, ng, hn] -> context [sq, b, np * hn]."""
        if packed_seq_params is not None:
            raise ValueError(f"{_THIS}: SDPAttention (the CPU layer spec) does not support packed sequences "
                             "(packed_seq_params); pass padded [b, s] batches")
        if attention_bias is not None:
            raise ValueError(f"{_THIS}: SDPAttention does not support attention_bias")
        self._check_heads(query, key)
        dropout_p = self.attention_dropout.p if self.training else 0.0
        default_causal = self.attn_mask_type == AttnMaskType.causal
        if dropout_p == 0.0:
            return sdpa_core_attention(query, key, value, attention_mask, default_causal, self.sdpa_scale)
        if self.config.sequence_parallel:
            return sdpa_core_attention(query, key, value, attention_mask, default_causal, self.sdpa_scale, dropout_p)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return sdpa_core_attention(query, key, value, attention_mask, default_causal, self.sdpa_scale, dropout_p)


def functional_path_blockers(config) -> list[str]:
    """The TransformerConfig settings under which an expert ``MLP`` is *not* plain
    ``fc2(act(fc1(x)) * probs)`` (so ``FunctionalSequentialMLP`` defers to ``SequentialMLP.forward``)."""
    checks = {
        "fp8": bool(config.fp8), "fp4": bool(config.fp4),
        "add_bias_linear": config.add_bias_linear,
        "bias_activation_fusion": config.bias_activation_fusion,
        "use_te_activation_func": config.use_te_activation_func,
        "gradient_accumulation_fusion": config.gradient_accumulation_fusion,
        "moe_apply_probs_on_input": config.moe_apply_probs_on_input,
        "activation_func_clamp_value": config.activation_func_clamp_value is not None,
        "glu_linear_offset": config.glu_linear_offset != 0.0,
        "cpu_offloading": config.cpu_offloading,
        "use_kitchen": config.use_kitchen,
    }
    return [name for name, blocked in checks.items() if blocked]


def expert_mlp(tokens: torch.Tensor, probs: torch.Tensor, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor,
               activation, gated: bool) -> torch.Tensor:
    """One expert: fc2(act(fc1(x)) * p), Megatron's expert ``MLP.forward`` without biases or fusions.

    tokens [t, h]; probs [t] (router weights, applied after the activation as Megatron does);
    fc1_weight [2f, h] (gated: gate rows then up rows) or [f, h]; fc2_weight [h, f]. Returns [t, h].
    Under expert TP the weights are this rank's shards and the result is this rank's partial sum, exactly
    what the parent's linears return (expert linears communicate nothing: the dispatcher does).
    """
    hidden = F.linear(tokens, fc1_weight)
    if gated:
        gate, up = torch.chunk(hidden, 2, dim=-1)
        hidden = activation(gate) * up
    else:
        hidden = activation(hidden)
    hidden = (hidden * probs.unsqueeze(-1)).to(hidden.dtype)
    return F.linear(hidden, fc2_weight)


class FunctionalSequentialMLP(SequentialMLP):
    """``SequentialMLP`` whose forward calls ``F.linear`` on each local expert's own ``linear_fc1.weight`` /
    ``linear_fc2.weight`` instead of calling the expert modules.

    Same submodules, parameters and (sharded) state dict as the parent; gradients accumulate into the same
    parameters' ``.grad``, so Megatron DDP's ``main_grad`` hooks see them. Works at any expert-parallel size
    (the dispatcher hands over this rank's tokens and ``tokens_per_expert`` per local expert) and any expert
    tensor-parallel size (expert linears never communicate: ``explicit_expert_comm`` in Megatron's linears).
    Settings under which an expert MLP does more than that (``functional_path_blockers``: fp8, biases,
    fused or TE activations, ...) use the parent's forward unchanged; ``self.functional_path`` says which.
    """

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, name=None):
        # megatron-core 0.19 passes its module path as name= (None when unnamed); 0.16.1 has no such argument
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection,
                         **({} if name is None else {"name": name}))
        self.functional_path = not functional_path_blockers(self.config)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        """[T, h] tokens grouped by local expert, [E_local] counts, [T] probs -> ([T, h], None)."""
        if not self.functional_path:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        activation, gated = self.config.activation_func, self.config.gated_linear_unit
        experts = self.local_experts
        if self.num_local_experts == 1:
            e = experts[0]
            out = expert_mlp(permuted_local_hidden_states, permuted_probs, e.linear_fc1.weight, e.linear_fc2.weight,
                             activation, gated)
            return out, None
        counts = tokens_per_expert.tolist()
        tokens = torch.split(permuted_local_hidden_states, counts)
        probs = torch.split(permuted_probs, counts)
        outputs = [expert_mlp(t, p, e.linear_fc1.weight, e.linear_fc2.weight, activation, gated)
                   for e, t, p in zip(experts, tokens, probs)]
        return torch.cat(outputs, dim=0), None


def sequence_parallel_slice(mask: torch.Tensor, local_len: int, tp_group) -> torch.Tensor:
    """This tensor-parallel rank's rows of a whole-sequence ``mask`` [s, b] under sequence parallelism (the
    contiguous chunk ``rank * local_len`` on). megatron-core 0.16.1 and 0.19.2 scatter ``GPTModel``'s padding
    mask only on the first pipeline stage, so later stages' MoE layers receive it whole."""
    if mask.shape[0] != local_len * tp_group.size():
        raise ValueError(f"{_THIS}: padding_mask covers {mask.shape[0]} positions; the MoE layer holds "
                         f"{local_len} per rank of a {tp_group.size()}-rank tensor-parallel group")
    start = tp_group.rank() * local_len
    return mask[start:start + local_len]


class PaddingFreeMoELayer(MoELayer):
    """Megatron's ``MoELayer`` that sends padded tokens to no expert.

    ``GPTModel.forward(..., padding_mask=...)`` ([b, s] bool, True = padding: the convention of Megatron's
    code, whose docstrings say the opposite) reaches every MoE layer; the parent would hand it to the router
    and still dispatch every token. Here the router routes every token as without a mask, then the padded
    rows of the routing map are cleared, so the dispatcher permutes only real tokens and returns zeros for
    the padded ones. A real token's output is unchanged: experts act per token, and with right padding
    and a causal mask no real token attends to a padded one, so what padded positions hold never reaches
    the loss. The router's outputs (what ``megatron/routing.py`` records and replays) are untouched apart
    from the padded rows; shared experts still see every token.
    """

    def route(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """hidden [s, b, h], padding_mask [s, b] (the parent's forward transposed it) -> probs, routing map
        [s * b, experts] with the padded rows empty."""
        if padding_mask is not None and padding_mask.shape[0] != hidden_states.shape[0]:
            padding_mask = sequence_parallel_slice(padding_mask, hidden_states.shape[0], self.attn_tp_group)
        # the router takes the mask (aux / z losses over real tokens) as on the Transformer Engine spec, except
        # where megatron-core 0.16.1's expert-bias count cannot (routing.router_takes_padding_mask)
        from gspo_megatron.megatron.routing import router_takes_padding_mask

        probs, routing_map = super().route(hidden_states, padding_mask if router_takes_padding_mask(self.config) else None)
        if padding_mask is None:
            return probs, routing_map
        real = ~padding_mask.reshape(-1, 1)
        return probs * real, routing_map & real


def skip_padding_in_moe_layers(model: torch.nn.Module) -> int:
    """Make every ``MoELayer`` of ``model`` a ``PaddingFreeMoELayer`` (returns how many; the caller asks
    ``model.padding_free_applies`` first). Done on the built
    model, not through the layer spec: Megatron's ``TransformerLayer`` hands its process groups only to MLP
    classes it knows by identity (a subclass in the spec is built with default groups and a warning). The
    subclass adds no state, so the object keeps every attribute, parameter and hook it was built with."""
    layers = [m for m in model.modules() if type(m) is MoELayer]
    for layer in layers:
        layer.__class__ = PaddingFreeMoELayer
    return len(layers)


class _AbsentTELinear:
    """Stands for Transformer Engine's TELinear where TE is not installed: a class nothing is an instance of."""


def enable_local_mla() -> None:
    """Let Megatron-Core 0.16.1's ``MLASelfAttention`` be built without Transformer Engine.

    Without TE, ``megatron.core.extensions.transformer_engine`` still imports, with mock stand-ins for its
    classes, so ``multi_latent_attention`` sets ``HAVE_TE = True`` and its ``isinstance(self.linear_proj,
    TELinear)`` raises TypeError (a mock is not a type). The stand-in is swapped for a real class no module
    is an instance of, which is the truth on such a machine; a real TELinear is left alone.
    """
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.TELinear = _AbsentTELinear
