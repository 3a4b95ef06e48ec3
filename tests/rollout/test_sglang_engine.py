"""SGLangEngine against local stand-in servers (tests/rollout/sglang_standin.py: NOT SGLang, 127.0.0.1 only):
routing and grouping, retries, restart of dead servers, the three weight-sync modes' requests, memory
release. What a real SGLang server does with these requests is tested only in test_sglang_gpu.py."""
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from gspo_megatron.rollout.sglang import engine as engine_mod
from gspo_megatron.rollout.ahead import ThreadedEngine
from gspo_megatron.rollout.base import RolloutInputError, SamplingParams
from gspo_megatron.rollout.sglang.config import SGLangConfig
from gspo_megatron.rollout.sglang.engine import SGLangEngine, SGLangEngineError, attach_servers, launch_servers
from gspo_megatron.typed_config import ConfigError, build

from tests.rollout.sglang_standin import StandinServer, StandinState, free_port

STANDIN = str(Path(__file__).with_name("sglang_standin.py"))
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]
PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=[3])


def _cfg(**overrides):
    base = {"urls": [], "backoff_s": 0.01, "backoff_max_s": 0.02, "max_retries": 3, "prompts_per_request": 2,
            "health_timeout_s": 2.0, "attach_timeout_s": 5.0}
    base.update(overrides)
    return build(SGLangConfig, base, "rollout.sglang")


def _attach(servers, **overrides):
    cfg = _cfg(urls=[s.url for s in servers], **overrides)
    return SGLangEngine(cfg, attach_servers(cfg), sleep=lambda s: None)


def _launch(tmp_path, *standin_args, servers=1, **overrides):
    base_port = free_port()
    launch = {"model_path": "standin", "servers": servers, "base_port": base_port, "log_dir": str(tmp_path / "logs"),
              "startup_timeout_s": 10.0, "health_poll_s": 0.05}
    cfg = _cfg(launch=launch, **overrides)
    slots = launch_servers(cfg, command_for=lambda i: [sys.executable, STANDIN, "--port", str(base_port + i),
                                                       "--lifetime-s", "60", *standin_args])
    return SGLangEngine(cfg, slots, sleep=lambda s: None)


def _kill(slot):
    os.kill(slot.process._proc.pid, signal.SIGKILL)
    slot.process._proc.wait(5)


def _check_groups(samples, prompts, g):
    assert len(samples) == len(prompts) * g
    for k, sample in enumerate(samples):
        i = k // g
        assert sample.prompt_index == i
        assert sample.response_ids[0] == prompts[i][-1]  # the stand-in echoes the prompt's last token first
        assert len(sample.logprobs) == len(sample.response_ids) and all(lp < 0 for lp in sample.logprobs)
        if sample.finish_reason == "stop":
            assert sample.response_ids[-1] == 3
        else:
            assert sample.finish_reason == "length" and len(sample.response_ids) == PARAMS.max_new_tokens


def test_generate_groups_by_prompt_over_two_servers():
    with StandinServer() as a, StandinServer() as b:
        engine = _attach([a, b])
        samples = engine.generate(PROMPTS, 3, PARAMS)
        _check_groups(samples, PROMPTS, 3)
        bodies = a.bodies("/generate") + b.bodies("/generate")
        assert a.bodies("/generate") and b.bodies("/generate")  # both servers took requests
        assert sorted(len(body["input_ids"]) for body in bodies) == [1, 2, 2]
        assert all(body["sampling_params"]["n"] == 3 and body["return_logprob"] for body in bodies)
        assert all(s.inflight == 0 for s in engine.slots)
        engine.shutdown()


def test_seeded_generate_is_reproducible_and_samples_in_a_group_differ():
    with StandinServer() as srv:
        engine = _attach([srv])
        params = SamplingParams(max_new_tokens=6, seed=11)
        first = engine.generate(PROMPTS, 4, params)
        again = engine.generate(PROMPTS, 4, params)
        other = engine.generate(PROMPTS, 4, SamplingParams(max_new_tokens=6, seed=12))
        assert [s.response_ids for s in first] == [s.response_ids for s in again]
        assert [s.response_ids for s in first] != [s.response_ids for s in other]
        assert len({tuple(s.response_ids) for s in first[:4]}) == 4
        assert all(isinstance(body["sampling_params"], list) for body in srv.bodies("/generate"))


def test_deterministic_server_gets_one_seed_per_sample_even_without_a_seed():
    with StandinServer(StandinState(deterministic=True)) as srv:
        engine = _attach([srv])
        samples = engine.generate(PROMPTS[:2], 3, SamplingParams(max_new_tokens=6))
        _check_groups(samples, PROMPTS[:2], 3)
        body = srv.bodies("/generate")[0]
        assert len({sp["sampling_seed"] for sp in body["sampling_params"]}) == 6


def test_transient_errors_are_retried_and_rejections_are_not():
    with StandinServer(StandinState(fail_generate=2, drop_generate=1)) as srv:
        engine = _attach([srv], prompts_per_request=10)
        _check_groups(engine.generate(PROMPTS, 2, PARAMS), PROMPTS, 2)
        assert srv.state.generate_calls == 4  # 503, 503, cut connection, answer
        engine.release_memory()  # the stand-in then refuses /generate with 400
        calls = srv.state.generate_calls
        with pytest.raises(SGLangEngineError, match="rejected by the server.*memory is released"):
            engine.generate(PROMPTS, 2, PARAMS)
        assert srv.state.generate_calls == calls + 1


def test_a_prompt_beyond_the_context_is_an_input_error_naming_both_lengths():
    """SGLang refuses it with 400 {"error": {"message": ...}} (the conformance test compares the stand-in's
    answer with a real server's): a RolloutInputError (exit 2, the trainer does not restart the engine), sent once."""
    with StandinServer(StandinState(context_length=16)) as srv:
        engine = _attach([srv], prompts_per_request=10)
        with pytest.raises(RolloutInputError, match=r"does not fit its context length: The input \(20 tokens\) is "
                                                    r"longer than the model's context length \(16 tokens\)\. \(the "
                                                    r"longest prompt of the request has 20 tokens, max_new_tokens is 6"):
            engine.generate([[5] * 3, [6] * 20], 2, PARAMS)
        assert srv.state.generate_calls == 1
        with pytest.raises(RolloutInputError, match=r"maximum context length of 16 tokens\. You requested a total of "
                                                    r"18 tokens: 12 tokens from the input messages and 6 tokens"):
            engine.generate([[5] * 12], 1, PARAMS)
        _check_groups(engine.generate([[5] * 10], 1, PARAMS), [[5] * 10], 1)  # 10 + 6 fits exactly
        assert srv.state.generate_calls == 3 and engine.healthy()


def test_too_many_transient_errors_give_a_clear_error():
    with StandinServer(StandinState(fail_generate=100)) as srv:
        engine = _attach([srv], max_retries=2, prompts_per_request=10)
        with pytest.raises(SGLangEngineError, match="gave up after 3 attempt.*503"):
            engine.generate(PROMPTS, 2, PARAMS)


def test_attached_server_that_stops_is_dropped_then_no_server_is_an_error():
    with StandinServer() as a:
        b = StandinServer()
        with b:
            engine = _attach([a, b])
        # b is gone: its requests fail, it is marked dead, a serves everything
        _check_groups(engine.generate(PROMPTS, 2, PARAMS), PROMPTS, 2)
        assert engine.server_states()[b.url].startswith("dead")
        assert not engine.healthy()
    with pytest.raises(SGLangEngineError, match="no SGLang server can serve"):
        engine.generate(PROMPTS, 2, PARAMS)


def test_owned_server_that_crashes_mid_request_is_restarted(tmp_path):
    engine = _launch(tmp_path, "--die-on-generate", "1", "--die-once-file", str(tmp_path / "died"))
    try:
        _check_groups(engine.generate(PROMPTS, 2, PARAMS), PROMPTS, 2)
        slot = engine.slots[0]
        assert slot.restarts == 1 and slot.process.starts == 2 and engine.healthy()
        assert slot.process.log_path.read_text().count("===== start") == 2
    finally:
        engine.shutdown()
    assert not engine.slots[0].process.alive()
    engine.shutdown()  # twice is fine
    with pytest.raises(SGLangEngineError, match="shut down"):
        engine.generate(PROMPTS, 2, PARAMS)


def test_server_restarted_after_a_sync_is_stale_until_the_next_sync(tmp_path):
    engine = _launch(tmp_path)
    try:
        engine.update_weights([("w", torch.ones(4))], final=True)
        assert engine.weight_version == 1
        _kill(engine.slots[0])
        with pytest.raises(SGLangEngineError, match="stale"):
            engine.generate(PROMPTS, 2, PARAMS)
        assert engine.slots[0].restarts == 1 and engine.slots[0].process.alive()
        engine.update_weights([("w", torch.ones(4))], final=True)
        _check_groups(engine.generate(PROMPTS, 2, PARAMS), PROMPTS, 2)
    finally:
        engine.shutdown()


def test_restarts_are_bounded(tmp_path):
    engine = _launch(tmp_path, max_restarts=0)
    try:
        _kill(engine.slots[0])
        with pytest.raises(SGLangEngineError, match="dead .*failed again after 0 restart"):
            engine.generate(PROMPTS, 2, PARAMS)
    finally:
        engine.shutdown()


def test_server_that_cannot_start_fails_launch_with_its_log(tmp_path):
    with pytest.raises(SGLangEngineError, match="(?s)1 of 1 SGLang servers failed to start.*exiting at start"):
        _launch(tmp_path, "--exit-at-start")


def test_tensor_sync_sends_one_payload_per_tp_rank_and_closes_on_the_final_bucket():
    with StandinServer(StandinState(tp_size=2)) as a, StandinServer() as b:
        engine = _attach([a, b], bucket_bytes=1 << 20)
        big = [(f"layer{i}.weight", torch.zeros(150_000)) for i in range(3)]  # 0.6 MB each: one per bucket
        engine.update_weights(big[:2], final=False)
        with pytest.raises(SGLangEngineError, match="middle of a weight sync"):
            engine.generate(PROMPTS, 2, PARAMS)
        engine.update_weights(big[2:] + [("norm.weight", torch.ones(8))], final=True)
        assert engine.weight_version == 1
        for srv, tp in ((a, 2), (b, 1)):
            bodies = srv.bodies("/update_weights_from_tensor")
            assert len(bodies) == 3
            assert all(len(body["serialized_named_tensors"]) == tp for body in bodies)
            assert [body["flush_cache"] for body in bodies] == [False, False, True]
            assert [body.get("weight_version") for body in bodies] == [None, None, "1"]
            assert srv.state.weight_version == "1"
        _check_groups(engine.generate(PROMPTS, 2, PARAMS), PROMPTS, 2)


def test_a_failed_sync_is_abandoned_and_leaves_servers_stale():
    with StandinServer() as srv:
        engine = _attach([srv])
        srv.state.tp_size = 2  # the stand-in now wants two payloads: the update is rejected (400)
        with pytest.raises(SGLangEngineError, match="rejected by .*update_weights_from_tensor.*one entry per TP rank"):
            engine.update_weights([("w", torch.ones(4))], final=True)
        assert engine.weight_version == 0 and engine.server_states()[srv.url].startswith("stale")
        with pytest.raises(SGLangEngineError, match="stale"):
            engine.generate(PROMPTS, 2, PARAMS)
        srv.state.tp_size = 1
        engine.update_weights([("w", torch.ones(4))], final=True)  # a fresh, complete sync
        assert engine.weight_version == 1
        _check_groups(engine.generate(PROMPTS, 2, PARAMS), PROMPTS, 2)


def test_disk_sync_writes_a_checkpoint_and_points_servers_at_it(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with StandinServer() as srv:
        engine = _attach([srv], weight_sync="disk", disk_dir=str(tmp_path / "sync"), disk_config_dir=str(model))
        engine.update_weights([("a", torch.ones(3))], final=False)
        engine.update_weights([("b", torch.zeros(2))], final=True)
        first = Path(srv.bodies("/update_weights_from_disk")[0]["model_path"])
        assert first == tmp_path / "sync" / "weights-v1"
        assert set(json.loads((first / "model.safetensors.index.json").read_text())["weight_map"]) == {"a", "b"}
        assert (first / "config.json").exists()
        engine.update_weights([("a", torch.ones(3))], final=True)
        second = srv.bodies("/update_weights_from_disk")[1]
        assert second == {"model_path": str(tmp_path / "sync" / "weights-v2"), "weight_version": "2", "load_format": "auto"}
        assert not first.exists()  # the previous checkpoint is removed once the servers moved on
        with pytest.raises(SGLangEngineError, match="at least one tensor"):
            engine.update_weights([], final=True)


def test_disk_mode_restart_reloads_the_last_checkpoint(tmp_path):
    engine = _launch(tmp_path, weight_sync="disk", disk_dir=str(tmp_path / "sync"))
    try:
        engine.update_weights([("a", torch.ones(3))], final=True)
        _kill(engine.slots[0])
        _check_groups(engine.generate(PROMPTS, 2, PARAMS), PROMPTS, 2)  # restarted and caught up: not stale
        assert engine.slots[0].restarts == 1 and engine.slots[0].weight_version == 1
    finally:
        engine.shutdown()


class FakeGroup:
    """Stands in for TrainerBroadcastGroup (tested over gloo in test_sglang_weight_sync.py)."""

    made = []

    def __init__(self, **kwargs):
        self.kwargs, self.broadcast, self.destroyed = kwargs, [], False
        self.group_name = kwargs["group_name"]
        FakeGroup.made.append(self)

    def broadcast_bucket(self, bucket):
        self.broadcast += [name for name, _ in bucket]

    def destroy(self):
        self.destroyed = True


def test_distributed_sync_inits_the_group_then_announces_and_broadcasts_each_bucket(monkeypatch):
    monkeypatch.setattr(engine_mod, "TrainerBroadcastGroup", FakeGroup)
    FakeGroup.made = []
    with StandinServer(StandinState(tp_size=2)) as a, StandinServer() as b:
        engine = _attach([a, b], weight_sync="distributed", bucket_bytes=1 << 20,
                         distributed={"master_address": "127.0.0.1", "master_port": 29999, "backend": "gloo"})
        tensors = [("x", torch.zeros(150_000)), ("y", torch.zeros(150_000)), ("z", torch.zeros(150_000, dtype=torch.bfloat16))]
        engine.update_weights(tensors, final=True)
        inits = [a.bodies("/init_weights_update_group")[0], b.bodies("/init_weights_update_group")[0]]
        assert [(i["rank_offset"], i["world_size"]) for i in inits] == [(1, 4), (3, 4)]
        assert {i["group_name"] for i in inits} == {"gspo_weight_sync-0"}
        group = FakeGroup.made[0]
        assert group.kwargs["world_size"] == 4 and group.broadcast == ["x", "y", "z"]
        bodies = a.bodies("/update_weights_from_distributed")
        # 0.6 MB + 0.6 MB + 0.3 MB in 1 MiB buckets: y and z travel together
        assert [body["names"] for body in bodies] == [["x"], ["y", "z"]]
        assert bodies[1]["dtypes"] == ["float32", "bfloat16"] and bodies[1]["shapes"] == [[150_000], [150_000]]
        assert [body["flush_cache"] for body in bodies] == [False, True]
        assert b.bodies("/update_weights_from_distributed") == bodies
        # a server that lost the group answers success=false (400): a clear error, and the next sync rebuilds
        b.state.groups.clear()
        with pytest.raises(SGLangEngineError, match="distributed weight sync failed"):
            engine.update_weights(tensors[:1], final=True)
        assert group.destroyed and a.bodies("/destroy_weights_update_group")
        engine.update_weights(tensors[:1], final=True)
        assert FakeGroup.made[1].group_name == "gspo_weight_sync-1" and engine.weight_version == 2


def test_release_resume_and_flush():
    with StandinServer() as srv:
        engine = _attach([srv])
        engine.release_memory()
        engine.resume_memory(["weights"])
        assert srv.state.released == {"kv_cache", "cuda_graph"}
        engine.resume_memory()
        assert srv.state.released == set()
        assert srv.bodies("/release_memory_occupation") == [{}]
        assert srv.bodies("/resume_memory_occupation") == [{"tags": ["weights"]}, {}]
        engine.flush_cache()
        assert "/flush_cache" in srv.paths()
    with StandinServer(StandinState(memory_saver=False)) as srv:
        with pytest.raises(SGLangEngineError, match="enable-memory-saver"):
            _attach([srv]).release_memory()


def test_old_servers_answer_on_get_server_info():
    with StandinServer(StandinState(old_api=True, tp_size=4)) as srv:
        engine = _attach([srv])
        assert engine.slots[0].info.tp_size == 4
        assert srv.paths()[-2:] == ["/server_info", "/get_server_info"]


def test_routed_experts_come_back_per_response_token():
    with StandinServer(StandinState(routed_experts=(3, 2))) as srv:
        engine = _attach([srv], routed_experts_layers=3, routed_experts_top_k=2)
        samples = engine.generate(PROMPTS[:2], 2, SamplingParams(max_new_tokens=5, return_routed_experts=True))
        for s in samples:
            p = len(PROMPTS[s.prompt_index])
            assert s.routed_experts.shape == (len(s.response_ids), 3, 2)
            # the stand-in writes (position*7 + layer*3 + k) % 8: row t is input position p - 1 + t
            assert s.routed_experts[0, 1, 1].item() == ((p - 1) * 7 + 3 + 1) % 8
    with StandinServer() as srv:
        with pytest.raises(SGLangEngineError, match="enable-return-routed-experts"):
            _attach([srv]).generate(PROMPTS, 1, SamplingParams(return_routed_experts=True))


def test_routed_experts_of_a_model_with_a_dense_first_layer_are_its_moe_layers(tmp_path):
    # GLM-4.5's shape: layer 0 dense (first_k_dense_replace=1), layers 1..3 MoE. SGLang (and the stand-in)
    # return [rows, num_hidden_layers=4, top_k]; the samples hold the 3 MoE layers, MoE layer j = global j + 1.
    from tests.conversion.hf_models import family_config

    model = family_config("glm4_moe")
    assert model.num_layers == 4 and model.first_dense_layers == 1
    (tmp_path / "config.json").write_text(json.dumps(model.to_hf_dict()))
    top_k = model.moe_router_topk
    state = StandinState(routed_experts=(4, top_k), dense_layers=1, num_experts=model.num_experts)
    for overrides in ({"disk_config_dir": str(tmp_path)},
                      {"routed_experts_layers": 4, "routed_experts_top_k": top_k, "routed_experts_first_dense_layers": 1}):
        with StandinServer(state) as srv:
            engine = _attach([srv], **overrides)
            samples = engine.generate(PROMPTS[:2], 2, SamplingParams(max_new_tokens=5, return_routed_experts=True))
        for s in samples:
            p = len(PROMPTS[s.prompt_index])
            assert s.routed_experts.shape == (len(s.response_ids), 3, top_k)
            assert s.prompt_routed_experts.shape == (p - 1, 3, top_k)
            # the stand-in writes (position*7 + global layer*3 + k) % E on MoE layers, 0 on the dense one
            for j in range(3):
                assert s.routed_experts[0, j].tolist() == [((p - 1) * 7 + (j + 1) * 3 + k) % model.num_experts
                                                           for k in range(top_k)]


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="rollout.sglang.urls: set exactly one"):
        build(SGLangConfig, {}, "rollout.sglang")
    with pytest.raises(ConfigError, match=r"rollout.sglang.urls\[0\]: must be an http"):
        build(SGLangConfig, {"urls": ["localhost:30000"]}, "rollout.sglang")
    with pytest.raises(ConfigError, match="rollout.sglang.disk_dir: required"):
        build(SGLangConfig, {"urls": ["http://h:1"], "weight_sync": "disk"}, "rollout.sglang")
    with pytest.raises(ConfigError, match="rollout.sglang.distributed.master_address"):
        build(SGLangConfig, {"urls": ["http://h:1"], "weight_sync": "distributed"}, "rollout.sglang")
    with pytest.raises(ConfigError, match="rollout.sglang.launch.dp_size: must be 1"):
        build(SGLangConfig, {"launch": {"model_path": "/m", "dp_size": 2}}, "rollout.sglang")
    with pytest.raises(ConfigError, match="rollout.sglang.launch.mem_fraction_static"):
        build(SGLangConfig, {"launch": {"model_path": "/m", "mem_fraction_static": 1.5}}, "rollout.sglang")
    with pytest.raises(ConfigError, match="rollout.sglang.weight_sync: must be one of"):
        build(SGLangConfig, {"urls": ["http://h:1"], "weight_sync": "nccl"}, "rollout.sglang")
    cfg = build(SGLangConfig, {"launch": {"model_path": "/m", "tp_size": 2}}, "rollout.sglang")
    assert cfg.launch.gpus_per_server() == 2 and cfg.weight_sync == "tensor"


# ---- several trainer ranks (gspo_megatron/trainer/rollout_setup.py drives these) ----------------------

def test_follower_posts_nothing_and_final_advances_its_version():
    with StandinServer() as a, StandinServer() as b:
        cfg = _cfg(urls=[a.url, b.url])
        follower = SGLangEngine(cfg, attach_servers(cfg), posts_weights=False, sleep=lambda s: None)
        follower.update_weights([("w", torch.ones(4))], final=False)
        follower.update_weights([("v", torch.ones(4))], final=True)
        assert follower.weight_version == 1 and follower.sync_report() == {}
        assert not [p for p in a.paths() + b.paths() if p.startswith(("/update_weights", "/flush_cache"))]
        assert set(follower.server_states().values()) == {"ready"}
        _check_groups(follower.generate(PROMPTS, 2, PARAMS), PROMPTS, 2)
        with pytest.raises(ValueError, match="colocated engine takes part"):
            SGLangEngine(cfg, attach_servers(cfg), posts_weights=False,
                         colocated=engine_mod.ColocatedSync(0, True, lambda p: [p], bool))


def test_sync_report_names_the_servers_a_poster_fed_and_adopting_it_routes_around_stale_ones():
    with StandinServer() as a, StandinServer() as b:
        poster = _attach([a, b])
        poster.update_weights([("w", torch.ones(4))], final=True)
        assert poster.sync_report() == {a.url: True, b.url: True}
        cfg = _cfg(urls=[a.url, b.url])
        follower = SGLangEngine(cfg, attach_servers(cfg), posts_weights=False, sleep=lambda s: None)
        follower.update_weights([("w", torch.ones(4))], final=True)
        follower.slots[0].dead = True  # the follower lost a; the poster reached it: in service again
        follower.adopt_sync_report({a.url: True, b.url: False})
        assert follower.server_states() == {a.url: "ready", b.url: "stale (holds weights v-1)"}
        calls = b.state.generate_calls
        _check_groups(follower.generate(PROMPTS, 2, PARAMS), PROMPTS, 2)
        assert b.state.generate_calls == calls  # every request went to a
        follower.adopt_sync_report({})  # servers not in a report keep the engine's own view
        assert follower.server_states()[b.url].startswith("stale")
        with pytest.raises(SGLangEngineError, match="does not know"):
            follower.adopt_sync_report({"http://127.0.0.1:1": True})


def test_colocated_leader_reports_its_own_server_only():
    with StandinServer() as a, StandinServer() as b:
        cfg = _cfg(urls=[a.url, b.url])
        leader = SGLangEngine(cfg, attach_servers(cfg), colocated=engine_mod.ColocatedSync(1, True, lambda p: [p], bool))
        other = SGLangEngine(cfg, attach_servers(cfg), colocated=engine_mod.ColocatedSync(0, False, lambda p: None, lambda a: True))
        for engine in (leader, other):
            engine.update_weights([("w", torch.ones(4))], final=True)
        assert leader.sync_report() == {b.url: True} and other.sync_report() == {}
        assert len(b.bodies("/update_weights_from_tensor")) == 1 and not a.bodies("/update_weights_from_tensor")


def test_launched_servers_die_with_the_trainer_even_on_sigkill(tmp_path):
    """launch_servers from a process that is then SIGKILLed: no server it started survives (they are spawned
    from the launching thread with a parent-death signal, processes.wrap_command)."""
    import subprocess
    import time

    script = tmp_path / "owner.py"
    script.write_text(
        "import sys, time\n"
        "from tests.rollout.test_sglang_engine import _launch\n"
        "from pathlib import Path\n"
        "engine = _launch(Path(sys.argv[1]), servers=2)\n"
        "print(' '.join(str(s.process._proc.pid) for s in engine.slots), flush=True)\n"
        "time.sleep(600)\n")
    repo = Path(__file__).resolve().parents[2]
    owner = subprocess.Popen([sys.executable, str(script), str(tmp_path)], cwd=repo, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(repo)})
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 2
        for pid in pids:
            os.kill(pid, 0)  # both running
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 20
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()], "a launched server outlived the trainer"


def _updates_wait_for_generations(log: list[str]) -> int:
    """Every /generate that reached the server before a weight update had finished before it; returns the
    number of updates checked."""
    updates = [i for i, p in enumerate(log) if p.startswith("/update_weights")]
    for u in updates:
        assert log[:u].count("/generate") == log[:u].count("done /generate"), log
    return len(updates)


def test_a_generation_submitted_before_an_update_runs_wholly_on_the_old_weights(monkeypatch):
    """Overlapped rollouts (rollout/ahead.py): ``submit`` returns before the server answers and the generation
    runs on a background thread; an update sent after it waits until it has finished, one submitted after the
    update runs on the new weights, and a cancelled one is still waited for."""
    from tests.rollout import sglang_standin

    monkeypatch.setattr(sglang_standin, "fake_generate",
                        sglang_standin.finishing_late(sglang_standin.fake_generate, "/generate"))
    with StandinServer() as srv:
        engine = ThreadedEngine(_attach([srv], prompts_per_request=8))  # what the overlapped schedule drives
        try:
            start = time.perf_counter()
            first = engine.submit(PROMPTS, 2, PARAMS)
            assert time.perf_counter() - start < 0.2  # did not wait for the server
            engine.update_weights([("norm.weight", torch.ones(8))], final=True)
            second = engine.submit(PROMPTS, 2, PARAMS)
            a, b = engine.result(first), engine.result(second)
            log = [p for p, _ in srv.state.requests]
            assert [p for p in log if "generate" in p or p.startswith("/update")] == [
                "/generate", "done /generate", "/update_weights_from_tensor", "/generate", "done /generate"]
            assert (a.weight_version, b.weight_version) == (0, 1) and a.generate_s >= 0.3
            _check_groups(a.samples, PROMPTS, 2)
            _check_groups(b.samples, PROMPTS, 2)
            third = engine.submit(PROMPTS, 1, PARAMS)
            engine.cancel(third)
            engine.update_weights([("norm.weight", torch.ones(8))], final=True)
            assert _updates_wait_for_generations([p for p, _ in srv.state.requests]) == 2
            with pytest.raises(KeyError, match="no submitted generation 2"):
                engine.result(third)
        finally:
            engine.shutdown()
