"""Limits for rewards that run in the calling process (``rewards.num_workers: 0``).

A worker pool enforces ``timeout_s`` by killing the worker; in the calling process nothing can be killed, so
each synchronous reward call runs under a SIGALRM deadline of ``timeout_s`` instead, and a stop signal
(SIGTERM, SIGUSR1, SIGHUP, SIGINT: ``processes.PREEMPTION_SIGNALS``) first reaches the handler already in
place (the trainer's preemption flag, which saves and exits after the step), then ends the running call;
the batch's later calls are skipped. An interrupted or skipped call scores 0 and is counted as a timeout.

Both are Python signal handlers, so they interrupt a reward between bytecodes and in any blocking call that
returns EINTR (``time.sleep``, socket reads): not one stuck inside C code that never returns to the
interpreter (that needs ``num_workers`` >= 1). Python runs handlers in the main thread only: off it (a reward
scored from a helper thread) the calls run without these limits.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any, Callable, Iterator

from gspo_megatron.processes import PREEMPTION_SIGNALS


class RewardInterrupted(BaseException):
    """A reward call ended by its deadline or a stop signal. A BaseException, so a reward's own
    ``except Exception`` cannot swallow it."""


class InProcessLimits:
    """``installed()`` around a batch; ``call(fn, args, timeout_s)`` per reward call (module docstring)."""

    def __init__(self) -> None:
        self.stopped_by: str | None = None
        self._active = False

    def _alarm(self, signum: int, frame: Any) -> None:
        raise RewardInterrupted("timed out")

    def _stop(self, previous: Any) -> Callable[[int, Any], None]:
        def handle(signum: int, frame: Any) -> None:
            self.stopped_by = signal.Signals(signum).name
            if callable(previous):
                previous(signum, frame)  # the trainer's flag records it (a second Ctrl-C raises from here)
            elif previous == signal.SIG_DFL:
                signal.signal(signum, signal.SIG_DFL)  # nobody handles it: what it would have done anyway
                os.kill(os.getpid(), signum)
            if self._active:
                raise RewardInterrupted(f"stopped by {self.stopped_by}")
        return handle

    @contextlib.contextmanager
    def installed(self) -> Iterator["InProcessLimits"]:
        if threading.current_thread() is not threading.main_thread():
            yield self  # handlers can only be installed from the main thread: no limits here
            return
        self.stopped_by = None
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGALRM, *PREEMPTION_SIGNALS)}
        signal.signal(signal.SIGALRM, self._alarm)
        for sig in PREEMPTION_SIGNALS:
            if previous[sig] != signal.SIG_IGN:
                signal.signal(sig, self._stop(previous[sig]))
        try:
            yield self
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            for sig, handler in previous.items():
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def call(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
        """``fn(*args)`` within ``timeout_s`` seconds; raises RewardInterrupted when it runs out or a stop
        signal arrived (now or earlier in the batch)."""
        if self.stopped_by is not None:
            raise RewardInterrupted(f"skipped: stopped by {self.stopped_by}")
        main = threading.current_thread() is threading.main_thread()
        if main:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
        self._active = True
        try:
            return fn(*args)
        finally:
            self._active = False
            if main:
                signal.setitimer(signal.ITIMER_REAL, 0)


__all__ = ["InProcessLimits", "RewardInterrupted"]
