"""What user code may print: reward functions and user tools (their workers' stdout and stderr, and an
in-process reward's ``print``) reach the log up to a byte cap per window, the rest is cut and counted.

    cap = PrintCap(65536, "the reward functions' output", "rewards.max_print_bytes")
    proc = subprocess.Popen(..., stdout=cap.fd, stderr=cap.fd)   # any number of child processes
    with cap.capturing():                                          # this process's sys.stdout / sys.stderr
        score_a_batch()
    cut = cap.end_window()   # bytes cut since the last window; one marker line in the log when > 0

A window is what the owner calls a unit (the reward pool: one scored batch; the tool registry: one rollout).
Child processes write into one pipe that a reader thread drains at once, so a flood never blocks the child
on a full pipe; what goes over the cap is read and dropped. ``end_window`` first waits (up to a second) for
the pipe to empty, so what a child wrote before it answered counts in its own window. ``capturing`` swaps ``sys.stdout`` / ``sys.stderr`` of this process, so it catches Python
``print`` and writes, not output a C extension or a child writes to fd 1 or 2 directly (a reward that needs
those bounded runs with workers).
"""
from __future__ import annotations

import contextlib
import fcntl
import io
import os
import select
import struct
import termios
import threading
import time
from typing import Iterator


class PrintCap:
    """At most ``limit_bytes`` of output per window to ``sink_fd`` (module docstring). ``what`` and ``setting``
    name the output and the config field in the marker line."""

    def __init__(self, limit_bytes: int, what: str, setting: str, sink_fd: int = 2):
        self.limit_bytes, self.what, self.setting, self.sink_fd = limit_bytes, what, setting, sink_fd
        self._lock = threading.Lock()
        self._kept = self._cut = 0
        self._line_open = False  # the last byte forwarded was not a newline: the marker starts a new line
        self._fd: int | None = None
        self._read_fd = -1

    @property
    def fd(self) -> int:
        """The write end of the pipe to hand a child as its stdout / stderr (opened on first use; a reader
        thread forwards what arrives until every writer has closed it)."""
        if self._fd is None:
            self._read_fd, self._fd = os.pipe()
            threading.Thread(target=self._drain, daemon=True, name="print-cap").start()
        return self._fd

    def _drain(self) -> None:
        """Read and forward whatever is in the pipe, a whole pipeful under the lock at a time, so that
        ``end_window`` sees either bytes still in the pipe or bytes already counted, never bytes in between."""
        while True:
            select.select([self._read_fd], [], [])
            with self._lock:
                chunk = os.read(self._read_fd, max(1, _available(self._read_fd)))
                if not chunk:  # every writer has closed it
                    os.close(self._read_fd)
                    return
                self._take(chunk)

    def write(self, data: bytes) -> None:
        """Forward what the window's budget allows of ``data``; count the rest as cut."""
        with self._lock:
            self._take(data)

    def _take(self, data: bytes) -> None:
        keep = max(0, min(len(data), self.limit_bytes - self._kept))
        self._kept += keep
        self._cut += len(data) - keep
        if keep:
            _write_all(self.sink_fd, data[:keep])
            self._line_open = not data[:keep].endswith(b"\n")

    def _settle(self, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) until the pipe is empty: what a child wrote before it answered belongs to
        this window. A child that keeps printing never empties it; the timeout bounds the wait."""
        deadline = time.monotonic() + timeout_s
        while self._fd is not None and time.monotonic() < deadline:
            with self._lock:
                if _available(self._read_fd) == 0:
                    return
            time.sleep(0.001)

    def end_window(self, settle_s: float = 1.0) -> int:
        """Close the window: the bytes cut in it (and a marker line naming them when there were any)."""
        self._settle(settle_s)
        with self._lock:
            cut, self._kept, self._cut = self._cut, 0, 0
            if cut:
                _write_all(self.sink_fd, (b"\n" if self._line_open else b"") + (
                    f"[{cut} more bytes of {self.what} cut ({self.setting}={self.limit_bytes})]\n").encode())
                self._line_open = False
        return cut

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """``sys.stdout`` and ``sys.stderr`` of this process go through the cap inside (main-thread use: other
        threads' prints meanwhile are capped too)."""
        stream = _CapStream(self)
        with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
            yield

    def close(self) -> None:
        """Close this process's write end (the reader ends once the children holding it have exited)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _CapStream(io.TextIOBase):
    """A text stream whose writes go through a ``PrintCap``."""

    def __init__(self, cap: PrintCap):
        self.cap = cap

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.cap.write(text.encode("utf-8", "replace"))
        return len(text)


def _available(fd: int) -> int:
    """Bytes waiting in pipe ``fd`` (FIONREAD)."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


__all__ = ["PrintCap"]
