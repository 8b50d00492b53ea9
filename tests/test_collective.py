"""What every rank comes through together (``fp8ops.collective``): a failure on one rank is
raised on every rank, said once, and no rank is left waiting for another."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.torchrun import worker_records

from fp8ops.collective import on_rank0, raise_if_any, together
from fp8ops.errors import Fp8opsError

WORKER = Path(__file__).parent / "workers" / "collective.py"


def test_one_process_runs_the_work_and_raises_its_own_problem():
    assert on_rank0(True, lambda: 3) == 3
    with pytest.raises(KeyError):
        on_rank0(True, lambda: {}["x"])
    raise_if_any(None)
    with pytest.raises(Fp8opsError, match="a problem") as raised:
        raise_if_any("a problem")
    assert raised.value.collective
    with pytest.raises(Fp8opsError, match="'x'") as raised, together():
        {}["x"]
    assert isinstance(raised.value.__cause__, KeyError)  # the block's own failure, kept


@pytest.mark.slow
def test_a_failure_on_one_rank_is_raised_on_both(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1,\n{"step": 2, "loss": 1.0, "tokens": 1}\n')
    rank0, rank1 = worker_records(WORKER, tmp_path / "out", run, ranks=2)

    # Rank 0's work failed: rank 0 raises its own error, rank 1 one naming it, said by rank 0.
    assert rank0["on_rank0"] == {
        "raised": "Fp8opsError",
        "message": "rank 0's work failed",
        "collective": False,
        "cause": None,
    }
    assert rank1["on_rank0"]["message"] == "rank 0 failed: rank 0's work failed"
    assert rank1["on_rank0"]["collective"]
    assert rank0["on_rank0_ok"] == rank1["on_rank0_ok"] == {"returned": "from rank 0"}

    # A problem of rank 1's alone: both raise it, said once.
    for case in ("raise_if_any", "together"):
        said = {k: rank0[case][k] for k in ("raised", "message", "collective")}
        assert said == {k: rank1[case][k] for k in ("raised", "message", "collective")}, case
        assert "rank 1's" in said["message"] and said["collective"], case
    assert (rank0["together"]["cause"], rank1["together"]["cause"]) == (None, "Fp8opsError")

    # The records rank 0 reads are damaged: both ranks end, neither waits for the other.
    assert "metrics.jsonl:1: not valid JSON" in rank0["check_releasable"]["message"]
    assert rank1["check_releasable"]["message"].startswith("rank 0 failed: ")
    assert "metrics.jsonl:1: not valid JSON" in rank1["check_releasable"]["message"]
