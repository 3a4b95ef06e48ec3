"""The typed model config: one description of a decoder-only LM, readable from a Hugging Face config.json
and turned into Megatron-Core's TransformerConfig (see ``model.py``) or back into a transformers config.

The families and their config.json mappings live in ``gspo_megatron/models/`` (one module each, behind
``models/registry.py``). Anything a family's config says that this model cannot represent (sliding
windows, an unknown RoPE type, dense layers inside an MoE stack, biases where the architecture has none)
is an error that names the field.
"""
from __future__ import annotations

import dataclasses
import errno
import json
from pathlib import Path
from typing import Any, Literal, Mapping

from gspo_megatron.models import registry
from gspo_megatron.typed_config import ConfigError, check

# The trainable families of gspo_megatron/models/registry.py.
Architecture = Literal[registry.TRAINABLE]


@dataclasses.dataclass
class ModelConfig:
    """Shape and numerics of a Qwen3-MoE-shaped decoder (dense when ``num_experts == 0``).

    Units: sizes are element counts; ``rope_theta`` is the RoPE base.
    """

    architecture: Architecture = "qwen3_moe"
    vocab_size: int = 64
    hidden_size: int = 64
    num_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    ffn_hidden_size: int = 128  # dense MLP width (unused when every layer is MoE)
    num_experts: int = 4  # 0 means a dense model
    moe_ffn_hidden_size: int = 64
    moe_router_topk: int = 2
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities to sum to 1
    moe_shared_expert_intermediate_size: int = 0  # width of the shared expert beside the routed ones (0: none)
    moe_shared_expert_gate: bool = False  # shared expert output scaled by sigmoid(gate . x) (Qwen2-MoE)
    first_dense_layers: int = 0  # leading layers with a dense MLP (ffn_hidden_size) before the MoE layers
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    # A per-expert bias added to the sigmoid scores for choosing experts only (DeepSeek-V3's
    # e_score_correction_bias). Megatron keeps it as a buffer; RL keeps it frozen (update rate 0).
    moe_router_expert_bias: bool = False
    moe_router_topk_scaling_factor: float = 1.0  # routed_scaling_factor: the top-k weights are multiplied by it
    # Group-limited routing (DeepSeek-V3's n_group / topk_group): experts in moe_router_num_groups equal groups,
    # only the moe_router_group_topk groups with the largest sums of their top (topk / group_topk) scores are
    # eligible. group_topk == num_groups (the default 1 == 1) restricts nothing.
    moe_router_num_groups: int = 1
    moe_router_group_topk: int = 1
    rotary_percent: float = 1.0  # fraction of each head's dims that RoPE rotates (the first ones)
    moe_aux_loss_coeff: float = 0.0  # load-balancing loss; off by default for RL
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_llama3_factor: float = 0.0  # > 0 enables Llama 3 RoPE frequency scaling with this factor
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_layernorm: bool = True  # per-head q/k RMSNorm; with MLA: the q_lora and kv_lora latents' RMSNorms
    # Multi-latent attention (DeepSeek-V3), on when kv_lora_rank > 0: queries through a q_lora_rank latent
    # (0: one plain q projection), keys and values expanded from a kv_lora_rank latent; each head's query/key
    # has head_dim dims, the last qk_rope_head_dim of them rotated (one rotated key shared by all heads),
    # and v_head_dim value dims. num_key_value_heads equals num_attention_heads.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # YaRN RoPE scaling of the rotated MLA dims (DeepSeek-V3, Kimi-K2), on when rope_yarn_factor > 0; the
    # rotation frequencies, the cos/sin factor mscale / mscale_all_dim and the softmax scale as Megatron's
    # YarnRotaryEmbedding / MLA (mscale_all_dim 0: no softmax correction)
    rope_yarn_factor: float = 0.0
    rope_yarn_original_max_position_embeddings: int = 4096
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    rope_yarn_mscale: float = 1.0
    rope_yarn_mscale_all_dim: float = 0.0
    init_method_std: float = 0.02
    # Megatron-LM's --make-vocab-size-divisible-by: the embedding/output rows are the vocabulary rounded
    # up to a multiple of this times TP (padded_vocab_size). Not part of config.json: a Megatron setting.
    make_vocab_size_divisible_by: int = 128

    def validate(self, path: str) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "max_position_embeddings"):
            check(getattr(self, name) >= 1, f"{path}.{name}", f"must be >= 1, got {getattr(self, name)}")
        check(self.num_attention_heads % self.num_key_value_heads == 0, f"{path}.num_key_value_heads",
              f"must divide num_attention_heads={self.num_attention_heads}, got {self.num_key_value_heads}")
        check(self.num_experts >= 0, f"{path}.num_experts", f"must be >= 0, got {self.num_experts}")
        if self.is_moe:
            check(1 <= self.moe_router_topk <= self.num_experts, f"{path}.moe_router_topk",
                  f"must be in [1, num_experts={self.num_experts}], got {self.moe_router_topk}")
            check(self.moe_ffn_hidden_size >= 1, f"{path}.moe_ffn_hidden_size", "must be >= 1")
            check(self.moe_shared_expert_intermediate_size >= 0, f"{path}.moe_shared_expert_intermediate_size",
                  f"must be >= 0, got {self.moe_shared_expert_intermediate_size}")
            check(not self.moe_shared_expert_gate or self.moe_shared_expert_intermediate_size > 0,
                  f"{path}.moe_shared_expert_gate", "needs a shared expert (moe_shared_expert_intermediate_size > 0)")
            check(0 <= self.first_dense_layers < self.num_layers, f"{path}.first_dense_layers",
                  f"must be in [0, num_layers={self.num_layers}), got {self.first_dense_layers}")
            if self.first_dense_layers:
                check(self.ffn_hidden_size >= 1, f"{path}.ffn_hidden_size", "must be >= 1 for the dense layers")
            check(not self.moe_router_expert_bias or self.moe_router_score_function == "sigmoid",
                  f"{path}.moe_router_expert_bias", "needs moe_router_score_function='sigmoid'")
            # Megatron renormalises sigmoid top-k weights whenever k > 1
            check(self.moe_router_score_function == "softmax" or self.moe_router_topk == 1 or self.norm_topk_prob,
                  f"{path}.norm_topk_prob", "must be true with the sigmoid router (Megatron renormalises its top-k)")
            check(self.moe_router_topk_scaling_factor > 0, f"{path}.moe_router_topk_scaling_factor", "must be > 0")
            groups, chosen = self.moe_router_num_groups, self.moe_router_group_topk
            check(groups >= 1 and self.num_experts % groups == 0, f"{path}.moe_router_num_groups",
                  f"must be >= 1 and divide num_experts={self.num_experts}, got {groups}")
            check(1 <= chosen <= groups and (chosen == groups or self.moe_router_topk % chosen == 0),
                  f"{path}.moe_router_group_topk", f"must be in [1, moe_router_num_groups={groups}] and divide "
                  f"moe_router_topk={self.moe_router_topk}, got {chosen}")
        if self.is_mla:
            self._validate_mla(path)
        else:
            for name in ("q_lora_rank", "qk_rope_head_dim", "v_head_dim", "rope_yarn_factor"):
                check(getattr(self, name) == 0, f"{path}.{name}", "must be 0 without multi-latent attention "
                      f"(kv_lora_rank=0), got {getattr(self, name)}")
        rotary_dims = self.head_dim * self.rotary_percent
        check(0 < self.rotary_percent <= 1 and rotary_dims == int(rotary_dims) and int(rotary_dims) % 2 == 0,
              f"{path}.rotary_percent", f"head_dim={self.head_dim} x rotary_percent={self.rotary_percent} must be "
              f"an even number of dims in (0, head_dim]")
        if not self.is_moe:
            check(self.ffn_hidden_size >= 1, f"{path}.ffn_hidden_size", "must be >= 1 for a dense model")
            check(self.first_dense_layers == 0, f"{path}.first_dense_layers", "must be 0 for a dense model")
        check(self.rms_norm_eps > 0, f"{path}.rms_norm_eps", "must be > 0")
        check(self.rope_theta > 0, f"{path}.rope_theta", "must be > 0")
        check(self.make_vocab_size_divisible_by >= 1, f"{path}.make_vocab_size_divisible_by",
              f"must be >= 1, got {self.make_vocab_size_divisible_by}")

    def _validate_mla(self, path: str) -> None:
        check(self.q_lora_rank >= 0, f"{path}.q_lora_rank", f"must be >= 0, got {self.q_lora_rank}")
        check(self.v_head_dim >= 1, f"{path}.v_head_dim", f"must be >= 1, got {self.v_head_dim}")
        check(2 <= self.qk_rope_head_dim < self.head_dim and self.qk_rope_head_dim % 2 == 0,
              f"{path}.qk_rope_head_dim", f"must be even and in [2, head_dim={self.head_dim}), got "
              f"{self.qk_rope_head_dim}")
        check(self.num_key_value_heads == self.num_attention_heads, f"{path}.num_key_value_heads",
              f"must equal num_attention_heads={self.num_attention_heads} with multi-latent attention")
        check(self.rope_yarn_factor == 0 or self.rope_yarn_factor > 1, f"{path}.rope_yarn_factor",
              f"must be 0 (no YaRN) or > 1, got {self.rope_yarn_factor}")
        for name, ok in (("rotary_percent", self.rotary_percent == 1.0), ("qkv_bias", not self.qkv_bias),
                         ("rope_llama3_factor", self.rope_llama3_factor == 0.0)):
            check(ok, f"{path}.{name}", f"unsupported with multi-latent attention, got {getattr(self, name)}")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def group_limited(self) -> bool:
        """Whether group-limited routing excludes any group."""
        return self.is_moe and self.moe_router_group_topk < self.moe_router_num_groups

    @property
    def kv_down_proj_rows(self) -> int:
        """Rows of MLA's key/value down-projection ([kv latent; shared rotated key]), split over TP."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def plain_q_proj(self) -> bool:
        """MLA with one query projection (no q_lora latent)."""
        return self.is_mla and self.q_lora_rank == 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` (0-based) has the MoE block (else the dense MLP)."""
        return self.is_moe and layer >= self.first_dense_layers

    def moe_layer_pattern(self) -> list[int]:
        """Megatron's ``moe_layer_freq`` as a 0/1 list over the layers."""
        return [int(self.is_moe_layer(layer)) for layer in range(self.num_layers)]

    @property
    def moe_layer_freq(self) -> int | list[int]:
        """Megatron's ``moe_layer_freq`` as Megatron-Bridge and Megatron-LM set it for this family: a 0/1 list
        when layers differ or the family is configured with one (``Family.moe_layer_list``: DeepSeek-V3,
        GLM-4.5, even when every layer is MoE), else 1. A list makes Megatron key every layer separately in
        checkpoints, an int stacks the layers under one key (``sharding.layer_keys`` loads either)."""
        if self.first_dense_layers or registry.FAMILIES[self.architecture].moe_layer_list:
            return self.moe_layer_pattern()
        return 1

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        """Rows of the embedding/output matrices, as Megatron-LM pads them: the vocabulary rounded up to
        a multiple of ``make_vocab_size_divisible_by * TP`` (every TP rank holds the same number of rows,
        itself a multiple of the divisor). Padding rows are zero on import, dropped on export, and
        masked out of the log-softmax (docs/megatron.md, "Vocabulary padding")."""
        if tensor_parallel_size < 1:
            raise ValueError(f"padded_vocab_size: tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        multiple = self.make_vocab_size_divisible_by * tensor_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    def num_parameters(self) -> int:
        """Parameter count (unpadded vocabulary), for memory arithmetic and progress reporting."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_attention_heads * 2 + self.num_key_value_heads * 2)
        if self.is_mla:
            attn = self._mla_parameters()
        if self.qkv_bias:
            attn += d * (self.num_attention_heads + 2 * self.num_key_value_heads)
        if self.qk_layernorm and not self.is_mla:
            attn += 2 * d
        moe = self.num_experts * 3 * h * self.moe_ffn_hidden_size + self.num_experts * h
        moe += 3 * h * self.moe_shared_expert_intermediate_size + (h if self.moe_shared_expert_gate else 0)
        dense = 3 * h * self.ffn_hidden_size
        mlps = sum(moe if self.is_moe_layer(layer) else dense for layer in range(self.num_layers))
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + 2 * h) + mlps + embed + h

    def _mla_parameters(self) -> int:
        """One MLA layer's attention parameters (latent norms included)."""
        h, n, d, lq, lkv = (self.hidden_size, self.num_attention_heads, self.head_dim, self.q_lora_rank,
                            self.kv_lora_rank)
        queries = h * lq + lq + lq * n * d if lq else h * n * d
        nope = d - self.qk_rope_head_dim
        return (queries + h * (lkv + self.qk_rope_head_dim) + lkv + lkv * n * (nope + self.v_head_dim)
                + n * self.v_head_dim * h)

    # ---- Hugging Face (the per-family mapping lives in gspo_megatron/models/) -------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json for the matching transformers class (weights use the hub's per-expert names)."""
        return registry.trainable_family(self.architecture, "ModelConfig.architecture").hf_dict(self)

    def to_hf_config(self):
        """The transformers ``PretrainedConfig`` of this model."""
        import transformers

        return transformers.AutoConfig.for_model(**self.to_hf_dict())

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        """Derive the model config from a Hugging Face config dict; errors name ``source`` and the field."""
        family = registry.trainable_family(hf.get("model_type"), source)
        config = cls(**family.config_kwargs(hf, source))
        config.validate(source)
        return config

    @classmethod
    def from_hf_dir(cls, hf_dir: str | Path) -> "ModelConfig":
        path = Path(hf_dir) / "config.json"
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ConfigError(f"{path}: no config.json in the Hugging Face folder") from None
        except OSError as err:  # a folder, no permission, a symbolic link loop: say which, not "missing"
            why = "a symbolic link loop" if err.errno == errno.ELOOP else err.strerror
            raise ConfigError(f"{path}: cannot be read: {why}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None
        return cls.from_hf_dict(data, source=str(path))

