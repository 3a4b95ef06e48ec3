"""One task of the 2-task Slurm job in test_local_slurm.py: find its rank from the environment Slurm
set, join a gloo process group through env:// and all-reduce; write what it saw to OUT_DIR/rank<r>.json.

Usage: python -m tests.slurm.gloo_worker OUT_DIR
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from gspo_megatron.trainer.launch_env import export_for_torch, resolve_launch
from tests.slurm.cluster import write_json_atomic


def main(out_dir: Path) -> None:
    launch = resolve_launch(os.environ)
    os.environ.update(export_for_torch(launch, os.environ))
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
    value = torch.tensor([float(launch.rank + 1)])
    dist.all_reduce(value)
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, launch.rank)
    write_json_atomic(out_dir / f"rank{launch.rank}.json", {
        "launch": dataclasses.asdict(launch),
        "torch_rank": dist.get_rank(),
        "torch_world_size": dist.get_world_size(),
        "all_reduce_sum": value.item(),
        "gathered_ranks": ranks,
        "job_id": int(os.environ["SLURM_JOB_ID"]),
    })
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
