"""Per-layer and stacked layer keys: Megatron-Bridge and Megatron-LM configure DeepSeek-V3 / GLM-4.5 with a
``moe_layer_freq`` list, which keys every layer separately, even when every layer is MoE; an int stacks the
layers under one key. Our checkpoints of those families are keyed per layer, and a checkpoint written with
either keying loads (logits equal to transformers') and converts back, whichever way the model is configured."""
import dataclasses

import pytest

from gspo_megatron.conversion import check, dcp_io, offline
from gspo_megatron.megatron import checkpoint
from gspo_megatron.megatron.sharding import stored_layer_keying
from gspo_megatron.models import registry
from tests.conversion import hf_models


def _convert_keyed(monkeypatch, architecture, per_layer, hf, out):
    """hf_to_megatron with the family's moe_layer_freq a list (per_layer) or an int, as another tool would."""
    family = registry.FAMILIES[architecture]
    with monkeypatch.context() as m:
        m.setitem(registry.FAMILIES, architecture, dataclasses.replace(family, moe_layer_list=per_layer))
        return offline.hf_to_megatron(hf, out, progress=False)


@pytest.mark.parametrize("name, architecture, ours", [("glm4_all_moe", "glm4_moe", True),
                                                      ("qwen3_moe", "qwen3_moe", False)])
def test_checkpoints_of_either_layer_keying_load(tmp_path, monkeypatch, name, architecture, ours):
    monkeypatch.setitem(hf_models.FAMILIES, "glm4_all_moe", dict(hf_models.FAMILIES["glm4_moe"], first_dense_layers=0))
    hf = hf_models.make_hf_dir(name, tmp_path / "hf")
    assert hf_models.family_config(name).moe_layer_freq == ([1] * 4 if ours else 1)
    default = offline.hf_to_megatron(hf, tmp_path / "ours", progress=False)
    other = _convert_keyed(monkeypatch, architecture, not ours, hf, tmp_path / "other")
    for meg, per_layer in ((default, ours), (other, not ours)):
        with dcp_io.CheckpointReader(meg) as reader:
            keys = reader.tensor_keys()
        assert stored_layer_keying(keys) == per_layer == checkpoint.per_layer_keys(meg)
        router = "model.decoder.layers.0.mlp.router.weight" if per_layer else "model.decoder.layers.mlp.router.weight"
        assert router in keys
        assert check.run_check(hf, meg) < 1e-4  # loads into the model configured the family's way
        back = offline.megatron_to_hf(meg, tmp_path / f"back-{meg.name}", progress=False)
        assert (back / "model.safetensors").read_bytes() == (hf / "model.safetensors").read_bytes()
