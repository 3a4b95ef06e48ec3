"""Run untrusted programs (model-written code) in a sandbox; the caller's process survives anything.

Layers, strongest first (``docs/rewards.md`` has the table of what each one stops):

1. Namespaces (``isolation: auto`` when the kernel allows it, ``namespaces`` to require them): a new
   network namespace (no interfaces but a downed loopback: no network at all), a pid namespace whose
   pid 1 is our init (when it exits the kernel kills every process left, daemonised or not), a mount
   namespace whose filesystem is an allowlist (``visible_paths``: the interpreter's files, the system
   libraries, a few device files and ``expose_paths``, read-only; nothing else of the host, wherever the
   project, its data or a run folder lies) and a working directory that is a fresh size-limited tmpfs;
   a fresh /proc; ipc and uts namespaces. As root this needs nothing else; as another user it needs
   unprivileged user namespaces.
2. Privileges: as root the program runs under a throw-away uid (``uid_base`` + a per-call offset),
   which makes RLIMIT_NPROC effective (the kernel never applies it to uid 0) and file permissions
   apply; in a user namespace every capability is dropped instead. ``no_new_privs`` always.
3. Resource limits (setrlimit, always): CPU seconds, address space, file size, open files, processes,
   no core dumps; the wall clock and the output size are enforced by the supervising process, which
   kills the program's process group (and, with namespaces, everything in its pid namespace).
4. A scrubbed environment (PATH, HOME, LANG, TMPDIR only) and ``python -I`` (isolated mode), with
   ``-S`` (no site-packages, standard library only) unless ``site_packages: true``.

The supervising code is ``_sandbox_launcher.py``, run as a separate interpreter so that it never
shares memory or signal handlers with the reward worker.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from typing import Any, Literal

from gspo_megatron.typed_config import check

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_launcher.py")
_SETUP_SLACK_S = 5.0  # launcher start, namespace and tmpfs set-up, reply; per call, not per case
_PER_RUN_SLACK_S = 0.5  # fork/exec and killing leftovers between runs
_call_counter = itertools.count()


@dataclasses.dataclass
class SandboxConfig:
    """Limits and isolation for one sandboxed program run (per test case)."""

    isolation: Literal["auto", "namespaces", "none"] = "auto"
    case_timeout_s: float = 5.0
    cpu_time_s: int = 5
    memory_mb: int = 1024
    max_output_bytes: int = 1 << 20
    max_file_mb: int = 16
    workdir_size_mb: int = 64
    max_processes: int = 16
    max_open_files: int = 64
    python: str = ""  # interpreter for the program; "" = the reward worker's own (sys.executable)
    site_packages: bool = False  # False: standard library only (python -S: faster start, less to reach)
    run_as_uid: bool = True  # as root: switch to a throw-away uid (needed for RLIMIT_NPROC)
    uid_base: int = 1_500_000_000
    # with namespaces the program sees only visible_paths(): the interpreter's files, SYSTEM_PATHS, DEVICES,
    # its working directory, and these (read-only; e.g. a data folder a test harness must read)
    expose_paths: list[str] = dataclasses.field(default_factory=list)

    def validate(self, path: str) -> None:
        check(self.case_timeout_s > 0, f"{path}.case_timeout_s", "must be > 0")
        check(self.cpu_time_s >= 1, f"{path}.cpu_time_s", "must be >= 1 (RLIMIT_CPU is in whole seconds)")
        check(self.memory_mb >= 64, f"{path}.memory_mb", "must be >= 64 (a Python interpreter needs ~30 MB)")
        check(self.max_output_bytes >= 1024, f"{path}.max_output_bytes", "must be >= 1024")
        check(self.max_file_mb >= 1, f"{path}.max_file_mb", "must be >= 1")
        check(self.workdir_size_mb >= 1, f"{path}.workdir_size_mb", "must be >= 1")
        check(self.max_processes >= 1, f"{path}.max_processes", "must be >= 1")
        check(self.max_open_files >= 16, f"{path}.max_open_files", "must be >= 16")
        check(0 < self.uid_base < 2**32 - 2**27, f"{path}.uid_base", "must leave room for 2**27 uids")
        check(self.python == "" or os.path.isabs(self.python), f"{path}.python", "must be an absolute path")
        for i, p in enumerate(self.expose_paths):
            check(os.path.isabs(p), f"{path}.expose_paths[{i}]", f"{p!r} is not absolute")


@dataclasses.dataclass
class Run:
    """One program execution: ``python <args>`` with ``stdin``; judged when ``expected_stdout`` is set.
    ``cases`` scales the per-case wall-clock and CPU limits (a harness that runs n tests in one process
    gets n times each)."""

    args: list[str]
    stdin: str = ""
    expected_stdout: str | None = None
    return_stdout: bool = False
    cases: int = 1


@dataclasses.dataclass
class RunResult:
    exit_code: int | None
    signal: int | None
    timed_out: bool
    output_overflow: bool
    elapsed_s: float
    stderr_tail: str
    passed: bool | None  # None when no expected output was given
    stdout: str | None = None


@dataclasses.dataclass
class SandboxReply:
    runs: list[RunResult]
    isolation: dict[str, Any]
    error: str | None  # set-up failure, launcher crash or overall deadline; the runs are then missing


class SandboxUnavailable(RuntimeError):
    """The configured isolation cannot be provided on this machine (raised at set-up, never per sample)."""


def _python(cfg: SandboxConfig) -> str:
    return cfg.python or sys.executable


# what every interpreter needs besides its own prefix: the dynamic loader, libc and the other shared
# libraries (the ld.so cache names where they are), and the device files programs open
SYSTEM_PATHS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/etc/ld.so.cache")
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


def visible_paths(cfg: SandboxConfig, workdir: str) -> list[str]:
    """Every host path a sandboxed program can see with namespaces (the launcher binds each read-only into
    an empty root; the working directory is a fresh tmpfs at ``workdir``): the allowlist."""
    return sorted(set(_expose_paths(cfg)) | set(SYSTEM_PATHS) | set(DEVICES) | {workdir})


def _expose_paths(cfg: SandboxConfig) -> list[str]:
    """The interpreter's directories (its prefixes: standard library, and site-packages when enabled), and
    ``expose_paths``."""
    python = _python(cfg)
    if python == sys.executable:
        paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    else:
        # <prefix>/bin/python: the prefix, and for a venv the base interpreter's prefix too
        paths = [os.path.dirname(os.path.dirname(python)),
                 os.path.dirname(os.path.dirname(os.path.realpath(python)))]
    return sorted(set(paths + list(cfg.expose_paths)))


def _sandbox_uid(cfg: SandboxConfig) -> int | None:
    """A uid no other live sandbox uses: the worker's pid (< 2**22) and a call counter (mod 32)."""
    if not cfg.run_as_uid or os.geteuid() != 0:
        return None
    return cfg.uid_base + ((os.getpid() & 0x3FFFFF) << 5 | next(_call_counter) & 31)


def _force_rmtree(path: str) -> None:
    """Remove a working directory even if the program made parts of it unwritable."""
    def make_writable_and_retry(func, p, _exc):
        os.chmod(os.path.dirname(p), stat.S_IRWXU)
        func(p)

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=make_writable_and_retry)
    else:
        shutil.rmtree(path, onerror=make_writable_and_retry)


def launcher_request(cfg: SandboxConfig, workdir: str, files: dict[str, str], runs: list[Run],
                     stop_on_failure: bool) -> dict[str, Any]:
    """The JSON request ``_sandbox_launcher.py`` reads on stdin."""
    python = _python(cfg)
    return {
        "parent_pid": os.getpid(),
        "workdir": workdir,
        "files": files,
        "runs": [{"argv": [python, "-I", *([] if cfg.site_packages else ["-S"]), *r.args],
                  "stdin": r.stdin, "expected_stdout": r.expected_stdout, "return_stdout": r.return_stdout,
                  "timeout_s": r.cases * cfg.case_timeout_s, "cpu_time_s": r.cases * cfg.cpu_time_s} for r in runs],
        "stop_on_failure": stop_on_failure,
        "limits": {k: getattr(cfg, k) for k in ("memory_mb", "max_output_bytes", "max_file_mb",
                                                 "max_processes", "max_open_files", "workdir_size_mb")},
        "isolation": {"mode": cfg.isolation, "visible_paths": [p for p in visible_paths(cfg, workdir) if p != workdir]},
        "uid": _sandbox_uid(cfg),
        "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
                "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"},
    }


def run_in_sandbox(cfg: SandboxConfig, files: dict[str, str], runs: list[Run],
                   stop_on_failure: bool = False) -> SandboxReply:
    """Write ``files`` into a fresh working directory and execute ``runs`` in order, each in the sandbox.

    Returns one ``RunResult`` per run executed (fewer when ``stop_on_failure`` stops at the first run
    whose output does not match). Never raises for anything the program does.
    """
    workdir = tempfile.mkdtemp(prefix="gspo-sandbox-")
    request = launcher_request(cfg, workdir, files, runs, stop_on_failure)
    deadline_s = _SETUP_SLACK_S + sum(r["timeout_s"] + _PER_RUN_SLACK_S for r in request["runs"])
    failure = None
    try:
        # The launcher runs on our own interpreter with -S (no site-packages) and a minimal environment:
        # it needs only the standard library, and it must not inherit the worker's secrets.
        proc = subprocess.Popen([sys.executable, "-I", "-S", LAUNCHER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, cwd="/",
                                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        try:
            out, err = proc.communicate(json.dumps(request).encode(), timeout=deadline_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher's death signal takes down init and the program
            out, err = proc.communicate()
            failure = f"sandbox did not finish within {deadline_s:.1f} s"
        except BaseException:
            # interrupted in the calling process (an in-process reward's deadline or a stop signal,
            # rewards/in_process.py): the launcher and its program go with the call, then the interruption goes on
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    finally:
        _force_rmtree(workdir)
    if failure is None and (proc.returncode != 0 or not out):
        failure = f"sandbox launcher exited with {proc.returncode}: {err.decode(errors='replace')[-500:]}"
    if failure is not None:
        return SandboxReply(runs=[], isolation={}, error=failure)
    reply = json.loads(out)
    return SandboxReply(runs=[RunResult(**r) for r in reply["runs"]], isolation=reply["isolation"],
                        error=reply["setup_error"])


def python_tool(cfg: SandboxConfig, code: str, timeout_s: float) -> tuple[str, bool, bool, bool]:
    """The multi-turn ``python`` tool (rollout/tools.py): ``code`` run as ``python main.py`` in the sandbox with
    ``cfg``'s limits and a wall-clock limit of ``timeout_s``. Returns (answer text, error, timed_out,
    truncated): its stdout, or why it failed. Never raises for anything the program does."""
    cfg = dataclasses.replace(cfg, case_timeout_s=timeout_s)
    reply = run_in_sandbox(cfg, {"main.py": code}, [Run(["main.py"], return_stdout=True)])
    if reply.error is not None:
        return f"error: {reply.error}", True, False, False
    run = reply.runs[0]
    if run.timed_out:
        return f"error: timed out after {timeout_s:g} s", True, True, False
    if run.output_overflow:  # the launcher stops a program at the byte limit (SIGKILL): say that, with the head
        return (f"error: the output passed {cfg.max_output_bytes} bytes: cut there, and the program stopped\n"
                f"{run.stdout or ''}"), True, False, True
    if run.signal is not None:
        return f"error: killed by {signal_name(run.signal)}\n{run.stderr_tail}", True, False, False
    if run.exit_code != 0:
        return f"error: exit code {run.exit_code}\n{run.stderr_tail}", True, False, False
    return run.stdout or "", False, False, False


def signal_name(number: int) -> str:
    """``11`` -> ``"SIGSEGV"`` (a number this Python does not name: ``"signal 99"``)."""
    return {s.value: s.name for s in signal.Signals}.get(number, f"signal {number}")


def probe_isolation(cfg: SandboxConfig) -> dict[str, Any]:
    """Run a trivial program once and return the isolation report; raise ``SandboxUnavailable`` when the
    interpreter cannot run in the sandbox or ``isolation: namespaces`` cannot be honoured.

    Called once at set-up by the reward pool so a misconfigured sandbox fails loudly instead of
    scoring every code response 0.
    """
    reply = run_in_sandbox(cfg, {"probe.py": "import json, socket, sys\nprint(sum(map(int, sys.stdin.read().split())))\n"},
                           [Run(["probe.py"], stdin="1 2", expected_stdout="3")])
    if reply.error is not None:
        raise SandboxUnavailable(f"rewards.code.sandbox: {reply.error}")
    run = reply.runs[0]
    if not run.passed:
        raise SandboxUnavailable(
            f"rewards.code.sandbox: the interpreter {_python(cfg)} could not run a trivial program in the "
            f"sandbox (exit {run.exit_code}, signal {run.signal}): {run.stderr_tail.strip()[-400:]}. "
            "Set rewards.code.sandbox.python to an interpreter every user can read, add the directories it "
            "needs to expose_paths, or raise memory_mb.")
    return reply.isolation


__all__ = ["DEVICES", "Run", "RunResult", "SYSTEM_PATHS", "SandboxConfig", "SandboxReply", "SandboxUnavailable",
           "probe_isolation", "run_in_sandbox", "visible_paths"]
