"""User tools for the multi-turn tests (loaded by ``module:function`` like user rewards, in the tool worker)."""
import time


def echo(text: str) -> str:
    return f"echo:{text}"


def explode(**_arguments) -> str:
    raise RuntimeError("the tool blew up")


def hang(**_arguments) -> str:
    time.sleep(600)
    return "never"


def flood(**_arguments) -> str:
    print("noise on the tool's stdout must not corrupt the worker's replies")
    return "x" * 5_000_000


def spawn_and_hang(pid_file: str) -> str:
    """Starts a child that would outlive the tool (a shell sleeping), records its pid, then hangs."""
    import subprocess

    child = subprocess.Popen(["sleep", "600"])
    with open(pid_file, "w") as f:
        f.write(str(child.pid))
    time.sleep(600)
    return "never"


def loud(**_arguments) -> str:
    """Prints 8 MB per call on stdout and stderr (a debug print left in): the log must stay bounded."""
    import sys

    sys.stdout.write("o" * (4 << 20) + "\n")
    sys.stderr.write("e" * (4 << 20) + "\n")
    return "done"
