#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine, for tests and for trying the sbatch examples.
#
#   tools/slurm/local_cluster.sh install   # apt-get install the Debian packages when missing
#   tools/slurm/local_cluster.sh start     # install if needed, write slurm.conf, start daemons, wait for an idle node
#   tools/slurm/local_cluster.sh status    # exit 0 when both daemons run and the node answers
#   tools/slurm/local_cluster.sh stop      # SIGTERM then SIGKILL by the PIDs in the pid files; idempotent
#
# `start` prints one line on stdout, `export SLURM_CONF=...`, so `eval "$(tools/slurm/local_cluster.sh start)"`
# points the clients (sbatch, srun, squeue, scontrol) at this cluster; everything else goes to stderr.
# Starting a running cluster is a no-op that prints the same line.
#
# Environment:
#   GSPO_SLURM_DIR         state folder (conf, spool, logs, pid files); default /tmp/gspo-slurm
#   GSPO_SLURM_CTLD_PORT   slurmctld port; default 6817 (change it to run a second cluster beside this one)
#   GSPO_SLURM_SLURMD_PORT slurmd port; default 6818
#   GSPO_SLURM_CPUS        CPUs the node offers; default max(nproc, 2), so 2-task jobs fit on any machine
#
# Exit codes: 0 ok; 1 failure (the daemon logs are printed); 3 Slurm is missing and cannot be installed
# here (no apt-get or not root): tests skip on 3 only.
#
# Facts this relies on (measured with Debian 12's Slurm 22.05.8, see docs/slurm.md): auth/none + cred/none
# need no munged; no systemd or cgroups are needed with proctrack/linuxproc + task/none; slurmd needs
# `-N localhost` because the machine's hostname is not the node name.
set -euo pipefail

STATE_DIR=${GSPO_SLURM_DIR:-/tmp/gspo-slurm}
CTLD_PORT=${GSPO_SLURM_CTLD_PORT:-6817}
SLURMD_PORT=${GSPO_SLURM_SLURMD_PORT:-6818}
CONF="$STATE_DIR/slurm.conf"
CTLD_PID="$STATE_DIR/run/slurmctld.pid"
SLURMD_PID="$STATE_DIR/run/slurmd.pid"
NODE=localhost
PACKAGES=(slurmctld slurmd slurm-client munge)
EXIT_CANNOT_INSTALL=3
START_TIMEOUT_S=60
STOP_TIMEOUT_S=15

log() { echo "local_cluster: $*" >&2; }
die() { log "error: $*"; exit 1; }

have_slurm() { command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null; }

apt_has_lists() { compgen -G "/var/lib/apt/lists/*_Packages*" >/dev/null; }

cmd_install() {
    if have_slurm; then
        return 0
    fi
    if ! command -v apt-get >/dev/null; then
        log "cannot install Slurm: apt-get not found (install ${PACKAGES[*]} by hand)"
        exit "$EXIT_CANNOT_INSTALL"
    fi
    if [ "$(id -u)" != 0 ]; then
        log "cannot install Slurm: apt-get needs root (run: sudo apt-get install ${PACKAGES[*]})"
        exit "$EXIT_CANNOT_INSTALL"
    fi
    local apt=(apt-get -o DPkg::Lock::Timeout=300 -q)
    export DEBIAN_FRONTEND=noninteractive
    if ! apt_has_lists; then
        "${apt[@]}" update >&2
    fi
    # A stale package list can name versions the mirror no longer has: refresh once and retry.
    if ! "${apt[@]}" install -y --no-install-recommends "${PACKAGES[@]}" >&2; then
        "${apt[@]}" update >&2
        "${apt[@]}" install -y --no-install-recommends "${PACKAGES[@]}" >&2
    fi
    have_slurm || die "apt-get finished but slurmctld/slurmd/sbatch are still not on PATH"
}

# True while the process runs; a killed daemon stays a zombie until PID 1 reaps it, which counts as dead.
alive() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }  # drop "pid (comm) ": the state letter comes first
    [ "${stat%% *}" != Z ]
}

# The PID in a pid file, printed only when that process is alive and is the daemon named (PIDs get reused).
live_pid() {
    local pidfile=$1 name=$2 pid
    [ -s "$pidfile" ] || return 1
    pid=$(tr -dc '0-9' <"$pidfile")
    [ -n "$pid" ] && alive "$pid" || return 1
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ] || return 1
    echo "$pid"
}

node_state() { SLURM_CONF=$CONF sinfo -h -N -n "$NODE" -o '%t' 2>/dev/null | head -n 1; }

is_running() {
    live_pid "$CTLD_PID" slurmctld >/dev/null && live_pid "$SLURMD_PID" slurmd >/dev/null \
        && [ -n "$(node_state)" ]
}

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

write_conf() {
    local cpus mem_mb user
    cpus=${GSPO_SLURM_CPUS:-$(nproc)}
    [ "$cpus" -ge 2 ] || cpus=2
    # 90% of physical memory: a node that reports less than its configured RealMemory is drained.
    mem_mb=$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)
    user=$(id -un)
    mkdir -p "$STATE_DIR"/{state,spool,run,log}
    cat >"$CONF.tmp" <<EOF
# Written by tools/slurm/local_cluster.sh; rewritten on every fresh start.
ClusterName=gspo-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/none
CredType=cred/none
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Without batch_sched_delay=0 a submitted job waits for the scheduler's next tick (about 3 s).
SchedulerParameters=batch_sched_delay=0
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MailProg=/bin/true
ReturnToService=2
# Short waits between SIGTERM and SIGKILL keep failing-job tests quick.
KillWait=5
# Take the declared CPU count even where the hardware has fewer (a 2-task job must fit on any CI machine).
SlurmdParameters=config_overrides
StateSaveLocation=$STATE_DIR/state
SlurmdSpoolDir=$STATE_DIR/spool
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd.log
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus Boards=1 SocketsPerBoard=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=$mem_mb State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$CONF.tmp" "$CONF"
}

show_logs() {
    local f
    for f in "$STATE_DIR"/log/slurmctld.log "$STATE_DIR"/log/slurmd.log; do
        [ -f "$f" ] && { log "--- last lines of $f"; tail -n 25 "$f" >&2; }
    done
    return 0
}

stop_daemon() {
    local pidfile=$1 name=$2 pid waited=0
    pid=$(live_pid "$pidfile" "$name") || { rm -f "$pidfile"; return 0; }
    kill -TERM "$pid" 2>/dev/null || true
    while alive "$pid" && [ "$waited" -lt $((STOP_TIMEOUT_S * 10)) ]; do
        sleep 0.1
        waited=$((waited + 1))
    done
    if alive "$pid"; then
        log "$name (pid $pid) ignored SIGTERM for ${STOP_TIMEOUT_S}s: SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
}

# slurmd leaves running steps alive when it stops (by design, to survive restarts), so jobs are cancelled
# first and given KillWait (+ a margin) to end; otherwise their processes would outlive the cluster.
cancel_jobs() {
    live_pid "$CTLD_PID" slurmctld >/dev/null || return 0
    SLURM_CONF=$CONF scancel --user="$(id -un)" 2>/dev/null || true
    local deadline=$((SECONDS + STOP_TIMEOUT_S))
    while [ "$SECONDS" -lt "$deadline" ] && [ -n "$(SLURM_CONF=$CONF squeue -h -t RUNNING,COMPLETING,PENDING,CONFIGURING -o %i 2>/dev/null)" ]; do
        sleep 0.2
    done
}

cmd_stop() {
    cancel_jobs
    stop_daemon "$SLURMD_PID" slurmd
    stop_daemon "$CTLD_PID" slurmctld
}

cmd_start() {
    cmd_install
    mkdir -p "$STATE_DIR"
    # Two `start`s at once (two pytest sessions) must not both write the conf and spawn daemons.
    exec 9>"$STATE_DIR/.lock"
    flock -w 120 9 || die "another local_cluster.sh holds $STATE_DIR/.lock for over 120 s"
    if is_running; then
        log "already running (state in $STATE_DIR)"
        echo "export SLURM_CONF=$CONF"
        return 0
    fi
    cmd_stop  # a half-running cluster (one daemon died) is restarted whole
    local port
    for port in "$CTLD_PORT" "$SLURMD_PORT"; do
        if port_in_use "$port"; then
            die "port $port is taken (another Slurm?); set GSPO_SLURM_CTLD_PORT / GSPO_SLURM_SLURMD_PORT"
        fi
    done
    write_conf
    # -c: start with empty job state, so jobs of an earlier run are not resurrected.
    # 9>&-: the daemons must not inherit the lock, or it would be held for as long as they run.
    slurmctld -c -f "$CONF" 9>&- || { show_logs; die "slurmctld did not start"; }
    slurmd -f "$CONF" -N "$NODE" 9>&- || { show_logs; die "slurmd did not start"; }
    local deadline=$((SECONDS + START_TIMEOUT_S)) state=""
    while [ "$SECONDS" -lt "$deadline" ]; do
        state=$(node_state)
        case "$state" in
            idle | mix | alloc) break ;;
        esac
        sleep 0.2
    done
    case "$state" in
        idle | mix | alloc) ;;
        *) show_logs; cmd_stop; die "node $NODE not idle after ${START_TIMEOUT_S}s (state: '${state:-no answer}')" ;;
    esac
    log "running: slurmctld pid $(live_pid "$CTLD_PID" slurmctld), slurmd pid $(live_pid "$SLURMD_PID" slurmd), state in $STATE_DIR"
    echo "export SLURM_CONF=$CONF"
}

cmd_status() {
    local ctld slurmd
    ctld=$(live_pid "$CTLD_PID" slurmctld || echo "not running")
    slurmd=$(live_pid "$SLURMD_PID" slurmd || echo "not running")
    echo "state dir: $STATE_DIR"
    echo "slurmctld: $ctld"
    echo "slurmd:    $slurmd"
    if is_running; then
        echo "node $NODE: $(node_state)"
        echo "export SLURM_CONF=$CONF"
        return 0
    fi
    return 1
}

case "${1:-}" in
    install) cmd_install ;;
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) echo "usage: $0 {install|start|stop|status}" >&2; exit 2 ;;
esac
