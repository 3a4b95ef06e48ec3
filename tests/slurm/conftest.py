"""Session fixtures: ``slurm_cluster``, a real single-node Slurm started by tools/slurm/local_cluster.sh,
and ``slurm_multinode``, a 2-node one in network namespaces that the fixture starts and removes itself.

CI starts the cluster before pytest (tools/run_tests.sh); then ``start`` finds it running, and this
fixture leaves it running at the end. Otherwise the fixture starts it (installing the Debian packages if
needed) and stops it when the session ends. Only "Slurm cannot be installed here" (no apt-get, not root)
skips; any other failure to start fails the tests that need the cluster.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from tests.slurm.cluster import (CLUSTER_SCRIPT, EXIT_CANNOT_INSTALL, LocalSlurm, MultiNodeSlurm, start_multinode,
                                 stop_multinode, teardown_on_sigterm)


def _cluster_cmd(action: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER_SCRIPT), action], capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[LocalSlurm]:
    with teardown_on_sigterm():
        yield from _slurm_cluster()


def _slurm_cluster() -> Iterator[LocalSlurm]:
    was_running = _cluster_cmd("status", 30).returncode == 0
    # Installing the packages takes about 20 s cold; apt may wait for another apt's lock.
    started = _cluster_cmd("start", 900)
    if started.returncode == EXIT_CANNOT_INSTALL:
        pytest.skip(f"Slurm is not installed and cannot be installed here: {started.stderr.strip()}")
    if started.returncode != 0:
        pytest.fail(f"tools/slurm/local_cluster.sh start failed ({started.returncode}):\n{started.stderr}",
                    pytrace=False)
    match = re.search(r"^export SLURM_CONF=(\S+)$", started.stdout, re.M)
    assert match, f"local_cluster.sh start printed no SLURM_CONF line: {started.stdout!r}"
    yield LocalSlurm(conf=Path(match.group(1)))
    if not was_running:
        _cluster_cmd("stop", 120)


@pytest.fixture(scope="session")
def slurm_multinode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiNodeSlurm]:
    """A 2-node cluster (two network namespaces) for this session only, beside any single-node one; when
    the session ends it is stopped and the teardown fails if anything of it is left."""
    with teardown_on_sigterm():
        cluster = start_multinode(tmp_path_factory.mktemp("slurm-multinode"), nodes=2)
        try:
            yield cluster
        finally:
            left = stop_multinode(cluster)
            assert not left, f"the multi-node cluster left behind: {left}"
