"""Every process a command starts dies with it, even when the command is killed with SIGKILL.

Linux tells a child that its parent died only when the child asked for it beforehand:
``prctl(PR_SET_PDEATHSIG, SIGKILL)``. The request survives ``exec`` but not ``fork``, and it names the
parent *thread*, so each kind of child sets it differently:

* a command we exec (torchrun, an SGLang server): ``wrap_command`` runs it through this module, which sets
  the signal, checks that the parent is still there, and execs the real command (same pid);
* a command whose own children do not die with it (SGLang's detokenizer): it runs in its own session and
  ``group_keeper_command`` starts a keeper beside it that SIGKILLs that group when we die;
* a fresh interpreter of ours (the reward workers): ``die_with_parent(parent_pid)`` first thing;
* a ``fork`` of a training rank (Megatron's checkpoint writers in ``FileSystemWriterAsync.
  write_preloaded_data_multiproc``): ``kill_forked_children_with_parent()`` sets it in every forked child
  through ``os.register_at_fork``;
* Megatron's results-queue manager (``filesystem_async._get_write_results_queue``, a *spawned* server
  process holding sockets): ``own_checkpoint_results_queue()`` starts it with ``die_with_parent``.

The command that relaunches itself under torchrun forwards SIGTERM / SIGINT / SIGHUP past torchrun to its
ranks (``run_forwarding_signals(to_ranks=True)``): torchrun would give them 30 s and then SIGKILL them,
mid-save; the ranks save and exit 0, and torchrun with them. SIGKILL cannot be forwarded, so there the
parent death signal of each level takes the tree down.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Sequence

PR_SET_PDEATHSIG = 1
# Set by the torchrun launcher for its ranks: they were started by our own command, so they die with it.
# A rank started by the user's own torchrun or srun does not set a death signal (a closed terminal must
# not kill a run the user detached on purpose).
DIE_WITH_PARENT_ENV = "GSPO_DIE_WITH_PARENT"
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_libc = ctypes.CDLL(None, use_errno=True)
# The parent at start-up (this module is imported first thing by the command line): a later
# ``die_with_parent(STARTED_BY)`` tells whether the parent died before the death signal was set.
STARTED_BY = os.getppid()
_fork_hook_installed = False
_forking_thread_is_main = True
_forking_pid = 0


def pid_running(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (owned by anyone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_identity(pid: int) -> str | None:
    """``boot_id:start_ticks`` of process ``pid``: a pid is reused, this pair is not (the start time in clock
    ticks since boot, /proc/PID/stat field 22, on one boot). None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # the command name (field 2) is in parentheses and may hold spaces: count fields after its ")"
    return f"{boot}:{stat.rsplit(')', 1)[1].split()[19]}"


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when the thread that started it exits."""
    if _libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")


def die_with_parent(parent_pid: int) -> None:
    """Set the death signal, then exit at once when ``parent_pid`` is no longer our parent (it died
    before the signal was set: the kernel would never send it)."""
    set_parent_death_signal()
    if os.getppid() != parent_pid:
        os._exit(128 + signal.SIGKILL)


def _before_fork() -> None:
    global _forking_thread_is_main, _forking_pid
    _forking_thread_is_main = threading.current_thread() is threading.main_thread()
    _forking_pid = os.getpid()


def _after_fork_in_child() -> None:
    # The death signal follows the forking *thread*: a child forked from a short-lived helper thread
    # would be killed when that thread ends, so only children of the main thread get it. A parent killed
    # between the fork and this hook never triggers the signal: die_with_parent checks for that.
    if _forking_thread_is_main:
        die_with_parent(_forking_pid)


def kill_forked_children_with_parent() -> None:
    """Every later ``fork`` of this process (multiprocessing 'fork' children) dies with it. Idempotent."""
    global _fork_hook_installed
    if not _fork_hook_installed:
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _fork_hook_installed = True


def own_checkpoint_results_queue() -> None:
    """Create Megatron's checkpoint results queue ourselves, so its manager process (spawned, i.e. not
    covered by the fork hook) dies with this rank instead of lingering with its sockets after a SIGKILL.

    megatron-core 0.16.1 creates it lazily in ``filesystem_async._get_write_results_queue`` as
    ``mp.get_context("spawn").Manager().Queue()`` and keeps it in the module global ``_results_queue``."""
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))
    # srun sends SIGUSR1 (preemption) to every process of the step, this helper too, whose default action
    # is to die (then the checkpoint fails with EOFError). Blocked across the spawn, the mask survives exec:
    # the helper ignores them before unblocking; this rank gets a pending one once start() returns.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)
    try:
        manager.start(initializer=_results_queue_manager_init, initargs=(os.getpid(),))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    filesystem_async._results_queue = manager.Queue()


# the signals that stop a run with a checkpoint (trainer/preemption.py); helper processes ignore them: a
# terminal's Ctrl-C and srun's signals reach every process of the group or step, not only the trainer
PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _results_queue_manager_init(parent_pid: int) -> None:
    """Initializer of the results-queue manager: preemption signals are for the rank; it dies with it."""
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, PREEMPTION_SIGNALS)
    die_with_parent(parent_pid)


def wrap_command(command: Sequence[str]) -> list[str]:
    """``command`` run so that it dies with the calling process (the thread calling Popen)."""
    return [sys.executable, "-m", "gspo_megatron.processes", str(os.getpid()), "--", *command]


def worker_children(pid: int) -> list[int]:
    """The children of ``pid`` that are torchrun workers (``LOCAL_RANK`` in their environment), not its
    other helpers."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children += [int(c) for c in task.read_text().split()]
        except OSError:
            continue  # the thread ended meanwhile
    workers = []
    for child in sorted(set(children)):
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        if any(var.startswith(b"LOCAL_RANK=") for var in environ):
            workers.append(child)
    return workers


def run_forwarding_signals(command: Sequence[str], env: dict[str, str] | None = None, to_ranks: bool = False) -> int:
    """Run ``command`` (dying with us), forward SIGTERM / SIGINT / SIGHUP to it, wait for it; the exit
    status as a shell reports it (128 + signal when it was killed).

    ``to_ranks`` (``command`` is torchrun): the command runs in its own session, so a terminal's Ctrl-C
    reaches only us, and a signal goes to torchrun's workers as SIGTERM (a stop with a checkpoint,
    trainer/preemption.py), torchrun itself untouched: it would SIGKILL them 30 s later. A second signal
    kills the whole tree at once. After a first SIGINT a clean stop returns 130 (interrupted)."""
    proc = subprocess.Popen(wrap_command(command), env=env, start_new_session=to_ranks)
    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)
        if proc.poll() is not None:
            return
        if not to_ranks:
            proc.send_signal(signum)
            return
        workers = worker_children(proc.pid)
        if len(received) > 1:
            os.killpg(proc.pid, signal.SIGKILL)  # the workers die with torchrun (their death signal) too
        elif workers:
            for pid in workers:
                os.kill(pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)  # torchrun is still starting them: it stops them itself

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code == 0 and received and received[0] == signal.SIGINT:
        return 128 + signal.SIGINT
    return 128 - code if code < 0 else code


GROUP_KEEPER_SIGNAL = signal.SIGUSR1


def group_keeper_command(pgid: int) -> list[str]:
    """A process that SIGKILLs process group ``pgid`` when the calling thread dies, even by SIGKILL. For a
    command started in its own session whose children do not die with their parent (SGLang's
    detokenizer and multiprocessing resource tracker), which the leader's parent death signal alone
    leaves behind. The owner SIGKILLs the keeper when it stops the group itself."""
    return [sys.executable, "-m", "gspo_megatron.processes", "--keep-group", str(pgid), str(os.getpid())]


def keep_group(pgid: int, parent_pid: int) -> None:
    """Body of ``group_keeper_command``: wait for the parent's death, then kill group ``pgid``."""

    def kill_group(_signum=None, _frame=None):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the group ended by itself
        os._exit(0)

    # The keeper shares the owner's process group: a Ctrl-C there is for the owner, whose death then
    # triggers the keeper. Only the parent death signal (SIGUSR1, set below) makes it act.
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(GROUP_KEEPER_SIGNAL, kill_group)
    set_parent_death_signal(GROUP_KEEPER_SIGNAL)
    if os.getppid() != parent_pid:  # the parent died before the signal was set
        kill_group()
    while True:
        signal.pause()


def main(argv: list[str]) -> None:
    """``python -m gspo_megatron.processes PARENT_PID -- COMMAND...``: die with PARENT_PID, exec COMMAND.
    ``python -m gspo_megatron.processes --keep-group PGID PARENT_PID``: see ``group_keeper_command``."""
    if len(argv) == 3 and argv[0] == "--keep-group":
        keep_group(int(argv[1]), int(argv[2]))
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit("usage: python -m gspo_megatron.processes PARENT_PID -- COMMAND [ARGS...]")
    die_with_parent(int(argv[0]))
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
