"""Every child dies with its parent, even on SIGKILL (gspo_megatron/processes.py)."""
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.reliability.helpers import REPO, describe, kill_tagged, tagged_env, wait_until_gone


def _run_parent(code: str, ready_lines: int = 1):
    """Start ``python -c code`` in a tagged environment; wait for its ``ready_lines`` lines of output."""
    env, tag = tagged_env()
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, text=True)
    lines = [proc.stdout.readline() for _ in range(ready_lines)]
    assert all(lines), f"parent ended early (rc {proc.wait()})"
    return proc, tag, lines


def _sigkill_and_check(proc, tag, timeout_s=15.0):  # generous: a loaded CI machine tears processes down slowly
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = wait_until_gone(tag, timeout_s)
    kill_tagged(tag)
    assert not left, "outlived their SIGKILLed parent:\n" + describe(left)


def test_wrapped_command_dies_with_parent_on_sigkill():
    proc, tag, _ = _run_parent("""
        import subprocess, sys
        from gspo_megatron.processes import wrap_command
        child = subprocess.Popen(wrap_command(["sleep", "60"]))
        print(child.pid, flush=True)
        child.wait()
    """)
    _sigkill_and_check(proc, tag)


def test_forked_children_die_with_parent():
    # what Megatron's checkpoint writer does: multiprocessing 'fork' children of a rank
    proc, tag, _ = _run_parent("""
        import multiprocessing as mp, time
        from gspo_megatron.processes import kill_forked_children_with_parent
        kill_forked_children_with_parent()
        child = mp.get_context("fork").Process(target=time.sleep, args=(60,))
        child.start()
        print(child.pid, flush=True)
        child.join()
    """)
    _sigkill_and_check(proc, tag)


def test_forked_child_dies_when_its_parent_dies_before_the_fork_hook_runs():
    """The race a loaded machine hits: the parent is killed after fork() but before the child has set its
    death signal, so the kernel never sends it. A hook registered first holds the child back until the
    parent has exited; the child must still go."""
    proc, tag, _ = _run_parent("""
        import os, time
        os.register_at_fork(after_in_child=lambda: time.sleep(2))  # runs before the hook below
        from gspo_megatron.processes import kill_forked_children_with_parent
        kill_forked_children_with_parent()
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        print("forked", flush=True)
        os._exit(0)  # the parent is gone before the child's hooks are done
    """)
    proc.wait()
    left = wait_until_gone(tag, 15.0)
    kill_tagged(tag)
    assert not left, "a child forked just before its parent died outlived it:\n" + describe(left)


def test_checkpoint_results_queue_manager_dies_with_rank():
    # Megatron's spawned results-queue manager (filesystem_async._results_queue) kept sockets open forever
    proc, tag, _ = _run_parent("""
        import time
        from gspo_megatron.processes import own_checkpoint_results_queue
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        own_checkpoint_results_queue()
        assert filesystem_async._get_write_results_queue() is filesystem_async._results_queue
        print("ready", flush=True)
        time.sleep(60)
    """)
    _sigkill_and_check(proc, tag)


def test_forwarding_launcher_passes_sigterm_and_reports_it():
    proc, tag, lines = _run_parent("""
        import sys
        from gspo_megatron.processes import run_forwarding_signals
        print("ready", flush=True)
        code = run_forwarding_signals([sys.executable, "-c",
            "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(7)); print('child', flush=True); time.sleep(60)"])
        print("exit", code, flush=True)
    """, ready_lines=2)
    assert lines[1].strip() == "child"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=10)
    assert out.strip() == "exit 7"  # the child got SIGTERM (its handler exited 7), the launcher outlived it
    left = wait_until_gone(tag, 5)
    kill_tagged(tag)
    assert not left, describe(left)


TORCHRUN = """
import os, signal, subprocess, sys
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, lambda n, _f: print("torchrun got", signal.Signals(n).name, flush=True))
rank = subprocess.Popen([sys.executable, sys.argv[1]], env={**os.environ, "LOCAL_RANK": "0"})
sys.exit(rank.wait())
"""
RANK = """
import signal, sys, time
def save_and_exit(n, _f):  # what a rank does on a stop signal: checkpoint, then exit 0
    print("rank got", signal.Signals(n).name, flush=True)
    sys.exit(0)
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, save_and_exit)
print("rank ready", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("sig, code", [(signal.SIGHUP, 0), (signal.SIGINT, 130), (signal.SIGTERM, 0)])
def test_the_nproc_launcher_stops_its_ranks_on_every_signal_with_the_single_process_status(tmp_path, sig, code):
    """train --nproc: SIGHUP, SIGINT and SIGTERM to the launcher reach each rank as SIGTERM (a stop with a
    checkpoint), torchrun untouched, and the launcher exits as one process does (entry.py: 0, 130 after
    Ctrl-C; test_signals.py runs the real trainer for SIGHUP and SIGINT in one process, SIGTERM at 2)."""
    (tmp_path / "torchrun.py").write_text(TORCHRUN)
    (tmp_path / "rank.py").write_text(RANK)
    proc, tag, lines = _run_parent(f"""
        import sys
        from gspo_megatron.processes import run_forwarding_signals
        print("ready", flush=True)
        code = run_forwarding_signals([sys.executable, {str(tmp_path / 'torchrun.py')!r}, {str(tmp_path / 'rank.py')!r}],
                                      to_ranks=True)
        print("exit", code, flush=True)
    """, ready_lines=2)
    assert lines[1].strip() == "rank ready"
    time.sleep(0.3)  # the rank's environment (LOCAL_RANK) is readable once it has exec'd: it has, it printed
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=20)
    left = wait_until_gone(tag, 5)
    kill_tagged(tag)
    assert not left, describe(left)
    assert out.split("\n")[:2] == ["rank got SIGTERM", f"exit {code}"], out
