#!/usr/bin/env bash
# Stop the one-node SLURM cluster that ci/slurm_start.sh started: cancel its jobs, then stop
# slurmd, slurmctld and munged by the PIDs in their PID files (never by name). Idempotent:
# daemons that are not running are reported and skipped.
#
#   ci/slurm_stop.sh [--purge]   --purge also deletes saved state and logs
#   SLURM_LOCAL_ROOT             as for ci/slurm_start.sh (default /tmp/fp8ops-slurm)
set -uo pipefail
ROOT=${SLURM_LOCAL_ROOT:-/tmp/fp8ops-slurm}

alive() {  # alive PID COMM   (a zombie does not count: PID 1 may not reap it)
  [ -n "$1" ] && [ -r "/proc/$1/stat" ] || return 1
  [ "$(awk '{print $3}' "/proc/$1/stat")" != Z ] || return 1
  [ "$(cat "/proc/$1/comm" 2>/dev/null)" = "$2" ]
}
stop() {  # stop PIDFILE COMM
  local pid
  pid=$(cat "$1" 2>/dev/null || true)
  if alive "$pid" "$2"; then
    kill -TERM "$pid"
    for _ in $(seq 100); do alive "$pid" "$2" || break; sleep 0.1; done
    if alive "$pid" "$2"; then kill -KILL "$pid"; echo "$2 ($pid) killed"; else echo "$2 ($pid) stopped"; fi
  else
    echo "$2 not running"
  fi
  rm -f "$1"
}

# Cancel the jobs while the controller is up, so that no slurmstepd is left behind.
if alive "$(cat "$ROOT/run/slurmctld.pid" 2>/dev/null)" slurmctld; then
  jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')
  if [ -n "${jobs// }" ]; then
    echo "cancelling jobs: $jobs"
    # shellcheck disable=SC2086
    scancel $jobs
    for _ in $(seq 150); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2; done
  fi
fi

stop "$ROOT/run/slurmd.pid" slurmd
stop "$ROOT/run/slurmctld.pid" slurmctld
stop /run/munge/munged.pid munged

if [ "${1:-}" = --purge ]; then
  rm -rf "$ROOT/state" "$ROOT/log"
  echo "purged $ROOT/state and $ROOT/log"
fi
exit 0
