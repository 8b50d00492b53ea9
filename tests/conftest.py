"""Fixtures several test modules share: the CLI run in-process, one-rank process groups, and
the small base model (tests/support/shared_base.py)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest

# torch and fp8ops are imported in the fixtures: this file is loaded first, by the pytest-xdist
# controller too, which runs no test and should start its workers without them.


@dataclass
class CliResult:
    code: int
    out: str
    err: str


def pytest_report_header(config):
    from support.test_tier import FAST

    return (
        "test tier: fast (FP8OPS_TEST_TIER=fast: a tenth of the Hypothesis examples)"
        if FAST
        else []
    )


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run ``fp8ops ARGS`` through ``main``, the console script's function, in this process.

    ``main`` ends in ``SystemExit`` for success and user errors alike, so the code asserted is
    the one the process would exit with; any other exception is a bug and fails the test.
    """
    from fp8ops.cli import main

    monkeypatch.setenv("COLUMNS", "200")  # rich tables: no wrapping inside asserted text

    def run(*args: object) -> CliResult:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            main([str(a) for a in args])
        out, err = capsys.readouterr()
        return CliResult(exit_info.value.code or 0, out, err)

    return run


@pytest.fixture(scope="module")
def gloo_world_of_one(tmp_path_factory):
    """A one-rank gloo process group for the module's tests."""
    import torch.distributed as dist

    store = tmp_path_factory.mktemp("dist") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def megatron_tp1(gloo_world_of_one):
    """Megatron's parallel state at TP=1 on a one-rank group, as a launcher sets them up.
    (Imported here, not at the top: modules that use it skip first without megatron-core.)"""
    from fp8ops.megatron.compat import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    yield
    parallel_state.destroy_model_parallel()


@pytest.fixture(scope="session")
def small_base() -> Path:
    """The small model pre-trained for 4 steps in bf16: its run directory (weights in ``final/``),
    trained once per code change and cached under ``build/test-cache/`` (support/shared_base.py).
    Read it only: a test that writes to the run works on a copy (``shutil.copytree``). After the
    session the cache must be as it was built, or this fixture fails and the next session
    rebuilds it."""
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("needs the megatron extra: pip install -e '.[megatron]'")
    from support.shared_base import cached_base, changed_files

    cached = cached_base()
    yield cached / "run"
    changed = changed_files(cached)
    assert not changed, f"tests wrote into the cached base {cached}: {changed[:10]}"
