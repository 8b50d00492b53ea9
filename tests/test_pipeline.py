"""Pipeline parallelism at the model level: ``build_gpt`` builds one stage per rank and
``fp8ops.train.pipeline.forward_backward`` runs a step through Megatron's 1F1B schedule over gloo,
with fp8ops' FP8 scope around every micro-batch's forward on every stage.

Against the unpipelined model (the same weights by global name, the same batches), at TP 1 and
at TP 2 (four ranks): losses and every module's FP8 state (scales and amax histories) bit for
bit after four steps, gradient norms to float64 summation noise (the stages' sums of squares are
added last); FP8 modules named by global layer (parameters keep Megatron's local names); each
stage's amax group agreeing on its state. The trainer does not run pipelines yet
(``topology.pipeline_parallel`` is refused when a run starts).
"""

import importlib.util
from pathlib import Path

import pytest
from support.torchrun import worker_records

from fp8ops.errors import ManifestError
from fp8ops.manifest import derive, load_manifest

if importlib.util.find_spec("megatron") is None:
    pytest.skip("needs the megatron extra: pip install -e '.[megatron]'", allow_module_level=True)

WORKER = Path(__file__).parent / "workers" / "pipeline.py"
MANIFESTS = Path(__file__).resolve().parents[1] / "manifests"


def _run(tmp_path: Path, ranks: int, tensor_parallel: int = 1) -> list[dict]:
    out = tmp_path / f"ranks{ranks}-tp{tensor_parallel}"
    return worker_records(WORKER, out, tensor_parallel, ranks=ranks)


@pytest.mark.slow
def test_pp2_through_megatrons_schedule_equals_pp1(tmp_path):
    (one,) = _run(tmp_path, 1)
    first, last = _run(tmp_path, 2)
    assert (first["stage"], last["stage"]) == (0, 1)
    for unpiped, a, b in zip(one["steps"], first["steps"], last["steps"], strict=True):
        # Both stages report the last stage's loss and the one global norm.
        assert a["loss"] == b["loss"] == unpiped["loss"]
        assert a["grad_norm"] == b["grad_norm"]
        assert a["grad_norm"] == pytest.approx(unpiped["grad_norm"], rel=1e-8)  # measured 2.2e-9
    # Layers 0-1 on the first stage, 2-3 on the last, named globally.
    assert {name.split(".")[2] for name in first["fp8"]} == {"0", "1"}
    assert {name.split(".")[2] for name in last["fp8"]} == {"2", "3"}
    assert first["fp8"] | last["fp8"] == one["fp8"]  # every module's scales and histories
    assert first["agree"] and last["agree"]
    assert "embedding.word_embeddings.weight" in first["parameters"]
    assert "output_layer.weight" in last["parameters"]
    assert "output_layer.weight" not in first["parameters"]


@pytest.mark.slow
def test_tp2_pp2_on_four_ranks_equals_tp2_pp1(tmp_path):
    tp_only = _run(tmp_path, 2, tensor_parallel=2)  # ranks 0, 1: TP ranks 0, 1
    both = _run(tmp_path, 4, tensor_parallel=2)  # stage 0: ranks 0, 1; stage 1: ranks 2, 3
    assert [r["stage"] for r in both] == [0, 0, 1, 1]
    for step, expected in enumerate(tp_only[0]["steps"]):
        assert {r["steps"][step]["loss"] for r in both} == {expected["loss"]}
        norms = {r["steps"][step]["grad_norm"] for r in both}
        assert len(norms) == 1  # every rank clips by the same norm
        assert norms.pop() == pytest.approx(expected["grad_norm"], rel=1e-12)  # measured: 1 ulp
    for tp_rank in range(2):  # each TP rank's shard state, split over the two stages
        assert both[tp_rank]["fp8"] | both[2 + tp_rank]["fp8"] == tp_only[tp_rank]["fp8"]
    assert all(r["agree"] for r in both)  # each stage's amax group (its two TP ranks)


def test_what_a_pipelined_model_cannot_have_yet_is_refused_when_it_is_built():
    # The last stage's copy of the embedding would need Megatron's embedding-group gradient sum.
    from fp8ops.megatron import model as megatron_model

    manifest = derive(
        load_manifest(MANIFESTS / "tiny-gpt-cpu.yaml"),
        {"model.tied_embeddings": True, "topology.pipeline_parallel": 2},
        "test",
    )
    with pytest.raises(NotImplementedError, match="tied_embeddings"):
        megatron_model._check_stages(manifest)
    on_te = derive(manifest, {"model.tied_embeddings": False, "precision.backend": "te"}, "te")
    with pytest.raises(NotImplementedError, match="precision.backend te"):
        megatron_model._check_stages(on_te)


def test_a_run_with_pipeline_parallelism_is_still_refused_at_start():
    from fp8ops.start.checks import check_inputs

    manifest = derive(
        load_manifest(MANIFESTS / "tiny-gpt-cpu.yaml"), {"topology.pipeline_parallel": 2}, "test"
    )
    with pytest.raises(ManifestError, match="topology.pipeline_parallel is 2"):
        check_inputs(manifest, "test.yaml", resuming=False)
