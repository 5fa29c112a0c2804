#!/usr/bin/env bash
# Install and start a single-node Slurm (slurmctld + slurmd + munged) on this Debian machine.
#
#   sudo contrib/slurm/ci-setup.sh          # install if needed, configure, start, wait for srun
#   sudo contrib/slurm/ci-setup.sh stop     # stop slurmd, slurmctld and munged again
#   sudo contrib/slurm/ci-setup.sh status   # print what runs and exit 0 if srun works
#
# Meant for CI and for trying contrib/slurm on one machine: several rolloutd daemons on
# different ports of one node stand in for several nodes. Idempotent: run it as often as you
# like; it only rewrites slurm.conf (and restarts the daemons) when the machine changed.
# Runs as root, never reads stdin, and every wait is bounded (SLURM_CI_TIMEOUT_S in total).
#
# The configuration follows docs/DESIGN section 11: proctrack/linuxproc and task/none (no
# cgroups needed, so it works in containers), select/cons_tres, one node with this machine's
# CPUs, one default partition "debug". No accounting database.
set -euo pipefail
exec </dev/null

TIMEOUT_S=${SLURM_CI_TIMEOUT_S:-300}
CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
LOG_DIR=/var/log/slurm
NODE=$(hostname -s)
DEADLINE=$((SECONDS + TIMEOUT_S))

log() { printf '[ci-setup %3ds] %s\n' "$SECONDS" "$*" >&2; }
die() { log "error: $*"; exit 1; }
left() { local n=$((DEADLINE - SECONDS)); ((n > 0)) || die "gave up after ${TIMEOUT_S}s"; echo "$n"; }

# wait_for SECONDS DESCRIPTION COMMAND...: poll COMMAND every 0.5 s, bounded.
wait_for() {
    local limit=$1 what=$2; shift 2
    local until=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < until)) || die "timed out after ${limit}s waiting for $what"
        sleep 0.5
    done
}

pid_alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_pidfile() {  # stop_pidfile PIDFILE NAME: SIGTERM, wait up to 10 s, then SIGKILL.
    local pidfile=$1 name=$2 pid
    pid_alive "$pidfile" || { rm -f "$pidfile"; return 0; }
    pid=$(cat "$pidfile")
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$pidfile"
}

stop_all() {
    stop_pidfile /run/slurmd.pid slurmd
    stop_pidfile /run/slurmctld.pid slurmctld
    stop_pidfile /run/munge/munged.pid munged
}

srun_works() { timeout 20 srun -N1 -t 1 hostname; }

[[ $(id -u) == 0 ]] || die "run as root"

case ${1:-start} in
    stop) stop_all; exit 0 ;;
    status)
        for p in /run/munge/munged.pid /run/slurmctld.pid /run/slurmd.pid; do
            pid_alive "$p" && log "running: $p ($(cat "$p"))" || log "not running: $p"
        done
        srun_works; exit ;;
    start) ;;
    *) die "usage: $0 [start|stop|status]" ;;
esac

# 1. Packages (skipped when already installed).
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
        || ! command -v srun >/dev/null || ! command -v munged >/dev/null; then
    log "installing slurm-wlm and munge"
    export DEBIAN_FRONTEND=noninteractive
    timeout "$(left)" apt-get -o DPkg::Lock::Timeout=120 -q update
    timeout "$(left)" apt-get -o DPkg::Lock::Timeout=120 -q -y install --no-install-recommends \
        slurm-wlm munge
fi

# 2. munge: a key (0400, owned by munge) and a running munged.
install -d -m 0700 -o munge -g munge /etc/munge /var/lib/munge /var/log/munge
install -d -m 0755 -o munge -g munge /run/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    log "creating /etc/munge/munge.key"
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
if ! pid_alive /run/munge/munged.pid; then
    log "starting munged"
    runuser -u munge -- /usr/sbin/munged
fi
wait_for "$(left)" "munge to answer" sh -c 'munge -n | unmunge'

# 3. slurm.conf for this machine; rewritten (and the daemons restarted) only when it changes.
CPUS=$(nproc)
MEM_MB=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
install -d -m 0755 "$CONF_DIR" "$LOG_DIR" /var/spool/slurmctld /var/spool/slurmd
NEW_CONF=$(cat <<CONF
# Written by rolloutd contrib/slurm/ci-setup.sh: single-node Slurm for CI.
ClusterName=rolloutd-ci
SlurmctldHost=$NODE
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
# SIGTERM -> SIGKILL window on scancel/timeout; rolloutd's drain timeout must stay below it.
KillWait=30
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmdSpoolDir=/var/spool/slurmd
StateSaveLocation=/var/spool/slurmctld
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
NodeName=$NODE CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
)
if [[ ! -f $CONF ]] || [[ "$(cat "$CONF")" != "$NEW_CONF" ]]; then
    log "writing $CONF (NodeName=$NODE CPUs=$CPUS RealMemory=$MEM_MB)"
    printf '%s\n' "$NEW_CONF" >"$CONF.tmp"
    mv "$CONF.tmp" "$CONF"
    stop_pidfile /run/slurmd.pid slurmd
    stop_pidfile /run/slurmctld.pid slurmctld
fi

# 4. slurmctld and slurmd (each daemonizes itself).
if ! pid_alive /run/slurmctld.pid; then
    log "starting slurmctld"
    /usr/sbin/slurmctld
fi
wait_for "$(left)" "slurmctld to answer" scontrol ping
if ! pid_alive /run/slurmd.pid; then
    log "starting slurmd"
    /usr/sbin/slurmd
fi

# 5. The node must be usable: resume it if an earlier run left it down or drained.
node_ready() { sinfo -h -n "$NODE" -o %t | grep -Eq '^(idle|mix|alloc)'; }
until node_ready; do
    state=$(sinfo -h -n "$NODE" -o %t 2>/dev/null || true)
    case $state in
        down*|drain*|drng*|fail*) scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true ;;
    esac
    ((SECONDS < DEADLINE)) || die "node $NODE not usable (state: ${state:-unknown}); see $LOG_DIR"
    sleep 0.5
done

wait_for "$(left)" "srun -N1 hostname" srun_works
log "ready: $(srun -N1 -t 1 hostname) answers srun; Slurm $(sinfo -V | awk '{print $2}')"
