"""A TE model in the trainer's hands (``te_state.py``, ``model.fp8_state_modules``, admission):
its FP8 state read as fp8ops' ``Fp8Meta``, checkpointed as fp8ops' tensors through Megatron's
``dist_checkpointing``, and loaded back through TE's own ``set_extra_state`` past TE 2.18's
refusal of pickled state; its projections listed and switched by admission.

Transformer Engine's PyTorch side does not import here: these run against
``te_stand_in.TeLikeLinear``, whose ``set_extra_state`` uses TE's real payload classifier."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from torch import nn

if importlib.util.find_spec("megatron") is None:
    pytest.skip("needs the megatron extra: pip install -e '.[megatron]'", allow_module_level=True)

from support.te_stand_in import TE_EXTRA_STATE, TeLikeLinear, decoder

from fp8ops.checkpoint.state import FP8_TENSORS, Fp8Layout, fp8_digest, fp8_state, restore_fp8
from fp8ops.errors import Fp8opsError
from fp8ops.megatron import fp8_state_modules
from fp8ops.megatron.te_extra_state import te_extra_state
from fp8ops.megatron.te_state import UNSAFE_PICKLE_ENV, TeFp8MetaView, is_te_projection
from fp8ops.megatron.te_telemetry import TeTelemetryModule
from fp8ops.precision import DelayedScalingRecipe, Fp8Meta
from fp8ops.precision.formats import Fp8Format
from fp8ops.precision.state import carry_scales

RECIPE = DelayedScalingRecipe(amax_history_len=4)
needs_te_classifier = pytest.mark.skipif(
    TE_EXTRA_STATE is None, reason="needs TE 2.18 or later's _extra_state.py (ci/setup.sh)"
)


@pytest.fixture(autouse=True)
def no_switch(monkeypatch):
    """Every test starts without TE's unsafe-pickle switch, as a production job would."""
    monkeypatch.delenv(UNSAFE_PICKLE_ENV, raising=False)


def trained(module: TeLikeLinear, seed: int) -> dict[str, torch.Tensor]:
    """Give ``module`` TE state (one FP8 forward), then distinct values; returns them."""
    TeLikeLinear.autocast = True
    try:
        module(torch.randn(2, module.in_features))
    finally:
        TeLikeLinear.autocast = False
    generator = torch.Generator().manual_seed(seed)
    for key in ("scaling_fwd", "scaling_bwd"):
        state = module.fp8_meta[key]
        state.amax_history.copy_(torch.rand(state.amax_history.shape, generator=generator) * 9)
        state.scale.copy_(torch.rand(state.scale.shape, generator=generator) * 500)
    return TeFp8MetaView(module, RECIPE, "m").state_dict()


def test_only_te_modules_are_te_projections():
    assert is_te_projection(TeLikeLinear(8))
    plain = nn.Linear(8, 8)
    plain.fp8_enabled = True
    assert not is_te_projection(plain)  # no fp8_meta
    plain.fp8_meta = Fp8Meta.fresh(RECIPE)  # fp8ops' own layers keep an Fp8Meta
    assert not is_te_projection(plain)


def test_before_its_first_fp8_forward_the_state_is_the_one_te_will_create():
    view = TeFp8MetaView(TeLikeLinear(8), RECIPE, "m")
    state = view.state_dict()
    assert list(state) == list(FP8_TENSORS)
    assert torch.equal(state["scale_fwd"], torch.ones(3))
    assert torch.equal(state["amax_history_bwd"], torch.zeros(4, 2))
    assert view.forward.amax_history.shape == (4, 3) and view.backward.scale.shape == (2,)


def test_the_state_dict_is_a_copy_of_tes_tensors():
    module = TeLikeLinear(8)
    saved = trained(module, seed=1)
    assert torch.equal(saved["amax_history_fwd"], module.fp8_meta["scaling_fwd"].amax_history)
    saved["scale_fwd"].zero_()
    assert module.fp8_meta["scaling_fwd"].scale.min() > 0  # TE's own left alone


@needs_te_classifier
def test_loading_goes_through_tes_own_loader_with_the_switch_on_for_that_call_only():
    saved = trained(TeLikeLinear(8), seed=2)
    target = TeLikeLinear(8)  # no TE state yet: TE's loader creates it
    view = TeFp8MetaView(target, RECIPE, "decoder.layers.0.linear_qkv")
    view.load_state_dict(saved)

    assert target.classified == [True]  # TE's classifier let it through
    assert UNSAFE_PICKLE_ENV not in os.environ  # and the switch is off again
    assert target.fp8_meta["num_gemms"] == 1 and target.fp8_meta["recipe"].amax_history_len == 4
    for key, tensor in view.state_dict().items():
        assert torch.equal(tensor, saved[key]), key


@needs_te_classifier
def test_without_the_views_switch_te_refuses_the_same_payload():
    """Why the view turns the switch on: TE 2.18+'s own refusal, on the payload it builds."""
    saved = trained(TeLikeLinear(8), seed=3)
    with pytest.raises(RuntimeError, match="Refusing to load pickled"):
        TeLikeLinear(8).set_extra_state(te_extra_state(saved, RECIPE))


@needs_te_classifier
@pytest.mark.parametrize("value", ["0", "1"])
def test_a_switch_the_user_set_is_left_as_it_was(monkeypatch, value):
    monkeypatch.setenv(UNSAFE_PICKLE_ENV, value)
    saved = trained(TeLikeLinear(8), seed=4)
    TeFp8MetaView(TeLikeLinear(8), RECIPE, "m").load_state_dict(saved)
    assert os.environ[UNSAFE_PICKLE_ENV] == value


def test_a_state_of_another_shape_is_refused_naming_the_module_and_nothing_is_loaded():
    target = TeLikeLinear(8)
    before = trained(target, seed=5)
    other = TeFp8MetaView(TeLikeLinear(8), DelayedScalingRecipe(amax_history_len=8), "x")
    with pytest.raises(ValueError, match=r"decoder\.layers\.1\.linear_proj: .*amax_history_fwd"):
        TeFp8MetaView(target, RECIPE, "decoder.layers.1.linear_proj").load_state_dict(
            other.state_dict()
        )
    assert target.classified == []
    for key, tensor in TeFp8MetaView(target, RECIPE, "m").state_dict().items():
        assert torch.equal(tensor, before[key]), key


def test_the_trainer_reads_a_te_model_through_the_views():
    modules = fp8_state_modules(decoder(), RECIPE)
    assert list(modules) == [
        "decoder.layers.0.linear_qkv",
        "decoder.layers.0.linear_proj",
        "decoder.layers.1.linear_qkv",
        "decoder.layers.1.linear_proj",
    ]
    assert all(isinstance(m, TeTelemetryModule) for m in modules.values())
    assert all(isinstance(m.fp8_meta, TeFp8MetaView) for m in modules.values())


@needs_te_classifier
def test_a_te_models_fp8_state_round_trips_through_dist_checkpointing(tmp_path, megatron_tp1):
    """The trainer's own checkpoint functions: saved as fp8ops' ``fp8.<module>.<tensor>``
    tensors (not TE's pickle), loaded into a fresh TE model through TE's loader."""
    from fp8ops.checkpoint.sharded_io import load_sharded, save_sharded
    from fp8ops.megatron import apply_cpu_shims

    apply_cpu_shims()  # as build_gpt does before the trainer saves anything on a CPU
    model = decoder()
    for seed, module in enumerate(model.decoder.modules()):
        if isinstance(module, TeLikeLinear):
            trained(module, seed=10 + seed)
    views = fp8_state_modules(model, RECIPE)
    layout = Fp8Layout("shared", groups=1, group=0, replica=0)
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    save_sharded(fp8_state(views, layout), directory)

    fresh = decoder()
    fresh_views = fp8_state_modules(fresh, RECIPE)
    loaded = load_sharded(fp8_state(fresh_views, layout), directory)
    restore_fp8(fresh_views, loaded)

    for name, view in views.items():
        assert fp8_digest(fresh_views[name]) == fp8_digest(view), name
        module = fresh.get_submodule(name)
        assert module.classified == [True]
        assert torch.equal(
            module.fp8_meta["scaling_bwd"].amax_history,
            model.get_submodule(name).fp8_meta["scaling_bwd"].amax_history,
        )


def te_gpt(layers: int = 2, hidden: int = 16, tp_size: int = 1) -> nn.Module:
    """The module tree of Megatron's TE GPT spec (te_backend.build_gpt_te), projections only,
    plus a final norm; each projection's weight is this rank's: ``[out, in] / tp_size`` along
    its split (QKV 3x wide, FFN 4x)."""
    model = nn.Module()
    model.decoder = nn.Module()
    model.decoder.layers = nn.ModuleList()
    shard = hidden // tp_size
    for _ in range(layers):
        layer = nn.Module()
        layer.self_attention, layer.mlp = nn.Module(), nn.Module()
        for block, column, row, wide in (
            (layer.self_attention, "linear_qkv", "linear_proj", 3),
            (layer.mlp, "linear_fc1", "linear_fc2", 4),
        ):
            split = wide * shard
            setattr(block, column, TeLikeLinear(hidden, out_features=split, tp_size=tp_size))
            setattr(
                block,
                row,
                TeLikeLinear(
                    split if row == "linear_fc2" else shard,
                    out_features=hidden,
                    parallel_mode="row",
                    tp_size=tp_size,
                ),
            )
        model.decoder.layers.append(layer)
    model.decoder.final_layernorm = nn.LayerNorm(hidden)
    return model


def test_admission_lists_and_switches_a_te_models_projections():
    from support.example_manifests import TINY

    from fp8ops.admission import apply_admission, decide_admission
    from fp8ops.manifest import load_manifest

    precision = load_manifest(TINY).precision.model_copy(
        update={"exclude_modules": ["decoder.layers.1.mlp.*"]}
    )
    model = te_gpt(tp_size=2)
    table = decide_admission(model, precision, tensor_parallel=2)

    rows = {row.fqn: row for row in table.rows}
    assert len(rows) == 2 * 4 + 1  # eight projections and the final norm
    # (kind, split, global K x N, per-rank K x N): from this rank's weight and tp_size
    shapes = {
        row.fqn.rsplit(".", 1)[-1]: (
            row.kind,
            row.parallel,
            row.global_shape.k,
            row.global_shape.n,
            row.rank_shape.k,
            row.rank_shape.n,
        )
        for row in table.rows
        if row.fqn.startswith("decoder.layers.0.")
    }
    assert shapes == {
        "linear_qkv": ("qkv", "column", 16, 48, 16, 24),
        "linear_proj": ("proj", "row", 16, 16, 8, 16),
        "linear_fc1": ("fc1", "column", 16, 64, 16, 32),
        "linear_fc2": ("fc2", "row", 64, 16, 32, 16),
    }
    assert rows["decoder.final_layernorm"].reason.code == "norm"
    assert not rows["decoder.layers.1.mlp.linear_fc1"].fp8
    assert rows["decoder.layers.1.mlp.linear_fc1"].reason.code == "excluded"

    apply_admission(table, model)
    switched = {name: m.fp8_enabled for name, m in model.named_modules() if is_te_projection(m)}
    assert switched == {
        name: row.fp8 for name, row in rows.items() if name != "decoder.final_layernorm"
    }
    assert sum(switched.values()) == 6

    with pytest.raises(ValueError, match=r"tensor_parallel=1 does not fit .*linear_qkv"):
        decide_admission(model, precision, tensor_parallel=1)


def test_a_module_with_te_state_is_loaded_in_place_without_the_pickle():
    """As TE's own loader does once a module has state: the tensors TE's amax buffers point
    at stay the same objects."""
    saved = trained(TeLikeLinear(8), seed=6)
    target = TeLikeLinear(8)
    trained(target, seed=7)
    before = {key: target.fp8_meta[key] for key in ("scaling_fwd", "scaling_bwd")}
    tensors = [before["scaling_fwd"].amax_history, before["scaling_bwd"].scale]
    TeFp8MetaView(target, RECIPE, "m").load_state_dict(saved)
    assert target.classified == []  # TE's loader not called
    assert target.fp8_meta["scaling_fwd"].amax_history is tensors[0]
    assert target.fp8_meta["scaling_bwd"].scale is tensors[1]
    assert torch.equal(tensors[0], saved["amax_history_fwd"])


@needs_te_classifier
def test_a_state_of_another_format_is_not_copied_into_tes_state_made_for_this_one():
    """TE made the module's state for HYBRID (E5M2 gradients) from a payload; copying E4M3
    scales into it in place would leave TE casting gradients to E5M2 with E4M3's scales."""
    module = TeLikeLinear(8)
    TeFp8MetaView(module, RECIPE, "m").load_state_dict(trained(TeLikeLinear(8), seed=3))
    assert module.fp8_meta["scaling_bwd"].recipe.fp8_format.name == "HYBRID"
    before = TeFp8MetaView(module, RECIPE, "m").state_dict()
    e4m3 = DelayedScalingRecipe(amax_history_len=4, fp8_format=Fp8Format.E4M3)
    with pytest.raises(
        Fp8opsError,
        match=(
            r"^m: Transformer Engine made this module's FP8 state for fp8_format HYBRID and keeps "
            r"its casts' dtypes when loading; a state for E4M3 loads only into a model built afresh"
        ),
    ):
        TeFp8MetaView(module, e4m3, "m").load_state_dict(trained(TeLikeLinear(8), seed=4))
    after = TeFp8MetaView(module, RECIPE, "m").state_dict()
    assert all(torch.equal(before[key], after[key]) for key in before)  # nothing copied
    fresh = TeLikeLinear(8)  # as a resume builds it: TE makes the state from the payload
    TeFp8MetaView(fresh, e4m3, "m").load_state_dict(trained(TeLikeLinear(8), seed=4))
    assert fresh.fp8_meta["scaling_bwd"].recipe.fp8_format.name == "E4M3"


@needs_te_classifier
def test_a_te_history_at_another_length_is_loaded_through_tes_loader():
    """TE's state loaded from a checkpoint of another amax_history_len, not yet adjusted by a
    forward: TE's loader brings it to the recipe's length, then copies."""
    saved = trained(TeLikeLinear(8), seed=8)
    target = TeLikeLinear(8)
    trained(target, seed=9)
    target.fp8_meta["scaling_fwd"].amax_history = torch.ones(7, 3)
    TeFp8MetaView(target, RECIPE, "m").load_state_dict(saved)
    assert target.classified == [True]
    assert torch.equal(target.fp8_meta["scaling_fwd"].amax_history, saved["amax_history_fwd"])


class IgnoringTe(TeLikeLinear):
    """A TE whose loader skips the payload (as its classifier does with a stateless one)."""

    def set_extra_state(self, state):
        self.classified.append(False)


class FailingTe(TeLikeLinear):
    def set_extra_state(self, state):
        assert os.environ[UNSAFE_PICKLE_ENV] == "1"
        raise RuntimeError("TE failed")


def test_a_te_that_does_not_take_the_state_is_refused_by_name():
    saved = trained(TeLikeLinear(8), seed=10)
    with pytest.raises(
        Fp8opsError, match=r"decoder\.layers\.0\.linear_qkv: Transformer Engine did not take"
    ):
        TeFp8MetaView(IgnoringTe(8), RECIPE, "decoder.layers.0.linear_qkv").load_state_dict(saved)


def test_the_switch_is_off_again_when_tes_loader_fails():
    saved = trained(TeLikeLinear(8), seed=11)
    with pytest.raises(RuntimeError, match="TE failed"):
        TeFp8MetaView(FailingTe(8), RECIPE, "m").load_state_dict(saved)
    assert UNSAFE_PICKLE_ENV not in os.environ


def test_a_state_missing_a_tensor_is_refused_naming_it():
    saved = trained(TeLikeLinear(8), seed=12)
    del saved["scale_bwd"]
    target = TeLikeLinear(8)
    with pytest.raises(Fp8opsError, match=r"m: FP8 state lacks scale_bwd"):
        TeFp8MetaView(target, RECIPE, "m").load_state_dict(saved)
    assert target.fp8_meta == {}


def test_a_projection_tes_fp8_gemms_cannot_take_is_refused_by_name():
    """K in multiples of 16 and N in multiples of 8 per rank (TE's assert_dim_for_fp8_exec),
    checked when admission is decided, not at its first FP8 forward."""
    from support.example_manifests import TINY

    from fp8ops.admission import decide_admission
    from fp8ops.errors import ManifestError
    from fp8ops.manifest import derive, load_manifest

    manifest = derive(load_manifest(TINY), {"precision.backend": "te"}, "on TE")
    model = te_gpt(hidden=16)
    model.decoder.layers[0].self_attention.linear_qkv = TeLikeLinear(16, out_features=24)
    # N = 24: a multiple of 8 is enough for TE
    decide_admission(model, manifest.precision, tensor_parallel=1)
    model.decoder.layers[1].mlp.linear_fc1 = TeLikeLinear(16, out_features=20)
    with pytest.raises(ManifestError) as refused:
        decide_admission(model, manifest.precision, tensor_parallel=1)
    message = str(refused.value)
    assert "decoder.layers.1.mlp.linear_fc1 (K x N = 16 x 20 per rank)" in message
    assert "N in multiples of 8" in message and "linear_qkv" not in message
    excluded = derive(manifest, {"precision.exclude_modules": ["*.1.mlp.linear_fc1"]}, "bf16")
    # kept in BF16, it never reaches TE's FP8 GEMM
    decide_admission(model, excluded.precision, tensor_parallel=1)


def test_a_history_holding_nan_is_loaded_and_checked_bit_for_bit():
    saved = trained(TeLikeLinear(8), seed=13)
    saved["amax_history_fwd"][2, 1] = float("nan")
    target = TeLikeLinear(8)
    trained(target, seed=14)
    TeFp8MetaView(target, RECIPE, "m").load_state_dict(saved)  # in place
    assert torch.isnan(target.fp8_meta["scaling_fwd"].amax_history[2, 1])


def test_carried_scales_land_in_tes_own_tensors():
    """A resume that changes the format carries the scales of a TE model too (the trainer calls
    ``carry_scales`` on the views): TE's scale tensors change in place, histories stay."""
    module = TeLikeLinear(8)
    saved = trained(module, seed=9)
    e4m3 = DelayedScalingRecipe(amax_history_len=4, fp8_format=Fp8Format.E4M3)
    te_scale = module.fp8_meta["scaling_bwd"].scale
    factors = carry_scales([TeFp8MetaView(module, e4m3, "m")], RECIPE, e4m3)
    assert factors == {"backward": 2.0**-7}
    assert module.fp8_meta["scaling_bwd"].scale is te_scale
    assert torch.equal(te_scale, saved["scale_bwd"] * 2.0**-7)
    assert torch.equal(module.fp8_meta["scaling_fwd"].scale, saved["scale_fwd"])
    assert torch.equal(module.fp8_meta["scaling_bwd"].amax_history, saved["amax_history_bwd"])
