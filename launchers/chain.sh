#!/usr/bin/env bash
# Submit a chain of N training jobs: each starts when the one before it has ended, in whatever
# state (--dependency=afterany), and resumes the run from its latest checkpoint. For clusters
# where a job may not requeue itself, or to cap how many time slots a run may use.
#
#   FP8OPS_MANIFEST=manifests/x.yaml FP8OPS_RUN_DIR=runs/x \
#     launchers/chain.sh 4 --nodes=2 --gpus-per-node=8 --time=04:00:00 launchers/train.sbatch
#   fp8ops launch slurm manifests/x.yaml --chain 4 --nodes 2 --gpus-per-node 8 --time 04:00:00
#
# The links do not requeue themselves (FP8OPS_REQUEUE=0 unless set): a link asked to stop
# checkpoints and ends, and the next one resumes. A link that finds the run complete does
# nothing. Everything after N goes to sbatch (the batch script last). Prints the job ids.
set -euo pipefail

N=${1:?usage: chain.sh N [sbatch options...] SCRIPT}
shift
[[ "$N" =~ ^[1-9][0-9]*$ ]] || { echo "chain.sh: N must be a positive number, not '$N'" >&2; exit 2; }
[ $# -ge 1 ] || { echo "chain.sh: give the batch script (e.g. launchers/train.sbatch)" >&2; exit 2; }

export FP8OPS_REQUEUE=${FP8OPS_REQUEUE:-0}   # sbatch passes the environment on to the jobs

# The links after the first wait for the one before them. sbatch keeps the last --dependency it
# is given, so a --dependency of the caller's goes to the first link only (the others wait for
# it through the chain). sbatch also takes it abbreviated (--dep, --depend, ...: any prefix of
# at least --dep, which no other option of sbatch's starts with) and as -d.
later=()
skip=0
for arg in "$@"; do
  if [ "$skip" = 1 ]; then skip=0; continue; fi
  name=${arg%%=*}
  if [ "${#name}" -ge 5 ] && [[ "--dependency" == "$name"* ]]; then
    [[ "$arg" == *=* ]] || skip=1   # "--dep X": its value is the next word
    continue
  fi
  case "$arg" in
    -d) skip=1; continue ;;
    -d?*) continue ;;
  esac
  later+=("$arg")
done

previous=""
for _ in $(seq "$N"); do
  if [ -z "$previous" ]; then
    id=$(sbatch --parsable "$@")
  else
    id=$(sbatch --parsable --dependency="afterany:$previous" "${later[@]}")
  fi
  id=${id%%;*}   # "ID;CLUSTER" on federated clusters
  echo "$id"
  previous=$id
  # An accepted drift's reason is for the drift seen now, which the first link records as a
  # revision; the later links resume locked to it and refuse new drift. Going on after a Stop
  # alert is likewise for the Stop seen now.
  unset FP8OPS_ACCEPT_DRIFT FP8OPS_AFTER_STOP
done
