"""SGLang rollout engines for several trainer ranks: who launches the servers, who posts the weights,
which ranks feed which server (docs/rollout.md, "Several trainer ranks").

Every trainer rank holds an SGLangEngine over *all* servers and generates its data-parallel share
through them. What differs by rank:

- Servers: with ``rollout.sglang.urls`` every rank attaches. With ``rollout.sglang.launch`` (one node
  only) global rank 0 launches and owns them and broadcasts their URLs; the other ranks attach to those
  URLs. A rebuild after a failure (EngineSupervisor.generate, on the failed ranks only) repeats what that rank did
  first, without a collective: rank 0 launches again (same ports, so the URLs stay valid), others attach.
- Weights (every rank runs the export collective and receives the same buckets):
  * ``disk`` / ``distributed``: global rank 0 posts (one checkpoint writer; rank 0 of the NCCL group);
    the other ranks' engines are followers (``posts_weights=False``) that drop the buckets.
  * ``tensor``: colocated. Trainer local rank r feeds server ``r // g`` of its node as that server's TP
    rank ``r % g`` (g = GPUs per server); position 0 is the leader, which gathers its server's payloads
    (``ColocatedSync`` + ``gather_to_leader`` over one group per server) and posts them.
- After every sync ``share_sync_report`` merges the posters' {url: holds the new weights} on every rank.
  It is also the barrier: no rank starts the next rollout before the posters are done.

The placement functions are pure (tested without processes); ``connect_sglang`` and
``share_sync_report`` are collectives over the default group.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from gspo_megatron.megatron.device import cuda_present
from gspo_megatron.rollout.sglang.config import SGLangConfig
from gspo_megatron.rollout.sglang.engine import ColocatedSync, SGLangEngine, ack_from_leader, gather_to_leader
from gspo_megatron.trainer.launch_env import LaunchEnv, resolve_launch

PATH = "rollout.sglang"


class SGLangSetupError(ValueError):
    """The SGLang settings do not fit the trainer's ranks; the message names the field."""


# ---------------------------------------------------------------------------------------------- pure


def launching_rank(cfg: SGLangConfig, place: LaunchEnv) -> bool:
    """Whether this rank starts the servers: global rank 0, and only when ``launch`` is set (one node)."""
    if cfg.launch is not None and place.num_nodes > 1:
        raise SGLangSetupError(
            f"{PATH}.launch: launching servers from the trainer works on one node only, this job has "
            f"{place.num_nodes}; start the servers on every node beforehand and set {PATH}.urls "
            f"(examples/slurm/qwen3_30b_a3b_gspo_multinode.sbatch does)")
    return cfg.launch is not None and place.rank == 0


def sglang_pushes(cfg: SGLangConfig, rank: int, world_size: int) -> bool:
    """Whether this rank's engine takes part in posting weights. One rank alone feeds everything; with
    several, disk and distributed syncs are posted by global rank 0, tensor syncs by every rank through
    its server's ColocatedSync (whose leader posts)."""
    return world_size == 1 or cfg.weight_sync == "tensor" or rank == 0


def attach_config(cfg: SGLangConfig, urls: list[str]) -> SGLangConfig:
    """The config of a rank that attaches to servers another rank launched: same settings, ``urls``
    instead of ``launch``; config.json (disk checkpoints, routed-expert shapes) still comes from the
    launched model's folder."""
    config_dir = cfg.disk_config_dir or (cfg.launch.model_path if cfg.launch is not None else "")
    return dataclasses.replace(cfg, urls=list(urls), launch=None, disk_config_dir=config_dir)


@dataclasses.dataclass(frozen=True)
class ColocatedLayout:
    """Servers per node and GPUs (TP ranks) per server of a colocated tensor sync."""

    num_nodes: int
    local_world_size: int
    servers_per_node: int
    gpus_per_server: int

    def groups(self) -> list[tuple[int, ...]]:
        """Global ranks feeding each server, servers in URL order (node-major, as the sbatch example lists
        them): server ``n*S + k`` <- ranks ``n*L + k*g + j`` for TP rank j = 0..g-1; the leader is first."""
        L, S, g = self.local_world_size, self.servers_per_node, self.gpus_per_server
        return [tuple(n * L + k * g + j for j in range(g)) for n in range(self.num_nodes) for k in range(S)]

    def place(self, node_rank: int, local_rank: int) -> tuple[int, int]:
        """(server index, position = TP rank) of the trainer rank at ``local_rank`` on node ``node_rank``."""
        g = self.gpus_per_server
        return node_rank * self.servers_per_node + local_rank // g, local_rank % g


def colocated_layout(cfg: SGLangConfig, place: LaunchEnv) -> ColocatedLayout:
    """Check that every trainer rank pairs with exactly one server GPU of its node and return the layout."""
    L = place.local_world_size
    if place.rank != place.node_rank * L + place.local_rank or place.world_size != place.num_nodes * L:
        raise SGLangSetupError(
            f"{PATH}.weight_sync: 'tensor' with several ranks needs {L} ranks on every node numbered node by "
            f"node (torchrun's order); rank {place.rank} is local rank {place.local_rank} of node {place.node_rank} "
            f"in a world of {place.world_size} on {place.num_nodes} node(s)")
    if cfg.launch is not None:
        launch = cfg.launch
        if launch.servers * launch.tp_size != L or launch.base_gpu_id != 0:
            # CPU servers have tp_size 1, so the fix there is one server per rank (or disk sync, one poster)
            hint = (f"; with device cpu: {PATH}.launch.servers={L} (one server per trainer rank) or "
                    f"{PATH}.weight_sync=disk" if launch.device == "cpu" else "")
            raise SGLangSetupError(
                f"{PATH}.launch: weight_sync 'tensor' with several ranks pairs trainer local rank r with GPU r of "
                f"a server, so servers x tp_size must equal the {L} trainer ranks of the node and base_gpu_id be 0; "
                f"got {launch.servers} x {launch.tp_size} from GPU {launch.base_gpu_id}{hint}")
        return ColocatedLayout(place.num_nodes, L, launch.servers, launch.tp_size)
    n = len(cfg.urls)
    per_node = n // place.num_nodes
    if n % place.num_nodes or per_node == 0 or L % per_node:
        raise SGLangSetupError(
            f"{PATH}.urls: weight_sync 'tensor' with several ranks needs the same number of servers on every "
            f"node, listed node by node, each on an equal share of the node's {L} trainer GPUs; got {n} URL(s) "
            f"for {place.num_nodes} node(s)")
    return ColocatedLayout(place.num_nodes, L, per_node, L // per_node)


def launch_wait_s(cfg: SGLangConfig) -> float:
    """How long the other ranks wait for rank 0's launch: the servers' start-up timeout (they start
    concurrently), the server-info reads after it, and a margin; always longer than the launch may take."""
    return cfg.launch.startup_timeout_s + cfg.admin_timeout_s * (cfg.max_retries + 1) + 120.0


def this_host_names() -> set[str]:
    """Names and addresses under which a server URL points at this node."""
    names = {"localhost", "127.0.0.1", "0.0.0.0", "::1", socket.gethostname(), socket.getfqdn()}
    _, aliases, addresses = socket.gethostbyname_ex(socket.gethostname())
    return names | set(aliases) | set(addresses)


def check_sync_placement(cfg: SGLangConfig, engine: SGLangEngine, trainer_gpu: int, host_names: set[str]) -> None:
    """Distributed sync puts trainer rank 0 and every server GPU in one NCCL group; NCCL refuses two ranks
    on one GPU ("Duplicate GPU detected", ncclInvalidUsage). Servers on the trainer's GPUs take CUDA IPC
    (weight_sync 'tensor'). Run on trainer rank 0, whose GPU is ``trainer_gpu`` of this node."""
    if cfg.weight_sync != "distributed":
        return
    clash = [s.url for s in engine.slots
             if urlparse(s.url).hostname in host_names and trainer_gpu in s.info.gpus()]
    if clash:
        raise SGLangSetupError(
            f"{PATH}.weight_sync: 'distributed' would put trainer rank 0 (GPU {trainer_gpu}) and {clash} on one GPU "
            f"in one NCCL group, which NCCL refuses; use weight_sync 'tensor' for servers on the trainer's GPUs "
            f"('distributed' is for servers on GPUs of their own)")


def _trainer_gpu() -> int:
    """This process's GPU as the node numbers it (what a server's --base-gpu-id counts in)."""
    index = torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    return int(ids[index]) if ids and all(v.isdigit() for v in ids) else index


def _checked(rank: "SGLangRank", engine: SGLangEngine) -> tuple["SGLangRank", SGLangEngine]:
    # device branch: the placement rule compares GPU indices; CPU servers share no device with the trainer
    if rank.posts_weights and cuda_present():
        check_sync_placement(rank.cfg, engine, _trainer_gpu(), this_host_names())
    return rank, engine


# ---------------------------------------------------------------------------------------------- ranks


@dataclasses.dataclass(frozen=True)
class SGLangRank:
    """How this rank builds its engine; made once by connect_sglang, reused by every rebuild."""

    cfg: SGLangConfig  # the launch config on the launching rank, else an attach config
    posts_weights: bool
    colocated: ColocatedSync | None

    def build_engine(self) -> SGLangEngine:
        """A fresh engine as this rank built its first one; local (no collective), so a failed rank can
        rebuild alone."""
        return SGLangEngine.from_config(self.cfg, colocated=self.colocated, posts_weights=self.posts_weights)


def write_dummy_model_dir(cfg: SGLangConfig, model_config: Any) -> Path | None:
    """With ``launch.load_format: dummy`` and a ``launch.model_path`` without config.json, write the
    trainer's model config there (config.json, generation_config.json): the servers then start from random
    weights of the right shapes and the trainer's first sync (before any rollout) gives them the real ones,
    so a model built from ``model.config`` (the CPU demo) needs no Hugging Face folder. An existing
    config.json is used as it is. Returns the folder written, or None."""
    launch = cfg.launch
    if launch is None or launch.load_format != "dummy" or model_config is None:
        return None
    folder = Path(launch.model_path)
    if (folder / "config.json").is_file():
        return None
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "config.json.tmp"
    tmp.write_text(json.dumps(model_config.to_hf_dict(), indent=1))
    transformers.GenerationConfig.from_model_config(model_config.to_hf_config()).save_pretrained(folder)
    os.replace(tmp, folder / "config.json")
    return folder


def connect_sglang(cfg: SGLangConfig, environ: Mapping[str, str],
                   model_config: Any = None) -> tuple[SGLangRank, SGLangEngine]:
    """Build this rank's engine (see the module docstring). With several ranks a collective over the
    default group (every rank calls it at the same point); the node layout comes from the launch
    environment ``environ`` (trainer/launch_env.py: torchrun's or srun's variables). ``model_config``
    (the trainer's ModelConfig) fills a dummy launch's empty model folder (write_dummy_model_dir)."""
    if dist.get_world_size() == 1 or dist.get_rank() == 0:
        write_dummy_model_dir(cfg, model_config)
    if dist.get_world_size() == 1:
        rank = SGLangRank(cfg, posts_weights=True, colocated=None)
        return _checked(rank, rank.build_engine())
    place = resolve_launch(environ)
    if (place.rank, place.world_size) != (dist.get_rank(), dist.get_world_size()):
        raise SGLangSetupError(f"the launch environment says rank {place.rank} of {place.world_size}, "
                               f"torch.distributed says {dist.get_rank()} of {dist.get_world_size()}")
    launches = launching_rank(cfg, place)
    colocated = None
    if cfg.weight_sync == "tensor":
        layout = colocated_layout(cfg, place)
        server, position = layout.place(place.node_rank, place.local_rank)
        # new_group is collective over the whole world: every rank creates every group, in one order.
        groups = [dist.new_group(list(ranks)) for ranks in layout.groups()]
        leader = layout.groups()[server][0]
        colocated = ColocatedSync(server, position == 0, gather_to_leader(groups[server], leader),
                                  ack_from_leader(groups[server], leader))
    posts = sglang_pushes(cfg, place.rank, place.world_size)
    if cfg.launch is None:
        rank = SGLangRank(cfg, posts, colocated)
        return _checked(rank, rank.build_engine())
    # The URLs travel over a gloo group of their own whose timeout outlasts the launch (the default group's
    # is the trainer's collective timeout, shorter than loading a large model and capturing CUDA graphs).
    wait = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=launch_wait_s(cfg)))
    if launches:
        return _checked(*_launch_and_share(SGLangRank(cfg, posts, colocated), wait))
    box: list[dict | None] = [None]
    dist.broadcast_object_list(box, src=0, group=wait)
    if "error" in box[0]:
        raise SGLangSetupError(f"rank 0 could not launch the SGLang servers ({PATH}.launch): {box[0]['error']}")
    rank = SGLangRank(attach_config(cfg, box[0]["urls"]), posts, colocated)
    return _checked(rank, rank.build_engine())


def _launch_and_share(rank: SGLangRank, group) -> tuple[SGLangRank, SGLangEngine]:
    """On global rank 0: launch, then broadcast the servers' URLs, or the launch error so that the other
    ranks stop with it instead of waiting for URLs that never come."""
    try:
        engine = rank.build_engine()
    except Exception as err:
        dist.broadcast_object_list([{"error": f"{type(err).__name__}: {err}"}], src=0, group=group)
        raise
    dist.broadcast_object_list([{"urls": [s.url for s in engine.slots]}], src=0, group=group)
    return rank, engine


def share_sync_report(engine: SGLangEngine) -> dict[str, bool]:
    """After every rank's part of a sync: merge the posters' sync_report and adopt it on every rank.
    All-gather semantics make it the barrier that keeps any rank from generating before the servers hold
    the new weights. Returns the merged report {url: holds the new weights}."""
    reports: list[dict[str, bool] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, engine.sync_report())
    merged: dict[str, bool] = {}
    for report in reports:
        merged.update(report)
    engine.adopt_sync_report(merged)
    return merged


__all__ = ["ColocatedLayout", "SGLangRank", "SGLangSetupError", "attach_config", "check_sync_placement",
           "colocated_layout", "connect_sglang", "launch_wait_s", "launching_rank", "share_sync_report",
           "write_dummy_model_dir",
           "sglang_pushes", "this_host_names"]
