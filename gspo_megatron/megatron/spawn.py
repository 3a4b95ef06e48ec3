"""Run a function on N spawned processes joined in one gloo (CPU) / NCCL (GPU) process group.

Used by `convert check`, `gspo-megatron smoke`, the distributed tests and benchmarks: ``run_distributed(fn, 2, args)`` returns the per-rank return
values of ``fn(rank, world_size, *args)`` and, when any rank fails, raises with that rank's traceback.
One spawn should serve many checks (spawning costs a torch import per process), so a worker usually
returns a dict of named results that several tests then assert on.
"""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from gspo_megatron.reporting import quiet_known_warnings


class DistributedRunError(RuntimeError):
    """One or more ranks raised, or a rank died / timed out."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world_size: int, port: int, out_dir: str, payload: bytes) -> None:
    # A spawned process starts with Python's default warning filters, and unpickling ``fn`` imports Megatron,
    # which warns at import: so ``fn`` and its arguments travel as bytes, unpickled after the filters are in.
    quiet_known_warnings()
    fn, args = pickle.loads(payload)
    from gspo_megatron.megatron import parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)  # two ranks on two cores: oversubscription makes gloo runs several times slower
    out = Path(out_dir) / f"rank{rank}.pt"
    try:
        parallel.init_process_group(rank, world_size, master_port=port, timeout_s=300)
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, out)
    except BaseException:  # report any failure of the user function to the parent, then exit non-zero
        torch.save({"ok": False, "traceback": traceback.format_exc()}, out)
        raise
    finally:
        parallel.destroy()


def run_distributed(fn: Callable, world_size: int = 2, args: tuple = (), timeout_s: float = 600) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the results by rank."""
    with tempfile.TemporaryDirectory(prefix="gspo-dist-") as out_dir:
        ctx = mp.get_context("spawn")
        port = free_port()
        payload = pickle.dumps((fn, args))
        procs = [ctx.Process(target=_child, args=(r, world_size, port, out_dir, payload), daemon=False)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results, failures = [], []
        for rank in range(world_size):
            path = Path(out_dir) / f"rank{rank}.pt"
            if not path.exists():
                reason = "timed out" if rank in hung else f"died with exit code {procs[rank].exitcode}"
                failures.append(f"rank {rank} {reason} without a result")
                results.append(None)
                continue
            record = torch.load(path, weights_only=False)
            if record["ok"]:
                results.append(record["result"])
            else:
                failures.append(f"rank {rank} raised:\n{record['traceback']}")
                results.append(None)
        if failures:
            raise DistributedRunError("\n".join(failures))
        return results
