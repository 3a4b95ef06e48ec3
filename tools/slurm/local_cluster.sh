#!/usr/bin/env bash
# A real Slurm cluster on this machine, for tests and for trying the sbatch examples: one node, or N nodes
# each in its own network namespace.
#
#   tools/slurm/local_cluster.sh install            # apt-get install the Debian packages when missing
#   tools/slurm/local_cluster.sh start [--nodes N]  # install if needed, write slurm.conf, start daemons, wait for idle nodes
#   tools/slurm/local_cluster.sh status             # exit 0 when every daemon runs and every node answers
#   tools/slurm/local_cluster.sh stop               # cancel jobs, stop daemons by pid file, remove namespaces; idempotent
#
# --nodes 1 (default): node `localhost` at 127.0.0.1, as on a laptop.
# --nodes N >= 2: nodes node1..nodeN, node i in network namespace gspo<ctld port>-node<i> with address
# <subnet>.(10+i) on a veth whose host end joins a bridge gs<ctld port>br holding <subnet>.1, where
# slurmctld (host namespace) listens. Each slurmd runs in its namespace, in its own UTS namespace whose
# hostname is the node name (so gloo/NCCL pick the node's address) and its own mount namespace with
# /etc/netns/<namespace>/hosts bind-mounted over /etc/hosts (so node names resolve on every node); spool,
# log and pid file are per node (%n). Needs root, iproute2 and util-linux (nsenter, unshare); where
# namespaces cannot be made, start exits 4 and says why.
#
# `start` prints one line on stdout, `export SLURM_CONF=...`, so `eval "$(tools/slurm/local_cluster.sh start)"`
# points the clients (sbatch, srun, squeue, scontrol) at this cluster; everything else goes to stderr.
# Starting a running cluster is a no-op that prints the same line.
#
# Environment:
#   GSPO_SLURM_DIR         state folder (conf, spool, logs, pid files); default /tmp/gspo-slurm
#   GSPO_SLURM_CTLD_PORT   slurmctld port; default 6817 (change it to run a second cluster beside this one)
#   GSPO_SLURM_SLURMD_PORT slurmd port; default 6818
#   GSPO_SLURM_CPUS        CPUs each node offers; default max(nproc / nodes, 2), so 2-task jobs fit on any machine
#   GSPO_SLURM_SUBNET      first three octets of the nodes' /24 (--nodes >= 2); default 10.213.<ctld port % 256>
#   GSPO_SLURM_CRED_EXPIRE job credential lifetime in s, which is also how long a requeued job waits; default 30
#
# Exit codes: 0 ok; 1 failure (the daemon logs are printed); 3 Slurm is missing and cannot be installed
# here (no apt-get or not root); 4 network namespaces cannot be made here (--nodes >= 2). Tests skip on
# 3 and 4 only.
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
NODES_FILE="$STATE_DIR/nodes"  # the node count of the cluster last started here, for status and stop
PACKAGES=(slurmctld slurmd slurm-client munge)
EXIT_CANNOT_INSTALL=3
EXIT_NO_NAMESPACES=4
NET_PREFIX="gspo$CTLD_PORT-node"   # namespace gspo6817-node1 ...
BRIDGE="gs${CTLD_PORT}br"          # interface names have at most 15 characters
SUBNET=${GSPO_SLURM_SUBNET:-10.213.$((CTLD_PORT % 256))}
CRED_EXPIRE_S=${GSPO_SLURM_CRED_EXPIRE:-30}
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

# The layout: NUM_NODES, set from --nodes (start) or from $NODES_FILE (status, stop).
NUM_NODES=1
saved_nodes() { if [ -s "$NODES_FILE" ]; then tr -dc '0-9' <"$NODES_FILE"; else echo 1; fi; }
node_name() { if [ "$NUM_NODES" = 1 ]; then echo localhost; else echo "node$1"; fi; }
node_addr() { if [ "$NUM_NODES" = 1 ]; then echo 127.0.0.1; else echo "$SUBNET.$((10 + $1))"; fi; }
ctld_addr() { if [ "$NUM_NODES" = 1 ]; then echo 127.0.0.1; else echo "$SUBNET.1"; fi; }
# One node keeps the plain names (slurmd.pid, slurmd.log, spool/); several get one of each per node.
per_node() { if [ "$NUM_NODES" = 1 ]; then echo ""; else echo "-$1"; fi; }
slurmd_pidfile() { echo "$STATE_DIR/run/slurmd$(per_node "$(node_name "$1")").pid"; }
netns() { echo "$NET_PREFIX$1"; }
host_veth() { echo "gs${CTLD_PORT}h$1"; }

# "<node> <state>" lines, e.g. "node1 idle"; a node that never registered is missing or "unk".
node_states() { SLURM_CONF=$CONF sinfo -h -N -o '%N %t' 2>/dev/null | sort -u; }

all_nodes_in() {
    local states=$1 i state
    for ((i = 1; i <= NUM_NODES; i++)); do
        state=$(awk -v n="$(node_name "$i")" '$1 == n {print $2}' <<<"$states")
        case "$state" in idle | mix | alloc) ;; *) return 1 ;; esac
    done
}

is_running() {
    local i
    live_pid "$CTLD_PID" slurmctld >/dev/null || return 1
    for ((i = 1; i <= NUM_NODES; i++)); do
        live_pid "$(slurmd_pidfile "$i")" slurmd >/dev/null || return 1
    done
    [ -n "$(node_states)" ]
}

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

write_conf() {
    local cpus mem_mb user
    cpus=${GSPO_SLURM_CPUS:-$(($(nproc) / NUM_NODES))}
    [ "$cpus" -ge 2 ] || cpus=2
    # 90% of physical memory, shared out: a node that reports less than its RealMemory is drained.
    mem_mb=$(awk -v n="$NUM_NODES" '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.9 / n}' /proc/meminfo)
    user=$(id -un)
    mkdir -p "$STATE_DIR"/{state,spool,run,log}
    local i nodes=() node_lines=""
    for ((i = 1; i <= NUM_NODES; i++)); do
        nodes+=("$(node_name "$i")")
        node_lines+="NodeName=$(node_name "$i") NodeAddr=$(node_addr "$i") CPUs=$cpus Boards=1 SocketsPerBoard=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=$mem_mb State=UNKNOWN"$'\n'
    done
    cat >"$CONF.tmp" <<EOF
# Written by tools/slurm/local_cluster.sh; rewritten on every fresh start.
ClusterName=gspo-local
# "localhost" is the name slurmctld accepts as its own whatever the machine's hostname is.
SlurmctldHost=localhost($(ctld_addr))
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/none
CredType=cred/none
# Credential lifetime, and so how long a requeued job is held (BeginTime) before it may start again: a
# node refuses to launch a job whose previous run's credential it revoked until that has expired.
# Default 120 s; 30 s still covers a step launch on a loaded machine.
AuthInfo=cred_expire=$CRED_EXPIRE_S
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Without batch_sched_delay=0 a submitted job waits for the scheduler's next tick (about 3 s); a job
# whose BeginTime passes (a requeued one) waits for the next full pass, every sched_interval (default 60 s).
SchedulerParameters=batch_sched_delay=0,sched_interval=5
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MailProg=/bin/true
ReturnToService=2
# Short waits between SIGTERM and SIGKILL keep failing-job tests quick.
KillWait=5
# Take the declared CPU count even where the hardware has fewer (a 2-task job must fit on any CI machine).
SlurmdParameters=config_overrides
StateSaveLocation=$STATE_DIR/state
# %n: the node name, so the slurmds of a multi-node cluster keep apart.
SlurmdSpoolDir=$STATE_DIR/spool$(per_node %n)
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$STATE_DIR/run/slurmd$(per_node %n).pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd$(per_node %n).log
${node_lines}PartitionName=local Nodes=$(IFS=,; echo "${nodes[*]}") Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$CONF.tmp" "$CONF"
}

show_logs() {
    local f
    for f in "$STATE_DIR"/log/*.log; do
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

# --- network namespaces (--nodes >= 2) ---------------------------------------------------------------

# Why namespaces cannot be made here, or nothing when they can (checked by making and removing one).
namespaces_unavailable() {
    [ "$(id -u)" = 0 ] || { echo "network namespaces need root (ip netns add)"; return; }
    command -v ip >/dev/null || { echo "the ip command is missing (apt-get install iproute2)"; return; }
    command -v unshare >/dev/null && command -v nsenter >/dev/null \
        || { echo "unshare/nsenter are missing (apt-get install util-linux)"; return; }
    local probe="${NET_PREFIX}probe" err
    if ! err=$(ip netns add "$probe" 2>&1); then
        echo "ip netns add failed: $err"
        return
    fi
    ip netns del "$probe" 2>/dev/null || true
}

# Namespaces of this cluster by name (not only by the node count on file: a crashed start may have
# left more, or the nodes file may be gone).
our_namespaces() { ip netns list 2>/dev/null | awk -v p="$NET_PREFIX" 'index($1, p) == 1 {print $1}'; }

# SIGTERM, then SIGKILL after STOP_TIMEOUT_S, every process left in a namespace (job steps outlive slurmd).
kill_namespace_processes() {
    local ns=$1 pids waited=0
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
    [ -n "${pids// /}" ] || return 0
    log "namespace $ns: SIGTERM to leftover processes $pids"
    kill -TERM $pids 2>/dev/null || true
    while [ -n "$(ip netns pids "$ns" 2>/dev/null)" ] && [ "$waited" -lt $((STOP_TIMEOUT_S * 10)) ]; do
        sleep 0.1
        waited=$((waited + 1))
    done
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
    if [ -n "${pids// /}" ]; then
        log "namespace $ns: SIGKILL to $pids"
        kill -KILL $pids 2>/dev/null || true
    fi
}

teardown_network() {
    local ns i link
    for ns in $(our_namespaces); do
        kill_namespace_processes "$ns"
        ip netns del "$ns" 2>/dev/null || log "could not delete namespace $ns"
        rm -rf "/etc/netns/$ns"
    done
    # The host end of a veth goes with its namespace, but not always at once: delete what is left.
    for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' \
                  | grep -E "^gs${CTLD_PORT}(h[0-9]+|br)\$"); do
        ip link del "$link" 2>/dev/null || true
    done
    rm -rf "/etc/netns/${NET_PREFIX}probe"
}

# The subnet must not be in use by anything but this cluster's bridge.
check_subnet_free() {
    local users
    users=$(ip -o -4 addr show 2>/dev/null | awk -v s="$SUBNET." -v b="$BRIDGE" 'index($4, s) == 1 && $2 != b {print $2}')
    [ -z "$users" ] || die "subnet $SUBNET.0/24 is already used by interface(s) $users; set GSPO_SLURM_SUBNET"
}

setup_network() {
    local i ns veth hosts
    check_subnet_free
    ip link add "$BRIDGE" type bridge
    ip addr add "$(ctld_addr)/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    hosts=$(printf '127.0.0.1 localhost\n'; for ((i = 1; i <= NUM_NODES; i++)); do
        printf '%s %s\n' "$(node_addr "$i")" "$(node_name "$i")"; done)
    for ((i = 1; i <= NUM_NODES; i++)); do
        ns=$(netns "$i")
        veth=$(host_veth "$i")
        ip netns add "$ns"
        ip link add "$veth" type veth peer name "${veth}n"
        ip link set "$veth" master "$BRIDGE"
        ip link set "$veth" up
        ip link set "${veth}n" netns "$ns"
        # Every node calls its interface eth0, as identical machines would.
        ip -n "$ns" link set "${veth}n" name eth0
        ip -n "$ns" addr add "$(node_addr "$i")/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        # Bind-mounted over /etc/hosts and /etc/resolv.conf on that node only (where `ip netns exec` would
        # look for them too). No name server: the host's is unreachable from a node, and every reverse
        # lookup (c10d does some) would wait for its timeout; without one, glibc fails at once.
        mkdir -p "/etc/netns/$ns"
        printf '%s\n' "$hosts" >"/etc/netns/$ns/hosts"
        echo "# local_cluster.sh: no name server on emulated nodes" >"/etc/netns/$ns/resolv.conf"
    done
}

start_slurmd() {
    local i=$1 name ns
    name=$(node_name "$i")
    if [ "$NUM_NODES" = 1 ]; then
        slurmd -f "$CONF" -N "$name" 9>&-
        return
    fi
    ns=$(netns "$i")
    mkdir -p "$STATE_DIR/spool-$name"
    # Not `ip netns exec`: it remounts /sys for the namespace, which hides /sys/fs/cgroup, and slurmd
    # 22.05 will not start without it. So: the network namespace, plus our own UTS namespace (hostname =
    # node name, what gethostname() says on that node) and mount namespace (the node's /etc/hosts).
    nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation private sh -c \
        'hostname "$1" && mount --bind "$2/hosts" /etc/hosts && mount --bind "$2/resolv.conf" /etc/resolv.conf \
            && exec slurmd -f "$3" -N "$1"' \
        slurmd-in-namespace "$name" "/etc/netns/$ns" "$CONF" 9>&-
}

cmd_stop() {
    cancel_jobs
    local i
    for ((i = 1; i <= NUM_NODES; i++)); do
        stop_daemon "$(slurmd_pidfile "$i")" slurmd
    done
    stop_daemon "$CTLD_PID" slurmctld
    if [ "$NUM_NODES" -gt 1 ] || [ -n "$(our_namespaces)" ]; then
        teardown_network
    fi
    rm -f "$NODES_FILE"
}

cmd_start() {
    cmd_install
    mkdir -p "$STATE_DIR"
    # Two `start`s at once (two pytest sessions) must not both write the conf and spawn daemons.
    exec 9>"$STATE_DIR/.lock"
    flock -w 120 9 || die "another local_cluster.sh holds $STATE_DIR/.lock for over 120 s"
    local wanted=$NUM_NODES running
    NUM_NODES=$(saved_nodes)
    if is_running; then
        if [ "$NUM_NODES" != "$wanted" ]; then
            die "a $NUM_NODES-node cluster runs in $STATE_DIR; stop it first, or use another GSPO_SLURM_DIR and GSPO_SLURM_CTLD_PORT"
        fi
        log "already running (state in $STATE_DIR)"
        echo "export SLURM_CONF=$CONF"
        return 0
    fi
    cmd_stop  # a half-running cluster (one daemon died) is restarted whole
    NUM_NODES=$wanted
    if [ "$NUM_NODES" -gt 1 ]; then
        local why
        why=$(namespaces_unavailable)
        if [ -n "$why" ]; then
            log "cannot build a $NUM_NODES-node cluster: $why"
            exit "$EXIT_NO_NAMESPACES"
        fi
    fi
    local port
    for port in "$CTLD_PORT" "$SLURMD_PORT"; do
        if port_in_use "$port"; then
            die "port $port is taken (another Slurm?); set GSPO_SLURM_CTLD_PORT / GSPO_SLURM_SLURMD_PORT"
        fi
    done
    echo "$NUM_NODES" >"$NODES_FILE"
    write_conf
    if [ "$NUM_NODES" -gt 1 ]; then
        setup_network || { cmd_stop; die "could not build the network for $NUM_NODES nodes"; }
    fi
    # -c: start with empty job state, so jobs of an earlier run are not resurrected.
    # 9>&-: the daemons must not inherit the lock, or it would be held for as long as they run.
    slurmctld -c -f "$CONF" 9>&- || { show_logs; cmd_stop; die "slurmctld did not start"; }
    local i
    for ((i = 1; i <= NUM_NODES; i++)); do
        start_slurmd "$i" || { show_logs; cmd_stop; die "slurmd of $(node_name "$i") did not start"; }
    done
    local deadline=$((SECONDS + START_TIMEOUT_S)) states=""
    while [ "$SECONDS" -lt "$deadline" ]; do
        states=$(node_states)
        all_nodes_in "$states" && break
        sleep 0.2
    done
    if ! all_nodes_in "$states"; then
        show_logs
        cmd_stop
        die "nodes not idle after ${START_TIMEOUT_S}s (sinfo: '$(tr '\n' ' ' <<<"${states:-no answer}")')"
    fi
    log "running: $NUM_NODES node(s), slurmctld pid $(live_pid "$CTLD_PID" slurmctld), state in $STATE_DIR"
    echo "export SLURM_CONF=$CONF"
}

cmd_status() {
    local i
    NUM_NODES=$(saved_nodes)
    echo "state dir: $STATE_DIR"
    echo "slurmctld: $(live_pid "$CTLD_PID" slurmctld || echo "not running")"
    for ((i = 1; i <= NUM_NODES; i++)); do
        echo "slurmd $(node_name "$i"): $(live_pid "$(slurmd_pidfile "$i")" slurmd || echo "not running")"
    done
    if is_running; then
        node_states | sed 's/^/node /'
        echo "export SLURM_CONF=$CONF"
        return 0
    fi
    return 1
}

usage() { echo "usage: $0 {install|start [--nodes N]|stop|status}" >&2; exit 2; }

action=${1:-}
shift || true
while [ $# -gt 0 ]; do
    case "$1" in
        --nodes) [ $# -ge 2 ] || usage; NUM_NODES=$2; shift 2 ;;
        --nodes=*) NUM_NODES=${1#--nodes=}; shift ;;
        *) usage ;;
    esac
done
[[ "$NUM_NODES" =~ ^[1-9][0-9]?$ ]] || { log "error: --nodes wants a number from 1 to 99, got '$NUM_NODES'"; exit 2; }
[ "$action" = start ] || [ "$NUM_NODES" = 1 ] || { log "error: --nodes goes with start only"; exit 2; }
case "$action" in
    install) cmd_install ;;
    start) cmd_start ;;
    stop) NUM_NODES=$(saved_nodes); cmd_stop ;;
    status) cmd_status ;;
    *) usage ;;
esac
