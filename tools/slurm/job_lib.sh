# Shell functions for gspo-megatron sbatch scripts (source it; it is not a program).
#
#   source tools/slurm/job_lib.sh
#   gspo_run_step srun --kill-on-bad-exit=1 python -m gspo_megatron.cli train ... && rc=0 || rc=$?
#   gspo_requeue_if_preempted "$rc"
#   exit "$rc"
#
# Why: with `#SBATCH --signal=B:USR1@120` Slurm warns only the batch shell. A shell running `srun` in the
# foreground defers its traps until srun returns, i.e. too late; so the step runs in the background, the
# trap forwards SIGUSR1 to srun (srun passes it on to every process of the step: measured with Slurm
# 22.05, grandchildren included), and the shell waits again until the step really ends. The trainer sees
# the signal through gspo_megatron.trainer.preemption.PreemptionFlag, checkpoints and exits 0; the script
# then requeues the job, which resumes from that checkpoint (train --resume-or-start).

GSPO_PREEMPTED=0
GSPO_SIGNALS_SEEN=0
GSPO_STEP_PID=

_gspo_forward_usr1() {
    GSPO_PREEMPTED=1
    GSPO_SIGNALS_SEEN=$((GSPO_SIGNALS_SEEN + 1))
    echo "job_lib: SIGUSR1 at $(date -u +%FT%TZ): forwarding to the step (srun pid $GSPO_STEP_PID)" >&2
    kill -USR1 "$GSPO_STEP_PID" 2>/dev/null || true
}

# Run "$@" (an srun command line) in the background, forward SIGUSR1 to it, return its exit status.
gspo_run_step() {
    local seen rc last_rc=""
    "$@" &
    GSPO_STEP_PID=$!
    trap _gspo_forward_usr1 USR1
    while :; do
        seen=$GSPO_SIGNALS_SEEN
        wait "$GSPO_STEP_PID" && rc=0 || rc=$?
        # 127: this pid's status was already collected by the previous wait, which was therefore the
        # step's own status (a signal arrived just after the step ended), not an interruption.
        if [ "$rc" = 127 ] && [ -n "$last_rc" ]; then
            rc=$last_rc
            break
        fi
        # A trap that ran during `wait` makes it return 128+signal while the step goes on: wait again.
        if [ "$GSPO_SIGNALS_SEEN" = "$seen" ] || [ "$rc" -le 128 ]; then
            break
        fi
        last_rc=$rc
    done
    trap - USR1
    return "$rc"
}

# After a preempted step that exited 0 (checkpoint written), put the job back in the queue.
# A step that failed is not requeued: a crash loop would burn the allocation.
gspo_requeue_if_preempted() {
    local rc=$1
    if [ "$GSPO_PREEMPTED" != 1 ]; then
        if [ "$rc" != 0 ]; then
            # srun's own lines above name the task and node that failed first.
            echo "job_lib: the training step failed (exit $rc) on $SLURM_JOB_NODELIST: job $SLURM_JOB_ID ends without requeue; resubmit to resume from the last complete checkpoint" >&2
        fi
        return 0
    fi
    if [ "$rc" != 0 ]; then
        echo "job_lib: preempted, but the step exited $rc: not requeueing job $SLURM_JOB_ID" >&2
        return 0
    fi
    # Slurm holds a requeued batch job for the credential lifetime (AuthInfo cred_expire, default 120 s)
    # before it may start again.
    echo "job_lib: preempted; requeueing job $SLURM_JOB_ID (restart $((${SLURM_RESTART_COUNT:-0} + 1)))" >&2
    scontrol requeue "$SLURM_JOB_ID"
}

# Step 0 of a multi-node job: examples/slurm/start_sglang_node.sh on every node of the job (one srun task
# each), in the background (its srun's pid in GSPO_SGLANG_STEP_PID). The servers run under the interpreter
# the config names in rollout.sglang.launch.python (overrides included; default: PYTHON, the trainer's),
# the one setting the trainer's own launch reads too.
#   gspo_start_sglang_step PYTHON CONFIG MODEL_PATH SERVERS TP_SIZE BASE_PORT MEM_FRACTION LOG_DIR [dotted.key=value ...]
gspo_start_sglang_step() {
    local python=$1 config=$2 model=$3 servers=$4 tp=$5 port=$6 mem=$7 logs=$8
    shift 8
    GSPO_SGLANG_PYTHON=$("$python" -m gspo_megatron.trainer.launch_env sglang-python --config "$config" "$@") || return
    echo "job_lib: SGLang servers start with $GSPO_SGLANG_PYTHON (rollout.sglang.launch.python)"
    GSPO_SGLANG_PYTHON=$GSPO_SGLANG_PYTHON srun --overlap --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 \
        --kill-on-bad-exit=0 examples/slurm/start_sglang_node.sh "$model" "$servers" "$tp" "$port" "$mem" "$logs" &
    GSPO_SGLANG_STEP_PID=$!
}
