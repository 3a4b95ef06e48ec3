"""Bad input fails before anything is written, with a message naming the file, key or field, and a
failure part-way leaves no output folder behind."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from gspo_megatron.conversion import offline
from gspo_megatron.conversion.errors import ConversionError
from gspo_megatron.conversion.transforms import FusedQKV
from gspo_megatron.typed_config import ConfigError
from tests.conversion.hf_models import make_hf_dir


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A qwen3_moe HF folder (one model.safetensors) and its Megatron conversion; tests copy them."""
    root = tmp_path_factory.mktemp("errors")
    hf = make_hf_dir("qwen3_moe", root / "hf")
    return hf, offline.hf_to_megatron(hf, root / "meg", progress=False)


def _copy(path, tmp_path, name):
    return shutil.copytree(path, tmp_path / name)


def _edit_weights(hf, edit):
    tensors = load_file(hf / "model.safetensors")
    edit(tensors)
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})


def _edit_config(hf, **changes):
    config = json.loads((hf / "config.json").read_text())
    config.update(changes)
    (hf / "config.json").write_text(json.dumps(config))


def _leftovers(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))


def test_unknown_architecture(source, tmp_path):
    hf = _copy(source[0], tmp_path, "hf")
    _edit_config(hf, model_type="gpt2")
    with pytest.raises(ConfigError, match=r"config.json: model_type: unsupported architecture 'gpt2'"):
        offline.hf_to_megatron(hf, tmp_path / "out", progress=False)


def test_config_and_weight_shapes_disagree(source, tmp_path):
    hf = _copy(source[0], tmp_path, "hf")
    _edit_config(hf, moe_intermediate_size=48)
    with pytest.raises(ConversionError, match=r"model.safetensors: model.layers.0.mlp.experts.0.gate_proj.weight: "
                                              r"shape \[32, 64\] does not match config.json \(expected \[48, 64\]\)"):
        offline.hf_to_megatron(hf, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_missing_tensor(source, tmp_path):
    hf = _copy(source[0], tmp_path, "hf")
    _edit_weights(hf, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ConversionError, match=r"missing: model.layers.1.self_attn.k_norm.weight$"):
        offline.hf_to_megatron(hf, tmp_path / "out", progress=False)


def test_unexpected_tensors(source, tmp_path):
    hf = _copy(source[0], tmp_path, "hf")
    _edit_weights(hf, lambda t: t.update({"model.layers.0.mlp.shared_expert.weight": torch.zeros(2)}))
    with pytest.raises(ConversionError, match=r"unexpected tensors.*: model.layers.0.mlp.shared_expert.weight$"):
        offline.hf_to_megatron(hf, tmp_path / "out", progress=False)
    # an lm_head next to tied embeddings is not silently dropped
    hf2 = _copy(source[0], tmp_path, "hf2")
    _edit_config(hf2, tie_word_embeddings=True)
    with pytest.raises(ConversionError, match=r"tie_word_embeddings=true.*lm_head.weight"):
        offline.hf_to_megatron(hf2, tmp_path / "out", progress=False)


def test_mixed_dtypes_inside_one_fused_tensor(source, tmp_path):
    hf = _copy(source[0], tmp_path, "hf")
    key = "model.layers.0.self_attn.k_proj.weight"
    _edit_weights(hf, lambda t: t.update({key: t[key].to(torch.bfloat16)}))
    with pytest.raises(ConversionError, match=r"q_proj.weight, .*k_proj.weight, .*v_proj.weight: mixed dtypes"):
        offline.hf_to_megatron(hf, tmp_path / "out", progress=False)


def test_int32_and_fp16_tensors_in_an_fp32_checkpoint_are_named(source, tmp_path):
    hf = _copy(source[0], tmp_path, "hf")
    # one of a kind each (per-layer tensors stacked into one Megatron key must agree already)
    embed, norm = "model.embed_tokens.weight", "model.norm.weight"
    _edit_weights(hf, lambda t: t.update({embed: t[embed].to(torch.int32), norm: t[norm].to(torch.float16)}))
    with pytest.raises(ConversionError) as raised:
        offline.hf_to_megatron(hf, tmp_path / "out", progress=False)
    assert str(raised.value) == (f"{hf / 'config.json'} declares float32, but 2 tensor(s) are stored otherwise: "
                                 f"model.safetensors: {embed} int32; model.safetensors: {norm} float16")
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []
    # a wider tensor than declared stays (DeepSeek-V3's bf16 release keeps its router bias in fp32)
    _edit_weights(hf, lambda t: t.update({embed: t[embed].to(torch.float32), norm: t[norm].to(torch.float32)}))
    _edit_config(hf, dtype="bfloat16")
    _edit_weights(hf, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items() if k != norm}))
    offline.hf_to_megatron(hf, tmp_path / "out", progress=False)


def test_layout_that_does_not_divide_the_model(source, tmp_path):
    with pytest.raises(ConversionError, match=r"config.json: --ep 3 does not divide the model: num_experts=4"):
        offline.hf_to_megatron(source[0], tmp_path / "out", expert_parallel=3, progress=False)


def test_non_empty_output_needs_overwrite(source, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ConversionError, match=r"out: output folder is not empty \(pass --overwrite"):
        offline.hf_to_megatron(source[0], out, progress=False)
    with pytest.raises(ConversionError, match=r"out: output folder is not empty"):
        offline.megatron_to_hf(source[1], out, progress=False)
    assert (out / "keep.txt").is_file()
    offline.hf_to_megatron(source[0], out, overwrite=True, progress=False)
    assert not (out / "keep.txt").exists() and (out / "metadata.json").is_file()
    assert _leftovers(tmp_path) == []


def test_failure_mid_write_leaves_nothing(source, tmp_path, monkeypatch):
    from gspo_megatron.conversion import byte_ranges

    calls = []
    real = byte_ranges._copy_range

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(*args)

    monkeypatch.setattr(byte_ranges, "_copy_range", failing)
    with pytest.raises(OSError, match=r"meg: no space left on device \(ENOSPC\) while writing the conversion output"):
        offline.hf_to_megatron(source[0], tmp_path / "meg", progress=False)
    assert len(calls) == 3 and not (tmp_path / "meg").exists() and _leftovers(tmp_path) == []

    calls.clear()
    with pytest.raises(OSError, match=r"back: no space left on device \(ENOSPC\) while writing the conversion output"):
        offline.megatron_to_hf(source[1], tmp_path / "back", progress=False)
    assert len(calls) == 3 and not (tmp_path / "back").exists() and _leftovers(tmp_path) == []

    # a cast loads tensors: a failure in that path too
    monkeypatch.undo()
    monkeypatch.setattr(FusedQKV, "to_hf", lambda self, canonical: (_ for _ in ()).throw(RuntimeError("late")))
    with pytest.raises(RuntimeError, match="late"):
        offline.megatron_to_hf(source[1], tmp_path / "back", dtype=torch.bfloat16, progress=False)
    assert not (tmp_path / "back").exists() and _leftovers(tmp_path) == []


def test_megatron_checkpoint_of_another_model(source, tmp_path):
    # the checkpoint's own config against a template describing another model
    other = make_hf_dir("mixtral", tmp_path / "mixtral")
    with pytest.raises(ConversionError, match=r"mixtral/config.json does not describe the model in .*"
                                              r"architecture: 'qwen3_moe' vs 'mixtral'"):
        offline.megatron_to_hf(source[1], tmp_path / "out", hf_template=other, progress=False)
    # without its own config, the template's model decides, and the checkpoint's routers do not match it
    bare = _copy(source[1], tmp_path, "bare")
    for extra in ("model_config.json", "gspo_meta.json"):
        (bare / extra).unlink()
    shutil.rmtree(bare / "hf")
    with pytest.raises(ConversionError, match=r"bare: the model config's num_experts=0 but the checkpoint's routers "
                                              r"score \[4\] experts$"):
        offline.megatron_to_hf(bare, tmp_path / "out", hf_template=make_hf_dir("qwen3", tmp_path / "qwen3"),
                               progress=False)
    with pytest.raises(ConversionError, match=r"bare: no model_config.json .* and no --hf-template"):
        offline.megatron_to_hf(bare, tmp_path / "out", progress=False)


def test_megatron_checkpoint_with_wrong_shapes(source, tmp_path):
    meg = _copy(source[1], tmp_path, "meg")
    config = json.loads((meg / "model_config.json").read_text())
    config["moe_ffn_hidden_size"] = 48
    (meg / "model_config.json").write_text(json.dumps(config))
    shutil.rmtree(meg / "hf")
    with pytest.raises(ConversionError, match=r"experts.linear_fc1.weight: global shape \[2, 4, 64, 64\] in the "
                                              r"checkpoint, \[2, 4, 96, 64\] from the model config"):
        offline.megatron_to_hf(meg, tmp_path / "out", progress=False)


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "model_config.json").write_text(json.dumps({"architecture": "qwen3_moe"}))
    with pytest.raises(ConversionError, match=r"empty: not a torch_dist checkpoint \(no .metadata\)"):
        offline.megatron_to_hf(tmp_path / "empty", tmp_path / "out", progress=False)
