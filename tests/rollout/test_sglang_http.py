"""HTTP error classification, retry with backoff, and server process handling, against the local stand-in
(tests/rollout/sglang_standin.py: NOT SGLang; 127.0.0.1 only)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gspo_megatron.rollout.sglang.http import (RetriesExhausted, RetryPolicy, ServerBusy, ServerRejected,
                                               ServerUnreachable, call_with_retry, request)
from gspo_megatron.rollout.sglang.server import ServerProcess, ServerStartError, wait_healthy

from tests.rollout.sglang_standin import StandinServer, StandinState, free_port

STANDIN = str(Path(__file__).with_name("sglang_standin.py"))


class FakeTime:
    """A clock that only moves when the code under test sleeps."""

    def __init__(self):
        self.now = 0.0
        self.sleeps = []

    def sleep(self, s):
        self.sleeps.append(s)
        self.now += s

    def clock(self):
        return self.now


def test_errors_are_classified():
    with StandinServer(StandinState(fail_generate=1, drop_generate=1)) as srv:
        assert request(srv.url, "GET", "/health", timeout_s=5) is None
        assert request(srv.url, "POST", "/flush_cache", None, timeout_s=5).startswith("Cache flushed")
        with pytest.raises(ServerBusy, match="503"):
            request(srv.url, "POST", "/generate", {"input_ids": [[1]]}, timeout_s=5)
        with pytest.raises(ServerUnreachable):  # connection cut without an answer
            request(srv.url, "POST", "/generate", {"input_ids": [[1]]}, timeout_s=5)
        with pytest.raises(ServerRejected, match="top_k must be -1") as err:
            request(srv.url, "POST", "/generate", {"input_ids": [[1]], "return_logprob": True,
                                                   "sampling_params": {"top_k": 0}}, timeout_s=5)
        assert err.value.status == 400
        with pytest.raises(ServerRejected) as err:
            request(srv.url, "GET", "/no_such_endpoint", timeout_s=5)
        assert err.value.status == 404
    with pytest.raises(ServerUnreachable, match="no answer"):
        request(f"http://127.0.0.1:{free_port()}", "GET", "/health", timeout_s=2)


def test_backoff_is_exponential_and_capped():
    policy = RetryPolicy(max_retries=6, backoff_s=0.5, backoff_max_s=3.0, deadline_s=100)
    assert [policy.delay_s(k) for k in range(1, 7)] == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]


def _flaky(errors):
    calls = []

    def fn():
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return "ok"

    return fn, calls


def test_retry_succeeds_after_transient_failures_and_restarts_on_unreachable():
    t = FakeTime()
    restarts = []
    fn, calls = _flaky([ServerBusy("503"), ServerUnreachable("refused")])
    policy = RetryPolicy(max_retries=3, backoff_s=0.5, backoff_max_s=30, deadline_s=100)
    assert call_with_retry(fn, policy, what="x", on_unreachable=restarts.append, sleep=t.sleep, clock=t.clock) == "ok"
    assert len(calls) == 3 and t.sleeps == [0.5, 1.0]
    assert len(restarts) == 1 and isinstance(restarts[0], ServerUnreachable)  # not for the 503


def test_retry_gives_up_after_max_retries_and_never_retries_a_rejection():
    t = FakeTime()
    policy = RetryPolicy(max_retries=2, backoff_s=1, backoff_max_s=30, deadline_s=100)
    fn, calls = _flaky([ServerBusy("503")] * 5)
    with pytest.raises(RetriesExhausted, match="gave up after 3 attempt"):
        call_with_retry(fn, policy, what="x", sleep=t.sleep, clock=t.clock)
    assert len(calls) == 3
    fn, calls = _flaky([ServerRejected("HTTP 400: bad", 400)])
    with pytest.raises(ServerRejected):
        call_with_retry(fn, policy, what="x", sleep=t.sleep, clock=t.clock)
    assert len(calls) == 1


def test_retry_stops_at_the_deadline():
    t = FakeTime()
    policy = RetryPolicy(max_retries=100, backoff_s=10, backoff_max_s=10, deadline_s=25)
    fn, calls = _flaky([ServerUnreachable("refused")] * 100)
    with pytest.raises(RetriesExhausted):
        call_with_retry(fn, policy, what="x", sleep=t.sleep, clock=t.clock)
    assert len(calls) == 3 and t.now <= 25  # attempts at t = 0, 10, 20; the next would start past 25


def _process(tmp_path, *extra, timeout_s=10.0):
    port = free_port()
    cmd = [sys.executable, STANDIN, "--port", str(port), "--lifetime-s", "30", *extra]
    return ServerProcess(cmd, f"http://127.0.0.1:{port}", tmp_path / f"standin-{port}.log",
                         startup_timeout_s=timeout_s, poll_s=0.05)


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_process_waits_for_health_restarts_and_stops_its_group(tmp_path):
    proc = _process(tmp_path, "--startup-delay-s", "0.3", "--startup-503-s", "0.3")
    proc.start()
    try:
        assert proc.alive() and request(proc.url, "GET", "/health", timeout_s=2) is None
        first_pid = proc._proc.pid
        os.kill(first_pid, signal.SIGKILL)
        time.sleep(0.1)
        assert not proc.alive()
        proc.restart()
        assert proc.alive() and proc.starts == 2 and proc._proc.pid != first_pid
        pid = proc._proc.pid
    finally:
        proc.stop()
    assert not proc.alive() and _gone(pid)
    proc.stop()  # twice is fine
    assert "stand-in serving" in proc.log_path.read_text()


def test_process_that_exits_at_start_raises_with_its_log(tmp_path):
    proc = _process(tmp_path, "--exit-at-start")
    with pytest.raises(ServerStartError, match="exited while starting") as err:
        proc.start()
    assert "exiting at start as asked" in str(err.value) and "exit code 3" in str(err.value)


def test_process_not_healthy_before_the_deadline_is_stopped(tmp_path):
    proc = _process(tmp_path, "--startup-delay-s", "20", timeout_s=0.4)
    with pytest.raises(ServerStartError, match="not healthy after"):
        proc.start()
    assert not proc.alive()


def test_start_refuses_a_port_in_use(tmp_path):
    with StandinServer() as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        proc = ServerProcess([sys.executable, STANDIN, "--port", str(port)], srv.url, tmp_path / "x.log",
                             startup_timeout_s=5, poll_s=0.05)
        with pytest.raises(ServerStartError, match="already in use"):
            proc.start()


def test_wait_healthy_deadline_for_attached_urls():
    t = FakeTime()
    with pytest.raises(ServerStartError, match="not healthy after 3"):
        wait_healthy(f"http://127.0.0.1:{free_port()}", deadline_s=3, poll_s=1, clock=t.clock, sleep=t.sleep)
    assert t.sleeps == [1, 1, 1]


def _live_group_members(pgid: int) -> list[int]:
    """Processes of group ``pgid`` that are not zombies (a killed orphan waits for init to reap it)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue  # exited while we looked
            state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
            if int(pgrp) == pgid and state != "Z":
                members.append(int(entry.name))
    return members


def test_a_killed_owner_takes_the_whole_server_group_with_it(tmp_path):
    """SIGKILL the owner of a server whose own child does not die with its parent (as SGLang's
    detokenizer): the group keeper kills the child too."""
    owner = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from gspo_megatron.rollout.sglang.server import ServerProcess\n"
         "p = ServerProcess(['sh', '-c', 'sleep 300 & exec sleep 301'], 'http://10.0.0.1:1', sys.argv[1],\n"
         "                  startup_timeout_s=1, poll_s=1)\n"
         "p.spawn(); print(p._proc.pid, flush=True); time.sleep(300)\n", str(tmp_path / "s.log")],
        stdout=subprocess.PIPE, text=True)
    pgid = int(owner.stdout.readline())
    deadline = time.monotonic() + 10
    while len(_live_group_members(pgid)) < 2 and time.monotonic() < deadline:  # the two sleeps of sh
        time.sleep(0.05)
    assert len(_live_group_members(pgid)) == 2
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 10
    while _live_group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _live_group_members(pgid), f"left in the server's group after its owner died: {_live_group_members(pgid)}"
