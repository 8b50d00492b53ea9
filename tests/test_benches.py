"""The host-time benchmarks refuse counts they cannot report on, with a usage error (exit 2),
before any work. (Their numbers come from running them, outside the tests: docs/gpu.md.)"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="needs the megatron extra"
)


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("bench_host_overhead.py", ["--steps", "1"], "--steps must be at least 2"),
        ("bench_telemetry_host.py", ["--steps", "5"], "--steps must be at least 10"),
        ("bench_telemetry_host.py", ["--layers", "0"], "--layers must be at least 1"),
        ("bench_data.py", ["--documents", "5"], "--documents must be at least 100"),
        ("bench_data.py", ["--examples", "99"], "--examples must be at least 100"),
    ],
)
def test_a_count_too_small_is_refused(script, args, message):
    result = subprocess.run(
        [sys.executable, str(ROOT / "ci" / script), *args],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert message in result.stderr
