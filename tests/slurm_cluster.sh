#!/usr/bin/env bash
# A real one-node Slurm cluster in a folder, for tests/test_slurm.py (and for trying
# `seektrain launch slurm` by hand). Needs root and Debian's slurm-wlm + munge packages
# (.ci/run installs them).
#
#   tests/slurm_cluster.sh start DIR   write DIR/slurm.conf, start munged, slurmctld and slurmd with
#                                       every pid, socket, spool, state and log file under DIR, wait
#                                       until the node is idle, then print `export SLURM_CONF=...`
#   tests/slurm_cluster.sh stop DIR    stop the three daemons by the pids in DIR/*.pid
#
# Clients (sbatch, squeue, scontrol, scancel) find this cluster through SLURM_CONF=DIR/slurm.conf.
# Nothing outside DIR is used but the two TCP ports (SLURMCTLD_PORT / SLURMD_PORT, default 6817 / 6818);
# munge gets its own key in DIR.
# The node offers SLURM_CPUS CPUs (default 2, what the CI machine has); a job step that asks for more
# fails with "More processors requested than permitted", so size --cpus-per-task to it.
# Why these settings: proctrack/linuxproc and task/none need no cgroups (containers rarely have them),
# accounting is off (no slurmdbd; `scontrol show job` keeps a finished job for MinJobAge seconds),
# SlurmUser=root because the tests run as root. cred_expire=10 and the 2 s scheduler intervals make a
# requeued job start again within ~15 s instead of 2-3 minutes (the default credential lifetime of 120 s
# is also how long a requeued job waits).
set -euo pipefail

cmd=${1:-}
dir=${2:-}
if [[ -z $cmd || -z $dir ]]; then
    echo "usage: $0 start|stop DIR" >&2
    exit 2
fi
dir=$(realpath -m "$dir")

stop_pidfile() {  # stop_pidfile FILE: SIGTERM the daemon, SIGKILL it after 10 s
    local file=$1 pid
    [[ -s $file ]] || return 0
    pid=$(cat "$file")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$file"
}

if [[ $cmd == stop ]]; then
    stop_pidfile "$dir/slurmd.pid"
    stop_pidfile "$dir/slurmctld.pid"
    stop_pidfile "$dir/munge/munged.pid"
    exit 0
fi
[[ $cmd == start ]] || { echo "usage: $0 start|stop DIR" >&2; exit 2; }

for tool in munged slurmctld slurmd sinfo; do
    command -v "$tool" >/dev/null || { echo "$tool not found: apt-get install slurm-wlm munge" >&2; exit 1; }
done
[[ $(id -u) == 0 ]] || { echo "starting slurmd needs root" >&2; exit 1; }

node=$(hostname -s)
cpus=${SLURM_CPUS:-2}
mkdir -p "$dir"/{spool/ctld,spool/d,state,log,munge}
chmod 0755 "$dir/munge"
# A private munge key: the daemons and clients all run as root here, so munged runs as root with its own
# root-owned key; --force accepts a socket under a folder others cannot enter (pytest's 0700 tmp dirs).
[[ -s $dir/munge/munge.key ]] || dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
chmod 0400 "$dir/munge/munge.key"

cat >"$dir/slurm.conf" <<EOF
# written by tests/slurm_cluster.sh: a one-node cluster under $dir
ClusterName=seektrain-test
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=${SLURMCTLD_PORT:-6817}
SlurmdPort=${SLURMD_PORT:-6818}
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=10
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/d
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
ReturnToService=2
MinJobAge=600
KillWait=30
MpiDefault=none
MailProg=/bin/true
SwitchType=switch/none
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed"
slurmctld -f "$dir/slurm.conf"
slurmd -f "$dir/slurm.conf" -N "$node"

export SLURM_CONF="$dir/slurm.conf"
for _ in $(seq 150); do
    state=$(sinfo -h -n "$node" -o %T 2>/dev/null || true)
    if [[ $state == idle ]]; then
        echo "export SLURM_CONF=$SLURM_CONF"
        exit 0
    fi
    sleep 0.2
done
echo "slurm node $node not idle after 30 s (state: ${state:-none}); logs in $dir/log" >&2
tail -n 20 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" >&2 || true
exit 1
