"""One run per run directory, and one process tree per run at a time.

* A fresh ``train`` (no ``--resume``) refuses a run directory that already holds something: it would mix
  the old run's checkpoints and metrics with the new run's. (We refuse rather than pick a new numbered
  folder: the user named the folder, scripts read it, and a silent ``run_dir.1`` would hide the mistake.)
* ``--resume`` continues the run the directory holds (its newest complete checkpoint; a run that saved none
  yet starts from its beginning). A directory that holds no run (missing, empty: a mistyped ``--run-dir``)
  is refused, naming the runs beside it, rather than silently starting a new run.
* ``--resume-or-start`` continues the run the directory holds, or starts it when there is none: a Slurm job
  passes it, so its first start and every requeue (before the first checkpoint too) run the same line.
* While a run uses the directory, ``RUN_DIR/.lock`` names its main process (pid, host, boot id and start
  time). A second ``train`` on the directory is refused naming the holder; a lock whose holder is gone (same
  host; the pid not running, or now another process's) is taken over with a warning.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import time
from pathlib import Path

from gspo_megatron.processes import pid_running, process_identity

LOCK_NAME = ".lock"
# what ``gspo_megatron.api.train`` writes before the run starts (its config and rows): a fresh run may hold it
INPUTS_DIR = "inputs"


class RunDirError(ValueError):
    """The run directory cannot be used for this run; the message names the folder and what to do."""


class RunDirLock:
    """``RUN_DIR/.lock``: {"pid", "host", "since"} of the process that holds the run directory."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_NAME
        self.held = False

    def _write_exclusive(self) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                       "process": process_identity(os.getpid())}, f)
        return True

    def holder(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}  # removed meanwhile, or half written by a holder that died in between

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a takeover races only with another takeover: one O_EXCL create wins
            if self._write_exclusive():
                self.held = True
                atexit.register(self.release)  # also after a failed set-up; SIGKILL leaves a stale lock
                return
            holder = self.holder()
            pid, host = holder.get("pid"), holder.get("host")
            same_host = host == socket.gethostname()
            if pid is not None and (not same_host or (pid != os.getpid() and self._holder_alive(holder))):
                where = f"pid {pid} on {host}"
                hint = ("" if same_host else f"; if that process is gone, delete {self.path}")
                raise RunDirError(f"{self.path.parent}: in use by another run ({where}, lock file {self.path}){hint}")
            print(f"warning: {self.path}: taking over the stale lock of pid {pid} on {host} (not running)",
                  file=sys.stderr, flush=True)
            self.path.unlink(missing_ok=True)
        raise RunDirError(f"{self.path}: could not take the lock (another process keeps replacing it)")

    @staticmethod
    def _holder_alive(holder: dict) -> bool:
        """Whether the lock's process still runs on this host: its pid, and (locks written since) the same
        process, not another one that got the pid after a reboot or a wrap-around."""
        pid = int(holder["pid"])
        if "process" not in holder:
            return pid_running(pid)
        return process_identity(pid) == holder["process"]

    def release(self) -> None:
        """Remove the lock file if this process holds it (idempotent)."""
        if self.held and self.holder().get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)
        self.held = False


def check_fresh_start(run_dir: Path) -> None:
    """A fresh run needs an empty (or missing) run directory; the lock file and ``inputs/`` aside."""
    if not run_dir.is_dir():
        return
    contents = sorted(p.name for p in run_dir.iterdir() if p.name not in (LOCK_NAME, INPUTS_DIR))
    if contents:
        shown = ", ".join(contents[:5]) + (f" (+{len(contents) - 5} more)" if len(contents) > 5 else "")
        raise RunDirError(f"{run_dir}: holds an earlier run ({shown}); pass --resume to continue it, or choose "
                          f"another --run-dir (or delete that folder)")


def holds_a_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a run: its config.yaml (written once a run's set-up succeeded) or checkpoints."""
    return (run_dir / "config.yaml").is_file() or (run_dir / "checkpoints").is_dir()


def check_resume_target(run_dir: Path) -> None:
    """``--resume`` continues an existing run: refuse a folder that holds none, naming the runs beside it."""
    if holds_a_run(run_dir):
        return
    parent = run_dir.parent
    runs = sorted(str(p) for p in parent.iterdir() if p.is_dir() and holds_a_run(p)) if parent.is_dir() else []
    beside = (f"; runs in {parent}: {', '.join(runs[:10])}" + (f" (+{len(runs) - 10} more)" if len(runs) > 10 else "")
              if runs else f"; no run in {parent}")
    what = "no such folder" if not run_dir.exists() else "holds no run (no config.yaml, no checkpoints)"
    raise RunDirError(f"--resume: {run_dir}: {what}{beside}. To start a new run there drop --resume; a job that "
                      "starts or continues the same run (a Slurm requeue) passes --resume-or-start")


def claim(run_dir: Path, resume: bool) -> RunDirLock:
    """Lock ``run_dir`` for this run and check that a fresh start does not reuse an earlier run's folder."""
    lock = RunDirLock(run_dir)
    lock.acquire()
    if not resume:
        try:
            check_fresh_start(run_dir)
        except RunDirError:
            lock.release()
            raise
    return lock


def on_main_rank(fn, is_main: bool):
    """Run ``fn`` on the main rank only and raise its ``ValueError`` on every rank (the other ranks would
    otherwise wait forever in the next collective). Returns fn's result on the main rank, else None."""
    import torch.distributed as dist

    result, error = None, None
    if is_main:
        try:
            result = fn()
        except ValueError as err:  # a bad-input error: every rank reports it
            error = err
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None and error is None:
            raise RunDirError(box[0].split(": ", 1)[1])
    if error is not None:
        raise error
    return result


__all__ = ["INPUTS_DIR", "LOCK_NAME", "RunDirError", "RunDirLock", "check_fresh_start", "check_resume_target",
           "claim", "holds_a_run", "on_main_rank"]
