"""tools/slurm/local_cluster.sh itself: idempotent start, recovery from a dead daemon, idempotent stop.

Runs a second cluster in its own state folder on free ports, so a cluster other tests (or CI) use is
never touched.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.slurm.cluster import (CLUSTER_SCRIPT, EXIT_CANNOT_INSTALL, EXIT_NO_NAMESPACES, LocalSlurm, free_port,
                                 multinode_leftovers, start_multinode, stop_multinode, wait_until)


def _script(action: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER_SCRIPT), action], env=env, capture_output=True, text=True, timeout=120)


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for PID 1 to reap it."""
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(") ", 1)[1][0] != "Z"


def _pid(path: Path) -> int:
    return int(path.read_text().strip())


@pytest.mark.slurm
def test_start_twice_recover_and_stop(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    # slurm_cluster: only to have the packages installed (or skip where they cannot be).
    state = tmp_path / "cluster"
    env = {**{k: v for k, v in os.environ.items() if k != "SLURM_CONF"}, "GSPO_SLURM_DIR": str(state),
           "GSPO_SLURM_CTLD_PORT": str(free_port()), "GSPO_SLURM_SLURMD_PORT": str(free_port())}
    export_line = f"export SLURM_CONF={state}/slurm.conf"
    try:
        first = _script("start", env)
        assert first.returncode == 0, first.stderr
        assert first.stdout.strip() == export_line
        ctld, slurmd = _pid(state / "run" / "slurmctld.pid"), _pid(state / "run" / "slurmd.pid")

        again = _script("start", env)
        assert (again.returncode, again.stdout.strip()) == (0, export_line)
        assert "already running" in again.stderr
        assert _pid(state / "run" / "slurmctld.pid") == ctld  # nothing restarted

        os.kill(slurmd, 9)
        wait_until(lambda: not _alive(slurmd), 10, "slurmd to die")
        assert _script("status", env).returncode == 1
        recovered = _script("start", env)
        assert recovered.returncode == 0, recovered.stderr
        assert _script("status", env).returncode == 0
        job = subprocess.run(["sbatch", "--wait", "--wrap", "exit 5", f"--output={tmp_path}/job.out"],
                             env={**env, "SLURM_CONF": str(state / "slurm.conf")}, capture_output=True, text=True,
                             timeout=60)
        assert job.returncode == 5, job.stderr
        pids = [_pid(state / "run" / name) for name in ("slurmctld.pid", "slurmd.pid")]
    finally:
        stopped = _script("stop", env)
    assert stopped.returncode == 0, stopped.stderr
    assert not any(_alive(pid) for pid in pids + [ctld])
    assert _script("stop", env).returncode == 0  # idempotent
    assert _script("status", env).returncode == 1


def test_install_reports_when_slurm_cannot_be_installed(tmp_path: Path) -> None:
    """No Slurm and no apt-get on PATH: exit 3, the code the fixture turns into a skip."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "id").symlink_to("/usr/bin/id")
    result = subprocess.run(["/bin/bash", str(CLUSTER_SCRIPT), "install"], env={"PATH": str(bin_dir)},
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == EXIT_CANNOT_INSTALL
    assert "apt-get not found" in result.stderr


@pytest.mark.slurm
def test_two_nodes_start_twice_and_stop_leaves_nothing(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    """A second `start` is a no-op, a different node count is refused, and `stop` removes namespaces,
    links, daemons and whatever runs on the nodes: a job's processes, and a stray process of no job."""
    cluster = start_multinode(tmp_path / "cluster", nodes=2)
    try:
        assert {line.split()[1]: line.split()[2] for line in cluster.script("status").stdout.splitlines()
                if line.startswith("node ")} == {"node1": "idle", "node2": "idle"}
        again = cluster.script("start", "--nodes", "2")
        assert again.returncode == 0 and "already running" in again.stderr, again.stderr
        other = cluster.script("start", "--nodes", "3")
        assert other.returncode == 1 and "a 2-node cluster runs" in other.stderr, other.stderr
        # a job on both nodes, and a process started in node2's namespace behind Slurm's back
        job = subprocess.run(["sbatch", "--parsable", "--nodes=2", f"--output={tmp_path}/job.out", "--wrap",
                              "srun sleep 300"], env=cluster.env(), capture_output=True, text=True, timeout=60)
        assert job.returncode == 0, job.stderr
        wait_until(lambda: all(any(a.endswith("sleep 300") for a in cluster.processes(n).values())
                               for n in cluster.nodes), 30, "the job's sleep on both nodes")
        stray = subprocess.Popen(["nsenter", f"--net=/run/netns/{cluster.namespaces[1]}", "sleep", "301"],
                                 start_new_session=True)
        wait_until(lambda: stray.pid in cluster.processes("node2"), 10, "the stray process in node2")
    finally:
        left = stop_multinode(cluster)
    assert left == []
    assert stray.wait(timeout=10) != 0  # killed by stop, not by us
    assert cluster.script("stop").returncode == 0  # idempotent
    assert cluster.script("status").returncode == 1


def test_two_nodes_refused_where_namespaces_cannot_be_made(tmp_path: Path) -> None:
    """Slurm present but no `ip` on PATH: start --nodes 2 exits 4 and says why (tests skip on 4)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("slurmctld", "slurmd", "sbatch", "id", "nproc", "flock", "awk", "sinfo", "squeue", "scancel",
                 "cat", "tr", "mkdir", "rm", "sort", "sleep", "unshare", "nsenter"):
        found = shutil.which(tool)
        if found is None:
            pytest.skip(f"{tool} is not installed here")
        (bin_dir / tool).symlink_to(found)
    env = {"PATH": str(bin_dir), "GSPO_SLURM_DIR": str(tmp_path / "state"),
           "GSPO_SLURM_CTLD_PORT": str(free_port()), "GSPO_SLURM_SLURMD_PORT": str(free_port())}
    result = subprocess.run(["/bin/bash", str(CLUSTER_SCRIPT), "start", "--nodes", "2"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == EXIT_NO_NAMESPACES, result.stderr
    assert "the ip command is missing (apt-get install iproute2)" in result.stderr
    assert multinode_leftovers(int(env["GSPO_SLURM_CTLD_PORT"]), set(), set()) == []


@pytest.mark.parametrize("args", [["start", "--nodes", "0"], ["start", "--nodes", "x"], ["stop", "--nodes", "2"],
                                  ["start", "--bogus"]])
def test_bad_arguments_are_refused(args: list[str]) -> None:
    result = subprocess.run(["bash", str(CLUSTER_SCRIPT), *args], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2, result.stderr
    assert "--nodes" in result.stderr or "usage" in result.stderr
