"""Training under the stateless recipes (precision.scaling current, block, mxfp8) on the small
model: the run completes and learns, telemetry records what applies (amax every step, a
per-tensor scale for current scaling; the window metrics not applicable), layers.json and the
checkpoints carry the recipe and no FP8 state, a stop and resume equals the straight run bit for
bit, a change of recipe at resume is drift, and the manifest refuses what a recipe cannot do."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

if importlib.util.find_spec("megatron") is None:
    pytest.skip("needs the megatron extra", allow_module_level=True)

from support.small_model import MANIFESTS, SCHEDULE, SMALL_MODEL, write_derived

from fp8ops.checkpoint import read_meta
from fp8ops.checkpoint.directory import checkpoint_name
from fp8ops.errors import ManifestError
from fp8ops.manifest import derive, load_manifest
from fp8ops.run import read_metrics
from fp8ops.run.records import read_layers_json
from fp8ops.telemetry import open_run
from fp8ops.train import run_training

pytestmark = [
    pytest.mark.filterwarnings("ignore:MLP requires ffn_hidden_size:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]

N = 3
RECIPES = {
    "current": {"precision.scaling": "current"},
    "block": {"precision.scaling": "block"},
    "mxfp8": {"precision.scaling": "mxfp8"},
}
FC1 = "decoder.layers.0.mlp.linear_fc1"


def finetune(directory: Path, base: Path, changes: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return write_derived(
        directory / "finetune.yaml",
        MANIFESTS / "tiny-gpt-cpu.yaml",
        {
            **SMALL_MODEL,
            **SCHEDULE,
            "model.init_checkpoint": str(base / "final"),
            "data.num_examples": 400,
            "schedule.train_steps": 2 * N,
            "schedule.eval_interval": 2 * N,
            "schedule.checkpoint_interval": N,
            "optimizer.lr": 2e-3,
            "telemetry.every_steps": 2,
            "telemetry.error_sample_every": 2,
            # delayed scaling's window, which the CPU default sets, is not these recipes'
            "precision.amax_history_len": 1024,
            **changes,
        },
    )


@pytest.fixture(scope="module")
def runs(small_base, tmp_path_factory) -> dict[str, Path]:
    """Each recipe trained straight through."""
    out = {}
    for name, changes in RECIPES.items():
        directory = tmp_path_factory.mktemp(name)
        run = directory / "run"
        run_training(finetune(directory, small_base, changes), run, progress=False)
        out[name] = run
    return out


@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_trains_and_records_what_applies(runs, name):
    run = runs[name]
    metrics = read_metrics(run)
    assert [m.step for m in metrics] == list(range(1, 2 * N + 1))
    assert all(np.isfinite(m.loss) for m in metrics)
    assert metrics[-1].loss < metrics[0].loss

    layers = read_layers_json(run)
    assert layers.recipe.scaling == name and layers.recipe.amax_history_len is None
    assert any(row.precision == "fp8" for row in layers.rows)

    store = open_run(run)
    history = store.module_history(FC1)
    for slot in ("input", "weight", "grad_output"):
        amax = history[f"{slot}.amax"].to_numpy()
        assert np.isfinite(amax).all() and (amax > 0).all(), slot  # every step, not only measured
        scale = history[f"{slot}.scale"].to_numpy()
        if name == "current":  # one scale per tensor: the step's own, from its amax
            assert np.isfinite(scale).all()
        else:  # one per block: no single number
            assert np.isnan(scale).all()
        for delayed_only in ("window_max", "window_p90", "scale_change"):
            assert np.isnan(history[f"{slot}.{delayed_only}"].to_numpy()).all()
        low, median, high, floor = (
            history[f"{slot}.{m}"].to_numpy()
            for m in ("block_exp_min", "block_exp_median", "block_exp_max", "blocks_at_floor")
        )
        if name == "current":  # no blocks: not applicable, never zero
            assert all(np.isnan(v).all() for v in (low, median, high, floor))
        else:
            assert (low <= median).all() and (median <= high).all(), slot
            assert ((floor >= 0) & (floor <= 1)).all(), slot
            # The largest block's decode scale covers the tensor's amax: max x 2^(e+1) > amax
            # (gradients are E5M2 under the hybrid format).
            hybrid = load_manifest(run / "manifest.yaml").precision.fp8_format == "hybrid"
            fp8_max = 57344.0 if slot == "grad_output" and hybrid else 448.0
            assert (fp8_max * np.exp2(high + 1) > amax).all(), slot
    saturation = history["input.saturation"].to_numpy()
    assert np.isfinite(saturation[1::2]).all()  # measured every second step
    # What the console and inspect call not applicable is exactly what the store never fills.
    from fp8ops.telemetry.catalogue import applies

    for metric in history.columns:
        assert applies(metric, name) == bool(history[metric].notna().any()), metric
    meta = read_meta(run / "checkpoints" / checkpoint_name(2 * N))
    assert meta.fp8.layout == "none" and not meta.fp8.digests  # stateless: no FP8 state


def test_current_scaling_rows_pair_each_amax_with_its_casts_scale(runs):
    """Current scaling's row holds, per slot, the step's largest amax and the scale that cast
    was cast with: fp8_max / amax, one float32 division, as the cast computed it (so exact). Two
    micro-batches a step: input and grad_output are cast twice; the weight once."""
    from fp8ops.precision.scales import scale_from_amax

    history = open_run(runs["current"]).module_history(FC1)
    for slot, fp8_max in (("input", 448.0), ("weight", 448.0), ("grad_output", 57344.0)):
        amax = history[f"{slot}.amax"].to_numpy().astype(np.float32)
        scale = history[f"{slot}.scale"].to_numpy().astype(np.float32)
        expected = scale_from_amax(torch.from_numpy(amax), fp8_max, power_2_scale=False).numpy()
        np.testing.assert_array_equal(scale, expected, err_msg=slot)
        np.testing.assert_array_equal(
            history[f"{slot}.scale_inv"].to_numpy().astype(np.float32), np.float32(1) / scale
        )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["current", "mxfp8"])
def test_stop_and_resume_equals_the_straight_run(runs, small_base, tmp_path, cli, name):
    manifest = finetune(tmp_path, small_base, RECIPES[name])
    run = tmp_path / "run"
    paused = run_training(manifest, run, progress=False, stop_at=N)
    assert paused.paused
    result = cli("resume", run, "--no-progress")
    assert result.code == 0, result.err
    straight, resumed = read_metrics(runs[name]), read_metrics(run)
    # Exact: one configuration in this process, the same arithmetic across the checkpoint.
    assert [m.loss for m in straight] == [m.loss for m in resumed]
    final = run / "checkpoints" / checkpoint_name(2 * N)
    straight_final = runs[name] / "checkpoints" / checkpoint_name(2 * N)
    assert read_meta(final).weights_fingerprint == read_meta(straight_final).weights_fingerprint


@pytest.mark.slow
def test_block_scaling_trains_on_scaled_mm_as_on_the_emulation(runs, small_base, tmp_path):
    """The same fine-tuning with torch._scaled_mm (oneDNN here) multiplying the block-scaled
    casts. The GEMMs sum in another order, so the losses may differ by a rounding here and
    there; measured equal at every step on this machine (the power-of-2 scales leave most
    sums exact in float32, in any order)."""
    from fp8ops.precision import block_scaled_mm_unsupported

    reason = block_scaled_mm_unsupported("cpu")
    if reason is not None:
        pytest.skip(f"no block-scaled torch._scaled_mm GEMMs here: {reason}")
    changes = {**RECIPES["block"], "precision.backend": "scaled_mm"}
    run_training(finetune(tmp_path, small_base, changes), tmp_path / "run", progress=False)
    native, emulated = read_metrics(tmp_path / "run"), read_metrics(runs["block"])
    assert len(native) == len(emulated) == 2 * N
    gaps = [abs(a.loss - b.loss) / b.loss for a, b in zip(native, emulated, strict=True)]
    assert max(gaps) < 1e-3, gaps
    assert read_layers_json(tmp_path / "run").recipe.scaling == "block"


@pytest.mark.slow
def test_a_change_of_recipe_at_resume_is_drift(small_base, tmp_path, cli):
    """delayed -> current: refused without a reason, accepted with one (the saved scaling state
    is not used); current -> delayed: refused, no amax history was saved."""
    delayed = finetune(tmp_path / "d", small_base, {"precision.amax_history_len": 16})
    run = tmp_path / "run"
    run_training(delayed, run, progress=False, stop_at=N)
    to_current = ("--set", "precision.scaling=current", "--set", "precision.amax_history_len=1024")
    half = cli("resume", run, "--set", "precision.scaling=current", "--no-progress")
    assert half.code == 2 and "amax_history_len: a setting of delayed scaling" in half.err
    refused = cli("resume", run, *to_current, "--no-progress")
    assert refused.code == 4 and "precision.scaling" in refused.err
    accepted = cli(
        "resume",
        run,
        *to_current,
        "--accept-drift",
        "compare current scaling from here",
        "--no-progress",
    )
    assert accepted.code == 0, accepted.err
    assert read_layers_json(run).recipe.scaling == "current"
    stateless = finetune(tmp_path / "c", small_base, RECIPES["current"])
    run2 = tmp_path / "run2"
    run_training(stateless, run2, progress=False, stop_at=N)
    back = cli(
        "resume",
        run2,
        "--set",
        "precision.scaling=delayed",
        "--accept-drift",
        "try delayed",
        "--no-progress",
    )
    assert back.code != 0 and "holds no amax history" in back.err


def test_the_manifest_refuses_what_a_recipe_cannot_do():
    base = load_manifest(MANIFESTS / "tiny-gpt-cpu.yaml")

    def refused(changes: dict, message: str) -> None:
        with pytest.raises(ManifestError, match=message):
            derive(base, changes, "test")

    # the CPU default's window (amax_history_len 16) is delayed scaling's
    refused({"precision.scaling": "current"}, "amax_history_len")
    ok = {"precision.amax_history_len": 1024}
    refused({**ok, "precision.scaling": "mxfp8", "precision.power_2_scale": True}, "power_2_scale")
    refused({**ok, "precision.scaling": "current", "precision.w_block_scaling_dim": 1}, "block")
    refused({**ok, "precision.scaling": "block", "precision.x_block_scaling_dim": 2}, "only one of")
    refused({**ok, "precision.scaling": "current", "precision.backend": "te"}, "Transformer")
    refused({"precision.power_2_scale": True}, "not of scaling 'delayed'")
    refused({**ok, "precision.scaling": "block", "precision.reduce_amax": False}, "reduce_amax")
    current = derive(base, {**ok, "precision.scaling": "current"}, "test")
    assert current.precision.scaling == "current"
    refused(
        {**ok, "precision.scaling": "mxfp8", "precision.backend": "scaled_mm"},
        "BlockWise1x32.*use precision.backend 'emulated'",
    )
    # the device decides whether scaled_mm has block scaling's GEMMs (build_gpt), not the manifest
    native = derive(
        base, {**ok, "precision.scaling": "block", "precision.backend": "scaled_mm"}, "t"
    )
    assert native.precision.backend == "scaled_mm"


def test_mxfp8_refuses_modules_not_divisible_by_32(small_base, tmp_path):
    manifest = finetune(
        tmp_path,
        small_base,
        {**RECIPES["mxfp8"], "model.ffn_hidden_size": 240, "precision.small_gemm.enabled": False},
    )
    with pytest.raises(ManifestError, match="multiples of 32"):
        run_training(manifest, tmp_path / "run", progress=False)


def test_the_whatif_and_the_console_say_the_recipe(runs, cli):
    """A stateless run has no delayed window to replay; the console's header names its recipe."""
    from fp8ops.console.runs import read_header

    refused = cli("whatif", runs["current"])
    assert refused.code == 2 and "used current scaling" in refused.err
    assert read_header(runs["block"], None).recipe.startswith("block scaling, hybrid, power-of-2")
    assert (
        read_header(runs["mxfp8"], None).recipe == "MXFP8 scaling, hybrid, 1x32 blocks, E8M0 scales"
    )
