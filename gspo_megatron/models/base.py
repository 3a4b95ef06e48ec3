"""What every family module declares (``Family``), and the HF config reading all families share.

A family turns a Hugging Face ``config.json`` into the keyword arguments of the typed ``ModelConfig``
(``megatron/model_config.py``) and back. Anything the config says that the model cannot represent is an
error naming the file and the field: a model that loads but is subtly different is the failure users of
other converters complain about. The functions here receive the ``ModelConfig`` as ``config`` and only
read its fields; this package does not import ``megatron/`` (it sits below it).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from gspo_megatron.models.weights import Rule, fused_experts
from gspo_megatron.typed_config import ConfigError

_REQUIRED = object()

# Values of the Llama 3 RoPE scaling that Megatron-Core's ``rope_scaling`` implements (it hard-codes them).
LLAMA3_ROPE_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclasses.dataclass(frozen=True)
class ExpertCheckpointNames:
    """How one family names a routed expert's weights in HF checkpoints (``save_pretrained`` / the Hub).

    block: the MoE block's module name in checkpoints (in memory transformers 5.x always calls it ``mlp``).
    gate / up / down: per-expert projection names, ``{block}.experts.{E}.{gate}.weight``.
    """

    block: str
    gate: str
    up: str
    down: str


@dataclasses.dataclass(frozen=True)
class EngineFacts:
    """What the transformers rollout engine needs to know beyond the modules it finds in the model."""

    # per-head RMSNorm of queries and keys before the rotary embedding: always, never, or as the HF config
    # flag of this name says (GLM-4.5's use_qk_norm)
    qk_norm: bool | str
    expert_names: ExpertCheckpointNames | None = None  # None for dense families
    mla: bool = False  # multi-latent attention (DeepSeek-V3): the engine's own MLA path


class HFReader:
    """Reads fields of one HF config dict; errors name ``source``, the field and the model type."""

    def __init__(self, hf: Mapping[str, Any], source: str):
        self.hf = hf
        self.source = source
        self.model_type = hf.get("model_type")

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        if key in self.hf and self.hf[key] is not None:
            return self.hf[key]
        if default is _REQUIRED:
            raise self.error(key, f"required field is missing for {self.model_type}")
        return default

    def integer(self, key: str, default: Any = _REQUIRED) -> int:
        """``key`` as an int: a JSON integer (``2``, or ``2.0``); ``"two"``, ``2.5`` or ``true`` is an error
        naming the key (``int()`` raised a bare ValueError on the first and truncated the second)."""
        value = self.get(key, default)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"expected an integer, got {value!r}")
        return value

    def number(self, key: str, default: Any = _REQUIRED) -> float:
        """``key`` as a float (a JSON number, not a string or a boolean), else an error naming the key."""
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, f"expected a number, got {value!r}")
        return float(value)

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {key}: {message}")


@dataclasses.dataclass(frozen=True)
class Family:
    """One HF ``model_type``: config mapping, weight table and engine facts.

    ``read_hf`` returns the family's own ``ModelConfig`` fields (the common ones are read by
    ``config_kwargs``); ``write_hf`` returns the family's own config.json entries. A family with
    ``weights=None`` is served by the rollout engine only: no ModelConfig, no conversion, no training.
    """

    model_type: str
    hf_class: str
    engine: EngineFacts
    weights: tuple[Rule, ...] | None
    read_hf: Callable[[HFReader], dict[str, Any]] | None = None
    write_hf: Callable[[Any], dict[str, Any]] | None = None
    must_be: Mapping[str, list] = dataclasses.field(default_factory=dict)  # field -> values we can represent
    rope_types: tuple[str, ...] = ("default",)
    partial_rotary: bool = False  # may rotate only the first partial_rotary_factor of each head's dims
    # checkpoints may hold multi-token-prediction layers after the decoder (model.layers.<num_layers + i>.*),
    # which transformers does not run and the conversion leaves out
    mtp_layers: bool = False
    qkv_bias: bool = False
    qk_layernorm: bool = False
    # Megatron-Bridge and Megatron-LM pass moe_layer_freq as a list for this family (per-layer checkpoint keys)
    moe_layer_list: bool = False

    @property
    def trainable(self) -> bool:
        return self.weights is not None

    @property
    def stored_forms(self) -> tuple:
        """Other ways releases store this family's HF tensors (``weights.Stacked`` / ``Renamed``): the fused
        experts of transformers 5, for every MoE family."""
        names = self.engine.expert_names
        return fused_experts(names.block, names.gate, names.up, names.down) if names is not None else ()

    def config_kwargs(self, hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        """``ModelConfig`` keyword arguments from an HF config dict (not yet validated)."""
        reader = HFReader(hf, source)
        for key, allowed in self.must_be.items():
            if key in hf and hf[key] not in allowed:
                raise reader.error(key, f"unsupported value {hf[key]!r} for {self.model_type} (supported: {allowed})")
        act = reader.get("hidden_act", "silu")
        if act != "silu":
            raise reader.error("hidden_act", f"unsupported activation {act!r} (SwiGLU models use 'silu')")
        heads = reader.integer("num_attention_heads")
        hidden = reader.integer("hidden_size")
        rope_theta, llama3_factor = read_rope(reader, self.rope_types)
        rotary_percent = read_partial_rotary(reader)
        if rotary_percent != 1.0 and not self.partial_rotary:
            raise reader.error("partial_rotary_factor", f"partial rotary embeddings are not supported for "
                               f"{self.model_type}, got {rotary_percent}")
        kwargs: dict[str, Any] = dict(
            architecture=self.model_type,
            vocab_size=reader.integer("vocab_size"),
            hidden_size=hidden,
            num_layers=reader.integer("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=reader.integer("num_key_value_heads", heads),
            head_dim=reader.integer("head_dim", hidden // heads),
            rms_norm_eps=reader.number("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_llama3_factor=llama3_factor,
            rotary_percent=rotary_percent,
            max_position_embeddings=reader.integer("max_position_embeddings", 4096),
            tie_word_embeddings=bool(reader.get("tie_word_embeddings", False)),
            init_method_std=reader.number("initializer_range", 0.02),
            qkv_bias=self.qkv_bias,
            qk_layernorm=self.qk_layernorm,
        )
        kwargs.update(self.read_hf(reader))
        return kwargs

    def hf_dict(self, config) -> dict[str, Any]:
        """A config.json for the matching transformers class (weights use the hub's per-expert names)."""
        common = {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": config.max_position_embeddings,
            "rms_norm_eps": config.rms_norm_eps,
            "tie_word_embeddings": config.tie_word_embeddings,
            "initializer_range": config.init_method_std,
            "attention_dropout": 0.0,
        }
        rope: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_type": "default"}
        if config.rope_llama3_factor > 0:
            rope.update(rope_type="llama3", factor=config.rope_llama3_factor, **LLAMA3_ROPE_DEFAULTS)
        if config.rotary_percent != 1.0:
            rope["partial_rotary_factor"] = config.rotary_percent
        common["rope_parameters"] = rope
        common.update(self.write_hf(config))
        return common


def read_rope(reader: HFReader, rope_types: tuple[str, ...]) -> tuple[float, float]:
    """(rope_theta, llama3 factor or 0) from either transformers 5's ``rope_parameters`` or the older
    top-level ``rope_theta`` + ``rope_scaling``."""
    hf = reader.hf
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling")
    if scaling:
        params.update(scaling)
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, 0.0
    if rope_type == "llama3" and "llama3" in rope_types:
        for key, value in LLAMA3_ROPE_DEFAULTS.items():
            if float(params.get(key, value)) != value:
                raise reader.error(f"rope_parameters.{key}", f"Llama 3 RoPE scaling is supported with "
                                   f"{key}={value} only, got {params.get(key)}")
        return theta, float(params["factor"])
    if rope_type == "yarn" and "yarn" in rope_types:  # the family reads the YaRN parameters itself
        return theta, 0.0
    raise reader.error("rope_parameters.rope_type", f"unsupported RoPE type {rope_type!r} for {reader.model_type}")


def read_partial_rotary(reader: HFReader) -> float:
    """``partial_rotary_factor`` from ``rope_parameters`` (transformers 5) or the top level (older files)."""
    params = reader.hf.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", reader.hf.get("partial_rotary_factor") or 1.0))


def dense_fields(reader: HFReader) -> dict[str, Any]:
    """A dense SwiGLU MLP in every layer."""
    return dict(num_experts=0, ffn_hidden_size=reader.integer("intermediate_size"))


def sigmoid_moe_fields(reader: HFReader) -> dict[str, Any]:
    """The DeepSeek-V3-style MoE of GLM-4.5 and DeepSeek-V3: ``first_k_dense_replace`` dense layers, then
    MoE layers with a sigmoid router, its selection-only expert bias (frozen during RL), renormalised top-k
    weights scaled by ``routed_scaling_factor``, and ``n_shared_experts`` shared experts."""
    moe_ffn = reader.integer("moe_intermediate_size")
    if not reader.get("norm_topk_prob", True):
        raise reader.error("norm_topk_prob", "must be true: Megatron renormalises the sigmoid router's top-k")
    return dict(num_experts=reader.integer("n_routed_experts"), moe_router_topk=reader.integer("num_experts_per_tok"),
                moe_ffn_hidden_size=moe_ffn, ffn_hidden_size=reader.integer("intermediate_size"),
                moe_shared_expert_intermediate_size=reader.integer("n_shared_experts", 0) * moe_ffn,
                first_dense_layers=reader.integer("first_k_dense_replace", 0), norm_topk_prob=True,
                moe_router_score_function="sigmoid", moe_router_expert_bias=True,
                moe_router_topk_scaling_factor=reader.number("routed_scaling_factor", 1.0))


def sigmoid_moe_hf(config, model_type: str) -> dict[str, Any]:
    """config.json entries of ``sigmoid_moe_fields`` (no group-limited routing, no MTP layers)."""
    shared, width = config.moe_shared_expert_intermediate_size, config.moe_ffn_hidden_size
    if shared % width:
        raise ValueError(f"{model_type}: moe_shared_expert_intermediate_size={shared} is not a multiple of "
                         f"moe_ffn_hidden_size={width} (config.json counts whole shared experts)")
    return dict(n_routed_experts=config.num_experts, num_experts_per_tok=config.moe_router_topk,
                moe_intermediate_size=width, intermediate_size=config.ffn_hidden_size, n_shared_experts=shared // width,
                first_k_dense_replace=config.first_dense_layers, norm_topk_prob=True,
                routed_scaling_factor=config.moe_router_topk_scaling_factor, n_group=1, topk_group=1,
                num_nextn_predict_layers=0)
