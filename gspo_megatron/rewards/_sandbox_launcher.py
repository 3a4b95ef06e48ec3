"""Sandbox launcher: runs untrusted programs inside namespaces and resource limits (Linux).

This file is executed as a script (``python -I -S _sandbox_launcher.py``) by ``sandbox.py``; it imports
only the standard library so that it starts in ~10 ms and never touches the trainer's state. It reads
one JSON request on stdin and writes one JSON reply on stdout (see ``sandbox.py`` for both shapes).

Process tree (namespace mode):

    reward worker ── launcher (host pid ns, root or unprivileged) ── init (pid 1 of a new pid ns)
                                                                        └── program (one per test run)

* The launcher calls ``unshare`` (net, pid, mount, ipc, uts; plus a user namespace when it is not
  root), then forks ``init``. Because init is pid 1, the kernel SIGKILLs every process left in the
  namespace when init exits, so nothing the program forks, daemonises or ``setsid``-escapes survives.
* ``init`` builds the filesystem view (an allowlist: a tmpfs root holding read-only binds of the
  interpreter's files, system libraries and a few device files, a size-limited tmpfs working directory,
  a fresh /proc; ``_setup_filesystem``), then runs each program: fork, drop privileges,
  set rlimits, exec. Between runs it kills everything else in the namespace (``kill(-1)`` as pid 1).
* Every process has a parent-death signal, so killing the launcher (what the reward worker does on its
  deadline) or the worker itself tears the whole tree down.

Fallback mode (no namespaces allowed): the launcher runs the programs itself as a child subreaper, in
their own process group, with the same rlimits (and, as root, the same uid drop). See docs/rewards.md
for what that mode does not contain.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import select
import signal
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MS_BIND = 4096
MNT_DETACH = 2
MS_REC = 16384
MS_PRIVATE = 1 << 18

# mount_setattr has this number on every Linux architecture (unified table, 5.12+).
SYS_MOUNT_SETATTR = 442
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2

PR_SET_PDEATHSIG = 1
PR_SET_SECUREBITS = 28
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
# NOROOT + NO_SETUID_FIXUP + KEEP_CAPS, each with its lock bit: uid 0 in a user namespace gets no
# capabilities back on exec.
SECUREBITS_LOCKED_NOROOT = 0b101111

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0),
                       ctypes.c_ulong(0)), f"prctl({option})")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {fstype or source} on {target}")


def _mount_setattr(path: str, recursive: bool, attr_set: int, attr_clr: int) -> None:
    attr = MountAttr(attr_set, attr_clr, 0, 0)
    _check(_libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), path.encode(),
                         ctypes.c_uint(AT_RECURSIVE if recursive else 0), ctypes.byref(attr),
                         ctypes.c_size_t(ctypes.sizeof(attr))), f"mount_setattr {path}")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def _drop_all_capabilities() -> None:
    """For uid 0 inside a user namespace: lock out root semantics, then clear every capability set."""
    _prctl(PR_SET_SECUREBITS, SECUREBITS_LOCKED_NOROOT)
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3: two 32-bit data words
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "capset")


# ---------------------------------------------------------------------------------------------------
# Output comparison (also imported by sandbox.py so both sides agree on what "passed" means).

def _tokens_match(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    return abs(x - y) <= 1e-6 * max(1.0, abs(y))


def outputs_match(actual: str, expected: str) -> bool:
    """Judge-style comparison: trailing whitespace and blank trailing lines are ignored; failing an exact
    line match, whitespace-separated tokens must match (numbers to 1e-6 relative)."""
    norm = lambda s: [line.rstrip() for line in s.rstrip().splitlines()]  # noqa: E731
    if norm(actual) == norm(expected):
        return True
    got, want = actual.split(), expected.split()
    return len(got) == len(want) and all(_tokens_match(g, w) for g, w in zip(got, want))


# ---------------------------------------------------------------------------------------------------
# Namespace and filesystem set-up.

def _enter_namespaces(report: dict) -> str | None:
    """unshare net/pid/mount/ipc/uts; returns "root", "user" (via a user namespace) or None."""
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    if os.geteuid() == 0:
        if _libc.unshare(ctypes.c_int(flags)) == 0:
            return "root"
        report["notes"].append(f"unshare as root: {os.strerror(ctypes.get_errno())}")
    uid, gid = os.getuid(), os.getgid()
    if _libc.unshare(ctypes.c_int(flags | CLONE_NEWUSER)) != 0:
        report["notes"].append(f"unshare with a user namespace: {os.strerror(ctypes.get_errno())}")
        return None
    if uid == 0:
        # namespace root maps to host uid 0, which the kernel exempts from RLIMIT_NPROC
        report["notes"].append("host root without CAP_SYS_ADMIN: RLIMIT_NPROC is not enforced, fork bombs "
                               "are bounded by the time limits only")
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    return "user"


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _mirror_symlinks(path: str, root: str, bound: list[str]) -> None:
    """Recreate under ``root`` each symlink on the way to ``path`` (``/lib -> usr/lib``), so the program
    reaches the real path the same way; a link inside an already bound tree is already there."""
    host = ""
    for part in path.strip("/").split("/"):
        host += "/" + part
        if any(_under(host, b) for b in bound):
            return
        if os.path.islink(host):
            link = root + host
            if not os.path.lexists(link):
                os.makedirs(os.path.dirname(link), exist_ok=True)
                os.symlink(os.readlink(host), link)
            return _mirror_symlinks(os.path.realpath(host) + path[len(host):], root, bound)


def _pivot_root(root: str) -> None:
    """Make ``root`` this mount namespace's ``/`` and detach the old one (pivot_root(".", ".") then umount:
    no directory for the old root is needed). Python has no wrapper and glibc none either: the raw syscall."""
    number = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}[os.uname().machine]
    os.chdir(root)
    _check(_libc.syscall(ctypes.c_long(number), b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", ctypes.c_int(MNT_DETACH)), "umount the old root")
    os.chdir("/")


def _setup_filesystem(req: dict, report: dict, ns: str) -> None:
    """Runs in init (pid 1, root of its namespaces). The program's filesystem is an allowlist: a fresh tmpfs
    root holding read-only bind mounts of ``visible_paths`` (the interpreter's files, system libraries,
    a few device files; sandbox.visible_paths) and the working directory, a fresh size-limited tmpfs. The
    tmpfs is mounted over the (empty) working folder in this private namespace, made the root with
    pivot_root, and the old root is detached: nothing else of the host is reachable, whatever its path."""
    iso, limits = req["isolation"], req["limits"]
    workdir = req["workdir"]
    os.umask(0o022)
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)  # nothing below propagates to the host

    # the new root's mount point: the call's own working folder (fresh, empty, owned by this uid), which is
    # no ancestor of anything the program may see; a mount over it in this private namespace hides nothing
    # else (over /tmp it would hide an interpreter or venv that lives under /tmp)
    root = workdir
    shown = [p for p in iso["visible_paths"] if p != workdir and os.path.exists(p)]  # workdir: its own tmpfs
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    real = sorted({os.path.realpath(p) for p in shown})
    bound = [p for p in real if not any(q != p and _under(p, q) for q in real)]
    for path in shown:
        _mirror_symlinks(path, root, bound)
    for path in bound:
        target = root + path
        if os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "w").close()  # a file bind-mounts onto a file
        _mount(path, target, None, MS_BIND | MS_REC, None)
    report["visible_paths"] = bound

    os.makedirs(root + workdir, exist_ok=True)
    os.makedirs(root + "/proc", exist_ok=True)
    owner = req["uid"] if ns == "root" and req["uid"] is not None else 0
    _mount("tmpfs", root + workdir, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={limits['workdir_size_mb']}m,mode=700,uid={owner},gid={owner}")
    report["workdir_tmpfs"] = True
    try:
        # before the pivot: in a user namespace the kernel mounts a proc only while a fully visible one is
        # in the mount namespace (the host's, until the old root is detached)
        _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        report["private_proc"] = True
    except OSError as err:  # some containers mask /proc so a user namespace may not mount a new one
        report["notes"].append(str(err))
    _pivot_root(root)

    try:
        # not nodev: /dev/null and friends must keep working (device files stay permission-checked)
        _mount_setattr("/", True, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0)
        _mount_setattr(workdir, False, 0, MOUNT_ATTR_RDONLY)
        report["readonly_fs"] = True
    except OSError as err:  # kernels before 5.12 have no mount_setattr: the bound paths keep their host modes
        report["notes"].append(str(err))


def _write_files(req: dict, uid: int | None) -> None:
    for name, text in req["files"].items():
        if "/" in name or name.startswith("."):
            raise ValueError(f"bad sandbox file name {name!r}")
        path = os.path.join(req["workdir"], name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        if uid is not None:
            os.chown(path, uid, uid)


# ---------------------------------------------------------------------------------------------------
# Running one program.

def _child_exec(run: dict, req: dict, ns: str | None, fds: tuple[int, int, int]) -> None:
    """In the forked child: becomes the untrusted program. Never returns."""
    try:
        os.setsid()  # own session and process group, killed as a group
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, 65536)
        os.chdir(req["workdir"])
        limits = req["limits"]
        cpu = int(run["cpu_time_s"])
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        mem = limits["memory_mb"] * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        size = limits["max_file_mb"] * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits["max_open_files"], limits["max_open_files"]))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        # RLIMIT_NPROC is per real uid and ignored for uid 0, hence the uid drop below.
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"], limits["max_processes"]))
        uid = req["uid"]
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        elif ns == "user":
            _drop_all_capabilities()
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        if ns is None:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
        os.execve(run["argv"][0], run["argv"], req["env"])
    except BaseException as err:  # report why the program could not start, then die without cleanup
        os.write(2, f"sandbox: could not start {run['argv'][0]}: {err!r}\n".encode())
    os._exit(127)


def _kill_leftovers(ns: str | None, pgid: int) -> None:
    """Kill everything the program left behind and reap it."""
    if ns is not None:
        if os.getpid() != 1:
            raise RuntimeError("kill(-1) is only safe from pid 1 of our own pid namespace")
        try:
            os.kill(-1, signal.SIGKILL)  # every process in this pid namespace except init itself
        except ProcessLookupError:
            pass  # nothing was left
    else:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the group is already gone
        _kill_adopted_orphans()
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _kill_adopted_orphans() -> None:
    """As a child subreaper, processes that escaped the process group are re-parented to us: kill them."""
    me = os.getpid()
    for _ in range(100):
        children = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue  # the process exited while we listed /proc
            ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
            if ppid == me:
                children.append(int(entry))
        if not children:
            return
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it exited since the scan
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass  # reaped by the loop in _kill_leftovers


def _pidfd_open(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except OSError as err:
        if err.errno != errno.ENOSYS:
            raise
        return None  # kernel before 5.3


def _run_program(run: dict, req: dict, ns: str | None) -> dict:
    """Fork, exec ``run["argv"]``, feed stdin, collect capped stdout/stderr, enforce the wall clock."""
    limits = req["limits"]
    max_out = limits["max_output_bytes"]
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child_exec(run, req, ns, (in_r, out_w, err_w))
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    stdin = run.get("stdin", "").encode()
    deadline = start + run["timeout_s"]
    out, err = bytearray(), bytearray()
    timed_out = overflow = False
    status = None
    pidfd = _pidfd_open(pid)
    poller = select.poll()
    open_fds = {out_r: out, err_r: err}
    for fd in open_fds:
        poller.register(fd, select.POLLIN)
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    if stdin:
        os.set_blocking(in_w, False)
        poller.register(in_w, select.POLLOUT)
    else:
        os.close(in_w)
    while status is None or open_fds:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = status is None  # a program that exited but left its pipes open is not late
            break
        if pidfd is None and status is None:  # kernels before 5.3: poll the exit status on a short tick
            remaining = min(remaining, 0.01)
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                status = code
                deadline = min(deadline, time.monotonic() + 0.2)
        for fd, event in poller.poll(remaining * 1000):
            if fd == pidfd:
                status = os.waitpid(pid, 0)[1]
                poller.unregister(pidfd)
                if open_fds:  # the program is gone: give its pipes a moment, not the whole deadline
                    deadline = min(deadline, time.monotonic() + 0.2)
            elif fd == in_w:
                try:
                    written = os.write(in_w, stdin)
                except BrokenPipeError:
                    written = len(stdin)  # the program stopped reading; that is its business
                stdin = stdin[written:]
                if not stdin:
                    poller.unregister(in_w)
                    os.close(in_w)
            else:
                chunk = os.read(fd, 65536)
                if not chunk:
                    poller.unregister(fd)
                    os.close(fd)
                    del open_fds[fd]
                    continue
                buf = open_fds[fd]
                buf += chunk
                if len(buf) > max_out:
                    overflow = True
                    break
        if overflow:
            break
    if status is None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the group emptied itself between the deadline and the kill; waitpid still reaps it
        status = os.waitpid(pid, 0)[1]
    if pidfd is not None:
        os.close(pidfd)
    _kill_leftovers(ns, pid)
    for fd in list(open_fds) + ([in_w] if stdin else []):
        os.close(fd)
    stdout = bytes(out[:max_out]).decode("utf-8", "replace")
    result = {
        "exit_code": os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "timed_out": timed_out,
        "output_overflow": overflow,
        "elapsed_s": round(time.monotonic() - start, 4),
        "stderr_tail": bytes(err[-2000:]).decode("utf-8", "replace"),
        "passed": None,
    }
    if run.get("expected_stdout") is not None:
        result["passed"] = (not timed_out and not overflow and result["exit_code"] == 0
                            and outputs_match(stdout, run["expected_stdout"]))
    if run.get("return_stdout"):
        result["stdout"] = stdout
    return result


def _run_all(req: dict, ns: str | None) -> list[dict]:
    results = []
    for run in req["runs"]:
        result = _run_program(run, req, ns)
        results.append(result)
        if req["stop_on_failure"] and result["passed"] is False:
            break
    return results


def _init_main(req: dict, report: dict, ns: str, reply_fd: int) -> None:
    """pid 1 of the new pid namespace. Writes the reply and exits; its exit kills the namespace."""
    reply = {"isolation": report, "setup_error": None, "runs": []}
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        report["pid"] = report["net"] = report["mount"] = True
        _setup_filesystem(req, report, ns)
        _write_files(req, req["uid"] if ns == "root" else None)
        reply["runs"] = _run_all(req, ns)
    except Exception as err:  # reported to the parent as a set-up failure (the reward is then 0)
        reply["setup_error"] = f"{type(err).__name__}: {err}"
    _write_reply(reply_fd, reply)
    os._exit(0)


def _write_reply(fd: int, reply: dict) -> None:
    data = json.dumps(reply).encode()
    while data:
        data = data[os.write(fd, data):]


def main() -> None:
    req = json.loads(sys.stdin.buffer.read())
    reply_fd = sys.stdout.fileno()
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != req["parent_pid"]:
        os._exit(1)  # the reward worker died before we set the death signal
    report = {"mode": req["isolation"]["mode"], "namespaces": None, "net": False, "pid": False,
              "mount": False, "readonly_fs": False, "private_proc": False, "workdir_tmpfs": False,
              "visible_paths": [], "uid_drop": False, "notes": []}
    ns = None
    if req["isolation"]["mode"] != "none":
        ns = _enter_namespaces(report)
        report["namespaces"] = ns
        if ns is None and req["isolation"]["mode"] == "namespaces":
            _write_reply(reply_fd, {"isolation": report, "runs": [],
                                    "setup_error": "namespaces required but unavailable: "
                                                   + "; ".join(report["notes"])})
            return
    if req["uid"] is not None and (ns == "user" or os.geteuid() != 0):
        req["uid"] = None  # only real root can switch to an unprivileged uid
    report["uid_drop"] = req["uid"] is not None
    if ns is None:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans that escape the process group come back to us
        reply = {"isolation": report, "setup_error": None, "runs": []}
        if req["uid"] is not None:
            os.chown(req["workdir"], req["uid"], req["uid"])
        _write_files(req, req["uid"])
        reply["runs"] = _run_all(req, None)
        _write_reply(reply_fd, reply)
        return
    pid = os.fork()
    if pid == 0:
        _init_main(req, report, ns, reply_fd)
    _, status = os.waitpid(pid, 0)
    if not os.WIFEXITED(status):
        # init died before replying (killed from outside); the parent sees an empty reply
        os._exit(3)


if __name__ == "__main__":
    main()
