#!/usr/bin/env bash
# Start a one-node Slurm cluster on this machine (idempotent; needs root).
#   tests/slurm/start_slurm.sh [RUN_DIR]   (default /tmp/capture-megatron-slurm)
# Installs Debian's slurm-wlm and munge when missing, writes RUN_DIR/slurm.conf from slurm.conf.in,
# starts munged, slurmctld and slurmd, and waits until the node is idle. Client commands find the
# configuration through SLURM_CONF=RUN_DIR/slurm.conf (printed as the last line: `export SLURM_CONF=...`).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
run="${1:-/tmp/capture-megatron-slurm}"
mkdir -p "$run/state" "$run/spool"

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
    || ! command -v sbatch >/dev/null; then
  echo "installing slurm-wlm and munge (apt-get)" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q slurm-wlm munge >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q slurm-wlm munge >/dev/null; }
fi

# munge: a key, then the daemon
if [ ! -s /etc/munge/munge.key ]; then
  mkdir -p /etc/munge
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null
  chmod 400 /etc/munge/munge.key
fi
chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge 2>/dev/null || mkdir -p /run/munge
if ! pgrep -x munged >/dev/null; then
  mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
  if id munge >/dev/null 2>&1; then su -s /bin/sh munge -c /usr/sbin/munged || /usr/sbin/munged --force; else /usr/sbin/munged --force; fi
fi

host="$(hostname -s)"
mem="$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)"
sed -e "s|@HOST@|$host|g" -e "s|@RUN@|$run|g" -e "s|@MEM@|$mem|g" \
    -e "s|@CTLD_PORT@|${CAPTURE_SLURMCTLD_PORT:-16817}|g" -e "s|@D_PORT@|${CAPTURE_SLURMD_PORT:-16818}|g" \
    "$here/slurm.conf.in" > "$run/slurm.conf.new"
# Daemons started from an older configuration (e.g. before a node or partition was added) restart.
if [ -f "$run/slurm.conf" ] && ! cmp -s "$run/slurm.conf.new" "$run/slurm.conf"; then
  for daemon in slurmd slurmctld; do
    if [ -s "$run/$daemon.pid" ]; then kill "$(cat "$run/$daemon.pid")" 2>/dev/null || true; fi
  done
  for _ in $(seq 1 30); do pgrep -x slurmctld >/dev/null || pgrep -x slurmd >/dev/null || break; sleep 1; done
fi
mv "$run/slurm.conf.new" "$run/slurm.conf"
export SLURM_CONF="$run/slurm.conf"

if ! pgrep -x slurmctld >/dev/null; then /usr/sbin/slurmctld -f "$SLURM_CONF"; fi
if ! pgrep -x slurmd >/dev/null; then /usr/sbin/slurmd -f "$SLURM_CONF"; fi

for _ in $(seq 1 60); do
  state="$(sinfo -h -n "$host" -o %t 2>/dev/null || true)"
  case "$state" in
    idle*|mix*|alloc*) echo "export SLURM_CONF=$SLURM_CONF"; exit 0 ;;
    down*|drain*|unk*) scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true ;;
  esac
  sleep 1
done
echo "Slurm did not come up (node state: '${state:-none}')" >&2
tail -n 20 "$run/slurmctld.log" "$run/slurmd.log" >&2 2>/dev/null || true
exit 1
