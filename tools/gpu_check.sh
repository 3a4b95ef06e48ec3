#!/bin/bash
# The project's GPU check (docs/gpu.md, "The project's GPU check"): seven independent steps on one lent GPU
# machine (Python 3.12 with CUDA torch and transformers, no network, no megatron-core, no TE, no SGLang).
#
#   tools/gpu_check.sh --fetch-wheels   here, with network: tools/gpu_wheels.txt into build/gpu_wheels
#   tools/gpu_check.sh [OPTIONS]        on the GPU machine, carrying build/gpu_wheels: about 4 minutes,
#                                       at most --budget-s (420 s); results in $OUT/gpu_check.jsonl
#   tools/gpu_check.sh --cpu [OPTIONS]  every step on the CPU at a tiny size (the CI dry run, ~1 minute)
#
# OPTIONS go to `python -m gspo_megatron.testing.gpu_check` (--results PATH, --steps a,b,..., --size,
# --budget-s, --timeout-scale). The wheels are installed without a venv (the machine's python3 is itself
# a venv, and a venv made from it does not see its torch): `pip install --no-index --no-deps --target`,
# then that folder and this repository go first on PYTHONPATH. Each step prints one `GPU_CHECK {json}`
# line and appends it to the results file, whatever the other steps do. Exit status: 0 when every step is
# ok, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${GSPO_GPU_WHEELS:-build/gpu_wheels}
SITE=${GSPO_GPU_SITE:-/tmp/gspo-gpu-site}
PY=${GSPO_GPU_PYTHON:-python3}

# the pinned requirements of tools/gpu_wheels.txt, one a line
requirements() { grep -v '^#' tools/gpu_wheels.txt | grep -v '^[[:space:]]*$'; }

if [ "${1:-}" = "--fetch-wheels" ]; then
    mkdir -p "$WHEELS"
    # megatron-core is a cp312 manylinux wheel (one small C++ helper); the list holds no other
    exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
        --platform any -r <(requirements) -d "$WHEELS"
fi

cpu=0
for arg in "$@"; do
    case "$arg" in
        --cpu) cpu=1 ;;
        -h|--help) exec "$PY" -m gspo_megatron.testing.gpu_check --help ;;
    esac
done

if [ "$cpu" = 0 ]; then
    # each pinned wheel, as pip names the files it downloads ("-" and case normalised to "_" / lower), for
    # this interpreter (cpXY) or any Python 3 (py3)
    tag=$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
    wheels=()
    while read -r req; do
        name=$(echo "${req%%==*}" | tr 'A-Z-' 'a-z_'); version=${req##*==}
        found=$(ls "$WHEELS" 2>/dev/null | grep -iE "^${name}-${version}-(${tag}|py3)[-.].*\.whl$" | head -n 1)
        if [ -n "$found" ]; then
            wheels+=("$WHEELS/$found")
        else
            echo "gpu_check: $req is missing from $WHEELS (tools/gpu_check.sh --fetch-wheels where there is network);" \
                 "the steps that need it will fail and say so" >&2
        fi
    done < <(requirements)
    if [ "${#wheels[@]}" -gt 0 ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "${wheels[@]}" || echo "gpu_check: installing the wheels into $SITE failed; the steps go on" >&2
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m gspo_megatron.testing.gpu_check "$@"
