#!/bin/bash
# CI helper for chapter 03 (job launchers): a throw-away two-node Slurm cluster on ONE machine,
# plus Open MPI's mpirun (mpirun.sh) and tmux (launch-ssh.sh), so the launch files can be tested for real.
#
#   eval "$(.ci/launchers.sh up /tmp/slurm-state)"   # installs + starts; stdout is only `export SLURM_CONF=...`
#   sbatch --wait --nodes 2 03-job-launchers/job.sbatch ...
#   .ci/launchers.sh down /tmp/slurm-state            # stops every daemon it started, by PID
#
# Needs root and apt (Debian 12 / Slurm 22.05); no systemd needed. Nodes n1 and n2 are two slurmd
# daemons on 127.0.0.1 with different ports; each claims CPUs=2 even though they share the real cores
# (fine for tiny CPU tests). Progress goes to stderr; logs are in STATE_DIR/log.
# Ports can be moved with SLURM_CI_PORT_BASE (default 17000: slurmctld 17000, n1 17001, n2 17002).
set -euo pipefail

usage() { echo "usage: $0 {up|down} STATE_DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
CMD=$1
D=$(realpath -m "$2")
CONF=$D/etc/slurm.conf
PORT_BASE=${SLURM_CI_PORT_BASE:-17000}
NODES=(n1 n2)
MUNGE_PID=/run/munge/munged.pid
log() { echo "[launchers.sh] $*" >&2; }

# PID from a pid file, if that process is still alive.
live_pid() { local p; [ -s "$1" ] && p=$(cat "$1") && kill -0 "$p" 2>/dev/null && echo "$p"; }

install_packages() {
    local need=()
    command -v munged >/dev/null || need+=(munge)
    [ -x /usr/sbin/slurmctld ] || need+=(slurmctld)
    [ -x /usr/sbin/slurmd ] || need+=(slurmd)
    command -v sinfo >/dev/null || need+=(slurm-client)
    command -v mpirun >/dev/null || need+=(openmpi-bin)     # mpirun only; libopenmpi-dev is not needed
    command -v tmux >/dev/null || need+=(tmux)
    [ ${#need[@]} -eq 0 ] && return 0
    export DEBIAN_FRONTEND=noninteractive
    # A fresh machine often has no package lists yet: update only when a package has no candidate.
    local p
    for p in "${need[@]}"; do
        # (output captured first: grep -q quitting early would fail the pipe under pipefail)
        if [[ $(apt-cache policy "$p" 2>/dev/null) != *"Candidate: "[0-9]* ]]; then
            log "apt-get update"; apt-get update -qq >&2; break
        fi
    done
    log "apt-get install ${need[*]}"
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null   # errors still go to stderr
}

start_munge() {
    # Debian's package creates the key on install; make sure it exists with the modes munged insists on.
    [ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key
    chmod 0600 /etc/munge/munge.key
    install -d -o munge -g munge -m 0755 /run/munge   # without systemd nobody creates /run/munge
    if ! live_pid "$MUNGE_PID" >/dev/null; then
        log "starting munged"
        # munged refuses to run as root; it daemonizes itself and writes $MUNGE_PID.
        setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged
    fi
    munge -n | unmunge >/dev/null || { echo "munge does not work (see /var/log/munge/munged.log)" >&2; exit 1; }
}

write_conf() {
    local host; host=$(hostname -s)
    mkdir -p "$D/etc" "$D/state" "$D/log" "$D/run"
    local n; for n in "${NODES[@]}"; do mkdir -p "$D/spool/slurmd-$n"; done
    cat > "$CONF.new" <<CONF
ClusterName=ci
SlurmctldHost=${host}(127.0.0.1)
SlurmctldPort=${PORT_BASE}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/slurmd-%n
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
InactiveLimit=0
KillWait=5
Waittime=0
# sbatch --wait polls every 2 s, backing off to 8 and 32 s while below MinJobAge/2: at 4 s it stays at 2 s, and a job
# of 12 s is seen done after 12 to 14 s instead of 42. A finished job's record is kept 4 s and purged within 60 s.
MinJobAge=4
# Two "nodes" on one machine: same NodeHostname and NodeAddr, different slurmd ports.
NodeName=n1 NodeHostname=${host} NodeAddr=127.0.0.1 Port=$((PORT_BASE + 1)) CPUs=2 State=UNKNOWN
NodeName=n2 NodeHostname=${host} NodeAddr=127.0.0.1 Port=$((PORT_BASE + 2)) CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE OverSubscribe=YES State=UP
CONF
    if cmp -s "$CONF.new" "$CONF"; then rm "$CONF.new"; else mv "$CONF.new" "$CONF"; fi
}

all_idle() {
    # e.g. "n1 idle\nn2 idle"; a node can also read "idle*" (not responding) or "down".
    [ "$(sinfo -h -N -o '%N %T' 2>/dev/null | sort | tr '\n' ' ')" = "n1 idle n2 idle " ]
}

up() {
    local t0=$SECONDS
    install_packages
    start_munge
    write_conf
    export SLURM_CONF=$CONF
    # One daemon per line so $! is the daemon itself; -D keeps it in the foreground (PID stays valid).
    if ! live_pid "$D/run/slurmctld.pid" >/dev/null; then
        log "starting slurmctld"
        nohup /usr/sbin/slurmctld -D -c -f "$CONF" >"$D/log/slurmctld.out" 2>&1 &
        echo $! >"$D/run/slurmctld.pid"
    fi
    local n
    for n in "${NODES[@]}"; do
        if ! live_pid "$D/run/slurmd-$n.pid" >/dev/null; then
            log "starting slurmd -N $n"
            nohup /usr/sbin/slurmd -D -N "$n" -f "$CONF" >"$D/log/slurmd-$n.out" 2>&1 &
            echo $! >"$D/run/slurmd-$n.pid"
        fi
    done
    local deadline=$((SECONDS + ${SLURM_CI_WAIT:-90}))
    until all_idle; do
        if [ $SECONDS -ge $deadline ]; then
            echo "ERROR: Slurm nodes n1/n2 not idle after ${SLURM_CI_WAIT:-90}s. sinfo says:" >&2
            sinfo -N >&2 || true
            for f in "$D"/log/*.log "$D"/log/*.out; do echo "== tail $f" >&2; tail -n 15 "$f" >&2 || true; done
            exit 1
        fi
        # A node left "down"/"drain" by an earlier run of this cluster is put back into service.
        if sinfo -h -N -o '%T' 2>/dev/null | grep -qE '^(down|drain)'; then
            scontrol update NodeName=n1,n2 State=RESUME 2>/dev/null || true
        fi
        sleep 0.5
    done
    sinfo -N >&2
    log "cluster up in $((SECONDS - t0))s"
    echo "export SLURM_CONF=$CONF"
}

stop_pid() {  # stop_pid NAME PIDFILE: SIGTERM, wait up to 10 s, then SIGKILL
    local p; p=$(live_pid "$2") || { rm -f "$2"; return 0; }
    log "stopping $1 (pid $p)"
    kill "$p" 2>/dev/null || true
    local _; for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$p" 2>/dev/null; then kill -9 "$p" 2>/dev/null || true; fi
    rm -f "$2"
}

down() {
    if [ -f "$CONF" ] && live_pid "$D/run/slurmctld.pid" >/dev/null; then
        # Cancel leftover jobs first so no slurmstepd (and its training processes) outlive the daemons.
        SLURM_CONF=$CONF scancel --full --user root 2>/dev/null || true
        local _; for _ in $(seq 30); do pgrep -x slurmstepd >/dev/null || break; sleep 0.5; done
    fi
    local n
    for n in "${NODES[@]}"; do stop_pid "slurmd $n" "$D/run/slurmd-$n.pid"; done
    stop_pid slurmctld "$D/run/slurmctld.pid"
    stop_pid munged "$MUNGE_PID"
    log "down"
}

case $CMD in
    up) up ;;
    down) down ;;
    *) usage ;;
esac
