#!/usr/bin/env bash
# The README's test command: set up the environment, start a local Slurm for the slurm-marked tests,
# run the whole suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
slurm_started=0
if [ -x tools/slurm/local_cluster.sh ] && [ -z "${GSPO_SKIP_SLURM:-}" ]; then
  if bash tools/slurm/local_cluster.sh start > /tmp/gspo-slurm-start.log 2>&1; then
    slurm_started=1
    export SLURM_CONF=${GSPO_SLURM_DIR:-/tmp/gspo-slurm}/slurm.conf
  else
    echo "local Slurm could not start (see /tmp/gspo-slurm-start.log); slurm tests will be skipped" >&2
    cat /tmp/gspo-slurm-start.log >&2
  fi
fi
status=0
.venv/bin/python -m pytest "$@" || status=$?
if [ "$slurm_started" = 1 ]; then
  bash tools/slurm/local_cluster.sh stop > /dev/null 2>&1 || true
fi
exit $status
