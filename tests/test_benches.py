"""The host-time benchmarks refuse counts they cannot report on, with a usage error (exit 2),
before any work; every script under ci/ still imports. (Their numbers come from running them,
outside the tests: docs/gpu.md.)

Both load the scripts in this process (``support.ci_scripts``): a fresh interpreter per case spent
ten seconds importing torch and Megatron to test an argument check."""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from support.ci_scripts import load_script, past_the_check

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
        ("bench_sinks.py", ["--steps", "4"], "--steps must be at least 5"),
        ("bench_sinks.py", ["--rounds", "0"], "--rounds must be at least 1"),
        ("bench_gemms.py", ["--rounds", "0"], "--rounds and --steps must be at least 1"),
    ],
)
def test_a_count_too_small_is_refused(script, args, message, monkeypatch, capsys):
    module = load_script(ROOT / "ci" / script, monkeypatch)
    # The scripts' first work after their checks (support.ci_scripts).
    monkeypatch.setattr(torch, "set_num_threads", past_the_check)
    monkeypatch.setattr(tempfile, "TemporaryDirectory", past_the_check)
    monkeypatch.setattr(sys, "argv", [script, *args])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted((ROOT / "ci").glob("*.py")), ids=lambda path: path.name)
def test_every_benchmark_script_imports(path, monkeypatch):
    """Each script's imports still name what fp8ops has (bench_train once imported a function
    that had moved; nothing ran it until it was needed). Loaded as a module: its main() does
    not run."""
    assert callable(getattr(load_script(path, monkeypatch), "main", None))
