#!/usr/bin/env bash
# Create a virtual environment (if missing) and install gspo-megatron with its test extras. Idempotent and
# quick when everything is already there (a stamp file inside the venv, refreshed when setup.py changes).
#
#   bash tools/setup_env.sh            .venv on python3 (3.11): torch 2.13.0 CPU wheel, megatron-core 0.16.1
#   bash tools/setup_env.sh py312      .venv312 on Python 3.12.1: the registry's torch (a CUDA build that
#                                      runs on CPU, ~3 GB, cached in the venv), megatron-core 0.19.2
#
#   bash tools/setup_env.sh sglang      the SGLang server's own venv (python3.11, sglang==$GSPO_SGLANG_VERSION,
#                                      default 0.5.23; ~9 min, ~11 GB) in ${GSPO_CACHE_DIR:-~/.cache/gspo-megatron}/
#                                      sglang-<version>, outside the clone, kept across clones; prints its python
#
# Overrides: PYTHON (interpreter), GSPO_TORCH_VERSION, GSPO_MEGATRON_CORE (a version inside setup.py's range).
set -euo pipefail
cd "$(dirname "$0")/.."
leg=${1:-py311}
if [ "$leg" = sglang ]; then
  # Its torch (2.14.1, a CUDA build that runs on CPU) and transformers pins clash with ours, so the servers
  # get a venv of their own (rollout.sglang.launch.python points at it); the marker says it is complete.
  version=${GSPO_SGLANG_VERSION:-0.5.23}
  venv=${GSPO_CACHE_DIR:-$HOME/.cache/gspo-megatron}/sglang-$version
  if [ ! -f "$venv/.gspo-installed" ]; then
    # installed in place (a venv cannot be moved); without the marker a half-done one is started over
    echo "tools/setup_env.sh: installing sglang==$version into $venv (about 9 minutes, 11 GB)" >&2
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    "${PYTHON:-python3.11}" -m venv "$venv"
    "$venv/bin/python" -m pip install --upgrade pip >&2
    # one line per package, so a long install shows where it is
    "$venv/bin/python" -m pip install --progress-bar off "sglang==$version" >&2
    touch "$venv/.gspo-installed"
  fi
  echo "$venv/bin/python"
  exit 0
fi
case "$leg" in
  py311)
    venv=.venv
    py=${PYTHON:-python3}
    torch_spec="torch==${GSPO_TORCH_VERSION:-2.13.0}"
    megatron_spec=${GSPO_MEGATRON_CORE:+megatron-core==$GSPO_MEGATRON_CORE}
    ;;
  py312)
    venv=.venv312
    py=${PYTHON:-python3.12}
    export PYENV_VERSION=${PYENV_VERSION:-3.12.1}
    torch_spec="torch${GSPO_TORCH_VERSION:+==$GSPO_TORCH_VERSION}"
    # the newest end of the supported range is what this leg exists to test
    megatron_spec="megatron-core==${GSPO_MEGATRON_CORE:-0.19.2}"
    ;;
  *)
    echo "tools/setup_env.sh: unknown leg '$leg' (expected py311 or py312)" >&2
    exit 2
    ;;
esac
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
stamp=$venv/.gspo-installed
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ]; then
  # pip's own progress bars show the large downloads (torch alone can take minutes); a line per stage says
  # what is being installed and that the next run skips it
  echo "setup_env: installing into $venv (first time, or setup.py changed)" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip
  if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    echo "setup_env: [1/3] $torch_spec (the largest download; an installed torch is kept)" >&2
    "$venv/bin/python" -m pip install --progress-bar on "$torch_spec"
  fi
  if [ -n "$megatron_spec" ]; then
    echo "setup_env: [2/3] $megatron_spec" >&2
    "$venv/bin/python" -m pip install --progress-bar on "$megatron_spec"
  fi
  echo "setup_env: [3/3] gspo-megatron and its dependencies (transformers, ...)" >&2
  "$venv/bin/python" -m pip install --progress-bar on -e ".[dev]"
  echo "setup_env: done" >&2
  touch "$stamp"
fi
