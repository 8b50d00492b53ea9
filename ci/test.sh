#!/usr/bin/env bash
# Run the default test suite (CPU only). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q "$@"
