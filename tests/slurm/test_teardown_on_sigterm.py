"""pytest stopped by SIGTERM (a CI timeout) must still stop the clusters its fixtures started: the
fixtures wrap them in ``teardown_on_sigterm``. Checked with a stand-in daemon in a pytest of its own."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.slurm.cluster import REPO_ROOT, wait_until

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
