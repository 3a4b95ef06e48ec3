"""rollout.sglang.launch.device: cpu without a server: the flags, the refusals, the stand-in libcuda.so.1,
and CPU tensor payloads that a process which is not our child can open (the real servers:
tests/rollout/test_sglang_cpu_server.py, sglang leg)."""
from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest
import torch

from gspo_megatron.rollout.sglang.config import CPU_MAX_TOTAL_TOKENS, SGLangConfig, SGLangLaunchConfig
from gspo_megatron.rollout.sglang.cpu import CPUServerSetupError, cpu_server_env, libcuda_standin_dir, sglang_venv
from gspo_megatron.rollout.sglang.protocol import launch_command, launch_env
from gspo_megatron.rollout.sglang.weight_sync import serialize_named_tensors
from gspo_megatron.typed_config import ConfigError, build


def _launch(**fields) -> SGLangLaunchConfig:
    return build(SGLangLaunchConfig, {"model_path": "/m", **fields}, "rollout.sglang.launch")


def test_cpu_launch_adds_the_cpu_flags_a_kv_budget_and_no_memory_saver():
    cmd = launch_command(_launch(device="cpu", servers=2, base_gpu_id=3), server_index=1, python="/py")
    flags = dict(zip(cmd, cmd[1:]))
    assert flags["--device"] == "cpu" and flags["--attention-backend"] == "torch_native"
    assert "--disable-cuda-graph" in cmd and "--enable-memory-saver" not in cmd
    assert flags["--max-total-tokens"] == str(CPU_MAX_TOTAL_TOKENS)
    assert flags["--base-gpu-id"] == "0" and flags["--port"] == "30001"  # NUMA node 0 for every CPU server
    assert "2048" in launch_command(_launch(device="cpu", max_total_tokens=2048), 0, "p")
    # the GPU default is unchanged: memory saver on, no KV budget, no CPU flags
    gpu = launch_command(_launch(), 0, "p")
    assert "--enable-memory-saver" in gpu and "--max-total-tokens" not in gpu and "--device" not in gpu


@pytest.mark.parametrize("fields, section, field", [
    ({"enable_memory_saver": True}, "launch", "enable_memory_saver"),
    ({"enable_return_routed_experts": True}, "launch", "enable_return_routed_experts"),
    ({"enable_deterministic_inference": True}, "launch", "enable_deterministic_inference"),
    ({"tp_size": 2}, "launch", "tp_size"),
])
def test_cpu_refuses_what_the_cpu_server_cannot_do(fields, section, field):
    with pytest.raises(ConfigError, match=rf"rollout\.sglang\.launch\.{field}: .*device: cpu"):
        build(SGLangConfig, {"launch": {"model_path": "/m", "device": "cpu", **fields}, "release_memory": False},
              "rollout.sglang")


def test_cpu_refuses_memory_release_and_nccl_sync():
    launch = {"model_path": "/m", "device": "cpu"}
    with pytest.raises(ConfigError, match=r"^rollout\.sglang\.release_memory: must be false with rollout\.sglang\.launch\.device: cpu"):
        build(SGLangConfig, {"launch": launch}, "rollout.sglang")  # the default release_memory: true
    with pytest.raises(ConfigError, match=r"^rollout\.sglang\.weight_sync: 'distributed' is not supported"):
        build(SGLangConfig, {"launch": launch, "weight_sync": "distributed",
                             "distributed": {"master_address": "127.0.0.1", "master_port": 29000}}, "rollout.sglang")
    for ok in ({"release_memory": False}, {"weight_sync": "disk", "disk_dir": "/d"}):
        build(SGLangConfig, {"launch": launch, **ok}, "rollout.sglang")


def test_the_libcuda_standin_is_built_once_and_answers_no_device(tmp_path):
    env = {"GSPO_CACHE_DIR": str(tmp_path)}
    folder = libcuda_standin_dir(env)
    library = folder / "libcuda.so.1"
    built_at = library.stat().st_mtime_ns
    assert libcuda_standin_dir(env) == folder and library.stat().st_mtime_ns == built_at  # cached, not rebuilt
    lib = ctypes.CDLL(str(library))
    count = ctypes.c_int(7)
    assert lib.cuInit(0) == 100 and lib.cuDeviceGetCount(ctypes.byref(count)) == 100 and count.value == 0
    attr = ctypes.c_uint(5)
    assert lib.cuPointerGetAttribute(ctypes.byref(attr), 2, ctypes.c_ulonglong(0)) == 100 and attr.value == 0
    server_env = launch_env(_launch(device="cpu"), cpu_server_env(folder, {"LD_LIBRARY_PATH": "/x"}))
    assert server_env == {"SGLANG_USE_CPU_ENGINE": "1", "LD_LIBRARY_PATH": f"{folder}:/x"}
    assert sglang_venv("0.5.23", env) == tmp_path / "sglang-0.5.23"


def test_no_compiler_is_a_clear_error(tmp_path):
    with pytest.raises(CPUServerSetupError, match="launch.device: cpu needs a C compiler"):
        libcuda_standin_dir({"GSPO_CACHE_DIR": str(tmp_path), "CC": str(tmp_path / "no-such-cc")})


def test_cpu_tensor_payload_opens_in_a_process_that_is_not_our_child():
    """SGLang's server is started by us but is not a multiprocessing child: it holds no authkey of ours.
    A fresh interpreter plays it; torch's default (file descriptors) fails there, our payload does not."""
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4) * 0.5
    payload = serialize_named_tensors([("w", tensor)])
    reader = ("import sys; from gspo_megatron.rollout.sglang.weight_sync import deserialize_named_tensors as d; "
              "[(n, t)] = d(sys.stdin.read()); print(n, float(t.sum()), tuple(t.shape))")
    out = subprocess.run([sys.executable, "-c", reader], input=payload, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["w", str(float(tensor.sum())), "(3,", "4)"]
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"  # restored after the dump


def test_cpu_tensor_sync_to_two_servers_twice_leaves_the_shared_memory_openable():
    """One process feeding two servers pickles each payload for one receiver: every opener gives back one
    reference of the shared-memory segment, so one payload opened by two servers unlinked it while the
    trainer still shared the tensor, and the next sync of that tensor found no file (SGLang 0.5.23's
    scheduler died on it). A fresh interpreter opens every posted payload, in posting order."""
    import json

    from gspo_megatron.rollout.sglang.engine import SGLangEngine
    from tests.rollout.sglang_standin import StandinServer, StandinState

    weight = torch.randn(64, 32)
    with StandinServer(StandinState()) as a, StandinServer(StandinState()) as b:
        cfg = build(SGLangConfig, {"urls": [a.url, b.url], "release_memory": False}, "rollout.sglang")
        with SGLangEngine.from_config(cfg) as engine:
            for _ in range(2):
                engine.update_weights([("w", weight)], final=True)
                payloads = [body["serialized_named_tensors"][0] for srv in (a, b)
                            for body in srv.bodies("/update_weights_from_tensor")[-1:]]
                reader = ("import gc, json, sys; from gspo_megatron.rollout.sglang.weight_sync import "
                          "deserialize_named_tensors as d\nfor p in json.loads(sys.stdin.read()):\n"
                          "    [(n, t)] = d(p); print(float(t.sum())); del t; gc.collect()")
                out = subprocess.run([sys.executable, "-c", reader], input=json.dumps(payloads), capture_output=True,
                                     text=True, timeout=120)
                assert out.returncode == 0, out.stderr[-1500:]
                assert [float(v) for v in out.stdout.split()] == [pytest.approx(float(weight.sum()), rel=1e-5)] * 2
