"""Two processes over gloo (torchrun): reduce_amax makes every rank's scales identical;
without it each rank keeps its own."""

from pathlib import Path

import pytest
from support.torchrun import worker_records

WORKER = Path(__file__).parent / "workers" / "reduce_amax.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return {
        mode: worker_records(WORKER, tmp_path_factory.mktemp("runs") / mode, mode, ranks=2)
        for mode in ("reduce", "local")
    }


@pytest.mark.slow
def test_reduce_amax_makes_all_ranks_agree(results):
    rank0, rank1 = results["reduce"]
    assert rank0 == rank1
    # The first layer's inputs do not depend on any scale, so the shared input history is
    # the element-wise max of the two ranks' local histories.
    local0, local1 = results["local"]
    reduced = rank0["first"]["amax_history_fwd"]
    for row, (a, b) in enumerate(
        zip(local0["first"]["amax_history_fwd"], local1["first"]["amax_history_fwd"])
    ):
        assert reduced[row][0] == max(a[0], b[0])
    assert rank0["first"]["scale_fwd"][0] == min(
        local0["first"]["scale_fwd"][0], local1["first"]["scale_fwd"][0]
    )


@pytest.mark.slow
def test_without_reduction_scales_stay_rank_local(results):
    rank0, rank1 = results["local"]
    for layer in ("first", "second"):
        assert rank0[layer]["scale_fwd"][0] != rank1[layer]["scale_fwd"][0]
        assert rank0[layer]["scale_bwd"][0] != rank1[layer]["scale_bwd"][0]
        # weights are identical on both ranks, so their scales agree even unreduced
        assert rank0[layer]["scale_fwd"][1] == rank1[layer]["scale_fwd"][1]
