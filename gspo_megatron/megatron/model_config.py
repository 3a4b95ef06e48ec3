"""The typed model config: one description of a decoder-only LM, readable from a Hugging Face config.json
and turned into Megatron-Core's TransformerConfig (see ``model.py``) or back into a transformers config.

Supported families: Qwen3-MoE, Qwen3, Qwen2/Qwen2.5, Llama (incl. Llama 3 RoPE scaling), Mixtral. Anything
a family's config says that this model cannot represent (sliding windows, an unknown RoPE type, dense
layers inside an MoE stack, biases where the architecture has none) is an error that names the field:
a model that loads but is subtly different is the failure users of other converters complain about.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Literal, Mapping

from gspo_megatron.typed_config import ConfigError, check

Architecture = Literal["qwen3_moe", "qwen3", "qwen2", "llama", "mixtral"]

HF_ARCHITECTURE_CLASS = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


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
    moe_aux_loss_coeff: float = 0.0  # load-balancing loss; off by default for RL
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_llama3_factor: float = 0.0  # > 0 enables Llama 3 RoPE frequency scaling with this factor
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_layernorm: bool = True
    init_method_std: float = 0.02

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
        else:
            check(self.ffn_hidden_size >= 1, f"{path}.ffn_hidden_size", "must be >= 1 for a dense model")
        check(self.rms_norm_eps > 0, f"{path}.rms_norm_eps", "must be > 0")
        check(self.rope_theta > 0, f"{path}.rope_theta", "must be > 0")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def padded_vocab_size(self, tensor_parallel_size: int) -> int:
        """Rows of the embedding/output matrices: the vocabulary rounded up to a multiple of TP.

        Padding rows are zero on import, dropped on export, and masked out of the log-softmax.
        """
        return int(math.ceil(self.vocab_size / tensor_parallel_size) * tensor_parallel_size)

    def num_parameters(self) -> int:
        """Parameter count (unpadded vocabulary), for memory arithmetic and progress reporting."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_attention_heads * 2 + self.num_key_value_heads * 2)
        if self.qkv_bias:
            attn += d * (self.num_attention_heads + 2 * self.num_key_value_heads)
        if self.qk_layernorm:
            attn += 2 * d
        if self.is_moe:
            mlp = self.num_experts * 3 * h * self.moe_ffn_hidden_size + self.num_experts * h
        else:
            mlp = 3 * h * self.ffn_hidden_size
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    # ---- Hugging Face ---------------------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json for the matching transformers class (weights use the hub's per-expert names)."""
        common = {
            "architectures": [HF_ARCHITECTURE_CLASS[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.init_method_std,
            "attention_dropout": 0.0,
        }
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_llama3_factor > 0:
            rope.update(rope_type="llama3", factor=self.rope_llama3_factor, **_LLAMA3_ROPE_DEFAULTS)
        common["rope_parameters"] = rope
        arch = self.architecture
        if arch == "qwen3_moe":
            common.update(num_experts=self.num_experts, num_experts_per_tok=self.moe_router_topk,
                          moe_intermediate_size=self.moe_ffn_hidden_size, intermediate_size=self.ffn_hidden_size,
                          norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
                          router_aux_loss_coef=self.moe_aux_loss_coeff, attention_bias=False)
        elif arch == "mixtral":
            common.update(num_local_experts=self.num_experts, num_experts_per_tok=self.moe_router_topk,
                          intermediate_size=self.moe_ffn_hidden_size, router_aux_loss_coef=self.moe_aux_loss_coeff,
                          router_jitter_noise=0.0, sliding_window=None)
        else:
            common["intermediate_size"] = self.ffn_hidden_size
            if arch in ("qwen3", "llama"):
                common["attention_bias"] = False
            if arch == "llama":
                common["mlp_bias"] = False
        return common

    def to_hf_config(self):
        """The transformers ``PretrainedConfig`` of this model."""
        import transformers

        return transformers.AutoConfig.for_model(**self.to_hf_dict())

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        """Derive the model config from a Hugging Face config dict; errors name ``source`` and the field."""
        model_type = hf.get("model_type")
        if model_type not in _FAMILY_RULES:
            raise ConfigError(f"{source}: model_type: unsupported architecture {model_type!r} "
                              f"(supported: {sorted(_FAMILY_RULES)})")
        rules = _FAMILY_RULES[model_type]

        def get(key: str, default: Any = _REQUIRED) -> Any:
            if key in hf and hf[key] is not None:
                return hf[key]
            if default is _REQUIRED:
                raise ConfigError(f"{source}: {key}: required field is missing for {model_type}")
            return default

        for key, allowed in rules["must_be"].items():
            if key in hf and hf[key] not in allowed:
                raise ConfigError(f"{source}: {key}: unsupported value {hf[key]!r} for {model_type} "
                                  f"(supported: {allowed})")
        act = get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act: unsupported activation {act!r} (SwiGLU models use 'silu')")

        heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        rope_theta, llama3_factor = _read_rope(hf, source, model_type)
        kwargs: dict[str, Any] = dict(
            architecture=model_type,
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden,
            num_layers=int(get("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(get("num_key_value_heads", heads)),
            head_dim=int(get("head_dim", hidden // heads)),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_llama3_factor=llama3_factor,
            max_position_embeddings=int(get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            init_method_std=float(get("initializer_range", 0.02)),
            qkv_bias=rules["qkv_bias"],
            qk_layernorm=rules["qk_layernorm"],
        )
        if model_type == "qwen3_moe":
            experts = hf.get("num_experts", hf.get("num_local_experts"))
            if experts is None:
                raise ConfigError(f"{source}: num_experts: required field is missing for qwen3_moe")
            kwargs.update(num_experts=int(experts), moe_router_topk=int(get("num_experts_per_tok")),
                          moe_ffn_hidden_size=int(get("moe_intermediate_size")),
                          ffn_hidden_size=int(get("intermediate_size", 1)),
                          norm_topk_prob=bool(get("norm_topk_prob", False)))
        elif model_type == "mixtral":
            kwargs.update(num_experts=int(get("num_local_experts")), moe_router_topk=int(get("num_experts_per_tok")),
                          moe_ffn_hidden_size=int(get("intermediate_size")), ffn_hidden_size=int(get("intermediate_size")),
                          norm_topk_prob=True)
        else:
            kwargs.update(num_experts=0, ffn_hidden_size=int(get("intermediate_size")))
        config = cls(**kwargs)
        config.validate(source)
        return config

    @classmethod
    def from_hf_dir(cls, hf_dir: str | Path) -> "ModelConfig":
        path = Path(hf_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: no config.json in the Hugging Face folder")
        return cls.from_hf_dict(json.loads(path.read_text()), source=str(path))


_REQUIRED = object()

# Values of the Llama 3 RoPE scaling that Megatron-Core's ``rope_scaling`` implements (it hard-codes them).
_LLAMA3_ROPE_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# Per family: fields that must hold one of the given values (else the model would differ silently).
_FAMILY_RULES: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"qkv_bias": False, "qk_layernorm": True,
                  "must_be": {"attention_bias": [False], "use_sliding_window": [False], "decoder_sparse_step": [1],
                              "mlp_only_layers": [[]], "shared_expert_intermediate_size": [0, None]}},
    "qwen3": {"qkv_bias": False, "qk_layernorm": True,
              "must_be": {"attention_bias": [False], "use_sliding_window": [False]}},
    "qwen2": {"qkv_bias": True, "qk_layernorm": False, "must_be": {"use_sliding_window": [False]}},
    "llama": {"qkv_bias": False, "qk_layernorm": False,
              "must_be": {"attention_bias": [False], "mlp_bias": [False], "pretraining_tp": [1]}},
    "mixtral": {"qkv_bias": False, "qk_layernorm": False,
                "must_be": {"sliding_window": [None], "router_jitter_noise": [0.0, 0]}},
}


def _read_rope(hf: Mapping[str, Any], source: str, model_type: str) -> tuple[float, float]:
    """(rope_theta, llama3 factor or 0) from either transformers 5's ``rope_parameters`` or the older
    top-level ``rope_theta`` + ``rope_scaling``."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling")
    if scaling:
        params.update(scaling)
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, 0.0
    if rope_type == "llama3" and model_type == "llama":
        for key, value in _LLAMA3_ROPE_DEFAULTS.items():
            if float(params.get(key, value)) != value:
                raise ConfigError(f"{source}: rope_parameters.{key}: Llama 3 RoPE scaling is supported with "
                                  f"{key}={value} only, got {params.get(key)}")
        return theta, float(params["factor"])
    raise ConfigError(f"{source}: rope_parameters.rope_type: unsupported RoPE type {rope_type!r} for {model_type}")
