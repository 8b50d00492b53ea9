#!/usr/bin/env bash
# Run the default test suite (CPU only). Extra arguments go to pytest.
#
#   bash ci/test.sh            everything (what CI runs)
#   bash ci/test.sh --fast     the fast tier, for iteration: pytest -m "not slow", every package's
#                              unit tests in under 3 minutes on 2 cores; no SLURM is started
#
# `slow` (pyproject.toml) marks what the fast tier leaves to the full suite: multi-process runs
# (torchrun, SLURM jobs, the browser, a signalled or killed trainer), training beyond a few
# steps, torch.compile and the Triton interpreter beyond one case each; its property tests run a
# tenth of their Hypothesis examples (FP8OPS_TEST_TIER=fast). The small base model the
# end-to-end tests fine-tune from is trained once per code change and cached in
# build/test-cache/ (tests/support/shared_base.py), so a second run skips its training.
#
# Two pytest-xdist workers, each test file on one worker (--dist loadfile: a module's fixtures,
# such as a trained run, are built once). Much of the suite is process start-ups and waits
# (torchrun launchers, SLURM, a browser), which two workers overlap on two cores. Measured
# times: docs/benchmarks/test-suite.md.
# FP8OPS_TEST_WORKERS=0 runs it in this one process (as `-n 0` among the arguments does).
#
# The launcher tests (tests/test_slurm.py) submit jobs to a real one-node SLURM: where this
# machine can run one (root and apt), ci/slurm_start.sh starts it first (about 7 s the first time,
# installing 3.5 MB of packages; under a second after) and ci/slurm_stop.sh stops it afterwards.
# Elsewhere those tests skip and say why. FP8OPS_SLURM=0: never start one.
set -euo pipefail
cd "$(dirname "$0")/.."

fast=0
args=()
for arg in "$@"; do
  if [ "$arg" = --fast ]; then fast=1; else args+=("$arg"); fi
done
if [ "$fast" = 1 ]; then
  args=(-m "not slow" ${args[@]+"${args[@]}"})
  export FP8OPS_TEST_TIER=fast  # property tests run a tenth of their examples (tests/support/test_tier.py)
else
  export FP8OPS_TEST_TIER=full
fi

if [ "$fast" = 0 ] && [ "${FP8OPS_SLURM:-1}" != 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  if started=$(bash ci/slurm_start.sh 2>&1); then
    echo "local SLURM is up for tests/test_slurm.py (ci/slurm_start.sh)"
    # Stop only a cluster this run started; one that was already up stays up.
    if grep -q "slurmctld started" <<<"$started"; then
      trap 'bash ci/slurm_stop.sh | sed "s/^/ci\/slurm_stop.sh: /"' EXIT
    fi
  else
    echo "local SLURM did not start, so tests/test_slurm.py will skip; ci/slurm_start.sh said:" >&2
    tail -n 5 <<<"$started" >&2
  fi
fi

# Lint and format first: a second, not minutes of tests, to learn the tree is unformatted.
# (Two commands, not `a && b`: under `set -e` a failure on the left of && does not stop a script.)
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .

.venv/bin/python -m pytest -q -n "${FP8OPS_TEST_WORKERS:-2}" --dist loadfile ${args[@]+"${args[@]}"}
