"""Model config from HF config.json: every family, and clear errors naming the field."""
import dataclasses
import json

import pytest
import transformers

from gspo_megatron.megatron.model_config import ModelConfig
from gspo_megatron.typed_config import ConfigError, build


def hf_dict(family: str, **overrides) -> dict:
    cls = transformers.AutoConfig.for_model(family)
    d = cls.to_dict()
    d.update(overrides)
    return d


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3", "qwen2", "llama", "mixtral", "qwen2_moe", "glm4_moe",
                                        "deepseek_v3"])
def test_round_trip_through_hf_config(model_type):
    extra = {"head_dim": 128} if model_type == "glm4_moe" else {}  # its default 4096 / 96 heads is not whole
    if model_type == "deepseek_v3":  # its default 3 dense layers would leave no MoE layer
        extra = {"first_k_dense_replace": 1}
    cfg = ModelConfig.from_hf_dict(hf_dict(model_type, num_hidden_layers=3, vocab_size=1000, **extra))
    assert cfg.architecture == model_type and cfg.num_layers == 3 and cfg.vocab_size == 1000
    again = ModelConfig.from_hf_dict(cfg.to_hf_dict())
    assert again == cfg
    # transformers accepts what we write
    hf = cfg.to_hf_config()
    assert hf.num_hidden_layers == 3 and type(hf).__name__.lower().startswith(model_type.replace("_", ""))


def test_qwen3_moe_fields():
    cfg = ModelConfig.from_hf_dict(hf_dict("qwen3_moe", num_experts=128, num_experts_per_tok=8, head_dim=128,
                                           norm_topk_prob=True, rope_parameters={"rope_theta": 1e6, "rope_type": "default"}))
    assert (cfg.num_experts, cfg.moe_router_topk, cfg.head_dim, cfg.rope_theta) == (128, 8, 128, 1e6)
    assert cfg.qk_layernorm and not cfg.qkv_bias and cfg.norm_topk_prob
    assert ModelConfig.from_hf_dict(hf_dict("qwen2")).qkv_bias
    assert ModelConfig.from_hf_dict(hf_dict("mixtral")).norm_topk_prob


def test_qwen2_moe_fields():
    cfg = ModelConfig.from_hf_dict(hf_dict("qwen2_moe", num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                                           shared_expert_intermediate_size=5632, hidden_size=2048,
                                           num_attention_heads=16))
    assert (cfg.num_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size, cfg.head_dim) == (60, 4, 1408, 128)
    assert (cfg.moe_shared_expert_intermediate_size, cfg.moe_shared_expert_gate) == (5632, True)
    assert cfg.qkv_bias and not cfg.qk_layernorm and not cfg.norm_topk_prob
    # the shared expert (3 matrices) and its [1, hidden] gate count in the parameter total
    no_shared = ModelConfig(**{**vars(cfg), "moe_shared_expert_intermediate_size": 0, "moe_shared_expert_gate": False})
    assert cfg.num_parameters() - no_shared.num_parameters() == cfg.num_layers * (3 * 2048 * 5632 + 2048)


def test_glm4_moe_fields():
    # GLM-4.5-Air's config.json (older files keep partial_rotary_factor at the top level)
    air = dict(hidden_size=4096, num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
               n_routed_experts=128, num_experts_per_tok=8, moe_intermediate_size=1408, intermediate_size=10944,
               n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.0, attention_bias=True,
               use_qk_norm=False, vocab_size=151552, rope_parameters=None, rope_theta=1e6, partial_rotary_factor=0.5)
    cfg = ModelConfig.from_hf_dict(hf_dict("glm4_moe", **air))
    assert (cfg.num_experts, cfg.moe_router_topk, cfg.first_dense_layers, cfg.ffn_hidden_size) == (128, 8, 1, 10944)
    assert (cfg.moe_shared_expert_intermediate_size, cfg.rotary_percent, cfg.rope_theta) == (1408, 0.5, 1e6)
    assert cfg.moe_router_score_function == "sigmoid" and cfg.moe_router_expert_bias and cfg.norm_topk_prob
    assert cfg.qkv_bias and not cfg.qk_layernorm and not cfg.moe_shared_expert_gate
    assert cfg.moe_layer_pattern() == [0] + [1] * 45
    assert cfg.num_parameters() / 1e9 == pytest.approx(106, abs=1.0)  # the model card: 106B total


# Moonlight-16B-A3B's config.json (DeepSeek-V3-shaped: q_lora_rank null, plain RoPE, no group limit)
MOONLIGHT = dict(vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
                 num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
                 n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1, q_lora_rank=None,
                 kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_group=1, topk_group=1,
                 routed_scaling_factor=2.446, norm_topk_prob=True, max_position_embeddings=8192,
                 rope_parameters=None, rope_theta=50000.0, rope_scaling=None, tie_word_embeddings=False)


DEEPSEEK_V3_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                    "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def test_deepseek_v3_with_yarn_and_grouped_routing():
    # DeepSeek-V3's config.json (its MTP layer is left out by the conversion)
    v3 = dict(MOONLIGHT, vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
              num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
              n_routed_experts=256, num_experts_per_tok=8, first_k_dense_replace=3, q_lora_rank=1536, n_group=8,
              topk_group=4, routed_scaling_factor=2.5, max_position_embeddings=163840, rope_theta=10000.0,
              rope_scaling=DEEPSEEK_V3_YARN)
    cfg = ModelConfig.from_hf_dict(hf_dict("deepseek_v3", **v3))
    assert (cfg.rope_yarn_factor, cfg.rope_yarn_original_max_position_embeddings, cfg.rope_yarn_mscale,
            cfg.rope_yarn_mscale_all_dim, cfg.rope_yarn_beta_fast, cfg.rope_yarn_beta_slow) == (40, 4096, 1, 1, 32, 1)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    assert cfg.num_parameters() / 1e9 == pytest.approx(671, abs=3)  # the model card: 671B without the MTP module
    # transformers ignores mscale unless mscale_all_dim is set too: Megatron gets 1
    lone = ModelConfig.from_hf_dict(hf_dict("deepseek_v3", **{**v3, "rope_scaling": {**DEEPSEEK_V3_YARN, "mscale": 0.7,
                                                                                       "mscale_all_dim": 0}}))
    assert (lone.rope_yarn_mscale, lone.rope_yarn_mscale_all_dim) == (1.0, 0.0)


def test_deepseek_v3_fields():
    cfg = ModelConfig.from_hf_dict(hf_dict("deepseek_v3", **MOONLIGHT))
    # the router fields Moonlight's config.json still carries are accepted at their DeepSeek-V3 values
    assert ModelConfig.from_hf_dict(hf_dict("deepseek_v3", **MOONLIGHT, scoring_func="sigmoid", topk_method="noaux_tc",
                                            moe_layer_freq=1)) == cfg
    assert (cfg.num_experts, cfg.moe_router_topk, cfg.first_dense_layers, cfg.ffn_hidden_size) == (64, 6, 1, 11264)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (0, 512, 192, 64, 128)
    assert cfg.is_mla and cfg.plain_q_proj and cfg.num_key_value_heads == 16 and cfg.qk_layernorm
    assert (cfg.moe_shared_expert_intermediate_size, cfg.moe_router_topk_scaling_factor, cfg.rope_theta) == \
        (2816, 2.446, 50000.0)
    assert cfg.moe_router_score_function == "sigmoid" and cfg.moe_router_expert_bias and cfg.norm_topk_prob
    assert cfg.num_parameters() / 1e9 == pytest.approx(16.0, abs=0.5)  # the model card: 16B total
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk, cfg.group_limited) == (1, 1, False)
    # DeepSeek-V3's routing: 256 experts in 8 groups, the best 4 eligible, top-8 (= 2 x 4: the rankings agree)
    grouped = ModelConfig.from_hf_dict(hf_dict("deepseek_v3", **{**MOONLIGHT, "n_routed_experts": 256, "n_group": 8,
                                                                 "topk_group": 4, "num_experts_per_tok": 8}))
    assert (grouped.moe_router_num_groups, grouped.moe_router_group_topk, grouped.group_limited) == (8, 4, True)
    assert ModelConfig.from_hf_dict(grouped.to_hf_dict()) == grouped
    with_q_lora = ModelConfig.from_hf_dict(hf_dict("deepseek_v3", **{**MOONLIGHT, "q_lora_rank": 1536}))
    assert with_q_lora.q_lora_rank == 1536 and not with_q_lora.plain_q_proj
    # the q latent replaces one [hidden, heads * head_dim] projection by two and a norm
    assert with_q_lora.num_parameters() - cfg.num_parameters() == 27 * (1536 * (2048 + 1 + 16 * 192) - 2048 * 16 * 192)


def test_moonlight_example_layout_divides_the_model():
    from pathlib import Path

    from gspo_megatron.trainer.config import check_layout, load_config

    example = load_config(Path(__file__).resolve().parents[2] / "examples" / "moonlight_16b_a3b_gspo_multinode.yaml")
    assert example.model.layer_spec == "local"  # the TE MLA spec is refused
    cfg = ModelConfig.from_hf_dict(hf_dict("deepseek_v3", **MOONLIGHT))
    check_layout(example.parallel, cfg, "moonlight")
    with pytest.raises(ConfigError, match="parallel.tensor_parallel: 3 does not divide moonlight.num_attention_heads"):
        check_layout(dataclasses.replace(example.parallel, tensor_parallel=3), cfg, "moonlight")


@pytest.mark.parametrize("model_type, overrides, message", [
    ("deepseek_v3", {**MOONLIGHT, "n_group": 8, "topk_group": 4},
     "topk_group: group-limited routing with num_experts_per_tok=6 != 2 x topk_group=4 is not supported"),
    ("deepseek_v3", {**MOONLIGHT, "n_group": 5, "topk_group": 3, "num_experts_per_tok": 6},
     "moe_router_num_groups: must be >= 1 and divide num_experts=64, got 5"),
    ("deepseek_v3", {**MOONLIGHT, "rope_interleave": False}, "rope_interleave: must be true"),
    ("deepseek_v3", {**MOONLIGHT, "attention_bias": True}, "attention_bias: unsupported value True for deepseek_v3"),
    ("deepseek_v3", {**MOONLIGHT, "norm_topk_prob": False}, "norm_topk_prob: must be true"),
    ("deepseek_v3", {**MOONLIGHT, "num_key_value_heads": 8}, "num_key_value_heads: must equal num_attention_heads=16"),
    ("deepseek_v3", {**MOONLIGHT, "qk_rope_head_dim": 63}, "qk_rope_head_dim: must be even"),
    ("deepseek_v3", {**MOONLIGHT, "rope_scaling": {"type": "yarn", "factor": 40.0}},
     "rope_parameters.original_max_position_embeddings: required for YaRN"),
    ("deepseek_v3", {**MOONLIGHT, "rope_scaling": {**DEEPSEEK_V3_YARN, "mscale": 0}},
     "rope_parameters.mscale: must be set when mscale_all_dim=1.0 is"),
    ("deepseek_v3", {**MOONLIGHT, "rope_scaling": {**DEEPSEEK_V3_YARN, "truncate": False}},
     "rope_parameters.truncate: must be true"),
    ("deepseek_v3", {**MOONLIGHT, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}},
     "rope_parameters.rope_type: unsupported RoPE type 'longrope' for deepseek_v3"),
    ("deepseek_v3", {**MOONLIGHT, "kv_lora_rank": None}, "kv_lora_rank: required field is missing for deepseek_v3"),
    ("deepseek_v3", {**MOONLIGHT, "scoring_func": "softmax"}, "scoring_func: unsupported value 'softmax' for deepseek_v3"),
    ("deepseek_v3", {**MOONLIGHT, "n_shared_experts": 0}, "n_shared_experts: must be >= 1, got 0"),
    ("qwen2_moe", {"mlp_only_layers": [1]}, "mlp_only_layers: unsupported value [1] for qwen2_moe"),
    ("qwen2_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step: unsupported value 2"),
    ("qwen2_moe", {"qkv_bias": False}, "qkv_bias: unsupported value False"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size: must be >= 1"),
    ("qwen2_moe", {"moe_intermediate_size": None}, "moe_intermediate_size: required field is missing for qwen2_moe"),
    ("glm4_moe", {"n_group": 2}, "n_group: unsupported value 2 for glm4_moe"),
    ("glm4_moe", {"norm_topk_prob": False}, "norm_topk_prob: must be true"),
    ("glm4_moe", {"first_k_dense_replace": 46}, "first_dense_layers: must be in [0, num_layers=46), got 46"),
    ("glm4_moe", {"n_routed_experts": None}, "n_routed_experts: required field is missing for glm4_moe"),
    ("qwen3_moe", {"partial_rotary_factor": 0.5}, "partial_rotary_factor: partial rotary embeddings are not supported"),
])
def test_new_moe_families_errors_name_the_field(model_type, overrides, message):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_hf_dict(hf_dict(model_type, **overrides), source="ckpt/config.json")
    assert str(err.value).startswith("ckpt/config.json") and message in str(err.value)


@pytest.mark.parametrize("overrides, message", [
    ({"model_type": "gpt2"}, "model_type: unsupported architecture 'gpt2'"),
    ({"use_sliding_window": True}, "use_sliding_window: unsupported value True"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers: unsupported value [0]"),
    ({"hidden_act": "gelu"}, "hidden_act: unsupported activation 'gelu'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope_parameters.rope_type"),
    ({"num_key_value_heads": 5}, "num_key_value_heads: must divide num_attention_heads=32"),
    ({"num_experts_per_tok": 500}, "moe_router_topk: must be in [1, num_experts=128]"),
])
def test_errors_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_hf_dict(hf_dict("qwen3_moe", **overrides), source="ckpt/config.json")
    assert str(err.value).startswith("ckpt/config.json") and message in str(err.value)


def test_from_hf_dir_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_dict("llama")))
    assert ModelConfig.from_hf_dir(tmp_path).architecture == "llama"


def test_typed_build_errors():
    with pytest.raises(ConfigError, match=r"model\.hidden_sizee: unknown field"):
        build(ModelConfig, {"hidden_sizee": 3}, "model")
    with pytest.raises(ConfigError, match=r"model\.hidden_size: expected an integer, got 'x'"):
        build(ModelConfig, {"hidden_size": "x"}, "model")
    with pytest.raises(ConfigError, match=r"model\.architecture: must be one of"):
        build(ModelConfig, {"architecture": "bert"}, "model")
    assert build(ModelConfig, {"hidden_size": 128}, "model").hidden_size == 128


def test_padded_vocab():
    cfg = ModelConfig(vocab_size=151_937)  # Megatron-LM: a multiple of 128 * TP
    assert [cfg.padded_vocab_size(tp) for tp in (1, 2, 4, 8)] == [152_064, 152_064, 152_064, 152_576]
    cfg = ModelConfig(vocab_size=151_937, make_vocab_size_divisible_by=1)
    assert cfg.padded_vocab_size(1) == 151_937 and cfg.padded_vocab_size(2) == 151_938


def test_model_families_sit_below_megatron_conversion_and_rollout():
    """gspo_megatron/models/ imports only itself and typed_config (megatron/, conversion/ and rollout/
    import it), so a family module can be read, and a new one added, without the layers above it."""
    import ast
    from pathlib import Path

    import gspo_megatron.models

    allowed = ("gspo_megatron.models", "gspo_megatron.typed_config")
    for path in Path(gspo_megatron.models.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                assert not name.startswith("gspo_megatron") or name.startswith(allowed), f"{path.name}: {name}"


_MLA = ["model.config.architecture=deepseek_v3", "model.config.num_key_value_heads=4", "model.config.qk_rope_head_dim=6",
        "model.config.v_head_dim=12", "model.config.kv_lora_rank=20", "model.config.q_lora_rank=24"]


@pytest.mark.parametrize("overrides, message", [
    (["model.config.architecture=qwen2_moe", "model.config.moe_shared_expert_intermediate_size=47"],
     "2 does not divide model.config.moe_shared_expert_intermediate_size=47"),
    (["model.config.architecture=glm4_moe", "model.config.first_dense_layers=1", "model.config.ffn_hidden_size=47"],
     "2 does not divide model.config.ffn_hidden_size=47"),
    ([*_MLA, "model.config.kv_lora_rank=19"], "2 does not divide model.config.kv_down_proj_rows=25"),
    ([*_MLA, "model.config.q_lora_rank=25"], "2 does not divide model.config.q_lora_rank=25"),
])
def test_trainer_layout_checks_the_shared_expert_and_dense_layer_widths(overrides, message):
    from pathlib import Path

    from gspo_megatron.trainer.config import load_config

    demo = Path(__file__).resolve().parents[2] / "examples" / "cpu_demo.yaml"
    load_config(demo, ["parallel.tensor_parallel=2"])  # the demo itself divides
    with pytest.raises(ConfigError, match=r"^parallel\.tensor_parallel: " + message.replace(".", r"\.")):
        load_config(demo, ["parallel.tensor_parallel=2", *overrides])


def test_multi_latent_attention_refuses_the_transformer_engine_spec(monkeypatch):
    """The TE MLA spec fuses the latent norms into the up-projections under names the tables do not map."""
    from gspo_megatron.megatron import model

    monkeypatch.setattr(model, "resolve_layer_spec", lambda choice: "te")
    cfg = ModelConfig.from_hf_dict(hf_dict("deepseek_v3", **MOONLIGHT))
    with pytest.raises(ValueError, match="model.layer_spec: multi-latent attention .* set layer_spec: local"):
        model.layer_spec(cfg, config=None, choice="te")


def test_multi_latent_attention_names_the_megatron_versions_it_runs_on(monkeypatch):
    from gspo_megatron.megatron import cpu_runtime, model

    monkeypatch.setattr(cpu_runtime, "megatron_core_version", lambda: "0.19.2")
    with pytest.raises(ValueError, match=r"model.kv_lora_rank: .*megatron-core 0.16.1, this is 0.19.2"):
        model.check_mla_supported()
    monkeypatch.setattr(cpu_runtime, "megatron_core_version", lambda: "0.16.1")
    model.check_mla_supported()
