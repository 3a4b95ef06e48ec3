"""One SGLang server process we own: start, wait for health, restart, stop by process group.

The process runs in its own session (so its process group holds SGLang's scheduler and detokenizer
children too) with stdout and stderr appended to a log file; a failed start raises with the log's
last lines so the cause is in the error, not only in the file.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
import urllib.parse
from pathlib import Path
from typing import Callable, Sequence

from gspo_megatron.processes import group_keeper_command, wrap_command
from gspo_megatron.rollout.sglang.http import SGLangHTTPError, request

log = logging.getLogger(__name__)


class ServerStartError(RuntimeError):
    """A server did not become healthy before its deadline, or exited while starting."""


def log_tail(path: Path, lines: int = 30) -> str:
    if not path.exists():
        return f"(no log at {path})"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def probe_health(url: str, path: str, timeout_s: float) -> bool:
    """True when GET url+path answers 2xx (SGLang's /health answers 503 while starting)."""
    try:
        request(url, "GET", path, timeout_s=timeout_s)
    except SGLangHTTPError:
        return False
    return True


def wait_healthy(url: str, *, deadline_s: float, poll_s: float, health_path: str = "/health",
                 alive: Callable[[], bool] = lambda: True, describe: Callable[[], str] = lambda: "",
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
    """Poll until healthy; raise ServerStartError past the deadline or when ``alive()`` turns false."""
    start = clock()
    while True:
        if not alive():
            raise ServerStartError(f"server for {url} exited while starting{describe()}")
        if probe_health(url, health_path, timeout_s=max(poll_s, 1.0)):
            return
        if clock() - start + poll_s > deadline_s:  # no probe starts after the deadline
            raise ServerStartError(f"server at {url} not healthy after {deadline_s:.0f} s{describe()}")
        sleep(poll_s)


class ServerProcess:
    """A server started from ``command``; ``url`` is where it answers once healthy."""

    def __init__(self, command: Sequence[str], url: str, log_path: Path, *, env: dict[str, str] | None = None,
                 startup_timeout_s: float, poll_s: float, health_path: str = "/health"):
        self.command = list(command)
        self.url = url
        self.log_path = Path(log_path)
        self.env = dict(env or {})
        self.startup_timeout_s = startup_timeout_s
        self.poll_s = poll_s
        self.health_path = health_path
        self.starts = 0
        self._proc: subprocess.Popen | None = None
        self._keeper: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        """The leader's pid, which is also the process group id of the server and its children."""
        return None if self._proc is None else self._proc.pid

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _describe(self) -> str:
        code = None if self._proc is None else self._proc.poll()
        return f" (exit code {code}); command: {' '.join(self.command)}\nlast lines of {self.log_path}:\n{log_tail(self.log_path)}"

    def start(self) -> None:
        """Start the process and block until it is healthy (or raise ServerStartError)."""
        self.spawn()
        self.wait_ready()

    def spawn(self) -> None:
        """Start the process without waiting. It dies with the *thread* that calls this (the kernel's parent
        death signal names the thread), also when the trainer is killed with SIGKILL: call it from a thread
        that lives as long as the server should (the main thread), then ``wait_ready`` from anywhere."""
        if self.alive():
            raise RuntimeError(f"server for {self.url} is already running (pid {self._proc.pid})")
        parts = urllib.parse.urlsplit(self.url)
        if parts.hostname in ("127.0.0.1", "localhost", "0.0.0.0") and not port_is_free("127.0.0.1", parts.port):
            raise ServerStartError(f"port {parts.port} for {self.url} is already in use; pick another launch.base_port")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            log_file.write(f"\n===== start {self.starts + 1}: {' '.join(self.command)}\n".encode())
            log_file.flush()
            self._proc = subprocess.Popen(wrap_command(self.command), stdout=log_file, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env={**os.environ, **self.env},
                                          start_new_session=True)
            # the leader dies with us, but SGLang's detokenizer and resource tracker do not: a keeper
            # kills the whole group when we die (stop() kills the keeper once the group is gone)
            self._keeper = subprocess.Popen(group_keeper_command(self._proc.pid), stdout=log_file,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.starts += 1
        log.info("started %s (pid %d), log %s", self.url, self._proc.pid, self.log_path)

    def wait_ready(self) -> None:
        """Block until the spawned server is healthy; stop it and raise ServerStartError otherwise."""
        try:
            wait_healthy(self.url, deadline_s=self.startup_timeout_s, poll_s=self.poll_s,
                         health_path=self.health_path, alive=self.alive, describe=self._describe)
        except ServerStartError:
            self.stop()
            raise

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the whole process group, SIGKILL it after ``grace_s``; safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            self._signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._signal_group(proc, signal.SIGKILL)
                proc.wait(timeout=grace_s)
        # Children (SGLang's scheduler, detokenizer) may outlive the leader; the group signal reaches them.
        self._signal_group(proc, signal.SIGKILL)
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.kill()
            keeper.wait(timeout=grace_s)

    @staticmethod
    def _signal_group(proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)  # the group id is the leader's pid (start_new_session=True)
        except ProcessLookupError:
            pass  # the whole group is gone already

    def restart(self) -> None:
        self.stop()
        self.start()


__all__ = ["ServerProcess", "ServerStartError", "log_tail", "port_is_free", "probe_health", "wait_healthy"]
