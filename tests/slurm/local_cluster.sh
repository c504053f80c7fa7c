#!/usr/bin/env bash
# A fake two-node Slurm cluster on this machine, for tests: munged + slurmctld + two slurmd
# (nodes n1, n2 on 127.0.0.1 with their own ports), all state under one directory.
#   tests/slurm/local_cluster.sh up DIR      start; prints the SLURM_CONF to export
#   tests/slurm/local_cluster.sh down DIR    stop everything started by `up` (by pid files)
# Needs Debian's slurmctld slurmd slurm-client munge, and root (slurmd runs jobs as their user).
set -euo pipefail
cmd=${1:?up or down}; dir=$(realpath -m "${2:?state directory}")
cpus=${SLURM_TEST_CPUS:-2}

down() {
  for pid in "$dir"/slurmd-n1.pid "$dir"/slurmd-n2.pid "$dir"/slurmctld.pid "$dir"/munge/munged.pid; do
    [ -f "$pid" ] && kill "$(cat "$pid")" 2>/dev/null || true
  done
  sleep 1
  # What a failed test's job leaves running outlives the daemons: slurmstepd, srun, the batch
  # script and its workers. Each holds this cluster's slurm.conf in its environment (slurmd and
  # every job submitted to it were started with SLURM_CONF set): end them all.
  local env pid
  for env in /proc/[0-9]*/environ; do
    pid=${env#/proc/}; pid=${pid%/environ}
    [ "$pid" = $$ ] && continue
    if tr '\0' '\n' 2>/dev/null < "$env" | grep -qxF "SLURM_CONF=$dir/slurm.conf"; then
      kill -9 "$pid" 2>/dev/null || true
    fi
  done
}

if [ "$cmd" = down ]; then down; exit 0; fi

# NOTE: two settings shorten a requeue (the time-limit test) from 150 s to ~12 s: a requeued job
# may start only after the credential lifetime (AuthInfo cred_expire + 1 s; default 120 s), and then
# only the main scheduler picks it up (sched_interval; default 60 s). SlurmctldDebug=debug logs
# each time-limit warning signal ("send_job_warn_signal: warning signal 15 to JobId=N").
mkdir -p "$dir"/{state,spool,log,munge}
conf="$dir/slurm.conf"
port_base=${SLURM_TEST_PORT_BASE:-16817}
cat > "$conf" <<CONF
ClusterName=aoetest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$port_base
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=10
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
SlurmctldDebug=debug
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
SlurmdTimeout=300
InactiveLimit=0
KillWait=30
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((port_base + 1)) CPUs=$cpus State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((port_base + 2)) CPUs=$cpus State=UNKNOWN
PartitionName=test Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF

# munge: its own key, socket and files under $dir, run as the munge user.
chown -R munge: "$dir/munge" 2>/dev/null || true
if [ ! -f "$dir/munge/munge.key" ]; then
  mungekey --create --keyfile="$dir/munge/munge.key" --force >/dev/null
  chown munge: "$dir/munge/munge.key"; chmod 600 "$dir/munge/munge.key"
fi
chmod 700 "$dir/munge"
runuser -u munge -- munged --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
  --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" \
  --seed-file="$dir/munge/munged.seed" --force
chmod 755 "$dir/munge"

export SLURM_CONF="$conf"
slurmctld -f "$conf"
slurmd -N n1 -f "$conf"
slurmd -N n2 -f "$conf"
for _ in $(seq 1 60); do
  if [ "$(sinfo -h -N -o '%T' 2>/dev/null | grep -c -E '^(idle|mixed)$')" = 2 ]; then
    echo "$conf"; exit 0
  fi
  sleep 1
done
echo "the local Slurm cluster did not come up; see $dir/log" >&2
sinfo -N >&2 || true
exit 1
