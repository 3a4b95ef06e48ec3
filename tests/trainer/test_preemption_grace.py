"""The pure pieces of stopping on a signal: whether a step's rest and the save fit in the grace, which OS
errors are bad input, and the launcher's search for torchrun's workers."""
import errno
import os
import subprocess
import sys

from gspo_megatron.processes import worker_children
from gspo_megatron.reporting import is_bad_input
from gspo_megatron.trainer.preemption import fits_in_grace


def test_fits_in_grace_adds_the_time_gone_the_rest_of_the_step_and_the_save():
    assert fits_in_grace(30.0, elapsed_s=5.0, rest_of_step_s=10.0, save_s=15.0)
    assert not fits_in_grace(30.0, elapsed_s=5.0, rest_of_step_s=10.0, save_s=15.1)
    assert not fits_in_grace(0.001, elapsed_s=0.0, rest_of_step_s=0.01, save_s=0.0)


def test_only_os_errors_on_a_path_are_bad_input():
    assert not is_bad_input(BrokenPipeError(errno.EPIPE, "Broken pipe"))  # a dead reward worker: a crash
    assert not is_bad_input(OSError(errno.ENOSPC, "No space left on device"))  # no path: say which elsewhere
    assert is_bad_input(FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/x.jsonl"))
    assert is_bad_input(FileNotFoundError("/data/x: not a dist_checkpointing checkpoint"))  # our own message
    assert not is_bad_input(RuntimeError("boom"))


def test_worker_children_are_the_children_with_a_local_rank():
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env={**os.environ, "LOCAL_RANK": "0"})
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                              env={k: v for k, v in os.environ.items() if k != "LOCAL_RANK"})
    try:
        import time

        time.sleep(0.5)  # the environment is readable once the child has exec'd
        assert worker_children(os.getpid()) == [rank.pid]
    finally:
        rank.kill()
        helper.kill()
        rank.wait()
        helper.wait()
