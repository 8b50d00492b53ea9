"""What the manifest refuses under pipeline parallelism, each at the field to change. Pipelined
training itself, end to end: ``test_pipeline_training.py``; step time: ``ci/bench_pipeline.py``.
"""

from pathlib import Path

import pytest

from fp8ops.errors import ManifestError
from fp8ops.manifest import derive, load_manifest

MANIFESTS = Path(__file__).resolve().parents[1] / "manifests"


@pytest.mark.parametrize(
    ("changes", "field", "says"),
    [
        ({"data.pad_to": "longest"}, "data.pad_to", "one fixed shape"),
        ({"precision.backend": "te"}, "precision.backend", "not supported yet"),
        ({"model.num_layers": 3}, "model.num_layers", "divisible by topology.pipeline_parallel"),
    ],
)
def test_the_manifest_refuses_what_pipelining_cannot_run_with(changes, field, says):
    manifest = load_manifest(MANIFESTS / "tiny-gpt-cpu.yaml")
    with pytest.raises(ManifestError) as refused:
        derive(manifest, {**changes, "topology.pipeline_parallel": 2}, "test")
    message = str(refused.value)
    assert field in message and says in message, message
    assert derive(manifest, {"topology.pipeline_parallel": 2}, "test")
