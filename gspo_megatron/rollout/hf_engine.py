"""In-process rollout engine on a transformers model: the CPU default of gspo-megatron.

``HFRolloutEngine`` holds a ``transformers`` causal LM of one of the Llama-style decoder families
(Qwen3-MoE, Qwen3, Qwen2, Qwen2-MoE, Llama, Mixtral, GLM-4.5; ``gspo_megatron/models/``) and implements
``RolloutEngine``:

- ``generate``: batched sampling with a preallocated KV cache. Prompts of different lengths are left-padded
  and prefilled once per prompt; the cache is then copied ``samples_per_prompt`` times. Rows that sample a
  stop token leave the batch (the cache is compacted), so finished responses stop costing compute.
- ``Sample.logprobs`` are the exact log-probs of the sampled tokens; by default of the distribution they
  were sampled from, ``log_softmax(logits / T)`` (before top-k / top-p, like SGLang), which is what the
  trainer's forward computes. ``logprob_mode`` selects the unmodified (T = 1) or the exact truncated
  sampling distribution (see ``sampling.py``).
- ``update_weights``: HF-checkpoint-named tensors in buckets, copied in place into the parameters (nothing
  touches disk). transformers 5.x keeps MoE experts fused in memory (``mlp.experts.gate_up_proj``
  ``[E, 2*I, H]`` and ``mlp.experts.down_proj`` ``[E, H, I]``); the per-expert checkpoint names
  (``mlp.experts.E.{gate,up,down}_proj.weight``, Mixtral ``block_sparse_moe.experts.E.w{1,3,2}.weight``) are
  mapped onto slices of those tensors.

Decoding does not go through ``model.forward``: ``_decoder_forward`` runs the model's own submodules
(projections, norms, rotary embedding, MLP / MoE blocks) layer by layer with our KV cache and
``scaled_dot_product_attention``. That skips transformers' per-call mask building, output recording and
cache bookkeeping, which dominate decode time for small models on CPU. Its outputs are tested against a
teacher-forced ``model(...)`` forward for every supported family (tests/rollout/test_hf_engine.py).

Determinism: every sample draws its random numbers from its own seed (``sampling.sample_seed`` of the
call seed, ``prompt_offset`` + prompt index and sample index), so the same weights, prompt and seeds give
the same response whatever batch, chunk (``max_batch_rows``) or rank it was drawn in.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F
import transformers
from torch import nn

from gspo_megatron.models import registry
from gspo_megatron.models.base import ExpertCheckpointNames
from gspo_megatron.rollout.base import RolloutEngine, RolloutInputError, Sample, SamplingParams
from gspo_megatron.rollout.sampling import LOGPROB_MODES, LogprobMode, sample_next_tokens, sample_uniforms

# The families this engine serves, and their engine facts, are in gspo_megatron/models/.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = registry.ENGINE_MODEL_TYPES


# ----------------------------------------------------------------------------------------------------------
# Model loading


ModelSource = transformers.PretrainedConfig | transformers.PreTrainedModel | str | os.PathLike


def load_model(
    source: ModelSource, *, dtype: torch.dtype, device: torch.device, init_seed: int | None
) -> transformers.PreTrainedModel:
    """Build or adopt the causal LM the engine will hold (eval mode, no grads, ``dtype`` on ``device``).

    source: a ``PretrainedConfig`` (random init via ``AutoModelForCausalLM.from_config``, seeded by
    ``init_seed`` without disturbing the global RNG), a ``PreTrainedModel`` (adopted and converted in place),
    or a local directory written by ``save_pretrained`` (never a Hub id: nothing is downloaded).
    """
    if isinstance(source, transformers.PreTrainedModel):
        model = source
    elif isinstance(source, transformers.PretrainedConfig):
        with torch.random.fork_rng(devices=[]):
            if init_seed is not None:
                torch.manual_seed(init_seed)
            model = transformers.AutoModelForCausalLM.from_config(source, dtype=dtype)
    elif isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"HFRolloutEngine: model path {path!r} is not a local directory")
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    else:
        raise TypeError(
            "HFRolloutEngine: expected a PretrainedConfig, PreTrainedModel or local directory, "
            f"got {type(source).__name__}"
        )
    model_type = model.config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"HFRolloutEngine: model_type {model_type!r} is not supported (supported: {list(SUPPORTED_MODEL_TYPES)})"
        )
    model.to(device=device, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    return model


@dataclasses.dataclass(frozen=True)
class _Arch:
    """What the decode loop needs to know about the model, read once from its config and modules."""

    model_type: str
    num_layers: int
    num_kv_heads: int
    head_dim: int  # the keys' (and queries') head dim
    value_dim: int  # the values' head dim (differs from head_dim under multi-latent attention)
    mla: bool  # multi-latent attention (DeepSeek-V3): ``_mla_attention``
    vocab_size: int
    max_positions: int
    sliding_window: int | None
    qk_norm: bool
    moe_gates: tuple[nn.Module, ...]  # the router of each MoE layer, in layer order
    moe_top_k: int


def _read_arch(model: transformers.PreTrainedModel) -> _Arch:
    config = model.config
    layers = model.model.layers[: config.num_hidden_layers]
    attention = layers[0].self_attn
    moe_blocks = [layer.mlp for layer in layers if _is_moe_block(layer.mlp)]
    mla = registry.FAMILIES[config.model_type].engine.mla
    # MLA caches every head's expanded key and value (heads, not latents: simple and exact)
    head_dim = attention.qk_head_dim if mla else attention.head_dim
    return _Arch(
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_attention_heads if mla else config.num_key_value_heads,
        head_dim=head_dim,
        value_dim=attention.v_head_dim if mla else head_dim,
        mla=mla,
        vocab_size=config.vocab_size,
        max_positions=config.max_position_embeddings,
        sliding_window=_sliding_window(config),
        qk_norm=_qk_norm(config),
        moe_gates=tuple(block.gate for block in moe_blocks),
        moe_top_k=config.num_experts_per_tok if moe_blocks else 0,
    )


def _qk_norm(config: transformers.PretrainedConfig) -> bool:
    """Whether the family normalises each query/key head: a fixed fact, or a config flag it names."""
    qk_norm = registry.FAMILIES[config.model_type].engine.qk_norm
    return bool(getattr(config, qk_norm)) if isinstance(qk_norm, str) else qk_norm


def _sliding_window(config: transformers.PretrainedConfig) -> int | None:
    """The attention window some layers use, or None when every layer attends to the whole sequence.

    Qwen2/Qwen3/Qwen2-MoE mark windowed layers in ``layer_types`` (``sliding_window`` may hold a number even
    when unused); Mixtral and Qwen3-MoE window every layer when ``sliding_window`` is set; Llama has none.
    """
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return window if "sliding_attention" in layer_types else None
    return window


def _is_moe_block(module: nn.Module) -> bool:
    children = dict(module.named_children())
    return "experts" in children and "gate" in children


# ----------------------------------------------------------------------------------------------------------
# Weight-name table for update_weights


@dataclasses.dataclass(frozen=True)
class _WeightSlot:
    """Where one incoming tensor goes: ``param[index]`` of shape ``shape``; ``covers`` are the checkpoint
    names this tensor counts as (a fused in-memory name covers every per-expert name it holds)."""

    param: torch.Tensor
    index: tuple
    shape: tuple[int, ...]
    covers: tuple[str, ...]


def weight_slots(model: transformers.PreTrainedModel) -> tuple[dict[str, _WeightSlot], frozenset[str]]:
    """Every name ``update_weights`` accepts, and the set of checkpoint names one full sync must cover.

    Accepted: HF checkpoint names (as ``save_pretrained`` writes them: per-expert MoE weights, Mixtral's
    ``block_sparse_moe``), the in-memory names of transformers 5.x (fused ``experts.gate_up_proj``), and the
    second name of a tied parameter (``lm_head.weight`` when embeddings are tied; optional).
    """
    model_type = model.config.model_type
    expert_names = registry.FAMILIES[model_type].engine.expert_names
    moe_prefixes = {f"{name}." for name, module in model.named_modules() if _is_moe_block(module)}
    slots: dict[str, _WeightSlot] = {}
    first_name: dict[int, str] = {}
    required: set[str] = set()
    # checkpointed buffers (e.g. a router's e_score_correction_bias) are weights to sync like parameters
    persistent = model.state_dict().keys()
    buffers = [(name, buf) for name, buf in model.named_buffers() if name in persistent]
    for name, param in [*model.named_parameters(remove_duplicate=False), *buffers]:
        if id(param) in first_name:  # tied: accept the alias, require only the first name
            slots[name] = slots[first_name[id(param)]]
            continue
        first_name[id(param)] = name
        prefix = next((p for p in moe_prefixes if name.startswith(p)), None)
        if prefix is None:
            slots[name] = _WeightSlot(param, (), tuple(param.shape), (name,))
            required.add(name)
            continue
        if expert_names is None:
            raise ValueError(f"HFRolloutEngine: no checkpoint expert naming for MoE model_type {model_type!r}")
        local = name[len(prefix) :]
        ckpt_prefix = prefix[: -len("mlp.")] + f"{expert_names.block}." if prefix.endswith(".mlp.") else prefix
        if local in ("experts.gate_up_proj", "experts.down_proj"):
            per_expert = _expert_slots(model, prefix, local, param, ckpt_prefix, expert_names)
            slots.update(per_expert)
            required.update(per_expert)
            slots[name] = _WeightSlot(param, (), tuple(param.shape), tuple(per_expert))
        else:
            ckpt_name = ckpt_prefix + local
            slots[ckpt_name] = _WeightSlot(param, (), tuple(param.shape), (ckpt_name,))
            required.add(ckpt_name)
            if ckpt_name != name:
                slots[name] = slots[ckpt_name]
    return slots, frozenset(required)


def _expert_slots(
    model: nn.Module,
    prefix: str,
    local: str,
    param: torch.Tensor,
    ckpt_prefix: str,
    names: ExpertCheckpointNames,
) -> dict[str, _WeightSlot]:
    """Per-expert checkpoint names mapped onto a fused expert tensor.

    gate_up_proj: [E, 2*I, H] = concat([gate_e [I, H], up_e [I, H]], dim 1) per expert e;
    down_proj: [E, H, I], down_e = down_proj[e].
    """
    experts = model.get_submodule(prefix + "experts")
    # The slicing below assumes transformers' default layout; other layouts need their own mapping.
    if getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True):
        raise ValueError(f"HFRolloutEngine: {prefix}experts uses a transposed or interleaved layout, not supported")
    num_experts = param.shape[0]
    out: dict[str, _WeightSlot] = {}
    if local == "experts.down_proj":
        for e in range(num_experts):
            ckpt = f"{ckpt_prefix}experts.{e}.{names.down}.weight"
            out[ckpt] = _WeightSlot(param, (e,), tuple(param.shape[1:]), (ckpt,))
        return out
    inter = param.shape[1] // 2
    for e in range(num_experts):
        for proj, rows in ((names.gate, slice(0, inter)), (names.up, slice(inter, 2 * inter))):
            ckpt = f"{ckpt_prefix}experts.{e}.{proj}.weight"
            out[ckpt] = _WeightSlot(param, (e, rows), (inter, param.shape[2]), (ckpt,))
    return out


# ----------------------------------------------------------------------------------------------------------
# KV cache and the decoder forward


class _KVCache:
    """Preallocated keys/values per layer, ``[rows, kv_heads, capacity, head_dim]``; all rows advance together
    (prompts are left-padded), so one ``length`` counts the filled positions."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int):
        self.keys = keys
        self.values = values
        self.length = length

    @classmethod
    def empty(cls, arch: _Arch, rows: int, capacity: int, dtype: torch.dtype, device: torch.device) -> "_KVCache":
        shape = (rows, arch.num_kv_heads, capacity, arch.head_dim)
        value_shape = (*shape[:-1], arch.value_dim)
        keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]
        values = [torch.empty(value_shape, dtype=dtype, device=device) for _ in range(arch.num_layers)]
        return cls(keys, values, 0)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ``[rows, kv_heads, q, head_dim]`` after the filled part; return all keys/values so far."""
        end = self.length + k.shape[2]
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (compaction when responses finish); copies just the filled positions."""
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = torch.empty((rows.numel(), *old.shape[1:]), dtype=old.dtype, device=old.device)
                new[:, :, : self.length] = old[rows, :, : self.length]
                buffers[i] = new

    def repeat_rows(self, repeats: int) -> None:
        """Row i becomes rows i*repeats .. i*repeats+repeats-1 (one prefill per prompt, G samples)."""
        if repeats == 1:
            return
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                buffers[i] = old.repeat_interleave(repeats, dim=0)


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The family's RMSNorm module applied as one fused op (transformers' version takes seven ops).

    Same maths, ``weight * x / sqrt(mean(x^2) + eps)``; equal to the module's output up to float rounding.
    """
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` dims of each head (all of them unless the family rotates part)."""
    dims = cos.shape[-1]
    if dims == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :dims], x[..., dims:]
    return torch.cat([rot * cos + _rotate_half(rot) * sin, rest], dim=-1)


def _attention(
    attn: nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: _KVCache,
    layer: int,
    mask: torch.Tensor | None,
    arch: _Arch,
) -> torch.Tensor:
    """Self-attention of one decoder layer with the module's own projections and norms.

    x: [B, q, hidden]; cos, sin: [B, 1, q, head_dim]; mask: [B, 1, q, kv] bool (True = attend) or None
    (no padding: causal within the new tokens, everything cached before). Returns [B, q, hidden].
    """
    if arch.mla:
        return _mla_attention(attn, x, cos, sin, cache, layer, mask)
    batch, q_len, _ = x.shape
    shape = (batch, q_len, -1, arch.head_dim)
    queries = attn.q_proj(x).view(shape)
    keys = attn.k_proj(x).view(shape)
    if arch.qk_norm:  # Qwen3 normalises each head before the rotary embedding
        queries = _rms_norm(attn.q_norm, queries)
        keys = _rms_norm(attn.k_norm, keys)
    queries = queries.transpose(1, 2)
    keys = keys.transpose(1, 2)
    queries = _rotary(queries, cos, sin)
    keys = _rotary(keys, cos, sin)
    values = attn.v_proj(x).view(shape).transpose(1, 2)
    all_keys, all_values = cache.write(layer, keys, values)
    out = F.scaled_dot_product_attention(
        queries,
        all_keys,
        all_values,
        attn_mask=mask,
        is_causal=mask is None and q_len > 1,
        scale=attn.scaling,
        enable_gqa=True,
    )
    return attn.o_proj(out.transpose(1, 2).reshape(batch, q_len, -1))


def _rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on DeepSeek's interleaved pairs (x0, x1), (x2, x3), ...: the output holds the rotated even dims,
    then the odd ones (transformers' ``rope_interleave``). cos, sin: [..., d] = cat(freqs, freqs)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


def _mla_attention(
    attn: nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: _KVCache,
    layer: int,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """Multi-latent attention (DeepSeek-V3) with the module's own projections and norms, caching each head's
    expanded key [nope; rope] and value, so decoding is ordinary attention over the cache.

    x: [B, q, hidden]; cos, sin: [B, 1, q, rope]; mask as ``_attention``. Returns [B, q, hidden].
    """
    batch, q_len, _ = x.shape
    nope, rope = attn.qk_nope_head_dim, attn.qk_rope_head_dim
    if attn.q_lora_rank is None:
        queries = attn.q_proj(x)
    else:
        queries = attn.q_b_proj(_rms_norm(attn.q_a_layernorm, attn.q_a_proj(x)))
    q_pass, q_rot = queries.view(batch, q_len, -1, nope + rope).transpose(1, 2).split([nope, rope], dim=-1)
    latent, k_rot = attn.kv_a_proj_with_mqa(x).split([attn.kv_lora_rank, rope], dim=-1)
    kv = attn.kv_b_proj(_rms_norm(attn.kv_a_layernorm, latent)).view(batch, q_len, -1, nope + attn.v_head_dim)
    k_pass, values = kv.transpose(1, 2).split([nope, attn.v_head_dim], dim=-1)
    k_rot = k_rot.view(batch, 1, q_len, rope)  # one rotated key shared by every head
    rotary = _rotary_interleaved if attn.config.rope_interleave else _rotary
    q_rot, k_rot = rotary(q_rot, cos, sin), rotary(k_rot, cos, sin)
    queries = torch.cat([q_pass, q_rot], dim=-1)
    keys = torch.cat([k_pass, k_rot.expand(-1, k_pass.shape[1], -1, -1)], dim=-1)
    all_keys, all_values = cache.write(layer, keys, values)
    out = F.scaled_dot_product_attention(queries, all_keys, all_values, attn_mask=mask,
                                         is_causal=mask is None and q_len > 1, scale=attn.scaling)
    return attn.o_proj(out.transpose(1, 2).reshape(batch, q_len, -1))


def _decoder_forward(
    model: transformers.PreTrainedModel,
    arch: _Arch,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cache: _KVCache,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """Run new tokens through the decoder, appending to ``cache``; return the last position's logits.

    input_ids, position_ids: [B, q]; mask: [B, 1, q, cache.length + q] bool or None. Returns [B, V].
    ``mask is None`` with ``q > 1`` requires an empty cache (causal prefill of unpadded prompts).
    """
    inner = model.model
    hidden = inner.embed_tokens(input_ids)
    cos, sin = inner.rotary_emb(hidden, position_ids)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for i, layer in enumerate(inner.layers[: arch.num_layers]):
        hidden = hidden + _attention(
            layer.self_attn, _rms_norm(layer.input_layernorm, hidden), cos, sin, cache, i, mask, arch
        )
        hidden = hidden + layer.mlp(_rms_norm(layer.post_attention_layernorm, hidden))
    cache.length += input_ids.shape[1]
    return model.lm_head(_rms_norm(inner.norm, hidden[:, -1]))


class _RoutingRecorder:
    """Forward hooks on each MoE layer's router that keep the expert ids of the latest forward.

    transformers 5.x routers return ``(router_logits, routing_weights, expert_ids)``; ``expert_ids`` is
    [tokens, top_k] with tokens = B * q flattened row-major.
    """

    def __init__(self, gates: Sequence[nn.Module], top_k: int):
        self._gates = gates
        self._top_k = top_k
        self._latest: list[torch.Tensor | None] = [None] * len(gates)
        self._handles: list = []

    def __enter__(self) -> "_RoutingRecorder":
        self._handles = [gate.register_forward_hook(self._hook(i)) for i, gate in enumerate(self._gates)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int):
        def hook(module: nn.Module, args, output) -> None:
            if not (isinstance(output, tuple) and len(output) == 3 and output[2].shape[-1] == self._top_k):
                raise RuntimeError(
                    f"HFRolloutEngine: router {type(module).__name__} did not return (logits, weights, expert_ids "
                    f"[tokens, {self._top_k}]); this transformers version is not supported for routed experts"
                )
            self._latest[layer] = output[2]

        return hook

    def take(self) -> torch.Tensor:
        """Expert ids of the latest forward: [tokens, num_moe_layers, top_k] int32."""
        ids = torch.stack(self._latest, dim=1).to(torch.int32)
        self._latest = [None] * len(self._gates)
        return ids


# ----------------------------------------------------------------------------------------------------------
# The engine


class HFRolloutEngine(RolloutEngine):
    """Rollout engine on an in-process transformers model (see the module docstring).

    model: a ``PretrainedConfig`` (random init; the trainer's model config provides ``to_hf_config()``), a
        ``PreTrainedModel`` (adopted: converted to ``dtype``/``device`` in place) or a local HF directory.
    logprob_mode: ``"temperature"`` (default; log_softmax(logits / T), the distribution sampled from and
        what the trainer computes), ``"raw"`` or ``"sampling"`` (see ``gspo_megatron/rollout/sampling.py``).
    max_batch_rows: most sequences decoded at once; prompts are processed in chunks of
        ``max_batch_rows // samples_per_prompt`` (at least one prompt per chunk).
    init_seed: seed of the random initialisation when ``model`` is a config.
    """

    def __init__(
        self,
        model: ModelSource,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        logprob_mode: LogprobMode = "temperature",
        max_batch_rows: int = 256,
        init_seed: int | None = None,
    ):
        if logprob_mode not in LOGPROB_MODES:
            raise ValueError(
                f"HFRolloutEngine: logprob_mode must be one of {list(LOGPROB_MODES)}, got {logprob_mode!r}"
            )
        if max_batch_rows < 1:
            raise ValueError(f"HFRolloutEngine: max_batch_rows must be >= 1, got {max_batch_rows}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = load_model(model, dtype=dtype, device=self.device, init_seed=init_seed)
        self.logprob_mode: LogprobMode = logprob_mode
        self.max_batch_rows = max_batch_rows
        self.weight_version = 0
        self._arch = _read_arch(self.model)
        self._slots, self._required_names = weight_slots(self.model)
        self._names_loaded: set[str] = set()
        self._pad_token_id = 0  # any valid id: padded positions are masked out of every attention

    # -- properties other parts use

    @property
    def num_moe_layers(self) -> int:
        return len(self._arch.moe_gates)

    @property
    def moe_top_k(self) -> int:
        return self._arch.moe_top_k

    def checkpoint_weight_names(self) -> list[str]:
        """The HF checkpoint names one full ``update_weights`` sync must send (sorted)."""
        return sorted(self._required_names)

    # -- generation

    def generate(
        self, prompts: Sequence[Sequence[int]], samples_per_prompt: int, params: SamplingParams
    ) -> list[Sample]:
        self._check_request(prompts, samples_per_prompt, params)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        prompts_per_chunk = max(1, self.max_batch_rows // samples_per_prompt)
        samples: list[Sample] = []
        gates = self._arch.moe_gates if params.return_routed_experts else ()
        with torch.inference_mode(), _RoutingRecorder(gates, self._arch.moe_top_k) as recorder:
            for start in range(0, len(prompts), prompts_per_chunk):
                chunk = prompts[start : start + prompts_per_chunk]
                indices = [params.prompt_index(start + k) for k in range(len(chunk))]
                uniforms = sample_uniforms(seed, indices, samples_per_prompt, params.max_new_tokens)
                samples.extend(self._generate_chunk(chunk, start, samples_per_prompt, params, uniforms, recorder))
        return samples

    def _check_request(self, prompts: Sequence[Sequence[int]], samples_per_prompt: int, params: SamplingParams) -> None:
        if samples_per_prompt < 1:
            raise RolloutInputError(f"generate: samples_per_prompt must be >= 1, got {samples_per_prompt}")
        checks = (
            (params.max_new_tokens >= 1, "max_new_tokens", "must be >= 1"),
            (params.temperature >= 0.0 and math.isfinite(params.temperature), "temperature", "must be >= 0"),
            (0.0 < params.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (params.top_k >= 0, "top_k", "must be >= 0 (0 disables)"),
        )
        for ok, field, message in checks:
            if not ok:
                raise RolloutInputError(f"SamplingParams.{field}: {message}, got {getattr(params, field)!r}")
        longest = 0
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise RolloutInputError(f"generate: prompts[{i}] is empty")
            if min(prompt) < 0 or max(prompt) >= self._arch.vocab_size:
                raise RolloutInputError(f"generate: prompts[{i}] has token ids outside [0, {self._arch.vocab_size})")
            longest = max(longest, len(prompt))
        total = longest + params.max_new_tokens
        if total > self._arch.max_positions:
            raise RolloutInputError(
                f"generate: longest prompt ({longest}) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                f"model's max_position_embeddings ({self._arch.max_positions})"
            )
        window = self._arch.sliding_window
        if window is not None and total > window:
            raise RolloutInputError(
                f"generate: sequences of up to {total} tokens exceed config.sliding_window ({window}); "
                "sliding-window attention is not implemented by HFRolloutEngine"
            )

    def _generate_chunk(
        self,
        prompts: Sequence[Sequence[int]],
        first_prompt_index: int,
        group: int,
        params: SamplingParams,
        uniforms: torch.Tensor,
        recorder: _RoutingRecorder,
    ) -> list[Sample]:
        """Prefill the chunk's prompts once, copy each prompt's cache ``group`` times, then decode.
        uniforms: [prompts * group, max_new_tokens] float64, each output row's random numbers."""
        device, arch, max_new = self.device, self._arch, params.max_new_tokens
        record = params.return_routed_experts and self.num_moe_layers > 0
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        width = int(lengths.max())
        padded = bool((lengths < width).any())
        input_ids = torch.full((len(prompts), width), self._pad_token_id, dtype=torch.long, device=device)
        for i, prompt in enumerate(prompts):
            input_ids[i, width - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.long)
        is_token = torch.arange(width, device=device)[None, :] >= (width - lengths)[:, None]  # [P, width]
        positions = (is_token.cumsum(dim=1) - 1).clamp(min=0)
        # The last sampled token is never fed back, hence -1.
        cache = _KVCache.empty(arch, len(prompts), width + max_new - 1, self.dtype, device)

        prefill_mask = _prefill_mask(is_token) if padded else None
        logits = _decoder_forward(self.model, arch, input_ids, positions, cache, prefill_mask)
        prefill_routes = recorder.take().view(len(prompts), width, -1, arch.moe_top_k) if record else None
        routes = prefill_routes[:, -1] if record else None
        # prompt i sits right-aligned: its positions 0 .. P_i - 2 are columns width - P_i .. width - 2
        prompt_routes = ([prefill_routes[i, width - len(p) : width - 1].clone() for i, p in enumerate(prompts)]
                         if record else None)

        rows_total = len(prompts) * group
        cache.repeat_rows(group)
        logits = logits.repeat_interleave(group, dim=0)
        routes = routes.repeat_interleave(group, dim=0) if record else None
        key_mask = None
        if padded:  # [rows, 1, 1, capacity]: prompt padding masked, every generated position visible
            key_mask = torch.ones(rows_total, 1, 1, cache.keys[0].shape[2], dtype=torch.bool, device=device)
            key_mask[:, 0, 0, :width] = is_token.repeat_interleave(group, dim=0)
        next_position = lengths.repeat_interleave(group)
        rows = torch.arange(rows_total, device=device)  # which output row each batch row fills
        stop_ids = torch.tensor(sorted(set(params.stop_token_ids)), dtype=torch.long, device=device)

        out_tokens = torch.zeros(rows_total, max_new, dtype=torch.long, device=device)
        out_logprobs = torch.zeros(rows_total, max_new, dtype=torch.float32, device=device)
        out_lengths = torch.full((rows_total,), max_new, dtype=torch.long, device=device)
        out_routes = (
            torch.zeros(rows_total, max_new, self.num_moe_layers, arch.moe_top_k, dtype=torch.int32, device=device)
            if record
            else None
        )
        for step in range(max_new):
            tokens, logprobs = sample_next_tokens(
                logits,
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                uniforms=uniforms[rows.cpu(), step],
                logprob_mode=self.logprob_mode,
            )
            out_tokens[rows, step] = tokens
            out_logprobs[rows, step] = logprobs
            if record:
                out_routes[rows, step] = routes
            if step == max_new - 1:
                break
            if stop_ids.numel():
                stopped = torch.isin(tokens, stop_ids)
                if bool(stopped.any()):
                    out_lengths[rows[stopped]] = step + 1
                    keep = (~stopped).nonzero().squeeze(1)
                    if keep.numel() == 0:
                        break
                    rows, tokens, next_position = rows[keep], tokens[keep], next_position[keep]
                    cache.select_rows(keep)
                    key_mask = key_mask[keep] if key_mask is not None else None
            mask = key_mask[..., : cache.length + 1] if key_mask is not None else None
            logits = _decoder_forward(self.model, arch, tokens[:, None], next_position[:, None], cache, mask)
            if record:
                routes = recorder.take()
            next_position = next_position + 1
        return self._to_samples(first_prompt_index, group, out_tokens, out_logprobs, out_lengths, out_routes,
                                prompt_routes, params)

    def _to_samples(
        self,
        first_prompt_index: int,
        group: int,
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        lengths: torch.Tensor,
        routes: torch.Tensor | None,
        prompt_routes: list[torch.Tensor] | None,
        params: SamplingParams,
    ) -> list[Sample]:
        stop_ids = set(params.stop_token_ids)
        token_lists, logprob_lists, length_list = tokens.tolist(), logprobs.tolist(), lengths.tolist()
        samples = []
        for row, (ids, lps, n) in enumerate(zip(token_lists, logprob_lists, length_list)):
            samples.append(
                Sample(
                    prompt_index=first_prompt_index + row // group,
                    response_ids=ids[:n],
                    logprobs=lps[:n],
                    finish_reason="stop" if ids[n - 1] in stop_ids else "length",
                    routed_experts=routes[row, :n].clone() if routes is not None else None,
                    prompt_routed_experts=prompt_routes[row // group] if prompt_routes is not None else None,
                )
            )
        return samples

    # -- weights

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, final: bool) -> None:
        """Copy one bucket of HF-named tensors into the model in place (validated first, then applied).

        A sync is every bucket up to and including the one with ``final=True``; it must cover every name
        of ``checkpoint_weight_names()`` (a missing tensor is an error then, and ``weight_version`` is not
        bumped). Incoming dtypes are cast to the engine's dtype.
        """
        bucket = list(named_tensors)
        for name, tensor in bucket:
            slot = self._slots.get(name)
            if slot is None:
                raise KeyError(
                    f"update_weights: unknown tensor {name!r} for {self._arch.model_type} "
                    f"(expected HF checkpoint names such as {self.checkpoint_weight_names()[:3]})"
                )
            if tuple(tensor.shape) != slot.shape:
                raise ValueError(
                    f"update_weights: tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {slot.shape}"
                )
            if not tensor.is_floating_point():
                raise ValueError(f"update_weights: tensor {name!r} has dtype {tensor.dtype}, expected a float dtype")
        with torch.no_grad():
            for name, tensor in bucket:
                slot = self._slots[name]
                slot.param.detach()[slot.index].copy_(tensor)
                self._names_loaded.update(slot.covers)
        if not final:
            return
        missing = self._required_names - self._names_loaded
        self._names_loaded = set()
        if missing:
            raise ValueError(
                f"update_weights(final=True): {len(missing)} of {len(self._required_names)} weights were not sent "
                f"in this sync, e.g. {sorted(missing)[:5]}; weight_version stays {self.weight_version}"
            )
        self.weight_version += 1

    def shutdown(self) -> None:
        """Nothing runs outside this process; the model is kept so a second call is harmless."""


def _prefill_mask(is_token: torch.Tensor) -> torch.Tensor:
    """[P, 1, W, W] bool: causal, padding keys hidden. A padding query sees itself only, so no row is fully
    masked (which would give NaN that 0-weights cannot cancel). is_token: [P, W] bool."""
    width = is_token.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=is_token.device).tril()
    diagonal = torch.eye(width, dtype=torch.bool, device=is_token.device)
    return (causal[None] & (is_token[:, None, :] | diagonal[None]))[:, None]


__all__ = [
    "HFRolloutEngine",
    "SUPPORTED_MODEL_TYPES",
    "load_model",
    "weight_slots",
]
