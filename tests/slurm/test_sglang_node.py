"""The multi-node job's SGLang step (tools/slurm/job_lib.sh gspo_start_sglang_step, which
examples/slurm/qwen3_30b_a3b_gspo_multinode.sbatch runs) on the local Slurm: the servers start under the
interpreter the config names in rollout.sglang.launch.python, the setting the trainer's own launch reads,
not under the trainer's (GSPO_PYTHON). The interpreter here is a stand-in that records how it was called and
serves the SGLang stand-in's /health on the port it was given."""
from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from tests.rollout.sglang_cpu_models import free_port_block
from tests.slurm.cluster import REPO_ROOT, LocalSlurm, submit_and_wait

STANDIN = REPO_ROOT / "tests" / "rollout" / "sglang_standin.py"

JOB = """#!/bin/bash
set -euo pipefail
source tools/slurm/job_lib.sh
gspo_start_sglang_step "$GSPO_PYTHON" "$CONFIG" /models/m 1 1 "$PORT" 0.4 "$LOGS" \\
    "rollout.sglang.launch.python=$SGLANG_VENV_PYTHON"
for _ in $(seq 300); do
    if "$GSPO_PYTHON" -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=2)" \\
        "http://127.0.0.1:$PORT/health" 2>/dev/null; then
        echo healthy
        break
    fi
    sleep 0.2
done
kill -TERM "$GSPO_SGLANG_STEP_PID"
wait "$GSPO_SGLANG_STEP_PID" || true
"""


def _venv_python(tmp_path: Path) -> Path:
    """Stands in for another venv's python: records its arguments, then serves the stand-in on --port."""
    fake = tmp_path / "sglang-venv" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text(f"#!{sys.executable}\nimport runpy, sys\nargs = sys.argv[1:]\n"
                    f"open({str(tmp_path / 'called.args')!r}, 'w').write('\\n'.join(args))\n"
                    f"sys.argv = [{str(STANDIN)!r}, '--port', args[args.index('--port') + 1], '--lifetime-s', '60']\n"
                    f"runpy.run_path({str(STANDIN)!r}, run_name='__main__')\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return fake


@pytest.mark.slurm
def test_the_sglang_step_uses_the_configs_interpreter(slurm_cluster: LocalSlurm, tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("rollout:\n  engine: sglang\n  sglang:\n    urls: [http://localhost:30000]\n")
    job, out, port = tmp_path / "job.sbatch", tmp_path / "job.out", free_port_block(1)
    job.write_text(JOB)
    python = _venv_python(tmp_path)
    rc, _ = submit_and_wait(slurm_cluster, job, options=[f"--output={out}", "--nodes=1", "--ntasks=1"],
                            env={"CONFIG": str(config), "PORT": str(port), "LOGS": str(tmp_path / "logs"),
                                 "SGLANG_VENV_PYTHON": str(python)}, timeout_s=120)
    log = out.read_text()
    assert rc == 0 and "healthy" in log.splitlines(), log
    assert f"job_lib: SGLang servers start with {python} (rollout.sglang.launch.python)" in log
    args = (tmp_path / "called.args").read_text().splitlines()
    assert args[:4] == ["-m", "sglang.launch_server", "--model-path", "/models/m"], args
    assert args[args.index("--port") + 1] == str(port) and args[args.index("--mem-fraction-static") + 1] == "0.4"


def test_the_interpreter_setting_is_read_from_the_config_and_its_overrides(tmp_path: Path) -> None:
    import subprocess

    config = tmp_path / "c.yaml"
    config.write_text("rollout:\n  sglang:\n    launch: {python: ~/sglang/bin/python}\n")
    cmd = [sys.executable, "-m", "gspo_megatron.trainer.launch_env", "sglang-python", "--config", str(config)]
    run = lambda *extra: subprocess.run([*cmd, *extra], capture_output=True, text=True, check=True).stdout.strip()
    assert run() == str(Path.home() / "sglang" / "bin" / "python")
    assert run("rollout.sglang.launch.python=/opt/sg/bin/python") == "/opt/sg/bin/python"
    assert run("rollout.sglang.launch=null") == sys.executable  # unset: the trainer's own, as its launch does
