#!/usr/bin/env bash
# A one-host SLURM cluster for trying treadle's sbatch recipes (docs/cluster.md): munged, slurmctld and slurmd,
# as root, everything they write under one state directory, stopped by their pid files.
#
#   scripts/slurm_local.sh start     # prints `export SLURM_CONF=...`: sbatch / squeue / scontrol then use it
#   scripts/slurm_local.sh stop      # stops the daemons this script started (by pid file) and nothing else
#   scripts/slurm_local.sh env       # the export line again
#
# TREADLE_SLURM_DIR (default /tmp/treadle-slurm) holds the munge key and socket, slurm.conf, the daemons' state,
# logs and pid files, and the job completion log (jobcomp/filetxt: this cluster has no accounting database, so
# `sacct` has nothing to read; the completion log records each job's state and exit code instead).
# Nothing under /etc is touched and the ports are not SLURM's defaults, so a system SLURM on the host is left alone.
# Needs root and Debian's slurm-wlm and munge (`apt-get install -y slurm-wlm munge`).
set -euo pipefail

DIR=${TREADLE_SLURM_DIR:-/tmp/treadle-slurm}
CTLD_PORT=${TREADLE_SLURM_PORT:-16817}
CPUS=${TREADLE_SLURM_CPUS:-2}

say() { echo "slurm_local: $*" >&2; }

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_conf() {
  local host mem
  host=$(hostname -s)
  mem=$(awk '/MemTotal/ {print int($2 / 1024 / 2)}' /proc/meminfo)  # MiB: half the host's, for the jobs
  mkdir -p "$DIR"/state "$DIR"/spool "$DIR"/munge
  cat > "$DIR/slurm.conf" <<EOF
ClusterName=treadle-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$((CTLD_PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobRequeue=1
# Seconds between SIGTERM and SIGKILL when a job is cancelled or ends: the time a rank has to finish its step and
# write its checkpoint (treadle's resilience.shutdown_timeout_s should be below it).
KillWait=60
MinJobAge=3600
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.log
SchedulerType=sched/backfill
NodeName=$host NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
}

start() {
  [ "$(id -u)" -eq 0 ] || { say "must run as root (the daemons run as root here)"; exit 2; }
  for bin in munged slurmctld slurmd sinfo; do
    command -v "$bin" >/dev/null || { say "$bin not found; install: apt-get install -y slurm-wlm munge"; exit 2; }
  done
  if pid_alive "$DIR/slurmctld.pid"; then say "already running (state in $DIR)"; env_line; return; fi
  write_conf
  export SLURM_CONF=$DIR/slurm.conf
  if [ ! -f "$DIR/munge/munge.key" ]; then
    head -c 1024 /dev/urandom > "$DIR/munge/munge.key"
  fi
  chmod 700 "$DIR/munge"; chmod 400 "$DIR/munge/munge.key"
  pid_alive "$DIR/munge/munged.pid" || munged --force --key-file="$DIR/munge/munge.key" \
    --socket="$DIR/munge/munge.socket" --pid-file="$DIR/munge/munged.pid" --seed-file="$DIR/munge/munged.seed" \
    --log-file="$DIR/munge/munged.log"
  slurmctld -c  # -c: clear jobs left by an earlier cluster in $DIR (a fresh start)
  slurmd
  for _ in $(seq 60); do  # the node registers within a few seconds
    if sinfo -h -o %t 2>/dev/null | grep -qx idle; then env_line; return; fi
    sleep 0.5
  done
  say "the node did not come up idle within 30 s; logs: $DIR/slurmctld.log, $DIR/slurmd.log"
  sinfo >&2 || true
  stop
  exit 1
}

stop() {
  local f
  for f in "$DIR/slurmd.pid" "$DIR/slurmctld.pid" "$DIR/munge/munged.pid"; do
    if pid_alive "$f"; then
      kill -TERM "$(cat "$f")"
      for _ in $(seq 40); do pid_alive "$f" || break; sleep 0.25; done
      if pid_alive "$f"; then kill -KILL "$(cat "$f")"; fi
    fi
    rm -f "$f"
  done
}

env_line() { echo "export SLURM_CONF=$DIR/slurm.conf"; }

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  env) env_line ;;
  *) echo "usage: $0 start|stop|env" >&2; exit 2 ;;
esac
