"""One run per run directory: fresh starts refuse an earlier run's folder, a lock names its holder,
stale locks are taken over (gspo_megatron/trainer/run_dir.py)."""
import json
import os
import socket
import subprocess
import sys

import pytest

from gspo_megatron.trainer.run_dir import LOCK_NAME, RunDirError, RunDirLock, claim


def test_fresh_run_refuses_a_folder_holding_an_earlier_run(tmp_path):
    (tmp_path / "checkpoints" / "step_000004").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(RunDirError, match=r"holds an earlier run \(checkpoints, metrics.jsonl\); pass --resume"):
        claim(tmp_path, resume=False)
    assert not (tmp_path / LOCK_NAME).exists()  # a refused start leaves no lock behind
    lock = claim(tmp_path, resume=True)  # --resume continues it
    lock.release()
    claim(tmp_path / "new", resume=False).release()  # a new folder is fine


def test_second_run_on_a_held_folder_is_refused_naming_the_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname()}))
        with pytest.raises(RunDirError, match=rf"in use by another run \(pid {holder.pid} on {socket.gethostname()}"):
            claim(tmp_path, resume=True)
    finally:
        holder.kill()
        holder.wait()
    # the holder is dead now: its lock is stale and taken over
    lock = claim(tmp_path, resume=True)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_lock_of_another_host_is_not_taken_over(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "some-other-node"}))
    with pytest.raises(RunDirError, match=r"pid 1 on some-other-node.*if that process is gone, delete"):
        RunDirLock(tmp_path).acquire()


def test_the_demo_takes_the_next_free_numbered_folder(tmp_path):
    from gspo_megatron.cli import fresh_run_dir

    base = tmp_path / "runs" / "cpu_demo"
    assert fresh_run_dir(base) == base  # missing
    base.mkdir(parents=True)
    assert fresh_run_dir(base) == base  # empty
    (base / "metrics.jsonl").write_text("{}\n")
    assert fresh_run_dir(base) == tmp_path / "runs" / "cpu_demo-2"
    (tmp_path / "runs" / "cpu_demo-2").mkdir()
    (tmp_path / "runs" / "cpu_demo-2" / "config.yaml").write_text("x")
    assert fresh_run_dir(base) == tmp_path / "runs" / "cpu_demo-3"


def test_a_lock_whose_pid_now_belongs_to_another_process_is_stale(tmp_path):
    """The pid of a killed run is reused (after a reboot, or a wrap-around): the lock's boot id and start time
    tell the new process apart, so the lock is taken over instead of refused as "in use"."""
    from gspo_megatron.processes import process_identity

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        alive = process_identity(other.pid)
        boot, start = alive.rsplit(":", 1)
        (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": other.pid, "host": socket.gethostname(),
                                                      "process": f"{boot}:{int(start) - 1}"}))
        lock = claim(tmp_path, resume=True)  # the same pid, started at another time: not the holder
        assert json.loads((tmp_path / LOCK_NAME).read_text())["process"] == process_identity(os.getpid())
        lock.release()
        (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": other.pid, "host": socket.gethostname(), "process": alive}))
        with pytest.raises(RunDirError, match=rf"in use by another run \(pid {other.pid}"):
            claim(tmp_path, resume=True)  # the very process: in use
    finally:
        other.kill()
        other.wait()
