#!/usr/bin/env bash
# The GPU check (docs/gpu.md) on one GPU machine that has torch with CUDA but no network and no
# Transformer Engine; under 8 minutes on an H200. With --smoke it runs anywhere in seconds.
#
#   bash ci/gpu_check.sh --wheels DIR [--out FILE] [ci/gpu_check.py options]
#   FP8OPS_WHEELS=DIR bash ci/gpu_check.sh --out "$OUT/gpu_check.json"
#   bash ci/gpu_check.sh --smoke --out /tmp/gpu_check.json
#
# ci/setup.sh gets megatron-core (and psutil) from PyPI (`pip install -e '.[megatron]'`); here
# they come from a local directory of wheels, --wheels DIR or $FP8OPS_WHEELS. Every wheel in it is
# installed with `pip install --no-index --no-deps`: nothing is fetched and nothing else is
# resolved, so the machine's torch stays as it is. Without a directory, or if the install fails
# (a wheel for another Python, say), the check uses whatever is importable and says what is not.
# fp8ops itself runs from this checkout (ci/gpu_check.py puts it on sys.path).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
WHEELS=${FP8OPS_WHEELS:-}
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) WHEELS=${2:?--wheels needs a directory}; shift 2 ;;
        --wheels=*) WHEELS=${1#*=}; shift ;;
        *) args+=("$1"); shift ;;
    esac
done

if [ -n "$WHEELS" ]; then
    if [ ! -d "$WHEELS" ]; then
        echo "ci/gpu_check.sh: --wheels $WHEELS is not a directory" >&2
        exit 2
    fi
    shopt -s nullglob
    wheels=("$WHEELS"/*.whl)
    shopt -u nullglob
    if [ ${#wheels[@]} -eq 0 ]; then
        echo "ci/gpu_check.sh: no *.whl in $WHEELS; using what is importable" >&2
    elif ! "$PYTHON" -m pip install --disable-pip-version-check -q --no-index --no-deps \
        "${wheels[@]}"; then
        echo "ci/gpu_check.sh: installing the wheels in $WHEELS failed (above); using what is" \
            "importable" >&2
    fi
fi

# What the parts need: torch and numpy for all; megatron-core for (c), imported the way fp8ops
# imports it (fp8ops.megatron.compat); zarr, pandas and xarray for (c) with telemetry (fp8ops'
# telemetry package imports its store).
"$PYTHON" - <<'EOF'
import importlib
import sys

sys.path.insert(0, ".")
found, missing = [], []
for name, label in (("torch", "torch"), ("numpy", "numpy"), ("psutil", "psutil"),
                    ("fp8ops.megatron.compat", "megatron-core"),
                    ("fp8ops.telemetry.collector", "telemetry (zarr, pandas, xarray)")):
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # megatron can fail with more than ImportError
        missing.append(f"{label} ({type(exc).__name__}: {exc})"[:160])
        continue
    version = getattr(module, "MEGATRON_CORE_VERSION", getattr(module, "__version__", ""))
    found.append(f"{label} {version}".strip())
print(f"gpu_check.sh: Python {sys.version.split()[0]}; " + ", ".join(found))
if missing:
    print("gpu_check.sh: not importable: " + "; ".join(missing), file=sys.stderr)
EOF

exec "$PYTHON" ci/gpu_check.py ${args[@]+"${args[@]}"}
