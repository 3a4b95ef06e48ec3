"""PreemptionFlag with real signals sent to this process (and to a child that must exit cleanly)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from gspo_megatron.trainer.preemption import PreemptionFlag
from tests.slurm.cluster import REPO_ROOT, wait_until


def _deliver(sig: signal.Signals) -> None:
    os.kill(os.getpid(), sig)
    # The C handler runs at once; Python runs ours at the next bytecode boundary of the main thread.
    time.sleep(0.01)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_sets_the_flag_instead_of_killing(sig: signal.Signals) -> None:
    with PreemptionFlag() as flag:
        assert not flag.requested and flag.signal_name is None
        _deliver(sig)
        assert flag.requested
        assert flag.signal_name == sig.name


def test_first_signal_is_kept() -> None:
    with PreemptionFlag() as flag:
        _deliver(signal.SIGUSR1)
        _deliver(signal.SIGTERM)
        assert flag.signal_name == "SIGUSR1"


def test_uninstall_restores_previous_handlers() -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    # whatever SIGTERM did before (pytest's cluster fixtures tear down on SIGTERM, tests/slurm/cluster.py)
    term_before = signal.getsignal(signal.SIGTERM)
    try:
        flag = PreemptionFlag().install()
        assert flag.installed
        assert signal.getsignal(signal.SIGTERM) == flag._handle
        flag.uninstall()
        assert not flag.installed
        assert signal.getsignal(signal.SIGTERM) == term_before
        _deliver(signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] and not flag.requested
        flag.uninstall()  # a second uninstall is a no-op
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_install_twice_is_an_error_and_reinstall_clears_the_flag() -> None:
    flag = PreemptionFlag(signals=(signal.SIGUSR1,))
    with flag:
        with pytest.raises(RuntimeError, match="already installed"):
            flag.install()
        _deliver(signal.SIGUSR1)
        assert flag.requested
    with flag:
        assert not flag.requested


def test_a_child_checkpoints_and_exits_zero_on_sigterm(tmp_path) -> None:
    """What the trainer does with the flag: finish the step, write the checkpoint, return normally."""
    program = textwrap.dedent(f"""
        import pathlib, sys, time
        from gspo_megatron.trainer.preemption import PreemptionFlag
        out = pathlib.Path({str(tmp_path)!r})
        with PreemptionFlag() as flag:
            (out / "ready").write_text("")
            step = 0
            while not flag.requested and step < 2000:
                time.sleep(0.01)  # one "training step"
                step += 1
            (out / "checkpoint").write_text(f"{{flag.signal_name}} after {{step}} steps")
        sys.exit(0 if flag.requested else 1)
    """)
    child = subprocess.Popen([sys.executable, "-c", program], cwd=REPO_ROOT,
                             env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        wait_until(lambda: (tmp_path / "ready").exists() or child.poll() is not None, 30, "the child to start")
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == 0
    finally:
        child.kill()
    assert (tmp_path / "checkpoint").read_text().startswith("SIGTERM after ")


def test_checkpoint_helper_survives_the_signals_srun_sends_to_the_whole_step() -> None:
    """srun passes SIGUSR1 to every process of a step: Megatron's checkpoint results-queue manager (spawned
    by gspo_megatron.processes.own_checkpoint_results_queue) must neither die of it while it starts nor
    after, and the rank must still see the signal. Found by the multi-node preemption test, where the
    manager died and the preemption checkpoint failed with EOFError."""
    program = textwrap.dedent("""
        import os, signal, threading, time
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        from gspo_megatron.processes import own_checkpoint_results_queue
        from gspo_megatron.trainer.preemption import PreemptionFlag
        with PreemptionFlag() as flag:
            done = threading.Event()
            def storm():  # what srun does, over and over, while the manager starts
                while not done.is_set():
                    os.killpg(0, signal.SIGUSR1)
                    time.sleep(0.01)
            thread = threading.Thread(target=storm)
            thread.start()
            own_checkpoint_results_queue()
            done.set()
            thread.join()
            for sig in (signal.SIGUSR1, signal.SIGTERM):
                os.killpg(0, sig)
            time.sleep(0.5)
            queue = filesystem_async._results_queue
            queue.put("alive")
            print(queue.get(timeout=10), flag.requested, flush=True)
    """)
    child = subprocess.run([sys.executable, "-c", program], cwd=REPO_ROOT, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, start_new_session=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.split() == ["alive", "True"]
