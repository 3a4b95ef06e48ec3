"""A handle on the local Slurm cluster (tools/slurm/local_cluster.sh) and ``submit_and_wait`` for tests.

The session fixture ``slurm_cluster`` in conftest.py builds a ``LocalSlurm``; tests (and the trainer-level
Slurm tests) submit through it so every job sees the same clean environment: ``SLURM_CONF`` pointing at
the local cluster, the repository on ``PYTHONPATH``, and none of the launch variables (``SLURM_*``,
``RANK``, ``MASTER_ADDR``...) of whatever process runs pytest, which could itself be a Slurm job.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = REPO_ROOT / "tools" / "slurm" / "local_cluster.sh"
EXIT_CANNOT_INSTALL = 3  # local_cluster.sh: Slurm is missing and cannot be installed here

_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                     "MASTER_ADDR", "MASTER_PORT")


class SlurmJobTimeout(RuntimeError):
    """A job did not finish in time; it has been cancelled."""


@dataclasses.dataclass(frozen=True)
class LocalSlurm:
    conf: Path
    python: str = sys.executable

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for Slurm client commands (and, through sbatch's --export=ALL, for jobs)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in _LAUNCH_VARIABLES}
        env["SLURM_CONF"] = str(self.conf)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env["GSPO_PYTHON"] = self.python
        env.update(extra or {})
        return env

    def run(self, args: Sequence[str], *, check: bool = True, timeout_s: float = 60) -> subprocess.CompletedProcess:
        """A Slurm client command (``scontrol``, ``squeue``, ``scancel`` ...) against this cluster."""
        return subprocess.run(list(args), env=self.env(), capture_output=True, text=True, check=check,
                              timeout=timeout_s)

    def job_info(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (``JobState``, ``ExitCode`` ``"1:0"``, ``Restarts`` ...).

        No accounting daemon runs here, so ``sacct`` has nothing; scontrol keeps a finished job for
        MinJobAge (300 s by default).
        """
        out = self.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))


def _sbatch_command(script_or_wrap: Path | str, args: Sequence[str], options: Sequence[str]) -> list[str]:
    cmd = ["sbatch", "--parsable", *options]
    if isinstance(script_or_wrap, Path):
        return cmd + [str(script_or_wrap), *args]
    if args:
        raise ValueError("args go with a script Path, not with a --wrap command")
    return cmd + ["--wrap", script_or_wrap]


def _job_id(sbatch_stdout: str) -> int:
    # --parsable prints "<id>" or "<id>;<cluster>" as soon as the job is queued.
    match = re.match(r"(\d+)", sbatch_stdout)
    if match is None:
        raise RuntimeError(f"sbatch did not print a job id: {sbatch_stdout!r}")
    return int(match.group(1))


def submit(cluster: LocalSlurm, script_or_wrap: Path | str, *, args: Sequence[str] = (),
           options: Sequence[str] = (), env: Mapping[str, str] | None = None, cwd: Path | None = None) -> int:
    """Queue a job and return its id at once (for tests that act on a running job)."""
    proc = subprocess.run(_sbatch_command(script_or_wrap, args, options), env=cluster.env(env), cwd=cwd or REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"sbatch failed ({proc.returncode}): {proc.stderr}")
    return _job_id(proc.stdout)


def submit_and_wait(cluster: LocalSlurm, script_or_wrap: Path | str, *, args: Sequence[str] = (),
                    options: Sequence[str] = (), env: Mapping[str, str] | None = None,
                    cwd: Path | None = None, timeout_s: float = 120) -> tuple[int, int]:
    """Submit a job with ``sbatch --wait`` and return ``(exit_code, job_id)``.

    script_or_wrap: a ``Path`` is a batch script (``args`` follow it); a ``str`` is a shell command run
        with ``--wrap``. options: more sbatch options (``--ntasks=2``, ``--output=...``). The job starts in
        ``cwd`` (default the repository root), with ``cluster.env(env)`` as its environment.
    exit_code: sbatch's own exit status, which with --wait is the job's exit code.
    On ``timeout_s`` the job is cancelled and ``SlurmJobTimeout`` raised.
    """
    cmd = _sbatch_command(script_or_wrap, args, ["--wait", *options])
    proc = subprocess.Popen(cmd, env=cluster.env(env), cwd=cwd or REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    # The id comes before --wait blocks.
    first_line = proc.stdout.readline()
    if not first_line:
        proc.wait(timeout=30)
        raise RuntimeError(f"sbatch failed ({proc.returncode}): {proc.stderr.read()}")
    job_id = _job_id(first_line)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        cluster.run(["scancel", str(job_id)], check=False)
        proc.kill()
        proc.wait()
        raise SlurmJobTimeout(f"job {job_id} not finished after {timeout_s} s (cancelled): {cmd}") from None
    proc.stdout.close()
    proc.stderr.close()
    return proc.returncode, job_id


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.2) -> None:
    """Poll ``condition`` until it holds; ``TimeoutError`` naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"after {timeout_s} s still waiting for {what}")
        time.sleep(poll_s)


def write_json_atomic(path: Path, payload: object) -> None:
    """Workers' results: written to a temporary name and renamed, so a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, sort_keys=True))
    tmp.rename(path)
