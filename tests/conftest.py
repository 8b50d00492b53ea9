"""Fixtures several test modules share: the CLI run in-process, and one-rank process groups."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch.distributed as dist

from fp8ops.cli import main


@dataclass
class CliResult:
    code: int
    out: str
    err: str


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run ``fp8ops ARGS`` through ``main``, the console script's function, in this process.

    ``main`` ends in ``SystemExit`` for success and user errors alike, so the code asserted is
    the one the process would exit with; any other exception is a bug and fails the test.
    """
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
