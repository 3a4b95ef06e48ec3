"""Hostile programs: each is contained, the parent (this test process and the reward workers) stays
alive, nothing is left running, and the reward is 0.

These run for real on this machine. The isolation report says which layers were active; tests for a
layer that the machine cannot provide are skipped with the reason (as root on Linux >= 5.12, none is).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from gspo_megatron.rewards.code import CodeRewardConfig, code_reward
from gspo_megatron.rewards.sandbox import (LAUNCHER, Run, SandboxUnavailable, _expose_paths, launcher_request,
                                           probe_isolation, run_in_sandbox)
from tests.rewards.helpers import code_block, fast_sandbox, sandbox_uid_processes

SANDBOX = fast_sandbox()
CODE_CFG = CodeRewardConfig(sandbox=SANDBOX)


@pytest.fixture(scope="module")
def isolation():
    return probe_isolation(SANDBOX)


def _run(source: str, stdin: str = "", expected: str | None = None):
    reply = run_in_sandbox(SANDBOX, {"solution.py": source},
                           [Run(["solution.py"], stdin=stdin, expected_stdout=expected, return_stdout=True)])
    assert reply.error is None, reply.error
    return reply.runs[0]


def _reward(source: str, expected_output: str) -> float:
    sample = {"tests": {"inputs": [""], "outputs": [expected_output]}}
    return code_reward(sample, code_block(source), CODE_CFG).reward


def test_isolation_layers_reported(isolation):
    # The report is what docs/rewards.md quotes for this machine; every key is present either way.
    for key in ("namespaces", "net", "pid", "mount", "readonly_fs", "private_proc", "uid_drop"):
        assert key in isolation
    if os.geteuid() == 0:
        assert isolation["namespaces"] == "root" and isolation["uid_drop"], isolation


def test_infinite_loop_is_stopped():
    start = time.monotonic()
    run = _run("while True:\n    pass\n")
    assert run.timed_out or run.signal is not None
    assert time.monotonic() - start < SANDBOX.case_timeout_s + 3
    assert _reward("while True:\n    pass\n", "never") == 0.0
    assert sandbox_uid_processes(SANDBOX) == []


def test_process_limit_holds_as_root(isolation):
    if not (isolation["uid_drop"] or os.geteuid() != 0):
        pytest.skip("root without a uid drop: RLIMIT_NPROC is not enforced for uid 0")
    source = ("import os, time\nn = 0\nfor _ in range(200):\n    try:\n        pid = os.fork()\n"
              "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n"
              "    n += 1\nprint(n)\n")
    run = _run(source)
    assert run.exit_code == 0, run.stderr_tail
    assert int(run.stdout) < SANDBOX.max_processes  # the program itself counts as one
    assert sandbox_uid_processes(SANDBOX) == []  # the sleeping children were killed


def test_fork_bomb_is_contained():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    start = time.monotonic()
    assert _reward(bomb, "boom") == 0.0
    assert time.monotonic() - start < SANDBOX.case_timeout_s + 5
    assert sandbox_uid_processes(SANDBOX) == []


def test_memory_hog_hits_the_address_space_limit():
    hog = "chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 1024 * 1024))\n"
    run = _run(hog)
    assert run.exit_code != 0
    assert "MemoryError" in run.stderr_tail  # the rlimit stopped it, not the kernel's OOM killer
    assert _reward(hog, "") == 0.0


def test_writing_outside_the_working_directory_fails(tmp_path):
    os.chmod(tmp_path, 0o777)  # even a world-writable host folder must stay untouched
    targets = [str(tmp_path / "escape.txt"), f"/tmp/gspo-escape-{uuid.uuid4().hex}", "/etc/gspo-escape",
               "/work/gspo-escape"]
    source = ("ok = []\nfor p in " + repr(targets) + ":\n"
              "    try:\n        open(p, 'w').write('x')\n        ok.append(p)\n    except OSError:\n        pass\n"
              "open('inside.txt', 'w').write('fine')\n"  # the working directory itself is writable
              "print('escaped' if ok else 'contained', open('inside.txt').read())\n")
    run = _run(source)
    assert run.stdout.strip() == "contained fine", (run.stdout, run.stderr_tail)
    assert _reward(source, "escaped fine") == 0.0
    for target in targets:
        assert not os.path.exists(target), target


def test_network_is_unreachable(isolation):
    if not isolation["net"]:
        pytest.skip("no network namespace on this machine: " + "; ".join(isolation["notes"]))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    source = (f"import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect(('127.0.0.1', {port}))\n"
              "print('connected')\n")
    assert _reward(source, "connected") == 0.0
    run = _run(source)
    assert "connected" not in (run.stdout or "") and "Error" in run.stderr_tail
    with pytest.raises(socket.timeout):
        listener.accept()  # nothing reached the host's loopback
    listener.close()


def test_signalling_the_parent_does_nothing(isolation):
    if not (isolation["pid"] or isolation["uid_drop"]):
        pytest.skip("without a pid namespace or a uid drop, kill(-1) would reach this user's processes")
    me = os.getpid()
    source = ("import os, signal\n"
              f"for pid in ({me}, os.getppid(), 1):\n"
              "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n"
              "for target in (-1, 0):\n"
              "    try:\n        os.kill(target, signal.SIGKILL) if target == -1 else os.killpg(0, signal.SIGKILL)\n"
              "    except OSError:\n        pass\n"
              "print('still here')\n")
    assert _reward(source, "parent dead") == 0.0
    assert os.getpid() == me  # this process (the sandbox's parent) survived
    run = _run("print(input())", stdin="alive\n", expected="alive")
    assert run.passed  # and the sandbox still works afterwards


def test_flooding_stdout_is_cut_off():
    start = time.monotonic()
    run = _run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n")
    assert run.output_overflow
    assert len(run.stdout) <= SANDBOX.max_output_bytes
    assert time.monotonic() - start < SANDBOX.case_timeout_s  # killed on overflow, not at the deadline
    assert _reward("while True:\n    print('y' * 1000)\n", "y") == 0.0


def test_environment_secrets_are_not_visible(monkeypatch, isolation):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("GSPO_TEST_SECRET_TOKEN", secret)
    source = ("import os\nfound = [v for v in os.environ.values() if v.startswith('s3cret-')]\n"
              "for pid in os.listdir('/proc'):\n"
              "    for name in ('environ', 'cmdline'):\n"
              "        try:\n            data = open(f'/proc/{pid}/{name}', 'rb').read()\n"
              "        except OSError:\n            continue\n"
              "        found += [part.decode(errors='replace').split('=', 1)[-1] for part in data.split(b'\\0')\n"
              "                  if b's3cret-' in part]\n"
              "print(found[0] if found else 'nothing', sorted(os.environ))\n")
    run = _run(source)
    assert secret not in run.stdout, run.stdout
    assert run.stdout.startswith("nothing")
    assert _reward(source.replace(", sorted(os.environ)", ""), secret) == 0.0
    if isolation["namespaces"] is not None and os.path.isdir("/root"):
        # only the path to the interpreter is in /root (when pyenv lives there): not the trainer's home
        visible = set(eval(_run("import os\nprint(sorted(os.listdir('/root')) if os.path.isdir('/root') else [])").stdout))
        exposed = {p.split("/")[2] for p in _expose_paths(SANDBOX) if p.startswith("/root/")}
        assert visible <= exposed, visible


# --- the fallback without namespaces (what runs where unshare is refused) -----------------------------

def test_fallback_probe_explains_an_unreadable_interpreter():
    """As root without a mount namespace the throw-away uid cannot reach an interpreter under /root;
    the set-up probe must say so instead of letting every response score 0."""
    cfg = fast_sandbox(isolation="none")
    try:
        report = probe_isolation(cfg)
    except SandboxUnavailable as err:
        assert "rewards.code.sandbox" in str(err) and "Permission denied" in str(err)
    else:
        assert report["namespaces"] is None  # the interpreter is world-readable here: the probe passed


def test_fallback_contains_time_output_and_escaped_children():
    cfg = fast_sandbox(isolation="none", run_as_uid=False)
    reply = run_in_sandbox(cfg, {"solution.py": "while True:\n    pass\n"}, [Run(["solution.py"])])
    assert reply.isolation["namespaces"] is None
    assert reply.runs[0].timed_out or reply.runs[0].signal is not None  # wall clock or RLIMIT_CPU
    flood = run_in_sandbox(cfg, {"solution.py": "while True:\n    print('x' * 9999)\n"}, [Run(["solution.py"])])
    assert flood.runs[0].output_overflow
    # a daemon that leaves the process group: the launcher is a child subreaper and kills it
    daemon = ("import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
              "        print(os.getpid(), flush=True)\n        time.sleep(60)\n    os._exit(0)\n"
              "time.sleep(0.3)\n")
    run = run_in_sandbox(cfg, {"solution.py": daemon}, [Run(["solution.py"], return_stdout=True)]).runs[0]
    pid = int(run.stdout.split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_user_namespace_mode_as_an_unprivileged_user():
    """The path a non-root trainer takes: the launcher as uid 65534 (system Python, since this venv's
    interpreter lives under /root) gets a user namespace; the program has no capabilities and cannot
    undo the mounts, write outside its directory or reach the network."""
    system_python = "/usr/bin/python3"
    if os.geteuid() != 0 or not shutil.which("setpriv") or not os.access(system_python, os.X_OK):
        pytest.skip("needs root, setpriv and /usr/bin/python3 to impersonate an unprivileged user")
    cfg = fast_sandbox(python=system_python, run_as_uid=False)
    program = ("import ctypes, os, socket\n"
               "caps = open('/proc/self/status').read().split('CapEff:')[1].split()[0]\n"
               "libc = ctypes.CDLL(None, use_errno=True)\n"
               "umount = libc.umount2(b'/tmp', 2)\n"
               "try:\n    open('/etc/gspo-escape', 'w')\n    wrote = True\nexcept OSError:\n    wrote = False\n"
               "try:\n    socket.create_connection(('127.0.0.1', 22), timeout=1)\n    net = True\n"
               "except OSError:\n    net = False\n"
               "print(caps, umount, wrote, net)\n")
    # the working folder as that user's trainer makes it (tempfile.mkdtemp in /tmp): reachable by the launcher,
    # whose private root is mounted over it (pytest's tmp_path lies under root's mode-700 folder)
    workdir = Path(tempfile.mkdtemp(prefix="gspo-sandbox-test-"))
    os.chmod(workdir, 0o777)
    request = launcher_request(cfg, str(workdir), {"solution.py": program}, [Run(["solution.py"], return_stdout=True)],
                               stop_on_failure=False)
    # A real non-root trainer runs the launcher from its own checkout; this impersonation may not be able
    # to read ours (a clone under /root), so the launcher's source is handed over on the command line.
    with open(LAUNCHER) as f:
        launcher_source = f.read()
    try:
        proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", system_python, "-I",
                               "-S", "-c", launcher_source], input=json.dumps(request).encode(), capture_output=True,
                              timeout=30)
    finally:
        workdir.rmdir()  # empty on the host: the program wrote into its own tmpfs
    assert proc.returncode == 0 and proc.stdout, proc.stderr.decode(errors="replace")[-2000:]
    reply = json.loads(proc.stdout)
    if reply["isolation"]["namespaces"] is None:
        pytest.skip("unprivileged user namespaces are disabled here: " + "; ".join(reply["isolation"]["notes"]))
    assert reply["setup_error"] is None, reply
    assert reply["isolation"]["namespaces"] == "user" and reply["isolation"]["readonly_fs"]
    assert reply["runs"][0]["stdout"], reply["runs"][0]["stderr_tail"]
    caps, umount, wrote, net = reply["runs"][0]["stdout"].split()
    assert int(caps, 16) == 0 and umount == "-1" and wrote == "False" and net == "False"


def test_the_file_view_is_an_allowlist(tmp_path, isolation):
    """A program sees the interpreter's files, a few system libraries and device files, and its working
    directory; nothing else, wherever the project, its data or a run folder lies (here: the project's own
    held-out data, a run folder under /tmp, a secret beside the project, /etc)."""
    if isolation["namespaces"] is None:
        pytest.skip("no mount namespace here: the fallback sees what its uid can read (docs/rewards.md)")
    from pathlib import Path

    from gspo_megatron.rewards.sandbox import visible_paths

    repo = Path(__file__).resolve().parents[2]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoint.txt").write_text("weights")
    os.chmod(tmp_path, 0o755)
    outside = Path(__import__("tempfile").mkdtemp(dir=repo.parent, prefix="gspo-sandbox-secret-"))
    try:
        os.chmod(outside, 0o755)
        (outside / "answers.jsonl").write_text("42")
        os.chmod(outside / "answers.jsonl", 0o644)
        targets = [str(repo / "examples/data/arithmetic3/eval.jsonl"), str(run_dir / "checkpoint.txt"),
                   str(outside / "answers.jsonl"), "/etc/passwd", str(repo / "setup.py")]
        source = ("import os\nread = []\nfor p in " + repr(targets) + ":\n"
                  "    try:\n        open(p).read()\n        read.append(p)\n    except OSError:\n        pass\n"
                  "print(read, sorted(os.listdir('/')))\n")
        run = _run(source)
    finally:
        shutil.rmtree(outside)
    read, top = run.stdout.rsplit("] ", 1)
    assert read == "[", (run.stdout, run.stderr_tail)
    allowed = {p.split("/")[1] for p in visible_paths(SANDBOX, "/tmp/x")} | {"proc"}
    assert set(eval(top)) <= allowed, (eval(top), allowed)
