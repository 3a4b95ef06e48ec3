"""SGLang's CPU server (``rollout.sglang.launch.device: cpu``): the cache folder, the stand-in driver
library it needs, and the environment of a CPU server.

SGLang 0.5.23 from the package registry serves on CPU with ``SGLANG_USE_CPU_ENGINE=1`` and the
torch-native attention backend, but its only kernel wheel links ``libcuda.so.1`` (see
``assets/sglang_cpu/libcuda_standin.c`` for why and what the stand-in does). The stand-in is compiled
with the system C compiler the first time a CPU server is launched, into
``$GSPO_CACHE_DIR/libcuda-standin`` (default ``~/.cache/gspo-megatron``), beside the SGLang venvs that
``tools/setup_env.sh sglang`` keeps there as ``sglang-<version>``.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Mapping

STANDIN_SOURCE = Path(__file__).resolve().parents[2] / "assets" / "sglang_cpu" / "libcuda_standin.c"
LIBRARY_NAME = "libcuda.so.1"
# The SGLang version the CPU path was run with (docs/rollout.md, "SGLang on CPU").
CPU_TESTED_SGLANG = "0.5.23"


class CPUServerSetupError(RuntimeError):
    """The CPU server cannot be prepared (no C compiler, compile error); the message says what to do."""


def cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """``$GSPO_CACHE_DIR``, else ``~/.cache/gspo-megatron``: venvs and built files kept outside the clone."""
    return Path(environ.get("GSPO_CACHE_DIR") or Path.home() / ".cache" / "gspo-megatron")


def sglang_venv(version: str = CPU_TESTED_SGLANG, environ: Mapping[str, str] = os.environ) -> Path:
    """Where ``tools/setup_env.sh sglang`` installs ``sglang==<version>`` (marker file ``.gspo-installed``)."""
    return cache_dir(environ) / f"sglang-{version}"


def libcuda_standin_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """The folder holding the built stand-in ``libcuda.so.1``, compiled now if it is missing or its source
    changed (the folder name carries the source's hash). Built under a temporary name and renamed, so
    concurrent launches never load a half-written library."""
    source = STANDIN_SOURCE.read_bytes()
    folder = cache_dir(environ) / f"libcuda-standin-{hashlib.sha256(source).hexdigest()[:12]}"
    library = folder / LIBRARY_NAME
    if library.is_file():
        return folder
    # $CC when set (and then only it), else cc, else gcc
    compiler = shutil.which(environ["CC"]) if environ.get("CC") else shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise CPUServerSetupError(
            "rollout.sglang.launch.device: cpu needs a C compiler (cc or gcc, or $CC) to build the stand-in "
            f"{LIBRARY_NAME} from {STANDIN_SOURCE}; install one (e.g. apt-get install gcc)")
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        built = Path(tmp) / LIBRARY_NAME
        proc = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-Wl,-soname," + LIBRARY_NAME,
                               "-o", str(built), str(STANDIN_SOURCE)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise CPUServerSetupError(f"building the stand-in {LIBRARY_NAME} for rollout.sglang.launch.device: cpu "
                                      f"failed ({compiler}, exit {proc.returncode}): {proc.stderr.strip()}")
        os.replace(built, library)
    return folder


def cpu_server_env(standin_dir: Path, inherited: Mapping[str, str]) -> dict[str, str]:
    """What a CPU server needs on top of ``inherited`` (the trainer's environment): SGLang's CPU switch
    (``is_cpu()`` in srt/utils/common.py reads it) and the stand-in first on the library path."""
    library_path = ":".join(p for p in (str(standin_dir), inherited.get("LD_LIBRARY_PATH", "")) if p)
    return {"SGLANG_USE_CPU_ENGINE": "1", "LD_LIBRARY_PATH": library_path}


__all__ = ["CPUServerSetupError", "CPU_TESTED_SGLANG", "LIBRARY_NAME", "STANDIN_SOURCE", "cache_dir",
           "cpu_server_env", "libcuda_standin_dir", "sglang_venv"]
