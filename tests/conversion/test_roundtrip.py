"""HF -> Megatron -> HF returns the same bytes for every family; the Megatron side is a real torch_dist
checkpoint with the fused tensors Megatron expects."""
import json
import os

import pytest
import torch

from gspo_megatron.conversion import dcp_io, offline
from gspo_megatron.conversion.errors import ConversionError
from gspo_megatron.conversion.tables import expand
from gspo_megatron.conversion.transforms import FusedGateUp, FusedQKV
from gspo_megatron.megatron import checkpoint
from gspo_megatron.megatron.model_config import ModelConfig
from tests.conversion.hf_models import (FAMILIES, TOKENIZER_FILES, family_config, index_of, make_hf_dir, read_all,
                                        weight_files)

SIDE_FILES = ["config.json", "generation_config.json", *TOKENIZER_FILES]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Per family: (HF folder, its Megatron conversion, converted back with the HF folder as template).
    qwen3_moe is saved in 20 KB shards, so the round trip must reproduce an index."""
    root = tmp_path_factory.mktemp("roundtrip")
    out = {}
    for name in FAMILIES:
        hf = make_hf_dir(name, root / f"{name}-hf", max_shard_size="20KB" if name == "qwen3_moe" else None)
        meg = offline.hf_to_megatron(hf, root / f"{name}-meg", progress=False)
        back = offline.megatron_to_hf(meg, root / f"{name}-back", hf_template=hf, progress=False)
        out[name] = (hf, meg, back)
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_round_trip_is_byte_identical(converted, name):
    hf, _, back = converted[name]
    assert weight_files(back) == weight_files(hf)
    assert index_of(back) == index_of(hf)
    assert (index_of(hf) is not None) == (name == "qwen3_moe")
    for file in weight_files(hf) + SIDE_FILES:
        assert (back / file).read_bytes() == (hf / file).read_bytes(), file
    ours, theirs = read_all(back), read_all(hf)
    assert ours.keys() == theirs.keys()
    assert ("lm_head.weight" in ours) == (not family_config(name).tie_word_embeddings)
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key


def test_megatron_checkpoint_holds_fused_tensors_under_megatrons_keys(converted):
    hf, meg, _ = converted["qwen3_moe"]
    config = ModelConfig.from_hf_dir(hf)
    assert json.loads((meg / offline.MODEL_CONFIG_NAME).read_text()) == config.__dict__
    assert checkpoint.read_meta(meg)["model_config"] == config.__dict__
    assert (meg / "hf" / "model.safetensors.index.json").is_file()  # kept for the way back
    hf_tensors = read_all(hf)
    with dcp_io.single_process_megatron():
        layout = dcp_io.checkpoint_layout(config)
    with dcp_io.CheckpointReader(meg) as reader:
        keys = reader.tensor_keys()
        assert keys["model.decoder.layers.self_attention.linear_qkv.weight"][0] == (2, 128, 64)
        assert keys["model.decoder.layers.mlp.experts.experts.linear_fc1.weight"][0] == (2, 4, 64, 64)
        requests = dcp_io.requests_for(layout, reader, config.vocab_size)
        wanted = [r for r in requests if r.name in ("decoder.layers.1.self_attention.linear_qkv.weight",
                                                    "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight")]
        tensors = reader.read(wanted, reader.plan(wanted))
    p = "model.layers.1."
    qkv = FusedQKV(4, 2, 16).to_megatron([hf_tensors[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    fc1 = FusedGateUp().to_megatron([hf_tensors[p + f"mlp.experts.2.{x}_proj.weight"] for x in ("gate", "up")])
    assert torch.equal(tensors["decoder.layers.1.self_attention.linear_qkv.weight"], qkv)
    assert torch.equal(tensors["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"], fc1)


def test_export_without_template_uses_the_checkpoints_own_hf_folder(converted, tmp_path):
    hf, meg, _ = converted["qwen3_moe"]
    back = offline.megatron_to_hf(meg, tmp_path / "back", progress=False)
    assert index_of(back) == index_of(hf)
    for file in weight_files(hf) + SIDE_FILES:
        assert (back / file).read_bytes() == (hf / file).read_bytes(), file


def test_max_shard_bytes_and_dtype_on_export(converted, tmp_path):
    hf, meg, _ = converted["mixtral"]
    back = offline.megatron_to_hf(meg, tmp_path / "back", max_shard_bytes=30_000, dtype=torch.bfloat16,
                                  progress=False)
    files = weight_files(back)
    index = index_of(back)
    assert len(files) > 3 and set(index["weight_map"].values()) == set(files)
    sizes = {f: (back / f).stat().st_size for f in files}
    theirs, ours = read_all(hf), read_all(back)
    # a shard exceeds the cap only when it holds a single tensor that does
    for f in files:
        names = [n for n, v in index["weight_map"].items() if v == f]
        assert sum(ours[n].numel() * 2 for n in names) <= 30_000 or len(names) == 1
        assert sizes[f] > 0
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in ours.values())
    assert all(ours[k].dtype == torch.bfloat16 and torch.equal(ours[k], theirs[k].to(torch.bfloat16)) for k in theirs)
    assert json.loads((back / "config.json").read_text())["dtype"] == "bfloat16"


def test_bf16_checkpoint_round_trips_in_bf16(tmp_path):
    hf = make_hf_dir("qwen3_moe", tmp_path / "hf", dtype=torch.bfloat16)
    meg = offline.hf_to_megatron(hf, tmp_path / "meg", progress=False)
    with dcp_io.CheckpointReader(meg) as reader:
        assert reader.tensor_keys()["model.embedding.word_embeddings.weight"][1] == torch.bfloat16
    back = offline.megatron_to_hf(meg, tmp_path / "back", progress=False)
    assert (back / "model.safetensors").read_bytes() == (hf / "model.safetensors").read_bytes()


def test_export_without_any_template_writes_configs_from_the_model_config(converted, tmp_path):
    import shutil

    hf, meg, _ = converted["llama"]
    bare = shutil.copytree(meg, tmp_path / "meg")
    shutil.rmtree(bare / "hf")
    with pytest.raises(ConversionError, match=r"meg: no tokenizer to export .*--hf-template.*--weights-only"):
        offline.megatron_to_hf(bare, tmp_path / "refused", progress=False)
    back = offline.megatron_to_hf(bare, tmp_path / "back", progress=False, weights_only=True)
    assert ModelConfig.from_hf_dir(back) == ModelConfig.from_hf_dir(hf)
    assert json.loads((back / "config.json").read_text())["dtype"] == "float32"
    assert (back / "generation_config.json").is_file() and not (back / "tokenizer.json").exists()
    ours, theirs = read_all(back), read_all(hf)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_early_writeback_while_writing_both_ways(converted, tmp_path, monkeypatch):
    """Both writers ask the writeback thread to start the disk writes as data accumulates, for every
    file they write (here after every tensor)."""
    from gspo_megatron.conversion import safetensors_io

    kicked = []
    real = safetensors_io.BackgroundWriteback.kick

    def recording(self, fd):
        kicked.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(self, fd)

    for module in (dcp_io, safetensors_io):  # every tensor now crosses the threshold
        monkeypatch.setattr(module, "WRITEBACK_BYTES", 1)
    monkeypatch.setattr(safetensors_io.BackgroundWriteback, "kick", recording)
    hf = converted["qwen3_moe"][0]
    meg = offline.hf_to_megatron(hf, tmp_path / "meg", progress=False)
    assert len(kicked) > 10 and {os.path.basename(f) for f in kicked} == {"__0_0.distcp"}
    kicked.clear()
    back = offline.megatron_to_hf(meg, tmp_path / "back", progress=False)
    assert len(kicked) > 10 and {os.path.basename(f) for f in kicked} == set(weight_files(hf))
    for file in weight_files(hf):
        assert (back / file).read_bytes() == (hf / file).read_bytes()


def test_converted_checkpoints_convert_back_without_loading_a_tensor(converted, tmp_path, monkeypatch):
    """Every tensor of a converted checkpoint is located inside its record and copied as bytes; only a
    cast loads tensors."""
    hf, meg, _ = converted["qwen3_moe"]
    loaded = []
    real_read = dcp_io.CheckpointReader.read

    def recording_read(self, requests, items):
        loaded.extend(r.name for r in requests)
        return real_read(self, requests, items)

    monkeypatch.setattr(dcp_io.CheckpointReader, "read", recording_read)
    back = offline.megatron_to_hf(meg, tmp_path / "back", progress=False)
    assert loaded == []
    for file in weight_files(hf):
        assert (back / file).read_bytes() == (hf / file).read_bytes()
    cast = offline.megatron_to_hf(meg, tmp_path / "cast", dtype=torch.bfloat16, progress=False)
    assert sorted(loaded) == sorted(e.megatron for e in expand(ModelConfig.from_hf_dir(hf)))  # all, once
    ours, theirs = read_all(cast), read_all(hf)
    assert all(torch.equal(ours[k], theirs[k].to(torch.bfloat16)) for k in theirs)


@pytest.mark.parametrize("direction", ["hf-to-megatron", "megatron-to-hf"])
def test_round_trip_without_copy_file_range(converted, tmp_path, monkeypatch, direction):
    """Where the kernel refuses copy_file_range (e.g. across file systems on older kernels) the same
    bytes are copied through a buffer."""
    import errno

    def refuse(*args):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    hf, meg, _ = converted["qwen3_moe"]
    monkeypatch.setattr(os, "copy_file_range", refuse)
    if direction == "hf-to-megatron":
        meg = offline.hf_to_megatron(hf, tmp_path / "meg", progress=False)
        monkeypatch.undo()
    back = offline.megatron_to_hf(meg, tmp_path / "back", progress=False)
    for file in weight_files(hf):
        assert (back / file).read_bytes() == (hf / file).read_bytes()


def test_multi_token_prediction_layer_is_kept_aside_and_restored(tmp_path):
    """A GLM-4.5 checkpoint holds its MTP layer as model.layers.<num_layers>.* (transformers skips it): the
    conversion keeps it aside in the Megatron checkpoint's mtp/ and the way back restores it, so the round trip
    is byte-identical, index included; without mtp/ (a checkpoint saved by training) it comes from the
    template's weights, and with neither the rest is written without it. In a family without MTP layers
    the same tensor is an error."""
    import shutil

    from safetensors.torch import save_file

    from gspo_megatron.conversion.errors import ConversionError

    for name in ("glm4_moe", "qwen3_moe"):
        hf = make_hf_dir(name, tmp_path / f"{name}-hf", max_shard_size="20KB")
        layer = family_config(name).num_layers
        mtp = {f"model.layers.{layer}.eh_proj.weight": torch.randn(64, 128),
               f"model.layers.{layer}.enorm.weight": torch.ones(64)}
        save_file(mtp, hf / "mtp.safetensors", metadata={"format": "pt"})
        index = index_of(hf)
        index["weight_map"].update({key: "mtp.safetensors" for key in mtp})
        index["metadata"]["total_size"] += sum(t.numel() * t.element_size() for t in mtp.values())
        (hf / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        if name == "qwen3_moe":
            # refused before anything is built: config.json's layer count against the tensors present
            refusal = f"num_hidden_layers={layer} but the weights hold {layer + 1} layers"
            with pytest.raises(ConversionError, match=refusal):
                offline.hf_to_megatron(hf, tmp_path / f"{name}-meg", progress=False)
            continue
        meg = offline.hf_to_megatron(hf, tmp_path / f"{name}-meg", progress=False)
        assert set(read_all(meg / offline.MTP_DIR)) == set(mtp)
        assert json.loads((meg / "gspo_meta.json").read_text())["mtp_tensors"] == 2
        back = offline.megatron_to_hf(meg, tmp_path / f"{name}-back", progress=False)
        assert weight_files(back) == weight_files(hf)
        assert index_of(back)["weight_map"] == index["weight_map"]
        assert index_of(back)["metadata"]["total_size"] == index["metadata"]["total_size"]
        for file in weight_files(hf):
            assert (back / file).read_bytes() == (hf / file).read_bytes(), file
        shutil.rmtree(meg / offline.MTP_DIR)
        from_template = read_all(offline.megatron_to_hf(meg, tmp_path / f"{name}-t", hf_template=hf, progress=False))
        theirs = read_all(hf)
        assert from_template.keys() == theirs.keys()
        assert all(torch.equal(from_template[key], theirs[key]) for key in theirs)
        without = read_all(offline.megatron_to_hf(meg, tmp_path / f"{name}-no-mtp", progress=False))
        assert set(theirs) - set(without) == set(mtp)
