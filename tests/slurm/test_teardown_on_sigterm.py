"""pytest stopped by SIGTERM (a CI timeout) must still stop the clusters its fixtures started: the
fixtures wrap them in ``teardown_on_sigterm``. Checked in a pytest of its own, with a stand-in daemon (no
Slurm needed) and with the real fixtures (a single-node and a 2-node cluster, network namespaces)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import json
import re
import textwrap
import time
from pathlib import Path

import pytest

from tests.slurm.cluster import (CLUSTER_SCRIPT, EXIT_CANNOT_INSTALL, REPO_ROOT, alive, free_port,
                                 processes_in_namespaces, wait_until)

CONFTEST = textwrap.dedent("""
    import subprocess, pytest
    from tests.slurm.cluster import teardown_on_sigterm

    @pytest.fixture(scope="session")
    def daemon(tmp_path_factory):
        with teardown_on_sigterm():
            proc = subprocess.Popen(["sleep", "300"], start_new_session=True)  # like slurmctld: its own session
            (tmp_path_factory.getbasetemp().parent / "daemon.pid").write_text(str(proc.pid))
            try:
                yield proc
            finally:
                proc.kill()
                proc.wait()
""")
TEST = textwrap.dedent("""
    import time

    def test_runs_until_stopped(daemon):
        time.sleep(300)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"


def test_a_sigtermed_pytest_still_tears_its_clusters_down(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    (suite / "test_it.py").write_text(TEST)
    base = tmp_path / "base"
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={base}",
                             "--rootdir", str(suite), str(suite)], cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    pid_file = tmp_path / "daemon.pid"
    try:
        wait_until(lambda: pid_file.exists() or proc.poll() is not None, 120, "the stand-in daemon to start")
        daemon = int(pid_file.read_text())
        time.sleep(1.0)  # inside the test now
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert not _alive(daemon), "the fixture's daemon outlived the SIGTERMed pytest:\n" + out[-2000:]
        assert "KeyboardInterrupt" in out and "SIGTERM" in out, out[-2000:]
    finally:
        proc.kill()
        if pid_file.exists() and _alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


REAL_CONFTEST = textwrap.dedent("""
    from tests.slurm.conftest import slurm_cluster, slurm_multinode  # noqa: F401  the suite's own fixtures
""")
REAL_TEST = textwrap.dedent("""
    import json, os, time
    from pathlib import Path

    def test_runs_until_stopped(slurm_cluster, slurm_multinode):
        multi = dict(slurm_multinode.env_vars)
        Path(os.environ["GSPO_TEST_STARTED"]).write_text(json.dumps({
            "state_dirs": [os.environ["GSPO_SLURM_DIR"], multi["GSPO_SLURM_DIR"]], "multinode_env": multi,
            "namespaces": list(slurm_multinode.namespaces), "inodes": list(slurm_multinode.namespace_inodes)}))
        time.sleep(300)
""")


def _daemon_pids(state_dirs: list[str]) -> set[int]:
    """The pids in the clusters' pid files (slurmctld, and slurmd of each node)."""
    return {int(text) for d in state_dirs for f in Path(d, "run").glob("*.pid") if (text := f.read_text().strip())}


def _processes_naming(state_dirs: list[str]) -> dict[int, str]:
    """Live processes whose command line names one of the state folders (``slurmd -f DIR/slurm.conf ...``)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                args = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if any(d in args for d in state_dirs) and alive(int(entry.name)):
                found[int(entry.name)] = args
    return found


@pytest.mark.slurm
def test_a_sigtermed_pytest_stops_its_real_slurm_clusters_and_namespaces(tmp_path):
    """The suite's fixtures in a pytest SIGTERMed mid-test: no slurmctld or slurmd of either cluster, no node
    namespace and nothing in one is left. The single-node cluster gets a state folder and ports of its own,
    so a cluster that CI started before pytest (same defaults as the fixture) is not touched."""
    installed = subprocess.run(["bash", str(CLUSTER_SCRIPT), "install"], capture_output=True, text=True, timeout=900)
    if installed.returncode == EXIT_CANNOT_INSTALL:
        pytest.skip(f"Slurm is not installed and cannot be installed here: {installed.stderr.strip()}")
    assert installed.returncode == 0, installed.stderr
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(REAL_CONFTEST)
    (suite / "test_it.py").write_text(REAL_TEST)
    started = tmp_path / "started.json"
    env = {**{k: v for k, v in os.environ.items() if k != "SLURM_CONF"}, "PYTHONPATH": str(REPO_ROOT),
           "GSPO_TEST_STARTED": str(started), "GSPO_SLURM_DIR": str(tmp_path / "single"),
           "GSPO_SLURM_CTLD_PORT": str(free_port()), "GSPO_SLURM_SLURMD_PORT": str(free_port())}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'base'}",
                             "--rootdir", str(suite), str(suite)], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    info = None
    try:
        wait_until(lambda: started.exists() or proc.poll() is not None, 300, "both clusters to start")
        assert started.exists(), "the inner pytest ended before its clusters ran:\n" + proc.communicate()[0][-3000:]
        info = json.loads(started.read_text())
        daemons = _daemon_pids(info["state_dirs"])
        # slurmctld and slurmd of the single node; slurmctld and two slurmd of the 2-node cluster
        assert len(daemons) == 5 and all(alive(pid) for pid in daemons), daemons
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        assert "KeyboardInterrupt" in out and "SIGTERM" in out, out[-3000:]
        assert not [pid for pid in daemons if alive(pid)], out[-3000:]
        assert not _processes_naming(info["state_dirs"]), out[-3000:]
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
        assert not set(re.findall(r"^(\S+)", netns, re.M)) & set(info["namespaces"]), netns
        assert not processes_in_namespaces(set(info["inodes"])), out[-3000:]
    finally:
        proc.kill()
        proc.wait()
        if info is not None:  # a failed teardown must not leak into the rest of the suite
            for pid in _processes_naming(info["state_dirs"]):
                os.kill(pid, signal.SIGKILL)
            subprocess.run(["bash", str(CLUSTER_SCRIPT), "stop"], env={**env, **info["multinode_env"]},
                           capture_output=True, timeout=120)
