"""Training with pipeline parallelism, end to end: ``fp8ops train`` and ``resume`` at
``topology.pipeline_parallel`` 2 under torchrun over gloo, on the small model (one layer per
stage), against the same run without pipelining.

Every process computes on one thread (tests/support/torchrun.py), so the runs reduce in the same
order, and a pipelined run is the unpipelined one bit for bit: losses, gradient norms, held-out
losses and buckets, the generated answers, every module's FP8 state, the weights, the telemetry
of every module (the first stage writes the store, every stage's modules in it) and the
admission table. So is a stop and resume at PP 2, and a PP 2 checkpoint resumed at PP 1 or the
reverse (a drift to accept): checkpoints name modules and layers globally. An imported Hugging
Face model compares with transformers through the stages as in one piece. Tied embeddings train
within the measured bf16 tolerance of PP 1, and at PP 4 (two middle stages with neither copy) as
at PP 2, bit for bit.
"""

import importlib.util
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from support.float_bounds import reordered_norm_rel_tol
from support.small_model import MANIFESTS, SCHEDULE, SMALL_MODEL, write_derived
from support.torchrun import fp8ops_ranks, worker_records

from fp8ops.checkpoint import read_meta
from fp8ops.checkpoint.directory import checkpoint_name
from fp8ops.evaluate.records import read_capability, read_predictions
from fp8ops.run import read_evals, read_metrics, read_run_record
from fp8ops.telemetry import open_run

if importlib.util.find_spec("megatron") is None:
    pytest.skip("needs the megatron extra: pip install -e '.[megatron]'", allow_module_level=True)

pytestmark = [
    pytest.mark.slow,  # every test runs torchrun
    pytest.mark.filterwarnings("ignore:MLP requires ffn_hidden_size:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]

N = 4  # steps before a stop, and after it
PP2 = ("--set", "topology.pipeline_parallel=2")
OWN_RECIPE = "decoder.layers.1.mlp.linear_fc1"
RESUME_WORKER = Path(__file__).parent / "workers" / "resume_outcome.py"
# Tied embeddings at PP 2 against PP 1, relative: PP 1 adds the embedding's two gradients in
# bf16 (autograd, in the parameter's dtype), PP 2 in float32 over the embedding group. Measured
# 1.1e-5 (losses), 1.4e-4 (gradient norms), 7.6e-3 (update norms); without the sum, 1.1e-4,
# 0.15 and 0.21. At DP 2 with the distributed optimizer: the same losses, norms within 1.6e-4
# (0.15 without the sum). TP 2 x PP 2 against TP 2: losses within 1.6e-6, gradient norms
# 6.7e-4, update norms 5.0e-4.
TIED_LOSS, TIED_NORM, TIED_UPDATE = 3e-5, 1e-3, 2e-2


@pytest.fixture(scope="module")
def manifest(small_base, tmp_path_factory) -> Path:
    """The CPU default's FP8 fine-tuning on the small model for 2N steps, checkpointing and
    evaluating (held-out loss and generation) every N, telemetry every step."""
    return write_derived(
        tmp_path_factory.mktemp("pipeline") / "finetune.yaml",
        MANIFESTS / "tiny-gpt-cpu.yaml",
        {
            **SMALL_MODEL,
            **SCHEDULE,
            "model.init_checkpoint": str(small_base / "final"),
            "data.num_examples": 400,
            "schedule.train_steps": 2 * N,
            "schedule.eval_interval": N,
            "schedule.eval_iters": 2,
            "schedule.checkpoint_interval": N,
            "optimizer.lr": 2e-3,
            "telemetry.every_steps": 1,
            "telemetry.error_sample_every": 2,
            "capability.items": 8,
            "capability.interval": N,
            # A module on the second stage runs a recipe of its own, matched by its global name.
            "precision.module_recipes": [
                {"modules": [OWN_RECIPE], "scaling": "current", "reason": "the pipeline tests"}
            ],
        },
    )


@pytest.fixture(scope="module")
def pp1(manifest, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("pp1") / "run"
    fp8ops_ranks("train", manifest, "--run-dir", run, ranks=1)
    return run


@pytest.fixture(scope="module")
def pp2(manifest, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("pp2") / "run"
    fp8ops_ranks("train", manifest, "--run-dir", run, *PP2)
    return run


def _metrics(run: Path) -> dict[int, tuple]:
    return {m.step: (m.loss, m.grad_norm, m.update_norm) for m in read_metrics(run)}


def _meta(run: Path, step: int):
    return read_meta(run / "checkpoints" / checkpoint_name(step))


def _answers(run: Path) -> list[tuple[int, list[str]]]:
    """Each capability evaluation's step and generated answers."""
    return [
        (record["step"], [p["generated"] for p in read_predictions(run, record)])
        for record in read_capability(run)
    ]


def assert_same_training(a: Path, b: Path) -> None:
    """Two runs that trained alike, bit for bit."""
    assert _metrics(a) == _metrics(b)
    assert list(_metrics(a)) == list(range(1, 2 * N + 1))
    assert [e.model_dump() for e in read_evals(a)] == [e.model_dump() for e in read_evals(b)]
    assert _answers(a) == _answers(b)
    assert [step for step, _ in _answers(a)] == [N, 2 * N]
    for step in (N, 2 * N):
        assert _meta(a, step).fp8.digests == _meta(b, step).fp8.digests
        assert _meta(a, step).weights_fingerprint == _meta(b, step).weights_fingerprint
    ta, tb = open_run(a), open_run(b)
    assert ta.modules == tb.modules
    for module in ta.modules:
        ha, hb = ta.module_history(module).to_numpy(), tb.module_history(module).to_numpy()
        assert np.array_equal(ha, hb, equal_nan=True), module


def test_pp2_trains_as_pp1_bit_for_bit(pp1, pp2):
    assert_same_training(pp1, pp2)
    # One store, written by the first stage, with both stages' modules named by global layer.
    store = open_run(pp2)
    assert store.ranks == (0,)
    assert {m.split(".")[2] for m in store.modules if m.startswith("decoder.layers.")} == {"0", "1"}
    # Four projections in each layer keep delayed-scaling state, but the one of its own recipe.
    assert set(_meta(pp2, 2 * N).fp8.modules) == set(store.modules) - {OWN_RECIPE}
    rows = json.loads((pp2 / "layers.json").read_text())["rows"]
    assert rows == json.loads((pp1 / "layers.json").read_text())["rows"]
    # The second stage's local layer 0 is the model's layer 1: its fc1 ran current scaling.
    assert [row["fqn"] for row in rows if row.get("scaling")] == [OWN_RECIPE]
    # (a stateless recipe keeps no history window: its window metrics are NaN, a delayed one's not)
    assert np.isnan(store.module_history(OWN_RECIPE)["input.window_max"]).all()
    delayed = store.module_history("decoder.layers.0.mlp.linear_fc1")
    assert not np.isnan(delayed["input.window_max"]).any()
    assert _meta(pp2, 2 * N).topology.pipeline_parallel == 2
    final = json.loads((pp2 / "final" / "fp8ops_weights.json").read_text())
    assert (
        final["fingerprint"]
        == json.loads((pp1 / "final" / "fp8ops_weights.json").read_text())["fingerprint"]
    )


def test_pp2_stop_and_resume_equals_the_straight_pp2_run(manifest, pp2, tmp_path):
    run = tmp_path / "run"
    fp8ops_ranks("train", manifest, "--run-dir", run, *PP2, "--stop-at", N)
    fp8ops_ranks("resume", run)
    assert_same_training(pp2, run)


def test_a_pp2_checkpoint_resumes_at_pp1_and_a_pp1_checkpoint_at_pp2(pp1, pp2, tmp_path):
    down = tmp_path / "down"
    shutil.copytree(pp2, down)
    accept = ("--accept-drift", "one stage")
    fp8ops_ranks(
        "resume", down, "--checkpoint", N, "--set", "topology.pipeline_parallel=1", *accept, ranks=1
    )
    event = [json.loads(line) for line in (down / "events.jsonl").read_text().splitlines()]
    resumed = [e for e in event if e["event"] == "resumed"][-1]
    assert [c["path"] for c in resumed["drift"]] == ["topology.pipeline_parallel"]
    assert _metrics(down) == _metrics(pp1)  # steps N+1.. as the run that never pipelined
    assert _meta(down, 2 * N).fp8.digests == _meta(pp1, 2 * N).fp8.digests

    up = tmp_path / "up"
    shutil.copytree(pp1, up)
    fp8ops_ranks("resume", up, "--checkpoint", N, *PP2, "--accept-drift", "two stages")
    assert _metrics(up) == _metrics(pp2)
    assert _meta(up, 2 * N).fp8.digests == _meta(pp2, 2 * N).fp8.digests
    assert _meta(up, 2 * N).topology.pipeline_parallel == 2


def test_a_store_of_another_run_stops_every_stage_with_the_refusal(pp1, pp2, tmp_path):
    """Only the first stage opens the telemetry store: it refused a store linked from another
    run, while the second stage went on into the pipeline schedule and waited there for it."""
    run = tmp_path / "run"
    shutil.copytree(pp2, run)
    shutil.rmtree(run / "telemetry.zarr")
    (run / "telemetry.zarr").symlink_to(pp1 / "telemetry.zarr")  # another run's
    outcomes = worker_records(RESUME_WORKER, tmp_path / "out", run, N, ranks=2)
    assert outcomes[0] == outcomes[1], outcomes  # the same refusal, said once (rank 0)
    assert outcomes[0]["outcome"] == "TelemetryError" and outcomes[0]["collective"]
    assert "telemetry.zarr was written by another run" in outcomes[0]["message"]


def test_tp2_pp2_on_four_ranks_trains_as_tp2(manifest, tmp_path):
    tp2, both = tmp_path / "tp2", tmp_path / "tp2pp2"
    fp8ops_ranks("train", manifest, "--run-dir", tp2, "--set", "topology.tensor_parallel=2")
    fp8ops_ranks(
        "train", manifest, "--run-dir", both, "--set", "topology.tensor_parallel=2", *PP2, ranks=4
    )
    assert_same_training(tp2, both)
    assert open_run(both).ranks == (0, 1)  # the first stage's two TP ranks write the store


def test_dp2_pp2_with_the_distributed_optimizer_trains_as_dp2(manifest, tmp_path):
    sharded = ("--set", "optimizer.distributed=true", "--set", "topology.data_parallel=2")
    dp2, both = tmp_path / "dp2", tmp_path / "dp2pp2"
    fp8ops_ranks("train", manifest, "--run-dir", dp2, *sharded)
    fp8ops_ranks("train", manifest, "--run-dir", both, *sharded, *PP2, ranks=4)
    a, b = _metrics(dp2), _metrics(both)
    # Exact: the same gradients (a sum over two ranks is the same in either order), and a
    # clip factor that differs in the float64 norm's last bit rounds to the same float32 but
    # once in about 2**29 (tests/test_distributed_optimizer.py's docstring).
    assert [loss for loss, _, _ in a.values()] == [loss for loss, _, _ in b.values()]
    # The slices' sums of squares are added over DP and PP in another order: the same terms,
    # so within reordered_norm_rel_tol of each other (measured: within an ulp).
    rel_tol = reordered_norm_rel_tol(read_run_record(dp2).model.parameters)
    for (_, norm_a, update_a), (_, norm_b, update_b) in zip(a.values(), b.values(), strict=True):
        assert math.isclose(norm_b, norm_a, rel_tol=rel_tol)
        assert math.isclose(update_b, update_a, rel_tol=rel_tol)
    assert _meta(dp2, 2 * N).fp8.digests == _meta(both, 2 * N).fp8.digests


def test_a_pipelined_checkpoint_exports_as_one_model(pp2, tmp_path, cli):
    out = tmp_path / "weights"
    result = cli("checkpoints", "export", pp2, "--out", out)
    assert result.code == 0, result.err
    exported = json.loads((out / "fp8ops_weights.json").read_text())
    assert exported["fingerprint"] == _meta(pp2, 2 * N).weights_fingerprint


def test_a_hugging_face_base_loads_into_the_stages_as_into_one_model(tmp_path, cli):
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    from support.hf_models import make_hf_model

    hf_dir, manifest = tmp_path / "llama", tmp_path / "llama.yaml"
    make_hf_model(hf_dir, "llama-untied")
    assert cli("manifest", "from-hf", hf_dir, "--out", manifest, "--seq-length", 64).code == 0
    short = [
        *("--set", "schedule.train_steps=2", "--set", "schedule.warmup_steps=1"),
        *("--set", "schedule.eval_iters=1", "--set", "capability.items=4"),
        *("--set", "precision.small_gemm.enabled=false", "--set", "data.pad_to=seq_length"),
    ]
    one, two = tmp_path / "pp1", tmp_path / "pp2"
    fp8ops_ranks("train", manifest, "--run-dir", one, *short, ranks=1)
    fp8ops_ranks("train", manifest, "--run-dir", two, *short, *PP2)
    # Each stage read its own layers' tensors: the weights hash as the unpipelined import's.
    first, second = read_run_record(one).model, read_run_record(two).model
    assert first.initial_weights_fingerprint == second.initial_weights_fingerprint
    assert first.parameters == second.parameters
    assert _metrics(one) == _metrics(two)
    assert _answers(one) == _answers(two) and _answers(two)
    # The logits, computed on the last stage, compared with transformers' on rank 0.
    assert second.init_hf_verification["passed"]
    assert second.init_hf_verification == first.init_hf_verification


def test_tied_embeddings_train_on_two_stages_as_on_one(tmp_path, cli):
    """The first stage's embedding and the last stage's output layer are one weight's two
    copies: both read from the import, their gradients summed, one step for both; alone, with
    data parallelism and the distributed optimizer, and with tensor parallelism."""
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    from support.hf_models import make_hf_model

    hf_dir, manifest = tmp_path / "llama", tmp_path / "llama.yaml"
    make_hf_model(hf_dir, "llama-tied")
    assert cli("manifest", "from-hf", hf_dir, "--out", manifest, "--seq-length", 64).code == 0
    short = [
        *("--set", "schedule.train_steps=4", "--set", "schedule.warmup_steps=1"),
        *("--set", "schedule.eval_iters=1", "--set", "capability.items=4"),
        *("--set", "precision.small_gemm.enabled=false", "--set", "data.pad_to=seq_length"),
    ]
    one, two, resumed = tmp_path / "pp1", tmp_path / "pp2", tmp_path / "resumed"
    fp8ops_ranks("train", manifest, "--run-dir", one, *short, ranks=1)
    fp8ops_ranks("train", manifest, "--run-dir", two, *short, *PP2)
    first, second = read_run_record(one).model, read_run_record(two).model
    assert first.initial_weights_fingerprint == second.initial_weights_fingerprint
    assert first.parameters == second.parameters  # the copy is not counted twice
    # The last stage's logits come from its copy: transformers agrees as with one stage.
    assert second.init_hf_verification["passed"]
    assert second.init_hf_verification == first.init_hf_verification
    a, b = _metrics(one), _metrics(two)
    assert list(a) == list(b) == [1, 2, 3, 4]
    assert a[1][0] == b[1][0]  # the first loss, before any step
    for (loss_a, norm_a, update_a), (loss_b, norm_b, update_b) in zip(a.values(), b.values()):
        assert loss_b == pytest.approx(loss_a, rel=TIED_LOSS)
        assert norm_b == pytest.approx(norm_a, rel=TIED_NORM)
        assert update_b == pytest.approx(update_a, rel=TIED_UPDATE)
    # A stop and resume restores both copies and their optimizer state from the one saved.
    fp8ops_ranks("train", manifest, "--run-dir", resumed, *short, *PP2, "--stop-at", 2)
    fp8ops_ranks("resume", resumed)
    assert _metrics(resumed) == b
    # The distributed optimizer sums the copies' gradients before it scatters them over DP
    # (compared at DP 2 both: each DP rank's micro-batches move the FP8 scales).
    sharded = ("--set", "optimizer.distributed=true", "--set", "topology.data_parallel=2")
    dp2, dp2pp2 = tmp_path / "dp2", tmp_path / "dp2pp2"
    fp8ops_ranks("train", manifest, "--run-dir", dp2, *short, *sharded)
    fp8ops_ranks("train", manifest, "--run-dir", dp2pp2, *short, *PP2, *sharded, ranks=4)
    for (loss_a, norm_a, _), (loss_b, norm_b, _) in zip(
        _metrics(dp2).values(), _metrics(dp2pp2).values(), strict=True
    ):
        assert loss_b == pytest.approx(loss_a, rel=TIED_LOSS)
        assert norm_b == pytest.approx(norm_a, rel=TIED_NORM)
    # Under TP each copy is split over the vocabulary alike: each TP rank sums its own slice.
    tp = ("--set", "topology.tensor_parallel=2")
    tp2, tp2pp2 = tmp_path / "tp2", tmp_path / "tp2pp2"
    fp8ops_ranks("train", manifest, "--run-dir", tp2, *short, *tp)
    fp8ops_ranks("train", manifest, "--run-dir", tp2pp2, *short, *tp, *PP2, ranks=4)
    first, second = read_run_record(tp2).model, read_run_record(tp2pp2).model
    assert first.initial_weights_fingerprint == second.initial_weights_fingerprint
    assert first.parameters == second.parameters
    assert second.init_hf_verification == first.init_hf_verification
    for (loss_a, norm_a, update_a), (loss_b, norm_b, update_b) in zip(
        _metrics(tp2).values(), _metrics(tp2pp2).values(), strict=True
    ):
        assert loss_b == pytest.approx(loss_a, rel=TIED_LOSS)
        assert norm_b == pytest.approx(norm_a, rel=TIED_NORM)
        assert update_b == pytest.approx(update_a, rel=TIED_UPDATE)


def test_tied_embeddings_on_four_stages_train_as_on_two(tmp_path, cli):
    """At PP 4 the two middle stages hold neither copy: Megatron's embedding group is the first
    and the last stage alone, and the copies' gradients are summed as at PP 2, bit for bit."""
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    from support.hf_models import make_hf_model

    hf_dir, manifest = tmp_path / "llama", tmp_path / "llama.yaml"
    make_hf_model(hf_dir, "llama-tied", num_hidden_layers=4)
    assert cli("manifest", "from-hf", hf_dir, "--out", manifest, "--seq-length", 64).code == 0
    short = [
        *("--set", "schedule.train_steps=3", "--set", "schedule.warmup_steps=1"),
        *("--set", "schedule.eval_iters=1", "--set", "capability.items=2"),
        *("--set", "precision.small_gemm.enabled=false", "--set", "data.pad_to=seq_length"),
    ]
    two, four = tmp_path / "pp2", tmp_path / "pp4"
    fp8ops_ranks("train", manifest, "--run-dir", two, *short, *PP2)
    fp8ops_ranks(
        "train", manifest, "--run-dir", four, *short, "--set", "topology.pipeline_parallel=4",
        ranks=4,
    )  # fmt: skip
    first, second = read_run_record(two).model, read_run_record(four).model
    assert first.parameters == second.parameters
    assert second.init_hf_verification == first.init_hf_verification
    assert second.init_hf_verification["passed"]
    assert _metrics(four) == _metrics(two) and list(_metrics(two)) == [1, 2, 3]
    assert _answers(four) == _answers(two) and [step for step, _ in _answers(two)] == [3]
    final = [json.loads((run / "final" / "fp8ops_weights.json").read_text()) for run in (two, four)]
    assert final[0]["fingerprint"] == final[1]["fingerprint"]


def test_a_model_from_random_weights_is_the_same_at_every_pipeline_size(tmp_path):
    """Without a base, the model starts from ``seeds.model``: each stage draws its layers'
    weights by their global names, so PP 2 and PP 4 start from the PP 1 model and train as it,
    bit for bit (one thread per process: the same reductions)."""
    manifest = write_derived(
        tmp_path / "scratch.yaml",
        MANIFESTS / "tiny-gpt-cpu.yaml",
        {
            **SMALL_MODEL,
            **SCHEDULE,
            "model.num_layers": 4,
            "model.init_checkpoint": None,
            "data.num_examples": 200,
            "schedule.train_steps": 2,
            "schedule.eval_interval": 2,
            "schedule.eval_iters": 1,
            "capability.enabled": False,
        },
    )
    runs = {pp: tmp_path / f"pp{pp}" for pp in (1, 2, 4)}
    for pp, run in runs.items():
        topology = ("--set", f"topology.pipeline_parallel={pp}") if pp > 1 else ()
        fp8ops_ranks("train", manifest, "--run-dir", run, *topology, ranks=pp)
    records = {pp: read_run_record(run).model for pp, run in runs.items()}
    assert len({r.initial_weights_fingerprint for r in records.values()}) == 1
    assert records[4].parameters == records[1].parameters
    metrics = {pp: _metrics(run) for pp, run in runs.items()}
    assert list(metrics[1]) == [1, 2]
    assert metrics[2] == metrics[1] and metrics[4] == metrics[1]
