"""A flag raised by SIGTERM / SIGUSR1 so a preempted or time-limited job checkpoints and exits cleanly.

Slurm warns a job before killing it: ``#SBATCH --signal=B:USR1@120`` sends SIGUSR1 to the batch script
120 s before the time limit (the sbatch examples forward it to the tasks through ``srun``), and
``scancel`` or a preemption sends SIGTERM, then SIGKILL after the cluster's KillWait. The handler only
records the signal: raising inside an arbitrary frame (the middle of a collective, of an optimizer step,
of a checkpoint write) would leave ranks out of step. The trainer reads ``requested`` once per step, at a
point where all ranks agree, saves a checkpoint and returns.

Only the main thread may install signal handlers (``signal.signal`` raises ``ValueError`` otherwise).
"""
from __future__ import annotations

import signal
from types import FrameType
from typing import Callable, Union

DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1)

_Handler = Union[Callable[[int, FrameType | None], object], int, None]


class PreemptionFlag:
    """``install()`` routes the signals to a flag; ``requested`` says whether one arrived since then.

    Usable as a context manager (installs on entry, restores the previous handlers on exit).
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = DEFAULT_SIGNALS) -> None:
        self.signals = tuple(signals)
        self._received: signal.Signals | None = None
        self._previous: dict[signal.Signals, _Handler] = {}

    @property
    def requested(self) -> bool:
        return self._received is not None

    @property
    def signal_name(self) -> str | None:
        """``"SIGUSR1"`` etc. for the first signal received, for the log line that says why training stopped."""
        return None if self._received is None else self._received.name

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Keep the first signal: a later SIGTERM from the scheduler does not change why we stopped.
        if self._received is None:
            self._received = signal.Signals(signum)

    def install(self) -> "PreemptionFlag":
        if self._previous:
            raise RuntimeError("PreemptionFlag.install(): already installed")
        self._received = None
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were in place before ``install()``; a no-op when not installed."""
        for sig, previous in self._previous.items():
            # None: the earlier handler was set outside Python and cannot be reinstated; the default is closest.
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous = {}

    def __enter__(self) -> "PreemptionFlag":
        return self.install()

    def __exit__(self, *exc_info: object) -> None:
        self.uninstall()


__all__ = ["DEFAULT_SIGNALS", "PreemptionFlag"]
