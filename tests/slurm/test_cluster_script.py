"""tools/slurm/local_cluster.sh itself: idempotent start, recovery from a dead daemon, idempotent stop.

Runs a second cluster in its own state folder on free ports, so a cluster other tests (or CI) use is
never touched.
"""
from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from tests.slurm.cluster import CLUSTER_SCRIPT, EXIT_CANNOT_INSTALL, LocalSlurm, wait_until


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
           "GSPO_SLURM_CTLD_PORT": str(_free_port()), "GSPO_SLURM_SLURMD_PORT": str(_free_port())}
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
