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


@pytest.mark.parametrize("path", sorted((ROOT / "ci").glob("*.py")), ids=lambda path: path.name)
def test_every_benchmark_script_imports(path, monkeypatch):
    """Each script's imports still name what fp8ops has (bench_train once imported a function
    that had moved; nothing ran it until it was needed). Loaded as a module: its main() does
    not run."""
    spec = importlib.util.spec_from_file_location(f"ci_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look themselves up
    monkeypatch.setattr(sys, "path", list(sys.path))  # some add their folder to it
    spec.loader.exec_module(module)
    assert callable(getattr(module, "main", None))
