"""Pipeline parallelism at the model level: ``build_gpt`` builds one stage per rank and
``fp8ops.train.pipeline.forward_backward`` runs a step through Megatron's 1F1B schedule over gloo,
with fp8ops' FP8 scope around every micro-batch's forward on every stage.

Against the unpipelined model (the same weights by global name, the same batches), at TP 1 and
at TP 2 (four ranks): losses and every module's FP8 state (scales and amax histories) bit for
bit after four steps, and the gradient norms too (each stage goes on from the earlier stages'
sums of squares); FP8 modules named by global layer (parameters keep Megatron's local names);
each stage's amax group agreeing on its state. The trainer's pipelined runs:
``test_pipeline_training.py``.
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
        assert a["grad_norm"] == b["grad_norm"] == unpiped["grad_norm"]
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
        assert norms.pop() == expected["grad_norm"]
    for tp_rank in range(2):  # each TP rank's shard state, split over the two stages
        assert both[tp_rank]["fp8"] | both[2 + tp_rank]["fp8"] == tp_only[tp_rank]["fp8"]
    assert all(r["agree"] for r in both)  # each stage's amax group (its two TP ranks)


@pytest.mark.parametrize(
    ("changes", "field", "says"),
    [
        ({"model.tied_embeddings": True}, "model.tied_embeddings", "must be false"),
        ({"capability.enabled": True}, "capability.enabled", "token by token"),
        ({"data.pad_to": "longest"}, "data.pad_to", "one fixed shape"),
        ({"precision.backend": "te"}, "precision.backend", "not supported yet"),
        ({"model.num_layers": 3}, "model.num_layers", "divisible by topology.pipeline_parallel"),
        (
            {
                "precision.module_recipes": [
                    {"modules": ["decoder.layers.0.*"], "scaling": "current", "reason": "test"}
                ]
            },
            "precision.module_recipes",
            "must be empty",
        ),
    ],
)
def test_the_manifest_refuses_what_pipelining_cannot_run_with(changes, field, says):
    manifest = load_manifest(MANIFESTS / "tiny-gpt-cpu.yaml")
    off = {"capability.enabled": False}  # the CPU default pipelines without generation
    with pytest.raises(ManifestError) as refused:
        derive(manifest, {**off, **changes, "topology.pipeline_parallel": 2}, "test")
    message = str(refused.value)
    assert field in message and says in message, message
    assert derive(manifest, {**off, "topology.pipeline_parallel": 2}, "test")
