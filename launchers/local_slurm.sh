#!/usr/bin/env bash
# A throw-away six-node Slurm cluster on localhost, for tests and CI.
#
#   launchers/local_slurm.sh up      # install (if needed) and start; idempotent
#   launchers/local_slurm.sh status  # sinfo + topology; exit 0 only when all nodes usable
#   launchers/local_slurm.sh down    # stop the daemons this script started; idempotent
#   ACCOUNTING=0 launchers/local_slurm.sh up   # the same cluster without slurmdbd
#
# Layout: one slurmctld plus six `slurmd -N nodeK` processes on this host, each node with
# 8 CPUs (more than the host has, allowed by SlurmdParameters=config_overrides) and four
# fake GPUs (plain files), wired into a tree topology of racks of two nodes:
#
#   spine -- rack1 -- node1, node2
#         |- rack2 -- node3, node4
#         \- rack3 -- node5, node6
#
# Why six: Slurm never places two components of one het job on the same node (a 5-node
# het job on 4 nodes stays PENDING for Resources), and the smallest job with every role
# (trainer on 2 nodes + generator + teacher + env) needs 5. rack1/rack2 are the two racks
# the placement tests use; rack3 holds the extra nodes.
#
# Everything lives in ${HPC_RL_SLURM_STATE:-/tmp/hpc_rl_slurm}. The daemons get that
# slurm.conf through SLURM_CONF; /etc/slurm/slurm.conf is a symlink to it so that plain
# sbatch/squeue/sinfo (no SLURM_CONF exported) reach the same cluster.
#
# Accounting (the default, as on every production cluster): a MariaDB server and slurmdbd,
# both from Debian's packages and both started by this script (init does not run services
# in containers), with the cluster registered, so `sacct` answers. The database lives in
# the state directory and survives `down`/`up` (its first start creates it: the slow part
# of a fresh `up`); slurmctld still starts with a clean state, so job ids restart at 1
# and sacct keeps older jobs with the same ids: job handles tell them apart by submit time.
# Ports: slurmdbd's default 6819 is a node's here, so slurmdbd and MariaDB sit above the
# nodes' range (PORT_BASE+10, PORT_BASE+11).
#
# Environment knobs:
#   ACCOUNTING              1 (default): MariaDB + slurmdbd; 0: no accounting (sacct fails)
#   HPC_RL_SLURM_STATE      state directory (default /tmp/hpc_rl_slurm)
#   HPC_RL_SLURM_PORT_BASE  slurmctld port; nodes use the next six (default 6817)
#   HPC_RL_SLURM_TIMEOUT    seconds `up` waits for all nodes to be idle (default 60)
set -euo pipefail

STATE="${HPC_RL_SLURM_STATE:-/tmp/hpc_rl_slurm}"
PORT_BASE="${HPC_RL_SLURM_PORT_BASE:-6817}"
UP_TIMEOUT="${HPC_RL_SLURM_TIMEOUT:-60}"
NODES=(node1 node2 node3 node4 node5 node6)
PARTITION=local
ETC_CONF=/etc/slurm/slurm.conf
ACCOUNTING="${ACCOUNTING:-1}"
DBD_PORT=$((PORT_BASE + 10))
DB_PORT=$((PORT_BASE + 11))
DB_NAME=slurm_acct_db
CLUSTER=hpc_rl_local
case "$ACCOUNTING" in
    0 | 1) ;;
    *) echo "[local_slurm] ACCOUNTING=$ACCOUNTING: set ACCOUNTING=1 (slurmdbd, the default) or ACCOUNTING=0 (none)" >&2; exit 2 ;;
esac

CONF="$STATE/slurm.conf"
RUN="$STATE/run"   # pid files of the daemons *this script* started
LOG="$STATE/log"
DB_DIR="$STATE/mysql"            # MariaDB's data directory
DB_SOCK="$DB_DIR/mysqld.sock"    # root's way in (unix socket authentication); slurmdbd uses TCP
DB_PASS_FILE="$STATE/dbd.pass"   # slurmdbd's database password, made once with the database
DBD_CONF="$STATE/slurmdbd.conf"  # slurmdbd reads the slurmdbd.conf beside SLURM_CONF
export SLURM_CONF="$CONF"

log() { echo "[local_slurm] $*" >&2; }

# Slurm daemons must run as root here (SlurmUser=root, and slurmd has to switch to the
# submitting user to run jobs). Re-run the whole script under sudo when we are not root
# (e.g. a CI runner user with passwordless sudo); -E keeps HPC_RL_SLURM_* settings.
if [[ "$(id -u)" != 0 ]]; then
    exec sudo -E bash "$0" "$@"
fi

# ----------------------------------------------------------------------------- helpers

# pid_alive FILE NAME: the pid in FILE is running and its command is NAME (a pid file
# left behind by a dead daemon may point at a recycled pid; don't trust it blindly).
# Zombies count as dead: our daemons are orphans, and in containers whose init does not
# reap, a crashed daemon lingers as a zombie with the same name.
pid_alive() {
    local file="$1" name="$2" pid stat
    [[ -s "$file" ]] || return 1
    pid="$(cat "$file")"
    [[ "$pid" =~ ^[0-9]+$ ]] || return 1
    stat="$(cat "/proc/$pid/stat" 2>/dev/null)" || return 1
    # /proc/PID/stat is "PID (COMM) STATE ...".
    [[ "$stat" == *"($name) "* ]] || return 1
    stat="${stat##*) }"
    [[ "${stat:0:1}" != Z ]]
}

# stop_pidfiles NAME FILE...: SIGTERM every live daemon first, then wait (up to 10 s)
# for all of them together -- a slurmd takes about a second to shut down, so stopping
# them one after another would make 'down' needlessly slow. SIGKILL stragglers; remove
# the pid files.
stop_pidfiles() {
    local name="$1" file i any
    shift
    for file in "$@"; do
        if pid_alive "$file" "$name"; then
            kill -TERM "$(cat "$file")" 2>/dev/null || true
        fi
    done
    for ((i = 0; i < 100; i++)); do
        any=0
        for file in "$@"; do pid_alive "$file" "$name" && any=1; done
        ((any)) || break
        sleep 0.1
    done
    for file in "$@"; do
        if pid_alive "$file" "$name"; then
            log "$name ($(cat "$file")) ignored SIGTERM; killing"
            kill -KILL "$(cat "$file")" 2>/dev/null || true
        fi
        rm -f "$file"
    done
}

# start_daemon NAME PIDFILE CMD...: start CMD in the foreground-mode (-D) of the daemon,
# detached into its own session so it survives this script and a Ctrl-C in the caller's
# terminal, with stdio on files so callers capturing our output (pytest) don't hang on an
# inherited pipe. A non-group-leader child makes setsid exec in place, so $! is the daemon.
start_daemon() {
    local name="$1" pidfile="$2"
    shift 2
    (
        close_inherited_fds
        exec setsid "$@" </dev/null >>"$LOG/$name.stdout" 2>&1
    ) &
    echo $! >"$pidfile"
}

# A daemon outlives this script: it must not keep the caller's descriptors open. A lock
# held by the caller (`flock LOCK launchers/local_slurm.sh up`, or pytest under flock
# calling `up`) would otherwise be held by munged or slurmctld until they stop.
close_inherited_fds() {
    local fd
    for fd in /proc/$BASHPID/fd/*; do
        fd="${fd##*/}"
        if [[ "$fd" =~ ^[0-9]+$ ]] && ((fd > 2)); then eval "exec $fd>&-" 2>/dev/null || true; fi
    done
}

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

slurm_installed() {
    command -v slurmctld && command -v slurmd && command -v sbatch && command -v munged &&
        command -v runuser
} >/dev/null 2>&1

accounting_installed() {
    command -v slurmdbd && command -v sacctmgr && command -v mariadbd && command -v mariadb &&
        command -v mariadb-install-db
} >/dev/null 2>&1

# Node lines "name state" from the controller; empty when it does not answer.
node_states() { timeout 10 sinfo -h -N -p "$PARTITION" -o '%N %T' 2>/dev/null || true; }

# All nodes are present and in a state that accepts jobs. A trailing '*' (not
# responding), '~' (powered down) or drain/down/fail/inval state means not usable.
nodes_usable() {
    local states
    states="$(node_states)"
    [[ -n "$states" ]] || return 1
    [[ "$(wc -l <<<"$states")" -eq ${#NODES[@]} ]] || return 1
    ! grep -Eqv ' (idle|mixed|allocated|completing)$' <<<"$states"
}

daemons_alive() {
    local n
    pid_alive "$RUN/slurmctld.pid" slurmctld || return 1
    for n in "${NODES[@]}"; do
        pid_alive "$RUN/slurmd.$n.pid" slurmd || return 1
    done
}

dump_logs() {
    local f
    # The *.log files are the daemons' own logs; *.stdout only matters when a daemon died
    # before it could open its log (bad config), so show just its last lines.
    for f in "$LOG"/slurmctld.log "$LOG"/slurmd.*.log "$LOG"/slurmdbd.log; do
        [[ -s "$f" ]] || continue
        echo "===== tail $f" >&2
        tail -n 25 "$f" >&2
    done
    for f in "$LOG"/*.stdout; do
        [[ -s "$f" ]] || continue
        echo "===== tail $f" >&2
        tail -n 5 "$f" >&2
    done
}

# ----------------------------------------------------------------------------- install

install_slurm() {
    local pkgs=()
    slurm_installed || pkgs+=(slurmctld slurmd slurm-client munge)
    if ((ACCOUNTING)) && ! accounting_installed; then pkgs+=(slurmdbd mariadb-server mariadb-client); fi
    ((${#pkgs[@]})) || return 0
    log "installing with apt-get: ${pkgs[*]}"
    # Fresh CI images need the index first. The packages' own service units may start
    # munge (fine: we reuse a working munged) and fail to start slurm/mariadb (no conf, or
    # no init in a container; fine: this script starts its own).
    DEBIAN_FRONTEND=noninteractive apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${pkgs[@]}"
    slurm_installed || { log "install finished but slurm binaries still missing"; exit 1; }
    if ((ACCOUNTING)) && ! accounting_installed; then
        log "install finished but slurmdbd/mariadb binaries still missing"; exit 1
    fi
}

# ----------------------------------------------------------------------------- config

# render_file PATH < content: write only when the content changed, and report via the
# global CONF_CHANGED, so a running cluster with the same config is left alone.
CONF_CHANGED=0
render_file() {
    local path="$1" tmp
    tmp="$(mktemp "$path.XXXXXX")"
    cat >"$tmp"
    if [[ -f "$path" ]] && cmp -s "$tmp" "$path"; then
        rm -f "$tmp"
    else
        mv -f "$tmp" "$path"
        chmod 644 "$path"
        CONF_CHANGED=1
    fi
}

slurm_conf_text() {
    local n k=0 port
    cat <<EOF
# Generated by launchers/local_slurm.sh -- edits are overwritten on the next 'up'.
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmctldPort=$PORT_BASE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
# Debian has no mail program installed; silence the startup error.
MailProg=/bin/true

StateSaveLocation=$STATE/ctld
# %n: one spool dir and log per emulated node, since all share this host.
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.%n.log
SlurmctldPidFile=$RUN/slurmctld.daemon.pid
SlurmdPidFile=$RUN/slurmd.%n.daemon.pid
SlurmctldDebug=info
SlurmdDebug=info

# No cgroups in containers/CI: track processes through /proc, no task binding.
# (proctrack/pgid works too but makes every batch job linger ~3 s after its script exits.)
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
$(accounting_lines)
JobCompType=jobcomp/none

SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Without a default, a job without --mem would claim the whole node's memory and
# serialize everything that shares a node.
DefMemPerCPU=256

# Heterogeneous jobs are only started by the backfill scheduler; poll every second.
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1

# Let nodes declare more CPUs/memory/GPUs than this host has.
SlurmdParameters=config_overrides
# A node that was down (e.g. after 'down'/'up') rejoins as soon as it registers.
ReturnToService=2

# Short timeouts: a local cluster should fail fast, not hang tests.
SlurmctldTimeout=10
SlurmdTimeout=30
MessageTimeout=10
InactiveLimit=0
KillWait=5
Waittime=0
# Finished jobs stay visible to 'scontrol show job' for 5 min (there is no accounting DB).
MinJobAge=300

GresTypes=gpu
TopologyPlugin=topology/tree

EOF
    for n in "${NODES[@]}"; do
        k=$((k + 1))
        port=$((PORT_BASE + k))
        echo "NodeName=$n NodeHostname=localhost NodeAddr=127.0.0.1 Port=$port CPUs=8 Boards=1 SocketsPerBoard=1 CoresPerSocket=8 ThreadsPerCore=1 RealMemory=4096 Gres=gpu:4 State=UNKNOWN"
    done
    echo "PartitionName=$PARTITION Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP"
}

accounting_lines() {
    if ((ACCOUNTING)); then
        echo "AccountingStorageType=accounting_storage/slurmdbd"
        echo "AccountingStorageHost=localhost"
        echo "AccountingStoragePort=$DBD_PORT"
    else
        echo "AccountingStorageType=accounting_storage/none"
    fi
}

slurmdbd_conf_text() {
    cat <<EOF
# Generated by launchers/local_slurm.sh -- edits are overwritten on the next 'up'.
AuthType=auth/munge
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$LOG/slurmdbd.log
PidFile=$RUN/slurmdbd.daemon.pid
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$(cat "$DB_PASS_FILE")
StorageLoc=$DB_NAME
EOF
}

# Fake GPUs: gres needs File= pointing at existing files, else the node is INVAL.
gres_conf_text() {
    local n
    echo "# Generated by launchers/local_slurm.sh. Fake GPUs: plain files, no autodetection."
    echo "AutoDetect=off"
    for n in "${NODES[@]}"; do
        echo "NodeName=$n Name=gpu File=$STATE/gpus/$n/gpu[0-3]"
    done
}

write_config() {
    local n
    mkdir -p "$STATE" "$RUN" "$LOG" "$STATE/ctld" "$STATE/gpus"
    # `sbatch` run by non-root users must be able to read the configs.
    chmod 755 "$STATE"

    # Process substitution, not a pipe: render_file must run in this shell to set
    # CONF_CHANGED.
    render_file "$CONF" < <(slurm_conf_text)

    for n in "${NODES[@]}"; do
        mkdir -p "$STATE/gpus/$n"
        touch "$STATE/gpus/$n"/gpu{0,1,2,3}
    done
    render_file "$STATE/gres.conf" < <(gres_conf_text)

    if ((ACCOUNTING)); then
        if [[ ! -s "$DB_PASS_FILE" ]]; then
            (umask 077 && head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$DB_PASS_FILE")
        fi
        render_file "$DBD_CONF" < <(slurmdbd_conf_text)
        # slurmdbd refuses a config that others can read (it holds the database password).
        chmod 600 "$DBD_CONF"
    fi

    render_file "$STATE/topology.conf" <<EOF
# Generated by launchers/local_slurm.sh. Three racks of two nodes under one spine switch.
SwitchName=rack1 Nodes=node[1-2]
SwitchName=rack2 Nodes=node[3-4]
SwitchName=rack3 Nodes=node[5-6]
SwitchName=spine Switches=rack[1-3]
EOF

    for n in "${NODES[@]}"; do mkdir -p "$STATE/spool/$n"; done
}

# /etc/slurm/slurm.conf -> our conf, so tools work without SLURM_CONF. A foreign file
# there is kept aside rather than clobbered.
link_etc_conf() {
    mkdir -p "$(dirname "$ETC_CONF")"
    if [[ -L "$ETC_CONF" && "$(readlink "$ETC_CONF")" == "$CONF" ]]; then
        return 0
    fi
    if [[ -e "$ETC_CONF" && ! -L "$ETC_CONF" ]]; then
        log "moving existing $ETC_CONF to $ETC_CONF.hpc_rl.bak"
        mv -f "$ETC_CONF" "$ETC_CONF.hpc_rl.bak"
    fi
    ln -sfn "$CONF" "$ETC_CONF"
}

# ----------------------------------------------------------------------------- daemons

start_munge() {
    # Reuse any working munged on the default socket (e.g. a systemd-started one on CI).
    munge_works && return 0
    # Key: created by the Debian package normally; make one on a bare machine.
    if [[ ! -s /etc/munge/munge.key ]]; then
        log "creating /etc/munge/munge.key"
        mkdir -p /etc/munge
        if command -v mungekey >/dev/null; then
            mungekey --create --keyfile=/etc/munge/munge.key
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        fi
    fi
    # munged refuses to run unless its dirs are owned by its user and not world-writable.
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /etc/munge /etc/munge/munge.key /run/munge /var/lib/munge /var/log/munge
    chmod 700 /etc/munge /var/log/munge
    chmod 600 /etc/munge/munge.key
    chmod 755 /run/munge
    rm -f /run/munge/munged.pid
    (
        close_inherited_fds
        exec runuser -u munge -- munged
    )
    # munged daemonizes and writes its own pid file; remember that *we* started it.
    local i
    for ((i = 0; i < 50; i++)); do
        munge_works && break
        sleep 0.1
    done
    munge_works || { log "munged did not come up"; exit 1; }
    cp /run/munge/munged.pid "$RUN/munged.pid"
}

db_sql() { mariadb --no-defaults --protocol=socket --socket="$DB_SOCK" -u root "$@"; }

# MariaDB on 127.0.0.1:DB_PORT with its data in the state directory; --no-defaults keeps a
# system my.cnf (socket, port, datadir) out of it. The first start creates the database.
start_mariadb() {
    pid_alive "$RUN/mariadbd.pid" mariadbd && db_sql -e 'SELECT 1' >/dev/null 2>&1 && return 0
    stop_pidfiles mariadbd "$RUN/mariadbd.pid"
    if [[ ! -d "$DB_DIR/mysql" ]]; then
        log "creating the accounting database in $DB_DIR"
        rm -rf "$DB_DIR"
        mkdir -p "$DB_DIR"
        chown mysql:mysql "$DB_DIR"
        mariadb-install-db --no-defaults --user=mysql --datadir="$DB_DIR" --auth-root-authentication-method=socket \
            --skip-test-db >>"$LOG/mariadb-install.stdout" 2>&1 || { tail -n 20 "$LOG/mariadb-install.stdout" >&2; exit 1; }
    fi
    # A small buffer pool: the accounting tables of a test cluster are tiny. mariadbd runs as
    # mysql, so its socket and pid file go in its own directory; its log is its stdout.
    start_daemon mariadbd "$RUN/mariadbd.pid" mariadbd --no-defaults --user=mysql --datadir="$DB_DIR" \
        --socket="$DB_SOCK" --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve \
        --pid-file="$DB_DIR/mariadbd.pid" --innodb-buffer-pool-size=32M
    local i
    for ((i = 0; i < 300; i++)); do
        db_sql -e 'SELECT 1' >/dev/null 2>&1 && break
        pid_alive "$RUN/mariadbd.pid" mariadbd || break
        sleep 0.1
    done
    db_sql -e 'SELECT 1' >/dev/null 2>&1 || { log "mariadbd did not come up"; tail -n 20 "$LOG/mariadbd.stdout" >&2; exit 1; }
    # Idempotent: the same user and password on every start (the password file may be new).
    db_sql <<EOF
CREATE DATABASE IF NOT EXISTS $DB_NAME;
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$(cat "$DB_PASS_FILE")';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$(cat "$DB_PASS_FILE")';
GRANT ALL ON $DB_NAME.* TO 'slurm'@'127.0.0.1';
EOF
}

dbd_answers() { timeout 10 sacctmgr -n -P list cluster format=cluster >/dev/null 2>&1; }

# slurmdbd (it creates its tables on the first start), then the cluster's registration,
# before slurmctld starts: a controller that finds its cluster registered needs no restart.
start_accounting() {
    start_mariadb
    stop_pidfiles slurmdbd "$RUN/slurmdbd.pid"
    start_daemon slurmdbd "$RUN/slurmdbd.pid" slurmdbd -D
    local deadline=$((SECONDS + UP_TIMEOUT))
    until dbd_answers; do
        if ! pid_alive "$RUN/slurmdbd.pid" slurmdbd || ((SECONDS >= deadline)); then
            log "slurmdbd did not come up"
            tail -n 25 "$LOG/slurmdbd.log" "$LOG/slurmdbd.stdout" >&2 2>/dev/null || true
            exit 1
        fi
        sleep 0.2
    done
    if ! timeout 10 sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER"; then
        timeout 30 sacctmgr -i add cluster "$CLUSTER" >/dev/null
    fi
}

accounting_alive() { pid_alive "$RUN/mariadbd.pid" mariadbd && pid_alive "$RUN/slurmdbd.pid" slurmdbd; }

# slurmdbd first: it may still write what slurmctld sent it.
stop_accounting() {
    stop_pidfiles slurmdbd "$RUN/slurmdbd.pid"
    # InnoDB's shutdown can take longer than a slurmd's; stop_pidfiles waits 10 s.
    stop_pidfiles mariadbd "$RUN/mariadbd.pid"
}

# Called only after stop_slurm, so nothing of ours is running.
start_slurm() {
    local n
    # Start from a clean controller state (wiped dir, and -c: ignore saved jobs/nodes).
    # Old state from an earlier run (another config, nodes marked down) is what breaks
    # restarts, and a local test cluster has nothing worth recovering. -i: ignore
    # errors reading whatever state is left.
    rm -rf "${STATE:?}/ctld"/*
    start_daemon slurmctld "$RUN/slurmctld.pid" slurmctld -D -c -i
    for n in "${NODES[@]}"; do
        # -N: this slurmd plays node $n (all share localhost, each on its own Port=).
        start_daemon "slurmd.$n" "$RUN/slurmd.$n.pid" slurmd -D -N "$n"
    done
}

stop_slurm() {
    local n
    # Best effort: cancel leftover jobs so their slurmstepd's go away with the nodes.
    if pid_alive "$RUN/slurmctld.pid" slurmctld; then
        timeout 10 scancel --partition="$PARTITION" >/dev/null 2>&1 || true
    fi
    local files=()
    for n in "${NODES[@]}"; do files+=("$RUN/slurmd.$n.pid"); done
    stop_pidfiles slurmd "${files[@]}"
    stop_pidfiles slurmctld "$RUN/slurmctld.pid"
}

wait_for_nodes() {
    local deadline=$((SECONDS + UP_TIMEOUT))
    while ((SECONDS < deadline)); do
        nodes_usable && return 0
        # A daemon that died will not come back by waiting.
        if ! daemons_alive; then
            log "a Slurm daemon exited during startup"
            break
        fi
        sleep 0.5
    done
    log "cluster not ready after ${UP_TIMEOUT}s; node states:"
    node_states >&2 || true
    dump_logs
    return 1
}

# ----------------------------------------------------------------------------- commands

cmd_up() {
    install_slurm
    mkdir -p "$STATE" "$RUN" "$LOG"
    CONF_CHANGED=0
    write_config
    link_etc_conf

    # ACCOUNTING=0: a database left by an earlier 'up' is not part of this cluster.
    ((ACCOUNTING)) || stop_accounting

    # Fast path: same config, everything running and usable -> nothing to do.
    if [[ "$CONF_CHANGED" == 0 ]] && munge_works && daemons_alive && nodes_usable &&
        { ((ACCOUNTING == 0)) || { accounting_alive && dbd_answers; }; }; then
        log "already up ($STATE)"
        return 0
    fi

    # Anything partial or stale (changed config, a dead daemon, nodes not usable):
    # restart Slurm as a whole; cheaper to reason about than repairing piecemeal. MariaDB
    # is kept when it answers (start_mariadb): its first start is the slow one.
    stop_slurm
    start_munge
    if ((ACCOUNTING)); then start_accounting; fi
    start_slurm
    wait_for_nodes || exit 1
    log "up: ${#NODES[@]} nodes idle in partition '$PARTITION' ($STATE), accounting $( ((ACCOUNTING)) && echo "on (slurmdbd port $DBD_PORT)" || echo off)"
}

cmd_down() {
    stop_slurm
    stop_accounting
    # Only stop munged if this script started it (a system munged is not ours).
    if [[ -s "$RUN/munged.pid" ]]; then
        stop_pidfiles munged "$RUN/munged.pid"
        rm -f /run/munge/munged.pid
    fi
    log "down"
}

cmd_status() {
    local rc=0
    if ! timeout 10 sinfo; then
        echo "slurmctld not reachable (SLURM_CONF=$SLURM_CONF)"
        return 1
    fi
    timeout 10 scontrol show topology || rc=1
    if grep -q '^AccountingStorageType=accounting_storage/slurmdbd' "$CONF" 2>/dev/null; then
        if dbd_answers; then echo "accounting: slurmdbd on port $DBD_PORT"; else echo "accounting: slurmdbd not answering"; rc=1; fi
    else
        echo "accounting: off"
    fi
    if nodes_usable; then
        echo "status: up, all ${#NODES[@]} nodes usable"
    else
        echo "status: not all nodes usable"
        rc=1
    fi
    return "$rc"
}

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    *)
        echo "usage: $0 up|down|status" >&2
        exit 2
        ;;
esac
