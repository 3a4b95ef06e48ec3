#!/usr/bin/env bash
# The README's test command, in two legs:
#   1. Python 3.11 / megatron-core 0.16.1 (.venv): the whole suite, with a local Slurm for the slurm tests;
#   2. Python 3.12 / megatron-core 0.19.2 (.venv312, cached): PY312_SUBSET below, the tests that exercise
#      Megatron-Core itself (the newest end of the supported range, docs/cpu-runtime.md).
#   3. sglang: the tests against real SGLang 0.5.23 servers on CPU (SGLANG_SUBSET below, marked `sglang`;
#      they skip in the other legs). The servers' venv lives in the cache folder (tools/setup_env.sh sglang,
#      ~9 min on a fresh machine, installed in the background while the other legs run, then reused); the
#      tests run in .venv and launch the servers from it.
# Extra arguments go to pytest in every leg. GSPO_LEGS=py311 (or py312, sglang, or several) runs those only.
set -euo pipefail
cd "$(dirname "$0")/.."

# The one definition of the 3.12 leg: parallel equivalence and checkpoint layouts
# (test_parallel_equivalence.py, tests/conversion/test_distributed.py), Megatron training (tests/megatron but
# test_temperature.py, whose engine-vs-trainer comparison is our code on top of the forward the others test),
# a short trainer run with a resume, and the conversion round trip. tests/distributed/test_layout_runs.py
# (4- and 8-process runs, ~8 min here) and the rest of test_train_e2e.py stay in the 3.11 leg only, to keep
# .ci/run under 60 minutes.
PY312_SUBSET=(
  tests/distributed/test_parallel_equivalence.py
  tests/megatron
  --deselect tests/megatron/test_temperature.py
  tests/conversion/test_distributed.py
  tests/conversion/test_roundtrip.py
  tests/trainer/test_train_e2e.py::test_short_run_then_resume_matches_uninterrupted
)

# Real servers start once per test class or file (35-170 s each, ~3.7 GB; at most two at a time).
SGLANG_SUBSET=(
  tests/rollout/test_sglang_cpu_server.py
  tests/trainer/test_sglang_cpu_train.py
  tests/rollout/test_sglang_cpu_partial.py
  tests/rewards/test_served_reward_model.py
)

legs=${GSPO_LEGS:-py311 py312 sglang}
status=0
# On a fresh machine the SGLang venv takes ~9 minutes of downloads and unpacking: start it now, at low priority,
# so it overlaps the other legs instead of adding to them (a no-op when the cache already holds it).
sglang_install_pid=
case " $legs " in
  *" sglang "*)
    sglang_install_log=$(mktemp "${TMPDIR:-/tmp}/gspo-sglang-install.XXXXXX")
    # its own process group (setsid), so stopping this script stops pip too, not only its bash
    setsid nice -n 19 bash tools/setup_env.sh sglang > "$sglang_install_log.python" 2> "$sglang_install_log" &
    sglang_install_pid=$!
    trap 'kill -TERM -- -$sglang_install_pid 2>/dev/null || true; rm -f "$sglang_install_log" "$sglang_install_log.python"' EXIT
    ;;
esac
# a TERM / INT / HUP (a CI timeout) exits through the EXIT trap above
trap 'exit 143' TERM INT HUP
for leg in $legs; do
  start=$SECONDS
  case "$leg" in
    py311)
      bash tools/setup_env.sh py311
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
      # pytest in the background so a TERM / INT / HUP to this script (a CI timeout) runs the trap at once:
      # pytest is stopped (its cluster fixtures tear down on SIGTERM, tests/slurm/cluster.py), then the
      # single-node cluster started above; a stopped run used to leave the daemons running
      .venv/bin/python -m pytest "$@" &
      pytest_pid=$!
      trap 'kill -TERM $pytest_pid 2>/dev/null; wait $pytest_pid; [ "$slurm_started" = 1 ] && bash tools/slurm/local_cluster.sh stop > /dev/null 2>&1; exit 143' TERM INT HUP
      wait $pytest_pid || status=$?
      trap 'exit 143' TERM INT HUP
      if [ "$slurm_started" = 1 ]; then
        bash tools/slurm/local_cluster.sh stop > /dev/null 2>&1 || true
        unset SLURM_CONF
      fi
      ;;
    py312)
      bash tools/setup_env.sh py312
      .venv312/bin/python -m pytest "$@" "${PY312_SUBSET[@]}" || status=$?
      ;;
    sglang)
      bash tools/setup_env.sh py311
      if wait "$sglang_install_pid"; then
        sglang_python=$(tail -n 1 "$sglang_install_log.python")
        GSPO_SGLANG_PYTHON=$sglang_python .venv/bin/python -m pytest "$@" "${SGLANG_SUBSET[@]}" || status=$?
      else
        echo "tools/run_tests.sh: the SGLang venv could not be installed (tools/setup_env.sh sglang):" >&2
        cat "$sglang_install_log" >&2
        status=1
      fi
      ;;
    *)
      echo "tools/run_tests.sh: unknown leg '$leg' in GSPO_LEGS (expected py311, py312, sglang)" >&2
      exit 2
      ;;
  esac
  echo "tools/run_tests.sh: leg $leg finished in $((SECONDS - start)) s" >&2
done
exit $status
