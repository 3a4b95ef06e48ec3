"""SGLang with several trainer ranks (gspo_megatron/trainer/rollout_setup.py), on CPU against the local
HTTP stand-in (tests/rollout/sglang_standin.py, NOT SGLang) over real gloo ranks: who launches, who posts,
the colocated layout, and a 2-rank Trainer step with disk sync. No real SGLang / NCCL / CUDA IPC here."""
import base64
import os
import stat
import sys
from pathlib import Path

import pytest
import torch

from gspo_megatron.rollout.sglang.config import SGLangConfig
from gspo_megatron.rollout.sglang.protocol import sample_seed
from tests.runs import sglang_standin_overrides
from gspo_megatron.megatron.spawn import run_distributed
from gspo_megatron.trainer.launch_env import LaunchEnv
from gspo_megatron.trainer.rollout_setup import (ColocatedLayout, SGLangSetupError, attach_config, colocated_layout,
                                                 launching_rank, sglang_pushes)
from gspo_megatron.typed_config import build

from tests.rollout import sglang_standin
from tests.rollout.sglang_standin import StandinServer, StandinState, free_port

STANDIN = sglang_standin.__file__
DEMO = Path(__file__).resolve().parents[2] / "examples" / "cpu_demo.yaml"
FAST = {"backoff_s": 0.01, "backoff_max_s": 0.02, "health_timeout_s": 2.0, "attach_timeout_s": 10.0}


def _cfg(**fields) -> SGLangConfig:
    return build(SGLangConfig, {**FAST, **fields}, "rollout.sglang")


def _place(rank, world_size, local_world_size, num_nodes=None):
    num_nodes = num_nodes or world_size // local_world_size
    return LaunchEnv(rank, world_size, rank % local_world_size, local_world_size, rank // local_world_size,
                     num_nodes, "127.0.0.1", 1, "torchrun")


# ---------------------------------------------------------------------------------------------- pure

@pytest.mark.parametrize("nodes, local, servers, gpus", [(1, 8, 2, 4), (2, 4, 2, 2), (3, 2, 2, 1), (1, 2, 1, 2)])
def test_colocated_layout_pairs_every_rank_with_one_server_gpu(nodes, local, servers, gpus):
    layout = ColocatedLayout(nodes, local, servers, gpus)
    groups = layout.groups()
    assert len(groups) == nodes * servers and all(len(g) == gpus for g in groups)
    assert sorted(r for g in groups for r in g) == list(range(nodes * local))  # each rank feeds one server
    for rank in range(nodes * local):
        server, position = layout.place(rank // local, rank % local)
        assert groups[server][position] == rank
        # a server's GPUs are on one node: its group never spans two nodes
        assert {r // local for r in groups[server]} == {rank // local}
    assert ColocatedLayout(2, 4, 2, 2).groups() == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_colocated_layout_from_config_and_its_errors():
    launch = {"model_path": "/m", "servers": 2, "tp_size": 4}
    assert colocated_layout(_cfg(launch=launch), _place(3, 8, 8)) == ColocatedLayout(1, 8, 2, 4)
    urls = [f"http://n{n}:{30000 + k}" for n in range(2) for k in range(2)]
    assert colocated_layout(_cfg(urls=urls), _place(5, 8, 4)) == ColocatedLayout(2, 4, 2, 2)
    with pytest.raises(SGLangSetupError, match=r"rollout.sglang.launch: .*got 2 x 2 from GPU 0"):
        colocated_layout(_cfg(launch={**launch, "tp_size": 2}), _place(0, 8, 8))
    with pytest.raises(SGLangSetupError, match="base_gpu_id be 0"):
        colocated_layout(_cfg(launch={**launch, "base_gpu_id": 4}), _place(0, 8, 8))
    # the CPU demo at --nproc 2 with its one server: the error says what to set
    cpu = {"model_path": "/m", "device": "cpu", "servers": 1}
    with pytest.raises(SGLangSetupError, match=r"got 1 x 1 from GPU 0; with device cpu: rollout.sglang.launch.servers=2 "
                       r"\(one server per trainer rank\) or rollout.sglang.weight_sync=disk"):
        colocated_layout(_cfg(launch=cpu, release_memory=False), _place(0, 2, 2))
    assert colocated_layout(_cfg(launch={**cpu, "servers": 2}, release_memory=False), _place(1, 2, 2)) == ColocatedLayout(1, 2, 2, 1)
    with pytest.raises(SGLangSetupError, match=r"rollout.sglang.urls: .*got 3 URL\(s\) for 2 node"):
        colocated_layout(_cfg(urls=urls[:3]), _place(0, 8, 4))
    with pytest.raises(SGLangSetupError, match=r"got 3 URL\(s\) for 1 node"):  # 3 servers cannot split 4 GPUs
        colocated_layout(_cfg(urls=urls[:3]), _place(0, 4, 4))
    odd = LaunchEnv(1, 4, 0, 2, 0, 2, "h", 1, "slurm")  # rank 1 as local rank 0 of node 0: not node by node
    with pytest.raises(SGLangSetupError, match="numbered node by node"):
        colocated_layout(_cfg(urls=urls[:2]), odd)


def test_the_sglang_demos_two_rank_command_fits_the_colocated_layout():
    """examples/cpu_demo_sglang.yaml's header shows the 2-process command; its overrides must give every
    rank a server (as first written, 1 server for 2 ranks, the run died at start-up)."""
    from gspo_megatron.trainer.config import load_config

    example = DEMO.with_name("cpu_demo_sglang.yaml")
    header = [line.lstrip("#").strip() for line in example.read_text().splitlines() if line.startswith("#")]
    start = next(i for i, line in enumerate(header) if "--nproc 2" in line)
    words = header[start].rstrip("\\").split()
    while header[start].endswith("\\"):
        start += 1
        words += header[start].split("#")[0].rstrip("\\").split()
    overrides = [w for w in words if "=" in w]
    assert "parallel.expert_parallel=2" in overrides
    cfg = load_config(example, overrides)
    for rank in range(2):
        assert colocated_layout(cfg.rollout.sglang, _place(rank, 2, 2)).servers_per_node == 2

def test_who_launches_and_who_posts():
    launch = _cfg(launch={"model_path": "/m"}, weight_sync="disk", disk_dir="/d")
    assert launching_rank(launch, _place(0, 4, 4)) and not launching_rank(launch, _place(1, 4, 4))
    assert not launching_rank(_cfg(urls=["http://h:1"]), _place(0, 8, 4))
    with pytest.raises(SGLangSetupError, match=r"rollout.sglang.launch: .*one node only, this job has 2.*"
                                               r"rollout.sglang.urls"):
        launching_rank(launch, _place(5, 8, 4))
    for mode, extra in (("disk", {"disk_dir": "/d"}),
                        ("distributed", {"distributed": {"master_address": "h", "master_port": 2}})):
        cfg = _cfg(urls=["http://h:1"], weight_sync=mode, **extra)
        assert [sglang_pushes(cfg, r, 4) for r in range(4)] == [True, False, False, False]
        assert sglang_pushes(cfg, 0, 1)
    tensor = _cfg(urls=["http://h:1"])
    assert all(sglang_pushes(tensor, r, 4) for r in range(4))  # every rank takes part in the gather


def test_attach_config_keeps_the_settings_and_the_model_folder():
    cfg = _cfg(launch={"model_path": "/models/m", "servers": 2}, weight_sync="disk", disk_dir="/d",
               prompts_per_request=3)
    attached = attach_config(cfg, ["http://127.0.0.1:5", "http://127.0.0.1:6"])
    attached.validate("rollout.sglang")  # exactly one of urls / launch
    assert attached.launch is None and attached.urls == ["http://127.0.0.1:5", "http://127.0.0.1:6"]
    assert attached.disk_config_dir == "/models/m" and attached.prompts_per_request == 3
    assert cfg.launch is not None and cfg.urls == []  # the original is unchanged
    keep = _cfg(launch={"model_path": "/models/m"}, disk_config_dir="/cfg")
    assert attach_config(keep, ["http://h:1"]).disk_config_dir == "/cfg"


# ---------------------------------------------------------------------------------------------- 2 ranks

def _fake_python(tmp_path: Path) -> str:
    """An 'interpreter' for launch.python: takes SGLang's `-m sglang.launch_server ... --port P ...` and
    runs the stand-in on P instead."""
    script = tmp_path / "fake_python"
    script.write_text(f"#!{sys.executable}\nimport runpy, sys\nargs = sys.argv[1:]\n"
                      f"sys.argv = [{STANDIN!r}, '--port', args[args.index('--port') + 1], '--lifetime-s', '60']\n"
                      f"runpy.run_path({STANDIN!r}, run_name='__main__')\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


PROMPTS = [[5, 6, 7], [8, 9]]


def connect_worker(rank, world_size, launch_fields: dict, disk_dir: str, tensor_urls: list, pair_urls: list) -> dict:
    import torch.distributed as dist

    from gspo_megatron.rollout.base import SamplingParams
    from gspo_megatron.trainer.rollout_setup import connect_sglang, share_sync_report

    params = SamplingParams(max_new_tokens=3, seed=rank)
    out = {}

    # 1. launch on rank 0 + disk sync posted by rank 0 only
    cfg = _cfg(launch=launch_fields, weight_sync="disk", disk_dir=disk_dir)
    me, engine = connect_sglang(cfg, os.environ)
    out["launch"] = {"urls": [s.url for s in engine.slots], "owns": [s.process is not None for s in engine.slots],
                     "posts": engine.posts_weights}
    for version in (1, 2):
        engine.update_weights([("w", torch.full((4,), float(version)))], final=False)
        engine.update_weights([("v", torch.ones(2))], final=True)
        out["launch"][f"report{version}"] = share_sync_report(engine)
    out["launch"]["version"] = engine.weight_version
    out["launch"]["samples"] = len(engine.generate(PROMPTS, 2, params))
    if rank == 1:  # a rebuild after a failure: rank 1 alone, no collective, attaches again
        engine.shutdown()
        engine = me.build_engine()
        out["launch"]["rebuilt"] = {"urls": [s.url for s in engine.slots], "launch": me.cfg.launch is None,
                                    "samples": len(engine.generate(PROMPTS, 2, params))}
    dist.barrier()  # rank 0 stops the servers it launched only once rank 1 is done with them
    engine.shutdown()
    log_dir = Path(launch_fields["log_dir"])
    out["launch"]["starts"] = sorted(p.read_text().count("===== start") for p in log_dir.glob("*.log"))

    # 2. colocated tensor sync: one TP=2 server fed by both ranks, then two TP=1 servers, one per rank
    for name, urls in (("tp2", tensor_urls), ("pair", pair_urls)):
        me, engine = connect_sglang(_cfg(urls=urls, bucket_bytes=1 << 20), os.environ)
        big = [(f"layer{i}.from_rank{rank}", torch.zeros(150_000)) for i in range(2)]  # 0.6 MB: one per bucket
        engine.update_weights(big, final=True)
        out[name] = {"report": share_sync_report(engine), "leader": me.colocated.is_leader,
                     "server": me.colocated.server_index, "version": engine.weight_version}
        engine.shutdown()
    return out


def _payload_ranks(body) -> list[int]:
    """Which rank serialized each payload (the tensor names carry it)."""
    return [next(r for r in range(2) if f"from_rank{r}".encode() in base64.b64decode(p))
            for p in body["serialized_named_tensors"]]


def test_two_ranks_launch_once_post_once_and_colocate(tmp_path):
    base_port = free_port()
    launch = {"model_path": str(tmp_path / "model"), "servers": 2, "base_port": base_port,
              "log_dir": str(tmp_path / "logs"), "startup_timeout_s": 20.0, "health_poll_s": 0.05,
              "python": _fake_python(tmp_path)}
    with StandinServer(StandinState(tp_size=2)) as tp2, StandinServer() as x, StandinServer() as y:
        runs = run_distributed(connect_worker, 2, (launch, str(tmp_path / "sync"), [tp2.url], [x.url, y.url]),
                               timeout_s=240)
        requests = {"tp2": tp2.bodies("/update_weights_from_tensor"), "x": x.bodies("/update_weights_from_tensor"),
                    "y": y.bodies("/update_weights_from_tensor")}
    urls = [f"http://127.0.0.1:{base_port + i}" for i in range(2)]
    zero, one = runs[0]["launch"], runs[1]["launch"]
    assert zero["urls"] == one["urls"] == urls
    assert zero["owns"] == [True, True] and one["owns"] == [False, False]  # rank 1 attached
    assert zero["posts"] and not one["posts"]
    assert zero["starts"] == [1, 1]  # each server started once: rank 1 never launched, not even on rebuild
    for version in (1, 2):
        assert zero[f"report{version}"] == one[f"report{version}"] == {u: True for u in urls}
    assert zero["version"] == one["version"] == 2 and zero["samples"] == one["samples"] == 4
    assert one["rebuilt"] == {"urls": urls, "launch": True, "samples": 4}
    assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["weights-v2"]  # one writer, v1 cleaned up

    # TP=2 server fed by ranks 0 and 1: one post per bucket (by the leader), payloads in TP order
    assert [r["tp2"]["leader"] for r in runs] == [True, False] and {r["tp2"]["server"] for r in runs} == {0}
    assert len(requests["tp2"]) == 2 and all(_payload_ranks(b) == [0, 1] for b in requests["tp2"])
    assert [b.get("weight_version") for b in requests["tp2"]] == [None, "1"]
    # two TP=1 servers: rank r leads server r and is the only one posting to it
    assert [(r["pair"]["server"], r["pair"]["leader"]) for r in runs] == [(0, True), (1, True)]
    assert [_payload_ranks(b) for b in requests["x"]] == [[0], [0]]
    assert [_payload_ranks(b) for b in requests["y"]] == [[1], [1]]
    assert all(r[k]["report"] == {u: True for u in us} and r[k]["version"] == 1
               for r in runs for k, us in (("tp2", [tp2.url]), ("pair", [x.url, y.url])))


# ---------------------------------------------------------------------------------------------- trainer

SECOND_ROLLOUT_SEED = 424_242


def trainer_worker(rank, world_size, run_dir: str, urls: list, disk_dir: str) -> dict:
    from gspo_megatron.trainer.config import load_config
    from gspo_megatron.trainer.loop import Trainer

    trainer = Trainer(load_config(DEMO, sglang_standin_overrides(urls, disk_dir, "train.steps=1",
                                                           "parallel.expert_parallel=2")), run_dir)
    try:
        metrics = trainer.train_step()
        trainer.step += 1
        # the next step's rollout: it must reach the servers only after they took the step's weights
        batch, _ = trainer.rollouts.rollout(next(trainer.prompts), SECOND_ROLLOUT_SEED + trainer.dp_rank, 2, 1.0, 4)
        return {"posts": trainer.engine.posts_weights, "version": trainer.engine.weight_version,
                "dp_rank": trainer.dp_rank, "dp_size": trainer.dp_size, "reward": metrics["reward_mean"],
                "second": sum(len(g.samples) for g in batch)}
    finally:
        trainer.close()


def _slow_disk_update(real):
    """Takes 0.3 s (a rank that does not wait for the sync would send its next /generate meanwhile) and
    records when the server holds the new weights."""
    return sglang_standin.finishing_late(real, "/update_weights_from_disk")


def test_trainer_step_on_two_ranks_syncs_each_server_once_and_waits_for_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sglang_standin, "update_from_disk", _slow_disk_update(sglang_standin.update_from_disk))
    with StandinServer() as a, StandinServer() as b:
        runs = run_distributed(trainer_worker, 2, (str(tmp_path / "run"), [a.url, b.url], str(tmp_path / "sync")),
                               timeout_s=300)
        logs = {s.url: list(s.state.requests) for s in (a, b)}
    assert [r["posts"] for r in runs] == [True, False] and [r["version"] for r in runs] == [2, 2]
    assert [r["dp_rank"] for r in runs] == [0, 1] and runs[0]["dp_size"] == 2
    assert all(0.0 <= r["reward"] <= 1.0 and r["second"] == 4 * 2 for r in runs)

    # which (rollout, rank) a request belongs to, from its per-sample seeds (seeded requests, G = 8 then 2)
    from gspo_megatron.trainer.schedule.base import step_seed

    # (one call seed per rollout, the same on every rank; samples seeded by their global prompt index: rank r
    # holds prompts 2r and 2r + 1 of the 4)
    owner = {}
    for rank in range(2):
        for phase, base, g in ((1, step_seed(0, 0, 1), 8), (2, SECOND_ROLLOUT_SEED + rank, 2)):
            owner.update({sample_seed(base, i, j): (phase, rank) for i in (2 * rank, 2 * rank + 1) for j in range(g)})
    seen = set()
    for url, log in logs.items():
        updates = [i for i, (p, _) in enumerate(log) if p == "/update_weights_from_disk"]
        done = [i for i, (p, _) in enumerate(log) if p == "done /update_weights_from_disk"]
        # one complete sync per sync point (Trainer init, then the step), not one per rank
        assert len(updates) == len(done) == 2, (url, [p for p, _ in log])
        assert [log[i][1]["weight_version"] for i in updates] == ["1", "2"]
        assert Path(log[updates[0]][1]["model_path"]).name == "weights-v1"
        for i, (path, body) in enumerate(log):
            if path != "/generate":
                continue
            phases = {owner[sp["sampling_seed"]] for sp in body["sampling_params"]}
            assert len(phases) == 1, phases
            phase, rank = phases.pop()
            seen.add((phase, rank))
            # every rollout reaches a server only after that server holds the weights it is meant for
            assert done[phase - 1] < i, (url, phase, rank, [p for p, _ in log])
            if phase == 1:
                assert i < updates[1]
    assert seen == {(1, 0), (1, 1), (2, 0), (2, 1)}  # both ranks generated through the servers, both times


def overlap_worker(rank, world_size, run_dir: str, urls: list, disk_dir: str) -> dict:
    from gspo_megatron.trainer.config import load_config
    from gspo_megatron.trainer.loop import Trainer

    trainer = Trainer(load_config(DEMO, sglang_standin_overrides(urls, disk_dir, "train.steps=3",
                                                           "train.rollout_mode=overlap")), run_dir)
    try:
        ages, hidden = [], []
        for _ in range(3):
            metrics = trainer.train_step()
            trainer.step += 1
            ages.append(metrics["staleness"])
            hidden.append("overlap_hidden_frac" in metrics)
        return {"ages": ages, "hidden": hidden, "version": trainer.engine.weight_version,
                "ahead": [f.step for f in trainer.driver.inner.ahead.queue]}
    finally:
        trainer.close()


def _slow_generate(real):
    """A /generate that records when it finished, and takes 0.8 s for rank 1's prompts (global indices 2 and 3 of
    each step's 4, told by their sample seeds) and 0.05 s for rank 0's: rank 0 is ready to post weights while
    rank 1's generation still runs on the shared servers."""
    from gspo_megatron.trainer.schedule.base import step_seed

    rank1 = {sample_seed(step_seed(0, step, 1), i, j) for step in range(5) for i in (2, 3) for j in range(8)}
    return sglang_standin.finishing_late(
        real, "/generate", lambda body: 0.8 if {sp["sampling_seed"] for sp in body["sampling_params"]} & rank1 else 0.05)


def test_overlapped_rollouts_with_sglang_on_two_ranks(tmp_path, monkeypatch):
    """train.rollout_mode: overlap with SGLang (stand-in servers, disk sync, DP=2): the next step's batch is
    generated while the trainer trains (one update old from step 1 on), and no server takes new weights while
    a generation of either rank is still running on it."""
    monkeypatch.setattr(sglang_standin, "fake_generate", _slow_generate(sglang_standin.fake_generate))
    monkeypatch.setattr(sglang_standin, "update_from_disk", _slow_disk_update(sglang_standin.update_from_disk))
    with StandinServer() as a, StandinServer() as b:
        runs = run_distributed(overlap_worker, 2, (str(tmp_path / "run"), [a.url, b.url], str(tmp_path / "sync")),
                               timeout_s=300)
        logs = {s.url: [p for p, _ in s.state.requests] for s in (a, b)}
    for run in runs:
        assert run["ages"] == [0.0, 1.0, 1.0] and all(run["hidden"])
        assert run["version"] == 4 and run["ahead"] == [3]  # the initial sync and one per step; step 3 is generating
    for url, log in logs.items():
        updates = [i for i, p in enumerate(log) if p == "/update_weights_from_disk"]
        assert len(updates) == 4, (url, log)
        for u in updates:
            assert log[:u].count("/generate") == log[:u].count("done /generate"), (url, log)
        assert log.count("/generate") > 0
