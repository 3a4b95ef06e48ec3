"""A handle on the local Slurm cluster (tools/slurm/local_cluster.sh) and ``submit_and_wait`` for tests.

The session fixture ``slurm_cluster`` in conftest.py builds a ``LocalSlurm``; tests (and the trainer-level
Slurm tests) submit through it so every job sees the same clean environment: ``SLURM_CONF`` pointing at
the local cluster, the repository on ``PYTHONPATH``, and none of the launch variables (``SLURM_*``,
``RANK``, ``MASTER_ADDR``...) of whatever process runs pytest, which could itself be a Slurm job.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import pytest


@contextlib.contextmanager
def teardown_on_sigterm() -> Iterator[None]:
    """While a cluster runs, SIGTERM and SIGHUP to pytest (a CI timeout, a closed terminal) raise
    KeyboardInterrupt: pytest then unwinds like after Ctrl-C and runs the fixtures' teardowns, which stop the
    daemons and remove the network namespaces. Killed by the default action, it used to leave them running."""
    def interrupt(signum: int, _frame) -> None:
        raise KeyboardInterrupt(f"pytest got {signal.Signals(signum).name}: stopping the Slurm test clusters")

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

REPO_ROOT = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = REPO_ROOT / "tools" / "slurm" / "local_cluster.sh"
EXIT_CANNOT_INSTALL = 3  # local_cluster.sh: Slurm is missing and cannot be installed here
EXIT_NO_NAMESPACES = 4  # local_cluster.sh start --nodes N>1: network namespaces cannot be made here

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


def metrics(run_dir: Path) -> list[dict]:
    """The trainer's ``metrics.jsonl`` records, in file order (a half-written last line is left out)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def write_json_atomic(path: Path, payload: object) -> None:
    """Workers' results: written to a temporary name and renamed, so a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, sort_keys=True))
    tmp.rename(path)


@dataclasses.dataclass(frozen=True)
class MultiNodeSlurm(LocalSlurm):
    """A cluster started with ``local_cluster.sh start --nodes N``: node ``node<i>`` runs in network
    namespace ``namespaces[i - 1]`` (whose inode is ``namespace_inodes[i - 1]``, to find its processes
    even after the namespace's name is gone)."""

    env_vars: tuple[tuple[str, str], ...] = ()  # GSPO_SLURM_DIR and ports: what local_cluster.sh needs
    namespaces: tuple[str, ...] = ()
    namespace_inodes: tuple[int, ...] = ()

    @property
    def nodes(self) -> list[str]:
        return [f"node{i + 1}" for i in range(len(self.namespaces))]

    def script(self, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
        """``local_cluster.sh ARGS`` for this cluster (its state folder and ports)."""
        env = {**{k: v for k, v in os.environ.items() if k != "SLURM_CONF"}, **dict(self.env_vars)}
        return subprocess.run(["bash", str(CLUSTER_SCRIPT), *args], env=env, capture_output=True, text=True,
                              timeout=timeout_s)

    def processes(self, node: str) -> dict[int, str]:
        """``{pid: command line}`` of the processes in ``node``'s network namespace, slurmd excluded."""
        inode = self.namespace_inodes[self.nodes.index(node)]
        return {pid: args for pid, args in processes_in_namespaces({inode}).items() if not args.startswith("slurmd ")}


def processes_in_namespaces(inodes: set[int]) -> dict[int, str]:
    """``{pid: command line}`` of every live process whose network namespace has one of ``inodes``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "ns" / "net").stat().st_ino not in inodes:
                continue
            if not alive(int(entry.name)):
                continue
            found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the process ended while we looked
        except PermissionError:
            continue  # PID 1 of a sandbox (gVisor) hides its namespaces; it is not ours anyway
    return found


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent (or PID 1) to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def multinode_leftovers(ctld_port: int, inodes: set[int], daemon_pids: set[int]) -> list[str]:
    """What a stopped multi-node cluster must not leave: its namespaces, links, /etc/netns folders, the
    daemons it ran (``daemon_pids``) and any process in its namespaces. Empty when all is gone."""
    prefix = f"gspo{ctld_port}-node"
    left = [f"namespace {ns}" for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                                      check=True).stdout.split() if ns.startswith(prefix)]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    left += [f"link {name}" for name in re.findall(rf"^\d+: (gs{ctld_port}(?:h\d+|br))[@:]", links, re.M)]
    left += [f"folder {p}" for p in Path("/etc/netns").glob(f"{prefix}*")] if Path("/etc/netns").is_dir() else []
    left += [f"daemon pid {pid}" for pid in sorted(daemon_pids) if alive(pid)]
    left += [f"process {pid} in a node namespace: {args}" for pid, args in processes_in_namespaces(inodes).items()]
    return left


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _free_subnet() -> str:
    """A 10.213.x.0/24 no interface here uses (two clusters at once must not share one)."""
    used = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    for third in range(256):
        subnet = f"10.213.{(os.getpid() + third) % 256}"
        if f" {subnet}." not in used:
            return subnet
    raise RuntimeError("no free 10.213.x.0/24 subnet for the multi-node cluster")


def start_multinode(state_dir: Path, nodes: int) -> MultiNodeSlurm:
    """``local_cluster.sh start --nodes N`` in ``state_dir`` on free ports; skips where Slurm cannot be
    installed or namespaces cannot be made (the script's exit codes 3 and 4 say which, and why)."""
    ctld_port = free_port()
    env_vars = (("GSPO_SLURM_DIR", str(state_dir)), ("GSPO_SLURM_CTLD_PORT", str(ctld_port)),
                ("GSPO_SLURM_SLURMD_PORT", str(free_port())), ("GSPO_SLURM_SUBNET", _free_subnet()))
    handle = MultiNodeSlurm(conf=state_dir / "slurm.conf", env_vars=env_vars)
    started = handle.script("start", "--nodes", str(nodes), timeout_s=900)
    if started.returncode in (EXIT_CANNOT_INSTALL, EXIT_NO_NAMESPACES):
        pytest.skip(f"no {nodes}-node Slurm here: {started.stderr.strip()}")
    if started.returncode != 0:
        handle.script("stop")
        pytest.fail(f"local_cluster.sh start --nodes {nodes} failed ({started.returncode}):\n{started.stderr}",
                    pytrace=False)
    namespaces = tuple(f"gspo{ctld_port}-node{i + 1}" for i in range(nodes))
    return dataclasses.replace(handle, namespaces=namespaces,
                               namespace_inodes=tuple(os.stat(f"/run/netns/{ns}").st_ino for ns in namespaces))


def stop_multinode(cluster: MultiNodeSlurm) -> list[str]:
    """Stop the cluster; return what it left behind (namespaces, links, daemons, processes): nothing, or a
    description of each leftover, which is then also removed by PID so one failure does not leak."""
    ctld_port = int(dict(cluster.env_vars)["GSPO_SLURM_CTLD_PORT"])
    run_dir = Path(dict(cluster.env_vars)["GSPO_SLURM_DIR"]) / "run"
    daemon_pids = {int(p.read_text().strip()) for p in run_dir.glob("*.pid") if p.read_text().strip()}
    stopped = cluster.script("stop")
    inodes = set(cluster.namespace_inodes)
    left = multinode_leftovers(ctld_port, inodes, daemon_pids)
    for pid in [*processes_in_namespaces(inodes), *daemon_pids]:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    if stopped.returncode != 0:
        left.append(f"local_cluster.sh stop exited {stopped.returncode}: {stopped.stderr}")
    return left
