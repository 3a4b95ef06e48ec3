#!/bin/bash
# Start this node's SGLang servers for the multi-node GSPO job and wait on them (one srun task per node).
#
#   start_sglang_node.sh MODEL_PATH SERVERS TP_SIZE BASE_PORT MEM_FRACTION LOG_DIR
#
# Server i uses GPUs i*TP_SIZE .. (i+1)*TP_SIZE-1 and port BASE_PORT+i, listens on all interfaces (the
# trainer ranks of other nodes send it requests) and is started with --enable-memory-saver so the trainer
# can release its weights and KV cache while it trains on the same GPUs (colocated). Being on the
# trainer's GPUs, numbered as the trainer numbers them, the servers take weights by CUDA IPC
# (rollout.sglang.weight_sync: tensor). When any server
# exits, the others are stopped and this script exits with that server's status; srun then ends the step.
#
# The interpreter is GSPO_SGLANG_PYTHON: the multi-node sbatch script sets it from the config's
# rollout.sglang.launch.python (tools/slurm/job_lib.sh gspo_start_sglang_step), the same setting the trainer
# uses when it launches servers itself; unset, GSPO_PYTHON, then `python`.
set -uo pipefail
if [ $# -ne 6 ]; then
    echo "usage: $0 MODEL_PATH SERVERS TP_SIZE BASE_PORT MEM_FRACTION LOG_DIR" >&2
    exit 2
fi
MODEL_PATH=$1 SERVERS=$2 TP_SIZE=$3 BASE_PORT=$4 MEM_FRACTION=$5 LOG_DIR=$6
HOST=$(hostname)
mkdir -p "$LOG_DIR"
pids=()
for ((i = 0; i < SERVERS; i++)); do
    "${GSPO_SGLANG_PYTHON:-${GSPO_PYTHON:-python}}" -m sglang.launch_server \
        --model-path "$MODEL_PATH" --host 0.0.0.0 --port $((BASE_PORT + i)) \
        --tp-size "$TP_SIZE" --base-gpu-id $((i * TP_SIZE)) \
        --mem-fraction-static "$MEM_FRACTION" --enable-memory-saver --skip-tokenizer-init \
        --dtype bfloat16 --log-level warning \
        >>"$LOG_DIR/sglang-$HOST-$((BASE_PORT + i)).log" 2>&1 &
    pids+=($!)
done
stop_all() { kill -TERM "${pids[@]}" 2>/dev/null; }
trap 'stop_all; exit 143' TERM INT
wait -n "${pids[@]}"
rc=$?
echo "start_sglang_node: a server on $HOST exited with $rc; stopping the others" >&2
stop_all
wait
exit "$rc"
