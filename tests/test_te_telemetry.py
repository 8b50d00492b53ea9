"""Telemetry of the TE backend: the collector reads TE's own ``fp8_meta`` (``te_telemetry.py``).

Transformer Engine does not import on any machine here, so these tests run the adapter against
``te_stand_in.TeLikeLinear``, which keeps TE's documented layout and behaviour; here the scales
are also updated when the autocast exits and when a backward pass ends (§2.4). They check
fp8ops' side only; whether TE itself behaves so is for a GPU with TE (docs/gpu.md).
"""

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

if importlib.util.find_spec("megatron") is None:
    pytest.skip("needs the megatron extra: pip install -e '.[megatron]'", allow_module_level=True)

from support.te_stand_in import TeLikeLinear, decoder

from fp8ops.manifest.schema import Telemetry
from fp8ops.megatron import mark_first_microbatch
from fp8ops.megatron.te_telemetry import TeTelemetryModule, te_telemetry_modules
from fp8ops.precision import DelayedScalingRecipe
from fp8ops.telemetry.catalogue import COLUMN
from fp8ops.telemetry.collector import TelemetryCollector

RECIPE = DelayedScalingRecipe(amax_history_len=4)
CADENCE = Telemetry(every_steps=2, error_sample_every=2)


def te_update(model, forward: bool) -> None:
    """Stands in for TE's update, which comes after the hooks: every scale of that direction
    quartered (the values do not matter, only that they change after the casts)."""
    for module in model.modules():
        state = getattr(module, "fp8_meta", {}).get("scaling_fwd" if forward else "scaling_bwd")
        if state is not None:
            state.scale /= 4


def step(model, collector, number: int, fp8=True, micro_batches=1, backward=True, mark=True):
    if mark:
        mark_first_microbatch(model)
    collector.begin_step(number)
    TeLikeLinear.autocast = fp8
    try:
        for _ in range(micro_batches):
            x = torch.randn(4, 8, requires_grad=True)
            for layer in model.decoder.layers:
                x = layer.linear_proj(layer.linear_qkv(x))
            te_update(model, forward=True)  # the autocast's exit
            if backward:
                x.sum().backward()
                te_update(model, forward=False)  # the end of the backward pass
    finally:
        TeLikeLinear.autocast = False
    return collector.end_step().result()


def state_row(collector, number: int):
    """A row read now, with no step run: the FP8 state as it stands."""
    collector.begin_step(number)
    return collector.end_step().result()


def cell(row, collector, module, metric):
    return row[collector.names.index(module), COLUMN[metric]]


QKV0 = "decoder.layers.0.linear_qkv"


def test_the_decoder_projections_are_observed_in_module_order():
    modules = te_telemetry_modules(decoder(), RECIPE)
    assert list(modules) == [
        "decoder.layers.0.linear_qkv",
        "decoder.layers.0.linear_proj",
        "decoder.layers.1.linear_qkv",
        "decoder.layers.1.linear_proj",
    ]


def test_the_row_holds_tes_own_state_read_afresh_every_row():
    model = decoder()
    collector = TelemetryCollector(te_telemetry_modules(model, RECIPE), CADENCE)
    module = model.decoder.layers[0].linear_qkv

    # Before its first FP8 forward TE has no state: the row shows the state TE will create.
    row = step(model, collector, 1, fp8=False)
    assert module.fp8_meta == {}
    assert cell(row, collector, QKV0, "input.scale") == 1.0
    assert cell(row, collector, QKV0, "input.window_max") == 0.0
    assert np.isnan(cell(row, collector, QKV0, "input.window_p50"))  # zeros: no observation
    assert cell(row, collector, QKV0, "fallback_gemms") == 3
    assert cell(row, collector, QKV0, "fp8_gemms") == 0

    # TE's update writes into its own tensors; so does the test, then reads a row at once.
    row = step(model, collector, 2)
    assert cell(row, collector, QKV0, "fp8_gemms") == 3
    assert np.isfinite(cell(row, collector, QKV0, "input_norm"))  # step 2 measures
    state = module.fp8_meta["scaling_fwd"]
    state.amax_history[1:, 0] = torch.tensor([2.0, 8.0, 4.0])
    state.scale[0] = 448.0 / 8.0
    row = state_row(collector, 3)
    assert cell(row, collector, QKV0, "input.scale") == np.float32(56.0)
    assert cell(row, collector, QKV0, "input.window_max") == 8.0
    assert cell(row, collector, QKV0, "input.amax") == 4.0  # the newest entry, row L-1

    # TE rebinds its tensors (loading a checkpoint): the next row reads the new ones.
    module.fp8_meta["scaling_bwd"].scale = torch.tensor([1024.0, 1.0])
    row = state_row(collector, 5)
    assert cell(row, collector, QKV0, "grad_output.scale") == 1024.0


def test_a_module_held_in_bf16_is_counted_as_fallback_and_its_state_frozen():
    model = decoder()
    collector = TelemetryCollector(te_telemetry_modules(model, RECIPE), CADENCE)
    held = model.decoder.layers[1].linear_proj
    held.fp8_enabled = False
    row = step(model, collector, 1)
    name = "decoder.layers.1.linear_proj"
    assert cell(row, collector, name, "fp8_enabled") == 0
    assert cell(row, collector, name, "fallback_gemms") == 3
    assert cell(row, collector, name, "fp8_gemms") == 0
    assert held.fp8_meta == {}  # it never ran in FP8


class TeLikeLayerNormLinear(TeLikeLinear):
    """A LayerNormLinear stand-in: it normalises its input before the GEMM."""

    def __init__(self, features: int):
        super().__init__(features)
        self.layer_norm_weight = nn.Parameter(torch.ones(features))

    def forward(self, x):
        return super().forward(nn.functional.rms_norm(x, (x.shape[-1],), self.layer_norm_weight))


def test_statistics_steps_recount_tes_casts_with_the_scales_it_used():
    model = decoder(layers=1)
    layer = model.decoder.layers[0]
    layer.linear_qkv = TeLikeLayerNormLinear(8)
    collector = TelemetryCollector(te_telemetry_modules(model, RECIPE), CADENCE)
    step(model, collector, 1)  # every module now has its TE state
    ordinary = step(model, collector, 3)  # not a statistics step: nothing recounted
    assert np.isnan(cell(ordinary, collector, "decoder.layers.0.linear_proj", "weight.saturation"))

    proj = layer.linear_proj
    with torch.no_grad():
        proj.weight.copy_(torch.linspace(-1, 1, 64).reshape(8, 8))
    proj.fp8_meta["scaling_fwd"].scale[1] = 448.0 / 0.5  # half the weight's values saturate
    proj.fp8_meta["scaling_bwd"].scale[0] = 2.0**-40  # every gradient flushes to zero (twice)
    name = "decoder.layers.0.linear_proj"
    row = step(model, collector, 4, micro_batches=2)
    assert cell(row, collector, name, "weight.saturation") == 32 / 64  # |w| > 0.5: 16 a side
    assert cell(row, collector, name, "grad_output.underflow") == 1.0
    assert cell(row, collector, name, "input.saturation") == 0.0
    assert cell(row, collector, name, "input.nan") == 0
    # The LayerNormLinear's cast input is its normalised input: not seen, so not counted.
    assert np.isnan(cell(row, collector, QKV0, "input.saturation"))
    assert cell(row, collector, QKV0, "weight.saturation") == 0.0
    assert np.isfinite(cell(row, collector, QKV0, "grad_output.underflow"))
    assert np.isnan(row[:, COLUMN["fp8_rel_error"]]).all()  # no TE module is sampled


@pytest.mark.parametrize(
    ("cache_disabled", "marked", "casts"),
    [(False, True, 1), (True, True, 3), (False, False, 0)],
    ids=["first micro-batch only", "parameter cache disabled: every call", "flag never reset"],
)
def test_the_weight_is_counted_when_te_casts_it(cache_disabled, marked, casts):
    model = decoder(layers=1)
    collector = TelemetryCollector(te_telemetry_modules(model, RECIPE), CADENCE)
    step(model, collector, 1)  # clears every flag (TELinear.forward)
    proj = model.decoder.layers[0].linear_proj
    proj.disable_parameter_transpose_cache = cache_disabled
    with torch.no_grad():
        proj.weight[0, 0] = float("inf")  # one Inf per cast of the weight
    row = step(model, collector, 2, micro_batches=3, backward=False, mark=marked)
    infs = cell(row, collector, "decoder.layers.0.linear_proj", "weight.inf")
    assert (np.isnan(infs) and casts == 0) or infs == casts
    assert cell(row, collector, "decoder.layers.0.linear_proj", "fp8_gemms") == 3 * 3


def test_the_counts_use_the_scales_the_casts_used_not_the_updated_ones():
    """TE updates the scales after the forward hooks (autocast exit) and after the gradient
    hooks (end of the backward pass): the counts must be taken with the scales before that."""
    model = decoder(layers=1)
    collector = TelemetryCollector(te_telemetry_modules(model, RECIPE), CADENCE)
    step(model, collector, 1)
    proj = model.decoder.layers[0].linear_proj
    with torch.no_grad():
        proj.weight.copy_(torch.full((8, 8), 1.0))
    proj.fp8_meta["scaling_fwd"].scale[1] = 448.0 * 2  # saturates all; a quarter of it, none
    proj.fp8_meta["scaling_bwd"].scale[0] = 2.0**-15  # 1 * 2^-15: E5M2's smallest subnormal is
    # 2^-16, so nothing flushes; a quarter of the scale, 2^-17, flushes every gradient of 1.0
    row = step(model, collector, 2)
    assert cell(row, collector, "decoder.layers.0.linear_proj", "weight.saturation") == 1.0
    assert cell(row, collector, "decoder.layers.0.linear_proj", "grad_output.underflow") == 0.0


def test_a_history_loaded_at_another_length_is_read_as_te_will_adjust_it():
    """A checkpoint of another amax_history_len loads at its own length; TE truncates or pads
    it (zeros at the end) at the next forward. Telemetry right after the load must not fail."""
    model = decoder()
    modules = te_telemetry_modules(model, RECIPE)  # amax_history_len 4
    longer = torch.arange(1.0, 25.0).reshape(8, 3)
    shorter = torch.tensor([[0.0, 0.0], [5.0, 6.0]])
    first, second = model.decoder.layers[0].linear_qkv, model.decoder.layers[0].linear_proj
    first.fp8_meta["scaling_fwd"] = SimpleNamespace(scale=torch.ones(3), amax_history=longer)
    second.fp8_meta["scaling_bwd"] = SimpleNamespace(scale=torch.ones(2), amax_history=shorter)
    collector = TelemetryCollector(modules, CADENCE)
    collector.seed_previous_scales()  # what the trainer does after loading a checkpoint
    view = modules[QKV0].fp8_meta
    assert torch.equal(view.direction(True).amax_history, longer[:4])
    padded = modules["decoder.layers.0.linear_proj"].fp8_meta.direction(False).amax_history
    assert torch.equal(padded, torch.tensor([[0.0, 0.0], [5.0, 6.0], [0.0, 0.0], [0.0, 0.0]]))
    assert torch.equal(longer, torch.arange(1.0, 25.0).reshape(8, 3))  # TE's own left alone


def test_a_module_of_two_gemms_is_refused_naming_it():
    model = nn.Module()
    model.decoder = nn.Module()
    model.decoder.mlp = TeLikeLinear(8, gemms=2)
    modules = te_telemetry_modules(model, RECIPE)
    TeLikeLinear.autocast = True
    try:
        model.decoder.mlp(torch.randn(2, 8))
    finally:
        TeLikeLinear.autocast = False
    with pytest.raises(ValueError, match=r"decoder\.mlp: TE's fp8_meta\['scaling_fwd'\].* 6 slots"):
        TelemetryCollector(modules, CADENCE)


def test_removing_the_hook_leaves_the_module_unobserved():
    module = TeLikeLinear(8)
    view = TeTelemetryModule(module, RECIPE, "m")
    view.probe = SimpleNamespace(fallback_call=lambda *a: pytest.fail("observed"))
    view.remove()
    module(torch.randn(2, 8))
