"""A recipe per module (``precision.module_recipes``): the manifest's rules, the entries as
Megatron-Core's per-module quantization config, the modules Megatron hands them to, admission
and layers.json, a delayed run with some modules under current scaling and MXFP8 (telemetry of
both kinds in one store, FP8 state checkpointed for the delayed ones only, a stop and resume
equal to the straight run), and the ledger staging a module in current scaling, applied at
resume."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

if importlib.util.find_spec("megatron") is None:
    pytest.skip("needs the megatron extra", allow_module_level=True)

from support.small_model import MANIFESTS, write_small_finetune

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
LAYER0 = "decoder.layers.0.*"
QKV0 = "decoder.layers.0.self_attention.linear_qkv"
FC2_1 = "decoder.layers.1.mlp.linear_fc2"
FC1_1 = "decoder.layers.1.mlp.linear_fc1"
MIXED = {
    "precision.module_recipes": [
        {"modules": [LAYER0], "scaling": "current", "reason": "the first layer is sensitive"},
        {"modules": ["*.linear_fc2"], "scaling": "mxfp8", "reason": "try MXFP8 on fc2"},
    ]
}


def finetune(path: Path, base: Path, changes: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_small_finetune(
        path,
        base,
        {
            "schedule.train_steps": 2 * N,
            "schedule.eval_interval": 2 * N,
            "schedule.checkpoint_interval": N,
            "data.num_examples": 400,
            "telemetry.every_steps": 2,
            "telemetry.error_sample_every": 2,
            **changes,
        },
    )


# -- the manifest --------------------------------------------------------------------------


def test_the_manifest_refuses_what_megatron_or_the_backend_cannot_do():
    base = load_manifest(MANIFESTS / "tiny-gpt-cpu.yaml")
    entry = {"modules": [LAYER0], "scaling": "current", "reason": "r"}

    def refused(changes: dict, message: str) -> None:
        with pytest.raises(ManifestError, match=message):
            derive(base, changes, "test")

    refused(
        {"precision.module_recipes": [{**entry, "scaling": "delayed"}]},
        "never a per-module recipe",
    )
    refused({"precision.module_recipes": [{**entry, "modules": []}]}, "at least one module glob")
    refused({"precision.module_recipes": [{**entry, "reason": ""}]}, "reason")
    refused({"precision.module_recipes": [entry, {**entry, "scaling": "block"}]}, "earlier entry")
    refused(
        {"precision.module_recipes": [{**entry, "power_2_scale": True}]},
        "power_2_scale: unknown key",
    )  # TE's defaults, as Megatron builds them: no recipe fields per entry
    ok = {"precision.amax_history_len": 1024}
    refused(
        {**ok, "precision.scaling": "current", "precision.module_recipes": [entry]},
        "the run's own recipe",
    )
    refused({"precision.backend": "te", "precision.module_recipes": [entry]}, "Transformer")
    refused(
        {
            "precision.backend": "scaled_mm",
            "precision.module_recipes": [{**entry, "scaling": "mxfp8"}],
        },
        "BlockWise1x32.*give these modules 'block' or 'current' instead",
    )
    for scaling in ("current", "block"):  # whether the device has the GEMMs: build_gpt's to say
        allowed = derive(
            base,
            {
                "precision.backend": "scaled_mm",
                "precision.module_recipes": [{**entry, "scaling": scaling}],
            },
            "t",
        )
        assert allowed.precision.module_recipes[0].scaling == scaling
    mixed = derive(base, MIXED, "test")
    assert mixed.precision.recipe_summary.endswith(
        "; current for decoder.layers.0.*; mxfp8 for *.linear_fc2"
    )
    # An empty list is the default, which the hash leaves out: the same manifest.
    refused({"precision.module_recipes": []}, "leave the manifest as it was")


def test_megatrons_recipe_config_matches_the_first_entry_in_the_manifests_order():
    from fp8ops.megatron.quant_config import quant_recipe, recipe_from_quant_config  # first: shims

    from megatron.core.quantization.utils import get_quant_config_or_none  # isort: skip

    manifest = derive(load_manifest(MANIFESTS / "tiny-gpt-cpu.yaml"), MIXED, "test")
    config = quant_recipe(manifest.precision)
    first = get_quant_config_or_none("decoder.layers.0.mlp.linear_fc2", config)
    later = get_quant_config_or_none(FC2_1, config)
    assert get_quant_config_or_none(FC1_1, config) is None
    assert (first.config_key, later.config_key) == ("module_recipes[0]", "module_recipes[1]")
    # the payload Megatron's own TE layers parse: Fp8Recipe values and the run's format
    assert later.config["training_recipe"] == {
        "fp8_quantization_recipe": "mxfp8",
        "fp8_format": "hybrid",
    }
    current, mxfp8 = recipe_from_quant_config(first), recipe_from_quant_config(later)
    assert (current.kind, current.power_2_scale, current.fp8_format.value) == (
        "current",
        False,
        "hybrid",
    )
    assert mxfp8.kind == "mxfp8"
    assert quant_recipe(load_manifest(MANIFESTS / "tiny-gpt-cpu.yaml").precision) is None


def test_a_pipeline_stage_matches_its_layers_by_their_global_numbers():
    from fp8ops.megatron.quant_config import global_name, quant_recipe  # first: shims

    from megatron.core.quantization.utils import get_quant_config_or_none  # isort: skip

    manifest = derive(load_manifest(MANIFESTS / "tiny-gpt-cpu.yaml"), MIXED, "test")
    # The second stage of two: Megatron names the model's layer 1 "decoder.layers.0" there.
    second = quant_recipe(manifest.precision, layer_offset=1)
    assert get_quant_config_or_none("decoder.layers.0.self_attention.linear_qkv", second) is None
    fc2 = get_quant_config_or_none("decoder.layers.0.mlp.linear_fc2", second)
    assert fc2.config_key == "module_recipes[1]"  # not [0]: this is not the model's layer 0
    first = quant_recipe(manifest.precision, layer_offset=0)
    assert get_quant_config_or_none(QKV0, first).config_key == "module_recipes[0]"
    assert global_name("decoder.layers.0.mlp.linear_fc2", 3) == "decoder.layers.3.mlp.linear_fc2"
    assert global_name("decoder.layers.1", 2) == "decoder.layers.3"
    assert global_name("output_layer", 3) == "output_layer"
    assert global_name("decoder.final_layernorm", 3) == "decoder.final_layernorm"


@pytest.mark.parametrize(
    "payload, message",
    [
        ({"training_recipe": {"fp8_quantization_recipe": "tensorwise"}}, "TEQuantizationParams"),
        (
            {
                "transformer_engine_config_type": "TEQuantizationParams",
                "training_recipe": {"fp8_quantization_recipe": "delayed"},
            },
            "fp8_quantization_recipe",
        ),
        (
            {
                "transformer_engine_config_type": "TEQuantizationParams",
                "training_recipe": {"fp4_quantization_recipe": "nvfp4"},
            },
            "fp8_quantization_recipe",
        ),
        (
            {
                "transformer_engine_config_type": "TEQuantizationParams",
                "training_recipe": {"fp8_quantization_recipe": "tensorwise"},
                "evaluation_recipe": {},
            },
            "training_recipe only",
        ),
    ],
)
def test_a_config_fp8ops_layers_cannot_run_is_refused_naming_it(payload, message):
    from fp8ops.megatron.quant_config import recipe_from_quant_config  # first: Megatron's shims

    from megatron.core.quantization.quant_config import MatchContext, QuantizationConfig  # isort: skip

    config = QuantizationConfig(payload, MatchContext("x", None), "mine")
    with pytest.raises(ValueError, match=f"'mine'.*{message}|{message}"):
        recipe_from_quant_config(config)


# -- a run -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixed_run(small_base, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("mixed")
    run = directory / "run"
    run_training(finetune(directory / "m.yaml", small_base, MIXED), run, progress=False)
    return run


def test_each_module_runs_and_records_its_own_recipe(mixed_run):
    layers = read_layers_json(mixed_run)
    scaling = {row.fqn: row.scaling for row in layers.rows if row.fp8}
    assert layers.recipe.scaling == "delayed"
    assert scaling[QKV0] == "current" and scaling["decoder.layers.0.mlp.linear_fc2"] == "current"
    assert scaling[FC2_1] == "mxfp8" and scaling[FC1_1] is None
    row = next(row for row in layers.rows if row.fqn == QKV0)
    assert "current scaling, not delayed, by precision.module_recipes[0]" in row.reason.text

    store = open_run(mixed_run)
    delayed, current, mxfp8 = (store.module_history(m) for m in (FC1_1, QKV0, FC2_1))
    for slot in ("input", "weight", "grad_output"):
        assert np.isfinite(delayed[f"{slot}.window_max"].to_numpy()).all()
        for stateless in (current, mxfp8):
            assert np.isfinite(stateless[f"{slot}.amax"].to_numpy()).all()
            assert np.isnan(stateless[f"{slot}.window_max"].to_numpy()).all()  # not applicable
            assert np.isnan(stateless[f"{slot}.scale_change"].to_numpy()).all()
        assert np.isnan(mxfp8[f"{slot}.scale"].to_numpy()).all()  # a scale per block
    # current scaling's weight scale is 448 / that step's own weight amax
    amax = current["weight.amax"].to_numpy().astype(np.float32)
    np.testing.assert_array_equal(
        current["weight.scale"].to_numpy().astype(np.float32), np.float32(448.0) / amax
    )

    meta = read_meta(mixed_run / "checkpoints" / checkpoint_name(2 * N))
    saved = set(meta.fp8.modules)
    assert FC1_1 in saved and QKV0 not in saved and FC2_1 not in saved
    losses = [m.loss for m in read_metrics(mixed_run)]
    assert len(losses) == 2 * N and losses[-1] < losses[0]


def test_the_ledger_refuses_current_scaling_for_a_module_that_runs_it(mixed_run):
    from fp8ops.overrides import Ledger, OverrideError

    ledger = Ledger(mixed_run)
    before = ledger.path.read_bytes() if ledger.path.exists() else b""  # the run's proposals
    with pytest.raises(OverrideError, match=f"{QKV0} already runs current scaling"):
        ledger.stage(QKV0, "x", who="ana", to="current")
    with pytest.raises(OverrideError, match="'bf16' or 'current'"):
        ledger.stage(FC1_1, "x", who="ana", to="block")
    assert (ledger.path.read_bytes() if ledger.path.exists() else b"") == before  # nothing written


@pytest.mark.slow
def test_stop_and_resume_equals_the_straight_run(mixed_run, small_base, tmp_path, cli):
    run = tmp_path / "run"
    paused = run_training(
        finetune(tmp_path / "m.yaml", small_base, MIXED), run, progress=False, stop_at=N
    )
    assert paused.paused
    result = cli("resume", run, "--no-progress")
    assert result.code == 0, result.err
    # Exact: one configuration in this process, the same arithmetic across the checkpoint.
    assert [m.loss for m in read_metrics(run)] == [m.loss for m in read_metrics(mixed_run)]
    final = checkpoint_name(2 * N)
    assert (
        read_meta(run / "checkpoints" / final).weights_fingerprint
        == read_meta(mixed_run / "checkpoints" / final).weights_fingerprint
    )


def test_a_glob_matching_no_module_is_refused_by_its_entry(small_base, tmp_path):
    changes = {
        "precision.module_recipes": [
            {"modules": ["decoder.layer.0.*"], "scaling": "current", "reason": "r"}
        ]
    }
    with pytest.raises(ManifestError, match=r"module_recipes\[0\]\.modules\[0\] 'decoder.layer.0"):
        run_training(
            finetune(tmp_path / "m.yaml", small_base, changes), tmp_path / "run", progress=False
        )
    assert not (tmp_path / "run").exists()


def test_a_per_module_mxfp8_module_not_divisible_by_32_is_refused_naming_the_entry(
    small_base, tmp_path
):
    changes = {
        "model.ffn_hidden_size": 240,
        "precision.small_gemm.enabled": False,
        "precision.module_recipes": [
            {"modules": ["*.linear_fc2"], "scaling": "mxfp8", "reason": "r"}
        ],
    }
    with pytest.raises(ManifestError, match="MXFP8 by precision.module_recipes.*linear_fc2.*entry"):
        run_training(
            finetune(tmp_path / "m.yaml", small_base, changes), tmp_path / "run", progress=False
        )


# -- the ledger stages current scaling -----------------------------------------------------


@pytest.mark.slow
def test_an_approved_current_override_applies_at_resume_and_cannot_be_lifted_mid_run(
    small_base, tmp_path, cli
):
    """Staged "current" and approved: the resume writes a module_recipes entry for the module
    (first, with the approval) and the module runs current scaling from there, its delayed state
    no longer checkpointed. Revoked: going back to delayed scaling mid-run is refused, since the
    checkpoint holds no amax history for it."""
    from fp8ops.overrides import Ledger, OverrideError

    run = tmp_path / "run"
    run_training(finetune(tmp_path / "m.yaml", small_base, {}), run, progress=False, stop_at=N)
    ledger = Ledger(run)
    staged = ledger.stage(FC1_1, "input saturates", who="ana", to="current")
    assert (staged.dtype, staged.scaling, staged.target) == ("fp8", "current", "current scaling")
    with pytest.raises(OverrideError, match="open override"):
        ledger.stage(FC1_1, "again", who="ana")
    ledger.approve(staged.id, who="ben")

    result = cli("resume", run, "--no-progress")
    assert result.code == 0, result.err
    locked = load_manifest(run / "manifest.yaml")
    (entry,) = locked.precision.module_recipes
    assert (entry.modules, entry.scaling, entry.approval) == (
        (FC1_1,),
        "current",
        ledger.get(staged.id).approval,
    )
    assert f"{FC1_1} to current scaling ({staged.id[:12]})" in locked.revision.reason
    row = next(row for row in read_layers_json(run).rows if row.fqn == FC1_1)
    assert row.scaling == "current"
    window = open_run(run).module_history(FC1_1)["input.window_max"].to_numpy()
    assert np.isfinite(window[:N]).all() and np.isnan(window[N:]).all()
    meta = read_meta(run / "checkpoints" / checkpoint_name(2 * N))
    assert FC1_1 not in meta.fp8.modules

    # back to delayed: no history to continue from
    Ledger(run).revoke(staged.id, "fixed", who="ben")
    extended = cli(
        "resume", run, "--set", "schedule.train_steps=8", "--accept-drift", "more", "--no-progress"
    )
    assert extended.code == 4, extended.err
    assert f"{FC1_1} would run delayed scaling" in extended.err
    assert "holds no amax history" in extended.err


def test_the_whatif_replays_the_delayed_modules_and_refuses_the_others(mixed_run, cli):
    import json

    result = cli("whatif", mixed_run, "--recipe", "current", "--json")
    assert result.code == 0, result.err
    replayed = {row["module"] for row in json.loads(result.out)["rows"]}
    assert FC1_1 in replayed and QKV0 not in replayed and FC2_1 not in replayed
    refused = cli("whatif", mixed_run, "--module", "decoder.layers.0.*")
    assert refused.code == 2 and "ran current scaling (precision.module_recipes)" in refused.err
