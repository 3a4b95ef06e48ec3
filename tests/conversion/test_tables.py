"""The tables and transforms on their own (no Megatron, no processes); safetensors I/O: test_safetensors_io.py."""
import dataclasses

import pytest
import torch

from gspo_megatron.conversion.cli import parse_bytes
from gspo_megatron.conversion.errors import ConversionError
from gspo_megatron.conversion.tables import expand, validate_layout
from gspo_megatron.megatron.te_names import TE_SPEC_NAMES, canonical_to_te, te_to_canonical
from gspo_megatron.conversion.transforms import FusedGateUp, FusedQKV, Identity
from gspo_megatron.testing.models import canonical_shapes, tiny_moe_config
from tests.conversion.hf_models import FAMILIES, family_config


def test_qkv_interleave_puts_each_groups_query_heads_before_its_key_and_value():
    heads, groups, d, hidden = 6, 2, 3, 5
    q = torch.randn(heads * d, hidden)
    k = torch.randn(groups * d, hidden)
    v = torch.randn(groups * d, hidden)
    fused = FusedQKV(heads, groups, d).to_megatron([q, k, v])
    # written out head by head: group g = [q heads 3g, 3g+1, 3g+2; k_g; v_g]
    rows = []
    for g in range(groups):
        for h in range(g * heads // groups, (g + 1) * heads // groups):
            rows.append(q[h * d:(h + 1) * d])
        rows += [k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
    assert torch.equal(fused, torch.cat(rows))
    back = FusedQKV(heads, groups, d).to_hf(fused)
    assert all(torch.equal(a, b) for a, b in zip(back, [q, k, v]))
    assert FusedQKV(heads, groups, d).hf_shapes(tuple(fused.shape)) == [tuple(q.shape), tuple(k.shape), tuple(v.shape)]


def test_qkv_bias_and_gate_up_round_trip():
    qkv = FusedQKV(4, 2, 8)
    bias = [torch.randn(32), torch.randn(16), torch.randn(16)]
    assert all(torch.equal(a, b) for a, b in zip(qkv.to_hf(qkv.to_megatron(bias)), bias))
    gate, up = torch.randn(7, 3), torch.randn(7, 3)
    fc1 = FusedGateUp().to_megatron([gate, up])
    assert torch.equal(fc1[:7], gate) and torch.equal(fc1[7:], up)
    assert all(torch.equal(a, b) for a, b in zip(FusedGateUp().to_hf(fc1), [gate, up]))
    assert Identity().to_hf(gate)[0] is gate


@pytest.mark.parametrize("name", FAMILIES)
def test_expand_covers_every_megatron_parameter_once(name):
    config = family_config(name)
    entries = expand(config)
    megatron = [e.megatron for e in entries]
    hf = [h for e in entries for h in e.hf]
    assert len(set(megatron)) == len(megatron) and len(set(hf)) == len(hf)
    assert set(megatron) == set(canonical_shapes(config))
    assert ("lm_head.weight" in hf) == (not config.tie_word_embeddings)


def test_every_architecture_of_the_model_config_has_a_table_and_a_transformers_class():
    import typing

    import transformers

    from gspo_megatron.megatron.model_config import Architecture
    from gspo_megatron.models import registry

    assert set(typing.get_args(Architecture)) == set(registry.TRAINABLE)
    for name in registry.TRAINABLE:
        family = registry.FAMILIES[name]
        assert family.weights and getattr(transformers, family.hf_class).config_class.model_type == name


def test_mixtral_uses_w1_as_gate_and_w3_as_up():
    entries = expand(family_config("mixtral"))
    entry = next(e for e in entries if e.megatron.endswith("local_experts.3.linear_fc1.weight"))
    assert entry.hf == ("model.layers.0.block_sparse_moe.experts.3.w1.weight",
                        "model.layers.0.block_sparse_moe.experts.3.w3.weight")


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel=3), "--tp 3 does not divide the model: num_attention_heads=4"),
    (dict(tensor_parallel=4), "--tp 4 does not divide the model: num_key_value_heads=2"),
    (dict(pipeline_parallel=3), "--pp 3 does not divide the model: num_layers=2"),
    (dict(expert_parallel=3), "--ep 3 does not divide the model: num_experts=4"),
])
def test_layouts_that_do_not_divide_the_model_are_rejected(kwargs, message):
    with pytest.raises(ConversionError, match=message.replace("+", r"\+")):
        validate_layout(tiny_moe_config(), **kwargs)


def test_dense_ffn_must_divide_by_tp_and_the_vocabulary_need_not():
    validate_layout(tiny_moe_config(vocab_size=97), tensor_parallel=2)  # padded (tests/conversion/test_vocab_padding.py)
    with pytest.raises(ConversionError, match="ffn_hidden_size=97"):
        validate_layout(dataclasses.replace(family_config("llama"), ffn_hidden_size=97), tensor_parallel=2)
    with pytest.raises(ConversionError, match="the model is dense"):
        validate_layout(family_config("llama"), expert_parallel=2)
    validate_layout(tiny_moe_config(), tensor_parallel=2, pipeline_parallel=2, expert_parallel=4)


def test_te_spec_names_translate_both_ways_with_expert_renumbering():
    # EP rank 1 of 2 with 4 experts holds global experts 2 and 3 as local 0 and 1
    assert te_to_canonical("decoder.layers.5.mlp.experts.linear_fc1.weight1", ep_rank=1, num_local_experts=2) == \
        "decoder.layers.5.mlp.experts.local_experts.3.linear_fc1.weight"
    assert te_to_canonical("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", 0, 2) == \
        "decoder.layers.0.input_layernorm.weight"
    assert te_to_canonical("decoder.layers.0.self_attention.linear_qkv.weight", 0, 2) == \
        "decoder.layers.0.self_attention.linear_qkv.weight"
    assert canonical_to_te("decoder.layers.5.mlp.experts.local_experts.3.linear_fc2.weight", 2, dense=False) == \
        (1, "decoder.layers.5.mlp.experts.linear_fc2.weight1")
    # MoE layers keep a separate pre-MLP norm under TE; dense layers fuse it into linear_fc1
    assert canonical_to_te("decoder.layers.2.pre_mlp_layernorm.weight", 2, dense=False) == \
        (None, "decoder.layers.2.pre_mlp_layernorm.weight")
    assert canonical_to_te("decoder.layers.2.pre_mlp_layernorm.weight", 2, dense=True) == \
        (None, "decoder.layers.2.mlp.linear_fc1.layer_norm_weight")
    for te, canonical in TE_SPEC_NAMES:  # every row round-trips
        name = canonical.format(layer=7, expert=5)
        rank, te_name = canonical_to_te(name, 4, dense=True)
        assert te_to_canonical(te_name, rank or 0, 4) == name


class _StandInTE:
    """Megatron's TE backend with marker classes in place of Transformer Engine's modules (not installed on
    CPU): what Megatron's own spec function builds with it names the TE model's parameters."""

    def __getattr__(self, name):
        if name == "fuse_layernorm_and_linear":
            return lambda: True
        if name == "grouped_mlp_modules":
            return lambda *args, **kwargs: (type("grouped_mlp", (), {}), None)
        return lambda *args, **kwargs: type(name, (), {})


_PARAMS = {"linear": ("weight",), "column_parallel_linear": ("weight",), "row_parallel_linear": ("weight",),
           "column_parallel_layer_norm_linear": ("weight", "layer_norm_weight"), "layer_norm": ("weight",)}


def _te_spec_params(spec, prefix=""):
    """Parameter names of the attention, norms and dense MLP of a layer spec built with ``_StandInTE``."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    out = set()
    module = spec.module if isinstance(spec, ModuleSpec) else spec
    for param in _PARAMS.get(getattr(module, "__name__", ""), ()):
        out.add(prefix + param)
    submodules = getattr(spec, "submodules", None) if isinstance(spec, ModuleSpec) else None
    for field in dataclasses.fields(submodules) if dataclasses.is_dataclass(submodules) else ():
        if field.name != "experts":  # routed experts: their own rows (expert renumbering), tested above
            out |= _te_spec_params(getattr(submodules, field.name), f"{prefix}{field.name}.")
    return out


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_plain_q", "glm4_moe"])
def test_te_names_are_the_parameters_of_megatrons_te_spec(monkeypatch, name):
    """Megatron-Core 0.16.1's TE layer spec (multi-latent attention for DeepSeek-V3: the input norm a module of
    its own, the q and kv latent norms fused into linear_q_up_proj / linear_kv_up_proj; GQA: the input norm
    fused into linear_qkv): every canonical attention / norm / dense-MLP name of a layer translates to one of
    its parameters, each parameter is reached once, and the translation comes back."""
    from megatron.core.models.gpt import gpt_layer_specs

    from gspo_megatron.conversion.tables import expand

    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", _StandInTE, raising=False)
    monkeypatch.setattr(gpt_layer_specs, "HAVE_TE", True, raising=False)
    config = family_config(name)
    for layer in (0, config.num_layers - 1):
        moe = config.is_moe_layer(layer)
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_experts if moe else None, moe_grouped_gemm=True, qk_layernorm=config.qk_layernorm,
            multi_latent_attention=config.is_mla)
        expected = {f"decoder.layers.{layer}.{p}" for p in _te_spec_params(spec)
                    if not p.startswith("mlp.router") and not p.startswith("mlp.shared_experts")}
        prefix = f"decoder.layers.{layer}."
        canonical = [e.megatron for e in expand(config) if e.megatron.startswith(prefix) and ".experts." not in e.megatron
                     and ".router." not in e.megatron and ".shared_experts." not in e.megatron]
        if not config.is_mla:  # GQA's q/k/v biases are not parameters the stand-in knows
            canonical = [n for n in canonical if not n.endswith("linear_qkv.bias")]
        translated = [canonical_to_te(n, 1, dense=not moe, mla=config.is_mla)[1] for n in canonical]
        if config.is_mla and config.q_lora_rank:  # the unmasked parameters that the TE spec builds but 0.16.1 skips
            expected.discard(prefix + "self_attention.linear_q_proj.weight")
        if config.is_mla and not config.q_lora_rank:
            expected -= {prefix + "self_attention.linear_q_down_proj.weight",
                         prefix + "self_attention.linear_q_up_proj.weight",
                         prefix + "self_attention.linear_q_up_proj.layer_norm_weight"}
        assert sorted(translated) == sorted(expected)
        assert [te_to_canonical(t, 0, 1, mla=config.is_mla) for t in translated] == canonical


def test_parse_bytes():
    assert parse_bytes("5GB") == 5 * 10**9
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1000") == 1000


def test_shared_expert_width_must_divide_by_tp():
    qwen2_moe = family_config("qwen2_moe")
    validate_layout(qwen2_moe, tensor_parallel=2, expert_parallel=2)
    with pytest.raises(ConversionError, match="--tp 2 does not divide the model: moe_shared_expert_intermediate_size=41"):
        validate_layout(dataclasses.replace(qwen2_moe, moe_shared_expert_intermediate_size=41), tensor_parallel=2)
