"""The SGLang protocol points where the trainer broke against real SGLang (read in the 0.5.9 and 0.5.23
sources; /work/shared/UPSTREAM_GPU_FACTS.md), checked against the stand-in, which enforces each of them
as SGLang 0.5.23 does (tests/rollout/sglang_standin.py: NOT SGLang):

- ignore_eos switches stop_token_ids off, so it is never sent true;
- tensor and distributed updates are refused (400) outside begin/end_weight_update; older servers answer
  404 on both and need no session;
- a disk update without load_format inherits the launch's, and 'dummy' cannot load from disk;
- a repeated /init_weights_update_group or /update_weights_from_distributed hangs the server, so neither
  is retried;
- distributed sync needs dp_size 1;
- A tensor-sync bucket is dropped only after the leader's post of it returned (acknowledged), at most
  tensor_buckets_in_flight alive.
- Tensor / distributed sync refuse a quantized served model (post-load is skipped after those updates).
"""
import gc
import weakref

import pytest
import torch

from gspo_megatron.rollout.sglang import engine as engine_mod
from gspo_megatron.rollout.sglang.config import SGLangConfig
from gspo_megatron.rollout.sglang.engine import SGLangEngine, SGLangEngineError, attach_servers
from gspo_megatron.rollout.sglang.http import ServerRejected, request
from gspo_megatron.typed_config import ConfigError, build

from tests.rollout.sglang_standin import StandinServer, StandinState
from tests.rollout.test_sglang_engine import PARAMS, PROMPTS, FakeGroup, _attach

SESSION = ("/begin_weight_update", "/end_weight_update")
DISTRIBUTED = {"weight_sync": "distributed",
               "distributed": {"master_address": "127.0.0.1", "master_port": 29999, "backend": "gloo"}}


def _sync_paths(srv) -> list[str]:
    return [p for p in srv.paths() if p.startswith(("/begin_weight", "/end_weight", "/update_weights", "/init_weights"))]


# ---- stop tokens --------------------------------------------------------------------------------


def test_responses_end_at_stop_tokens():
    with StandinServer() as srv:
        samples = _attach([srv]).generate(PROMPTS * 4, 4, PARAMS)
        assert all(b["sampling_params"]["ignore_eos"] is False for b in srv.bodies("/generate"))
        stopped = [s for s in samples if s.finish_reason == "stop"]
        assert stopped and all(s.response_ids[-1] == 3 and 3 not in s.response_ids[:-1] for s in stopped)
        # the control: with ignore_eos the stand-in, like SGLang, never stops at stop_token_ids
        body = {"input_ids": [[1, 2, 3]], "return_logprob": True,
                "sampling_params": {"max_new_tokens": 40, "stop_token_ids": list(range(64)), "ignore_eos": True}}
        out = request(srv.url, "POST", "/generate", body, timeout_s=5)
        assert out[0]["meta_info"]["finish_reason"]["type"] == "length"


# ---- weight-update sessions ----------------------------------------------------------------------


def test_stand_in_refuses_updates_outside_a_session():
    with StandinServer() as srv:
        with pytest.raises(ServerRejected, match="begin_weight_update"):
            request(srv.url, "POST", "/update_weights_from_tensor",
                    {"serialized_named_tensors": ["AA=="], "flush_cache": True}, timeout_s=5)


def test_tensor_sync_runs_inside_one_session():
    with StandinServer() as srv:
        engine = _attach([srv], bucket_bytes=1 << 20)
        big = [(f"w{i}", torch.zeros(150_000)) for i in range(3)]
        engine.update_weights(big[:2], final=False)
        engine.update_weights(big[2:], final=True)
        assert _sync_paths(srv) == ["/begin_weight_update"] + ["/update_weights_from_tensor"] * 3 + ["/end_weight_update"]
        assert not srv.state.session_open and srv.state.weight_version == "1"
        engine.update_weights(big[:1], final=True)  # the next sync opens its own session
        assert _sync_paths(srv)[-3:] == ["/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"]


def test_distributed_sync_runs_inside_one_session(monkeypatch):
    monkeypatch.setattr(engine_mod, "TrainerBroadcastGroup", FakeGroup)
    FakeGroup.made = []
    with StandinServer(StandinState(tp_size=2)) as a, StandinServer() as b:
        engine = _attach([a, b], bucket_bytes=1 << 20, **DISTRIBUTED)
        engine.update_weights([("x", torch.zeros(150_000)), ("y", torch.zeros(150_000))], final=True)
        for srv in (a, b):
            assert _sync_paths(srv) == ["/begin_weight_update", "/init_weights_update_group",
                                        "/update_weights_from_distributed", "/update_weights_from_distributed",
                                        "/end_weight_update"]


def test_older_servers_without_the_session_endpoints_are_updated_without_one():
    with StandinServer(StandinState(weight_update_session=False)) as srv:
        engine = _attach([srv])
        engine.update_weights([("w", torch.ones(4))], final=True)
        engine.update_weights([("w", torch.ones(4))], final=True)
        # asked once (404), then remembered
        assert _sync_paths(srv) == ["/begin_weight_update"] + ["/update_weights_from_tensor"] * 2
        assert srv.state.weight_version == "2"


def test_an_aborted_sync_closes_its_session():
    with StandinServer() as srv:
        engine = _attach([srv])
        srv.state.tp_size = 2  # the update is now rejected (400): the sync is abandoned
        with pytest.raises(SGLangEngineError, match="rejected"):
            engine.update_weights([("w", torch.ones(4))], final=True)
        assert not srv.state.session_open
        srv.state.tp_size = 1
        engine.update_weights([("w", torch.ones(4))], final=True)
        assert srv.state.weight_version == "1"


# ---- disk ----------------------------------------------------------------------------------------


def test_disk_sync_loads_into_a_server_launched_with_dummy_weights(tmp_path):
    with StandinServer(StandinState(load_format="dummy")) as srv:
        engine = _attach([srv], weight_sync="disk", disk_dir=str(tmp_path))
        engine.update_weights([("w", torch.ones(4))], final=True)
        assert srv.bodies("/update_weights_from_disk")[0]["load_format"] == "auto"
        assert srv.state.weight_version == "1"


# ---- calls that must not be repeated -------------------------------------------------------------


@pytest.mark.parametrize("path", ["/init_weights_update_group", "/update_weights_from_distributed"])
def test_nccl_group_calls_are_posted_once(monkeypatch, path):
    monkeypatch.setattr(engine_mod, "TrainerBroadcastGroup", FakeGroup)
    FakeGroup.made = []
    with StandinServer(StandinState(fail_paths={path: 1})) as srv:
        engine = _attach([srv], **DISTRIBUTED)  # max_retries=3: other calls would be retried
        with pytest.raises(SGLangEngineError, match="503"):
            engine.update_weights([("x", torch.ones(4))], final=True)
        assert srv.paths().count(path) == 1


# ---- dp_size -------------------------------------------------------------------------------------


def test_distributed_sync_refuses_data_parallel_servers():
    with pytest.raises(ConfigError, match="rollout.sglang.launch.dp_size: must be 1 with weight_sync 'distributed'"):
        build(SGLangConfig, {"launch": {"model_path": "/m", "dp_size": 2}, **DISTRIBUTED}, "rollout.sglang")
    with StandinServer(StandinState(dp_size=2)) as srv:
        with pytest.raises(SGLangEngineError, match="--dp-size 2.*'distributed'"):
            _attach([srv], **DISTRIBUTED)


# ---- IPC buffers ---------------------------------------------------------------------------------


def _weights(refs: list) -> list:
    out = [("w", torch.ones(4)), ("v", torch.ones(4))]
    refs.extend(weakref.ref(t) for _, t in out)
    return out


def test_colocated_buckets_are_dropped_only_after_the_leaders_post_answered():
    """SGLang answers once its copies are enqueued (item 12): a bucket is dropped only after its post has
    returned on the leader, which acknowledges it over the group; at most tensor_buckets_in_flight live."""
    with StandinServer() as srv:
        cfg = build(SGLangConfig, {"urls": [srv.url], "bucket_bytes": 1 << 20}, "rollout.sglang")
        refs: list = []
        acks: list = []

        def ack(answered):
            # at acknowledgement time the server has answered every post so far, and the bucket is alive
            acks.append((answered, len(srv.bodies("/update_weights_from_tensor")), sum(r() is not None for r in refs)))
            return answered

        leader = SGLangEngine(cfg, attach_servers(cfg), colocated=engine_mod.ColocatedSync(0, True, lambda p: [p], ack))
        for i in range(4):
            leader.update_weights(_weights(refs), final=i == 3)
            gc.collect()
            assert sum(r() is not None for r in refs) <= 2 * cfg.tensor_buckets_in_flight  # two tensors a bucket
        assert all(r() is None for r in refs)
        # one acknowledgement per bucket, in order, each after that bucket's post returned
        assert [a for a, _, _ in acks] == [True] * 4
        assert [posts for _, posts, _ in acks] == [2, 3, 4, 4]
        assert acks[0][2] == 4  # buckets 1 and 2 alive when bucket 1 is acknowledged (2 in flight)


def test_single_process_buckets_are_released_once_the_servers_answered():
    with StandinServer() as srv:
        engine = _attach([srv])
        refs: list = []
        engine.update_weights(_weights(refs), final=True)
        gc.collect()
        assert all(r() is None for r in refs)


# ---- placement and start-up ----------------------------------------------------------------------


def test_distributed_sync_is_refused_for_servers_on_the_trainer_gpu(monkeypatch):
    from gspo_megatron.trainer.rollout_setup import SGLangSetupError, check_sync_placement

    monkeypatch.setattr(engine_mod, "TrainerBroadcastGroup", FakeGroup)
    # servers on GPUs 0-3 and 4-7 of this node, as examples/slurm/start_sglang_node.sh starts them
    with StandinServer(StandinState(tp_size=4)) as a, StandinServer(StandinState(tp_size=4, base_gpu_id=4)) as b:
        engine = _attach([a, b], **DISTRIBUTED)
        here = {"127.0.0.1"}
        with pytest.raises(SGLangSetupError, match=r"weight_sync: 'distributed' would put trainer rank 0 \(GPU 5\)"):
            check_sync_placement(engine.cfg, engine, 5, here)
        check_sync_placement(engine.cfg, engine, 5, {"some-other-node"})  # servers of another node: fine
        tensor = _attach([a, b])
        check_sync_placement(tensor.cfg, tensor, 5, here)  # CUDA IPC is what colocated servers take


def test_the_wait_for_rank_zeros_launch_outlasts_the_launch():
    from gspo_megatron.trainer.rollout_setup import launch_wait_s

    cfg = build(SGLangConfig, {"launch": {"model_path": "/m", "startup_timeout_s": 1200}}, "rollout.sglang")
    assert launch_wait_s(cfg) > cfg.launch.startup_timeout_s + cfg.admin_timeout_s


def test_multinode_example_syncs_colocated_servers_by_cuda_ipc():
    """The example's servers sit on the trainer's GPUs (start_sglang_node.sh --base-gpu-id 0..), so its
    weights must travel by tensor (CUDA IPC) sync, which the start-up check would otherwise refuse."""
    from pathlib import Path

    from gspo_megatron.trainer.config import load_config

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "examples/qwen3_30b_a3b_gspo_multinode.yaml", [])
    assert cfg.rollout.sglang.weight_sync == "tensor"
    assert "--base-gpu-id $((i * TP_SIZE))" in (root / "examples/slurm/start_sglang_node.sh").read_text()


# ---- FP8 / quantized served models (issue 40, defect 7) ----------------------------------------------

def _served_model(tmp_path, quantized: bool):
    import json

    folder = tmp_path / ("fp8" if quantized else "bf16")
    folder.mkdir()
    config = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64}
    if quantized:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


LIVE = {"tensor": {}, "distributed": {"distributed": {"master_address": "127.0.0.1", "master_port": 29999}}}


@pytest.mark.parametrize("mode", ["tensor", "distributed"])
def test_live_sync_into_a_quantized_served_model_is_refused_by_name(tmp_path, mode):
    """SGLang 0.5.23 skips post-load after tensor / distributed updates: the FP8 scales would stay old."""
    fp8, bf16 = _served_model(tmp_path, True), _served_model(tmp_path, False)
    with pytest.raises(ConfigError, match=r"rollout\.sglang\.weight_sync: .*quantization_config \(quant_method fp8\)"):
        build(SGLangConfig, {"launch": {"model_path": fp8}, "weight_sync": mode, **LIVE[mode]}, "rollout.sglang")
    with pytest.raises(ConfigError, match=r"rollout\.sglang\.weight_sync: .*--quantization fp8"):
        build(SGLangConfig, {"launch": {"model_path": bf16, "extra_args": ["--quantization", "fp8"]},
                             "weight_sync": mode, **LIVE[mode]}, "rollout.sglang")
    build(SGLangConfig, {"launch": {"model_path": bf16}, "weight_sync": mode, **LIVE[mode]}, "rollout.sglang")
    # the refusal is about live sync; disk sync (a reload through the model loader) is outside it, and
    # loading the trainer's bf16 checkpoint beside a quantized config.json has not been checked
    build(SGLangConfig, {"launch": {"model_path": fp8}, "weight_sync": "disk", "disk_dir": str(tmp_path)},
          "rollout.sglang")


def test_an_attached_quantized_server_is_refused_for_tensor_sync(tmp_path):
    with StandinServer(StandinState(quantization="fp8")) as srv:
        cfg = build(SGLangConfig, {"urls": [srv.url]}, "rollout.sglang")
        with pytest.raises(SGLangEngineError, match=r"--quantization fp8.*rollout\.sglang\.weight_sync 'tensor'"):
            SGLangEngine(cfg, attach_servers(cfg))
        disk = build(SGLangConfig, {"urls": [srv.url], "weight_sync": "disk", "disk_dir": str(tmp_path)}, "rollout.sglang")
        SGLangEngine(disk, attach_servers(disk)).shutdown()


def test_the_trainer_exits_2_naming_the_setting(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    fp8 = _served_model(tmp_path, True)
    proc = subprocess.run([sys.executable, "-m", "gspo_megatron.cli", "train", "--config",
                           str(repo / "examples" / "cpu_demo.yaml"), "--run-dir", str(tmp_path / "run"),
                           "rollout.engine=sglang", f"rollout.sglang.launch.model_path={fp8}",
                           "rollout.sglang.weight_sync=tensor"],
                          capture_output=True, text=True, timeout=300, cwd=repo)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "rollout.sglang.weight_sync: 'tensor' cannot update a quantized served model" in proc.stderr


def test_buckets_in_flight_must_be_positive():
    with pytest.raises(ConfigError, match=r"rollout\.sglang\.tensor_buckets_in_flight: must be >= 1, got 0"):
        build(SGLangConfig, {"urls": ["http://127.0.0.1:1"], "tensor_buckets_in_flight": 0}, "rollout.sglang")
