"""Reward worker process: ``python -c "from gspo_megatron.rewards.worker import main; main(r, w)"``.

Started by ``RewardPool`` as a fresh interpreter (never forked from the trainer, so no torch, CUDA or
torch.distributed state is inherited and the trainer's ``__main__`` is not re-imported). It talks to
the pool over two pipes with ``multiprocessing.connection`` framing:

  pool -> worker: ("init", RewardConfig, sys.path) once; then ("task", task_id, term_index, items,
                  timeout_s) or ("close",)
  worker -> pool: ("ready", [(is_async, batched) per term]) or ("init_error", traceback);
                  per task of a synchronous per-response term: ("item", task_id, position, Outcome) as
                  each response is scored (the pool restarts its timeout clock on each), then
                  ("done", task_id, []); for async or batched terms ("done", task_id, [Outcome, ...])
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection


def _exit_when_orphaned(parent_pid: int) -> None:
    """A worker stuck in a reward function would outlive a killed trainer; this thread ends it."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def main(read_fd: int, write_fd: int, death_parent: int | None = None) -> None:
    """death_parent: the pool's pid when the kernel should kill this worker with it (processes.py)."""
    if death_parent is not None:
        from gspo_megatron.processes import die_with_parent

        die_with_parent(death_parent)
    inbox = Connection(read_fd, writable=False)
    outbox = Connection(write_fd, readable=False)
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    _, cfg, sys_path = inbox.recv()
    sys.path[:] = sys_path  # the trainer's import path, so custom reward modules resolve the same way
    try:
        from gspo_megatron.rewards.terms import build_terms, evaluate

        terms = build_terms(cfg)
    except BaseException:  # reported to the pool, which raises it at start-up
        outbox.send(("init_error", traceback.format_exc()))
        return
    outbox.send(("ready", [(t.is_async, t.batched) for t in terms]))
    while True:
        try:
            message = inbox.recv()
        except EOFError:
            return  # the pool is gone
        if message[0] == "close":
            return
        _, task_id, term_index, items, timeout_s = message
        term = terms[term_index]
        if term.is_async or term.batched:
            outbox.send(("done", task_id, evaluate(term, items, timeout_s)))
            continue
        for position, item in enumerate(items):
            outbox.send(("item", task_id, position, evaluate(term, [item], timeout_s)[0]))
        outbox.send(("done", task_id, []))
