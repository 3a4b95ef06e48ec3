"""safetensors I/O on its own: the streaming writer against the library, the lazy reader and its index
checks, shard planning, and the writeback hint (no Megatron, no processes)."""
import json
import os
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from gspo_megatron.conversion import safetensors_io
from gspo_megatron.conversion.errors import ConversionError
from gspo_megatron.conversion.safetensors_io import HFCheckpoint, SafetensorsWriter, TensorSpec, plan_shards, start_writeback


def test_safetensors_writer_matches_the_library_byte_for_byte(tmp_path):
    tensors = {"b.weight": torch.randn(3, 4), "a.weight": torch.randn(5).to(torch.bfloat16),
               "c.ids": torch.arange(6, dtype=torch.int64).reshape(2, 3), "a.bias": torch.randn(2)}
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    writer = SafetensorsWriter(tmp_path / "ours.safetensors",
                               [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()])
    for name in ["c.ids", "a.weight", "b.weight", "a.bias"]:  # any order
        writer.write(name, tensors[name])
    writer.close()
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    with safe_open(tmp_path / "ours.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor("b.weight"), tensors["b.weight"])


def test_safetensors_writer_refuses_wrong_and_missing_tensors(tmp_path):
    writer = SafetensorsWriter(tmp_path / "x.safetensors", [TensorSpec("a", (2,), torch.float32),
                                                            TensorSpec("b", (2,), torch.float32)])
    with pytest.raises(ConversionError, match=r"a: got \[3\]"):
        writer.write("a", torch.zeros(3))
    writer.write("a", torch.zeros(2))
    with pytest.raises(ConversionError, match="a: written twice"):
        writer.write("a", torch.zeros(2))
    with pytest.raises(ConversionError, match="never written: b"):
        writer.close()


def test_reader_reads_lazily_and_checks_the_index(tmp_path):
    save_file({"x": torch.arange(4.0)}, tmp_path / "model-1.safetensors")
    save_file({"y": torch.ones(2, 2, dtype=torch.bfloat16)}, tmp_path / "model-2.safetensors")
    index = {"metadata": {}, "weight_map": {"x": "model-1.safetensors", "y": "model-2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with HFCheckpoint(tmp_path) as ckpt:
        assert torch.equal(ckpt.read("x"), torch.arange(4.0))
        assert ckpt.read("y").dtype == torch.bfloat16
    index["weight_map"]["z"] = "model-2.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConversionError, match="listed in the index but in no file: z"):
        HFCheckpoint(tmp_path)
    (tmp_path / "model-1.safetensors").write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(ConversionError, match="model-1.safetensors: header length"):
        HFCheckpoint(tmp_path)


def test_shard_plan_caps_sizes_and_reuses_a_matching_template():
    specs = [TensorSpec(f"t{i}", (10,), torch.float32) for i in range(5)]  # 40 bytes each
    plan = plan_shards(specs, max_shard_bytes=100)
    assert [len(v) for v in plan.files.values()] == [2, 2, 1]
    assert list(plan.files) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert plan.index["metadata"] == {"total_parameters": 50, "total_size": 200}
    assert plan_shards(specs, 10**6).index is None  # one file: model.safetensors, no index
    template = {"weight_map": {f"t{i}": ("a.safetensors" if i % 2 else "b.safetensors") for i in range(5)}}
    plan = plan_shards(specs, 100, template)
    assert {s.name for s in plan.files["a.safetensors"]} == {"t1", "t3"}


@pytest.mark.skipif(safetensors_io._sync_file_range is None, reason="sync_file_range is Linux-only (a no-op elsewhere)")
def test_start_writeback_accepts_read_only_descriptors_and_reports_bad_ones(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10_000)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert start_writeback(fd) is None
    finally:
        os.close(fd)
    assert path.read_bytes() == b"x" * 10_000
    with pytest.raises(OSError, match="sync_file_range"):  # the call is made and its result checked
        start_writeback(fd)  # closed now
