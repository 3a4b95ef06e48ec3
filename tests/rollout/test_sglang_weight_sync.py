"""Trainer-side weight sync pieces: buckets, request bodies (field names from SGLang's io_struct.py /
sglang_for_rl.md), IPC serialization, disk checkpoints, and the broadcast group over gloo with a process
that joins the way SGLang's init_custom_process_group does (a stand-in for a server GPU, not SGLang)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gspo_megatron.rollout.sglang.weight_sync import (DiskCheckpointWriter, TrainerBroadcastGroup, bucket_metadata,
                                                      bucket_named_tensors, deserialize_named_tensors, dtype_name,
                                                      init_group_body, rank_offsets, serialize_named_tensors,
                                                      update_from_disk_body, update_from_distributed_body,
                                                      update_from_tensor_body)

from tests.rollout.sglang_standin import free_port

STANDIN = str(Path(__file__).with_name("sglang_standin.py"))


def _named(sizes_bytes):
    return [(f"w{i}", torch.zeros(n // 4, dtype=torch.float32)) for i, n in enumerate(sizes_bytes)]


def test_buckets_keep_order_and_respect_the_bound():
    named = _named([40, 40, 40, 100, 8, 8])
    buckets = list(bucket_named_tensors(iter(named), 80))
    assert [[n for n, _ in b] for b in buckets] == [["w0", "w1"], ["w2"], ["w3"], ["w4", "w5"]]
    # every bucket within the bound unless it holds a single larger tensor
    for b in buckets:
        assert sum(t.numel() * 4 for _, t in b) <= 80 or len(b) == 1
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    assert list(bucket_named_tensors([], 80)) == []


def test_buckets_refuse_a_repeated_name():
    with pytest.raises(ValueError, match="'w0' appears twice"):
        list(bucket_named_tensors(_named([4]) + _named([4]), 100))


def test_distributed_metadata_and_bodies():
    bucket = [("a.weight", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b.bias", torch.zeros(5, dtype=torch.float32))]
    assert dtype_name(torch.bfloat16) == "bfloat16"
    # UpdateWeightsFromDistributedReqInput: names, dtypes (getattr(torch, name) on the server), shapes, group_name
    body = update_from_distributed_body(bucket, group_name="g-0", flush_cache=False, weight_version=None)
    assert body == {"names": ["a.weight", "b.bias"], "dtypes": ["bfloat16", "float32"], "shapes": [[2, 3], [5]],
                    "group_name": "g-0", "flush_cache": False}
    assert bucket_metadata(bucket)["shapes"] == [[2, 3], [5]]
    assert update_from_distributed_body(bucket, group_name="g", flush_cache=True, weight_version="3")["weight_version"] == "3"
    # InitWeightsUpdateGroupReqInput
    assert init_group_body(master_address="10.0.0.1", master_port=29600, rank_offset=3, world_size=9, group_name="g",
                           backend="nccl") == {"master_address": "10.0.0.1", "master_port": 29600, "rank_offset": 3,
                                               "world_size": 9, "group_name": "g", "backend": "nccl"}
    # load_format travels always: a server launched with --load-format dummy would otherwise use it for the update
    assert update_from_disk_body("/ckpt/v2", weight_version="2") == {"model_path": "/ckpt/v2", "weight_version": "2",
                                                                     "load_format": "auto"}


def test_rank_offsets_put_the_trainer_at_rank_zero():
    assert rank_offsets([2, 4, 1]) == ([1, 3, 7], 8)
    with pytest.raises(ValueError):
        rank_offsets([2, 0])


def test_tensor_payload_is_base64_forking_pickle_of_named_tensors():
    # UpdateWeightsFromTensorReqInput.serialized_named_tensors: one base64 string per TP rank
    bucket = [("x", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("y", torch.ones(3, dtype=torch.bfloat16))]
    payload = serialize_named_tensors(bucket)
    assert isinstance(payload, str)
    body = update_from_tensor_body([payload, payload], flush_cache=True, weight_version="7")
    assert body == {"serialized_named_tensors": [payload, payload], "load_format": None, "flush_cache": True,
                    "weight_version": "7"}
    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")  # CPU tensors: shared memory by file name
    try:
        back = deserialize_named_tensors(serialize_named_tensors(bucket))
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
    assert [n for n, _ in back] == ["x", "y"]
    for (_, a), (_, b) in zip(back, bucket):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_disk_checkpoint_is_built_aside_and_renamed(tmp_path):
    config_dir = tmp_path / "model"
    config_dir.mkdir()
    (config_dir / "config.json").write_text('{"num_hidden_layers": 2}')
    writer = DiskCheckpointWriter(tmp_path / "sync", "weights-v1", config_dir)
    assert (tmp_path / "sync" / "weights-v1.tmp").is_dir() and not (tmp_path / "sync" / "weights-v1").exists()
    writer.add_bucket([("a", torch.ones(2, 2)), ("b", torch.zeros(3, dtype=torch.bfloat16))])
    writer.add_bucket([("c", torch.full((4,), 2.0))])
    with pytest.raises(ValueError, match="'a' written twice"):
        writer.add_bucket([("a", torch.ones(1))])
    path = writer.finish()
    assert path == tmp_path / "sync" / "weights-v1" and not (tmp_path / "sync" / "weights-v1.tmp").exists()
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"a": "model-00001.safetensors", "b": "model-00001.safetensors",
                                   "c": "model-00002.safetensors"}
    assert index["metadata"]["total_size"] == 16 + 6 + 16
    assert json.loads((path / "config.json").read_text()) == {"num_hidden_layers": 2}
    assert torch.equal(load_file(path / "model-00002.safetensors")["c"], torch.full((4,), 2.0))


def test_broadcast_group_reaches_a_process_joined_like_sglang(tmp_path):
    tensors = [("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b", torch.full((4,), 3, dtype=torch.bfloat16)),
               ("c", torch.arange(5))]
    buckets = list(bucket_named_tensors(tensors, 30))
    (tmp_path / "meta.json").write_text(json.dumps([bucket_metadata(b) for b in buckets]))
    port = free_port()
    receiver = subprocess.Popen([sys.executable, STANDIN, "receive-broadcast", "--master", "127.0.0.1", "--port", str(port),
                                 "--rank", "1", "--world", "2", "--group", "wsync-0", "--meta", str(tmp_path / "meta.json"),
                                 "--out", str(tmp_path / "got.pt")])
    try:
        group = TrainerBroadcastGroup(master_address="127.0.0.1", master_port=port, world_size=2, group_name="wsync-0",
                                      backend="gloo", timeout_s=30)
        for bucket in buckets:
            group.broadcast_bucket(bucket)
        assert receiver.wait(timeout=60) == 0
        group.destroy()
    finally:
        receiver.kill()
    got = torch.load(tmp_path / "got.pt")
    for name, tensor in tensors:
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor)


_SHARER = """
import subprocess, sys, torch
from gspo_megatron.rollout.sglang.weight_sync import serialize_named_tensors
payload = serialize_named_tensors([("w", torch.arange(4.0))])
open(sys.argv[1] + "/payload", "w").write(payload)
# not our child (its own session) and mapping our shared memory after we exit: an attached server
holder = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1]], start_new_session=True,
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
open(sys.argv[1] + "/holder.pid", "w").write(str(holder.pid))
while not __import__("os").path.exists(sys.argv[1] + "/mapped"):
    __import__("time").sleep(0.05)
print("shared", flush=True)
"""
_HOLDER = """
import os, sys, time
from gspo_megatron.rollout.sglang.weight_sync import deserialize_named_tensors
tensors = deserialize_named_tensors(open(sys.argv[1] + "/payload").read())
open(sys.argv[1] + "/mapped", "w").write(str(float(tensors[0][1].sum())))
while not os.path.exists(sys.argv[1] + "/release"):
    time.sleep(0.05)
"""


def test_a_cpu_tensor_share_leaves_no_process_holding_the_senders_stderr(tmp_path):
    """torch's torch_shm_manager (started at the first file_system share) lives while any process maps the
    shared memory, and used to inherit the sender's stderr: after a trainer that synced CPU tensors to an
    attached server exited, a pipe on its stderr stayed open until the server stopped (`| tee` waited; met
    by tests/rollout/test_sglang_cpu_partial.py). The sender here exits while another session still maps
    its tensor; reading its output to the end must not wait for that process."""
    try:
        proc = subprocess.run([sys.executable, "-c", _SHARER, str(tmp_path), _HOLDER], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0 and proc.stdout == "shared\n", proc.stderr[-2000:]
        assert (tmp_path / "mapped").read_text() == "6.0"
    finally:
        (tmp_path / "release").write_text("")  # the holder exits, and the shm manager after it
        if (tmp_path / "holder.pid").exists():
            pid = int((tmp_path / "holder.pid").read_text())
            time.sleep(0.5)
            if os.path.exists(f"/proc/{pid}"):
                os.kill(pid, signal.SIGKILL)
