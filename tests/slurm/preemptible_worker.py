"""A stand-in for a trainer rank under preemption: it installs PreemptionFlag, says it is ready, "trains"
until the flag is raised, then "checkpoints" (writes OUT_DIR/rank<r>.json) and exits 0. Without a
signal within 60 s it exits 1, so a lost signal fails the test instead of hanging it.

Usage: python -m tests.slurm.preemptible_worker OUT_DIR
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from gspo_megatron.trainer.launch_env import resolve_launch
from gspo_megatron.trainer.preemption import PreemptionFlag
from tests.slurm.cluster import write_json_atomic

WAIT_FOR_SIGNAL_S = 60.0


def main(out_dir: Path) -> int:
    launch = resolve_launch(os.environ)
    with PreemptionFlag() as flag:
        (out_dir / f"ready{launch.rank}").write_text(str(os.getpid()))
        deadline = time.monotonic() + WAIT_FOR_SIGNAL_S
        steps = 0
        while not flag.requested and time.monotonic() < deadline:
            time.sleep(0.05)
            steps += 1
        write_json_atomic(out_dir / f"rank{launch.rank}.json", {
            "launcher": launch.launcher,
            "world_size": launch.world_size,
            "signal": flag.signal_name,
            "steps": steps,
            "restart_count": os.environ.get("SLURM_RESTART_COUNT"),
        })
        return 0 if flag.requested else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
