#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, everything under one directory: for tests and for trying the SLURM
# scripts without a cluster. Needs root (apt-get, daemons as root); no systemd, nothing written outside DIR.
#
#   scripts/slurm_cluster.sh install           # Debian's slurmctld, slurmd, slurm-client and munge (once)
#   scripts/slurm_cluster.sh start DIR         # start munged, slurmctld and slurmd; prints `export SLURM_CONF=...`
#   scripts/slurm_cluster.sh stop DIR          # stop them by PID
#
# Every client (sbatch, squeue, scontrol, srun) must see SLURM_CONF=DIR/slurm.conf: without it they look for a
# cluster in DNS. Exit status 3 from `install` (or `start`) means SLURM cannot be had here: not root, no apt-get, or
# no package source (apt-get has no package lists, or its update and install both failed); 4 means apt-get reached
# its sources and failed to install the packages (the end of its output on stderr): a broken install, not a machine
# without SLURM.
set -euo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge)

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && command -v munged >/dev/null; then
    return 0
  fi
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "slurm_cluster.sh: installing ${PACKAGES[*]} needs root and apt-get" >&2
    exit 3
  fi
  local updated installed LISTS reached=1
  updated=$(apt-get update -qq 2>&1) || reached=0  # not final: lists from an earlier update may hold the packages
  eval "$(apt-config shell LISTS Dir::State::lists/d)"  # /var/lib/apt/lists/ by default
  if ! compgen -G "${LISTS:-/var/lib/apt/lists/}*_Packages*" >/dev/null; then
    echo "slurm_cluster.sh: apt-get has no package source (no package lists after apt-get update)" >&2
    [ -z "$updated" ] || tail -n 20 <<<"$updated" >&2
    exit 3
  fi
  if ! installed=$(DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${PACKAGES[@]}" 2>&1); then
    echo "slurm_cluster.sh: apt-get could not install ${PACKAGES[*]}; the end of apt-get's output:" >&2
    printf '%s\n%s\n' "$updated" "$installed" | grep -v '^$' | tail -n 25 >&2 || true
    # An update that failed too: the package source is out of reach (an offline machine with old lists), not broken.
    [ "$reached" = 1 ] || { echo "slurm_cluster.sh: apt-get update failed: no package source reachable" >&2; exit 3; }
    exit 4
  fi
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start() {
  local dir=$1 host cpus memory ctld_port slurmd_port
  dir=$(realpath -m "$dir")
  host=$(hostname -s)  # NodeName must be the short host name slurmd sees
  cpus=$(nproc)
  memory=$(($(free -m | awk '/^Mem:/ {print $2}') * 8 / 10))  # below what slurmd measures, or the node is invalid
  ctld_port=$(free_port)
  slurmd_port=$(free_port)
  mkdir -p "$dir"/{state,spool,log,munge}
  chmod 700 "$dir/munge"
  if [ ! -f "$dir/munge/munge.key" ]; then
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1 count=1024 status=none
    chmod 400 "$dir/munge/munge.key"
  fi
  munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.sock" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed"
  cat >"$dir/slurm.conf" <<CONF
ClusterName=local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.sock
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MinJobAge=3600
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus Sockets=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=$memory State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
  export SLURM_CONF=$dir/slurm.conf
  slurmctld
  slurmd
  for _ in $(seq 1 150); do
    if sinfo -h -o %T 2>/dev/null | grep -qx idle; then
      echo "export SLURM_CONF=$SLURM_CONF"
      return 0
    fi
    sleep 0.2
  done
  echo "slurm_cluster.sh: the node did not become idle in 30 s; see $dir/log/" >&2
  stop "$dir"
  exit 1
}

stop() {
  local dir=$1 pid
  for file in slurmd.pid slurmctld.pid munge/munged.pid; do
    pid=$(cat "$dir/$file" 2>/dev/null) || continue
    kill "$pid" 2>/dev/null || continue
    for _ in $(seq 1 100); do  # until it is gone (or a zombie waiting for PID 1)
      [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null || echo Z)" = Z ] && break
      sleep 0.1
    done
  done
}

case "${1:-}" in
  install) install ;;
  start) [ $# -eq 2 ] || { echo "usage: $0 start DIR" >&2; exit 2; }; install; start "$2" ;;
  stop) [ $# -eq 2 ] || { echo "usage: $0 stop DIR" >&2; exit 2; }; stop "$2" ;;
  *) echo "usage: $0 install | start DIR | stop DIR" >&2; exit 2 ;;
esac
