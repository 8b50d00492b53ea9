#!/usr/bin/env bash
# The CPU test suite against another megatron-core release than the one ci/setup.sh installs,
# without installing it:
#
#   bash ci/megatron_version_check.sh 0.19.2 [pytest arguments, e.g. tests/test_train.py]
#
# megatron-core 0.17 and later publish wheels for Python 3.12 and newer only, and this machine's
# venv is Python 3.11. Their code is Python but for a compiled dataset helper fp8ops never loads,
# so the release's wheel is unpacked into a scratch directory and put first on PYTHONPATH, ahead
# of the venv's megatron-core, for pytest and every process it starts (torchrun's ranks).
# Needs network (pip download, 2.5 MB) and the venv of ci/setup.sh. The SLURM tests (a local
# cluster, which ci/test.sh starts) and the browser tests are left out.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=${1:?usage: bash ci/megatron_version_check.sh VERSION [pytest arguments]}
shift
PYTHON=.venv/bin/python
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT

# A wheel for Python 3.12 (0.17 and later publish none older), or the venv's own if newer.
WHEEL_PYTHON=$("$PYTHON" -c 'import sys; print(f"3.{max(sys.version_info.minor, 12)}")')
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$WHEEL_PYTHON" \
  --platform "manylinux_2_28_$(uname -m)" --platform any -d "$SCRATCH" "megatron-core==$VERSION"
"$PYTHON" -m zipfile -e "$SCRATCH"/megatron_core-*.whl "$SCRATCH/site"

export PYTHONPATH="$SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -c 'import fp8ops.megatron.compat as c; import megatron.core as m
print(f"megatron-core {c.MEGATRON_CORE_VERSION} from {m.__file__}")'
set +e
"$PYTHON" -m pytest -q -n "${FP8OPS_TEST_WORKERS:-2}" --dist loadfile \
  --ignore=tests/test_slurm.py --ignore=tests/test_console_browser.py "$@"
status=$?
echo "megatron-core $VERSION: pytest exited $status"
exit "$status"
