"""A flag raised by SIGTERM / SIGUSR1 / SIGINT / SIGHUP so a stopped, preempted or time-limited job
checkpoints and exits cleanly, in every phase (docs/failures.md, "The run is stopped").

Slurm warns a job before killing it: ``#SBATCH --signal=B:USR1@120`` sends SIGUSR1 to the batch script
120 s before the time limit (the sbatch examples forward it to the tasks through ``srun``), and
``scancel`` or a preemption sends SIGTERM, then SIGKILL after the cluster's KillWait. The handler only
records the signal: raising inside an arbitrary frame (the middle of a collective, of an optimizer step,
of a checkpoint write) would leave ranks out of step. The trainer reads ``requested`` at the points where
work can stop and all ranks agree (each warm-start step, between the evaluation's rollouts, after each step,
between mini-batches when the grace would not cover the rest of the step), saves a checkpoint and returns.
A second SIGINT (Ctrl-C twice) does not wait: it raises ``KeyboardInterrupt`` (exit 130, no save).

Only the main thread may install signal handlers (``signal.signal`` raises ``ValueError`` otherwise).
"""
from __future__ import annotations

import signal
import time
from pathlib import Path
from types import FrameType
from typing import Callable, Union

from gspo_megatron.processes import PREEMPTION_SIGNALS

# SIGHUP (a closed terminal, or what some schedulers send) is a preemption like SIGTERM: one behaviour
# in one process and under --nproc, whose launcher forwards it
DEFAULT_SIGNALS: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS

_Handler = Union[Callable[[int, FrameType | None], object], int, None]


class PreemptionFlag:
    """``install()`` routes the signals to a flag; ``requested`` says whether one arrived since then.

    Usable as a context manager (installs on entry, restores the previous handlers on exit).
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = DEFAULT_SIGNALS) -> None:
        self.signals = tuple(signals)
        self._received: signal.Signals | None = None
        self._received_at = 0.0
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

    def seconds_since(self) -> float:
        """Seconds since the first signal arrived (0 when none did)."""
        return 0.0 if self._received is None else time.monotonic() - self._received_at

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Keep the first signal: a later SIGTERM from the scheduler does not change why we stopped.
        if self._received is None:
            self._received = signal.Signals(signum)
            self._received_at = time.monotonic()
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: stop now, without waiting for the save

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


def fits_in_grace(grace_s: float, elapsed_s: float, rest_of_step_s: float, save_s: float) -> bool:
    """Whether finishing the step (``rest_of_step_s``, estimated from its mini-batches so far) and saving
    (``save_s``, the last save's measured time) ends before the grace after the signal runs out (``grace_s``,
    ``train.preemption_grace_s``; ``elapsed_s`` of it have passed). The weight sync and metrics that follow the
    update are small beside it and taken as covered by the margin a grace should have anyway."""
    return elapsed_s + rest_of_step_s + save_s <= grace_s


class StoppedUpdate:
    """The rest of an RL step that a signal stopped between mini-batches: this rank's shares of the
    mini-batches not yet trained on (the rollout batch with its old / reference log-probs and advantages), the
    metrics of the mini-batches done, and the step's other metrics. Saved in the checkpoint (one file per rank
    beside Megatron's, the metrics in its metadata), so the resumed run finishes the step exactly."""

    def __init__(self, shares: list, update_metrics: list[dict[str, float]],
                 metrics: dict[str, float] | None = None, restored: bool = False):
        self.shares, self.update_metrics, self.metrics, self.restored = shares, update_metrics, metrics, restored

    @staticmethod
    def file_name(rank: int) -> str:
        return f"partial_step_rank{rank:05d}.pt"

    def meta(self) -> dict:
        import torch.distributed as dist

        return {"update_metrics": self.update_metrics, "metrics": self.metrics, "world_size": dist.get_world_size()}

    def write(self, folder: Path, rank: int) -> None:
        import torch

        torch.save(self.shares, folder / self.file_name(rank))

    @classmethod
    def load(cls, folder: Path, meta: dict, rank: int, world_size: int) -> "StoppedUpdate":
        import torch

        from gspo_megatron.typed_config import ConfigError

        if meta["world_size"] != world_size:
            raise ConfigError(f"{folder}: a signal stopped this step between mini-batches on {meta['world_size']} "
                              f"processes; resume it on {meta['world_size']} (each holds its share of the rest)")
        # our own file, written by StoppedUpdate.write: TrainSequence objects, not only tensors
        shares = torch.load(folder / cls.file_name(rank), weights_only=False)
        return cls(shares, list(meta["update_metrics"]), dict(meta["metrics"]), restored=True)


__all__ = ["DEFAULT_SIGNALS", "StoppedUpdate", "PreemptionFlag", "fits_in_grace"]
