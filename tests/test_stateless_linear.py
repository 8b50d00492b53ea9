"""The FP8 linear under the stateless recipes (current, block, MXFP8): which cast of which
tensor each of the three GEMMs multiplies, the statistics, weight reuse across micro-batches,
refusals, and the mapping to Transformer Engine's recipe objects."""

from __future__ import annotations

import math

import pytest
import torch

from fp8ops.precision import E4M3, Fp8Format, Fp8Linear, Fp8Scope
from fp8ops.precision.blocks import quantize_mxfp8, quantize_scaled
from fp8ops.precision.quantize import quantize_current
from fp8ops.precision.stateless import StatelessRecipe
from fp8ops.precision.te_recipe import load_te_recipe_module, to_te_recipe

RECIPES = {
    "current": StatelessRecipe.current(),
    "current-pow2-e4m3": StatelessRecipe.current(Fp8Format.E4M3, power_2_scale=True),
    "block": StatelessRecipe.block(),
    "block-hybrid-1d-weights": StatelessRecipe.block(Fp8Format.HYBRID, w_block_scaling_dim=1),
    "mxfp8": StatelessRecipe.mxfp8(),
    "mxfp8-hybrid": StatelessRecipe.mxfp8(Fp8Format.HYBRID),
}


def cast(recipe: StatelessRecipe, x: torch.Tensor, role: str, columnwise: bool = False):
    """The reference cast of the module docstring's table, from the block functions directly."""
    fp8 = recipe.fp8(role)
    if recipe.kind == "current":
        return quantize_current(
            x, fp8, power_2_scale=recipe.power_2_scale, epsilon=recipe.amax_epsilon
        )
    if recipe.kind == "mxfp8":
        return quantize_mxfp8(x, fp8, columnwise=columnwise)
    block = (128, 128) if recipe.block_dim(role) == 2 else (1, 128)
    return quantize_scaled(x, block[::-1] if columnwise else block, fp8, power_2_scale=True)


def deq(q) -> torch.Tensor:
    return q.dequantize() if hasattr(q, "block") else q.data.float() * q.scale_inv


def run(recipe, x, w, grad, gemm=None):
    layer = Fp8Linear(w.shape[1], w.shape[0], recipe, bias=False, gemm=gemm)
    with torch.no_grad():
        layer.weight.copy_(w)
    x = x.clone().requires_grad_(True)
    with Fp8Scope(recipe)():
        out = layer(x)
    out.backward(grad)
    return out, x.grad, layer.weight.grad


@pytest.mark.parametrize("name", RECIPES)
def test_each_gemm_multiplies_the_casts_te_gives_it(name):
    recipe = RECIPES[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 160, generator=g) * torch.logspace(-2, 2, 96).unsqueeze(1)
    w = torch.randn(64, 160, generator=g) * 0.05
    grad = torch.randn(96, 64, generator=g) * 1e-3
    out, dx, dw = run(recipe, x, w, grad)

    def close(got, expected):  # the same casts; the GEMM's float32 order may differ
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * expected.abs().max())

    close(out, deq(cast(recipe, x, "input")) @ deq(cast(recipe, w, "weight")).t())
    w_columnwise = cast(recipe, w, "weight", columnwise=True)
    close(dx, deq(cast(recipe, grad, "grad_output")) @ deq(w_columnwise))
    g_col, x_col = cast(recipe, grad, "grad_output", True), cast(recipe, x, "input", True)
    close(dw, deq(g_col).t() @ deq(x_col))
    # and near the float32 linear: FP8's few bits, not a wrong layout
    assert (out - x @ w.t()).norm() / (x @ w.t()).norm() < 0.08
    assert (dw - grad.t() @ x).norm() / (grad.t() @ x).norm() < 0.08


@pytest.mark.parametrize("name", ["block", "mxfp8"])
def test_wgrad_takes_copies_cast_from_high_precision(name):
    """The negative control: the row-wise casts, transposed, give another weight gradient."""
    recipe = RECIPES[name]
    g = torch.Generator().manual_seed(1)
    # Every other column 1e-5 of the rest: within a row's block those underflow, within a
    # column's block they are cast at full precision.
    x = torch.randn(128, 128, generator=g) * torch.tensor([1.0, 1e-5]).repeat(64)
    grad = torch.randn(128, 64, generator=g) * torch.tensor([1.0, 1e-5]).repeat(64).unsqueeze(1)
    _, _, dw = run(recipe, x, torch.randn(64, 128, generator=g), grad)
    rowwise = deq(cast(recipe, grad, "grad_output")).t() @ deq(cast(recipe, x, "input"))
    assert not torch.allclose(dw, rowwise, rtol=1e-3)


def test_gradients_are_cast_to_e5m2_under_hybrid():
    recipe = RECIPES["mxfp8-hybrid"]
    x, w = torch.randn(32, 64), torch.randn(32, 64)
    layer = Fp8Linear(64, 32, recipe, bias=False)
    layer.track_stats = True
    with torch.no_grad():
        layer.weight.copy_(w)
    with Fp8Scope(recipe)():
        out = layer(x.requires_grad_(True))
    out.backward(torch.full_like(out, 1e5))  # beyond E4M3's range, within E5M2's
    stats = layer.last_cast_stats
    assert set(stats) == {"input", "weight", "grad_output"}
    assert stats["grad_output"].as_dict()["saturated"] == 0
    assert recipe.fp8("grad_output").name == "e5m2" and recipe.fp8("input").name == "e4m3"


def test_statistics_count_what_each_cast_did():
    recipe = RECIPES["block"]
    x = torch.randn(4, 256)
    x[0, 0], x[1, 1], x[2, 2] = math.inf, math.nan, 1e-30  # 1e-30 beside 1.0 underflows
    layer = Fp8Linear(256, 16, recipe, bias=False)
    layer.track_stats = True
    with Fp8Scope(recipe)(), torch.no_grad():
        layer(x)
    counts = layer.last_cast_stats["input"].as_dict()
    assert counts["inf"] == 1 and counts["nan"] == 1 and counts["saturated"] == 1
    assert counts["underflow"] >= 1 and counts["amax"] == math.inf
    assert counts["numel"] == x.numel()


def test_the_weight_is_cast_once_per_step_across_micro_batches():
    recipe = RECIPES["block"]
    layer = Fp8Linear(128, 32, recipe, bias=False)
    x = torch.randn(8, 128)
    with Fp8Scope(recipe)():
        first = layer(x, is_first_microbatch=True)
        cached = layer._weight_fp8
        with torch.no_grad():
            layer.weight.mul_(2.0)  # an optimizer step would; a reused cast does not see it
        second = layer(x, is_first_microbatch=False)
    assert layer._weight_fp8 is cached
    torch.testing.assert_close(first, second)


def test_refusals_name_the_rule():
    with pytest.raises(ValueError, match="divisible by 32"), Fp8Scope(RECIPES["mxfp8"])():
        Fp8Linear(48, 32, RECIPES["mxfp8"])(torch.randn(32, 48))
    with pytest.raises(ValueError, match="2-D-blocked operand only by a 1-D one"):
        StatelessRecipe.block(x_block_scaling_dim=2)
    with pytest.raises(ValueError, match="pure E5M2"):
        StatelessRecipe.current(Fp8Format.E5M2)
    with pytest.raises(ValueError, match="powers of two by construction"):
        StatelessRecipe(kind="mxfp8", fp8_format=Fp8Format.E4M3, power_2_scale=True)
    with pytest.raises(ValueError, match="built for"), Fp8Scope(RECIPES["block"])():
        Fp8Linear(128, 32, RECIPES["current"])(torch.randn(4, 128))


te_recipe = load_te_recipe_module()


@pytest.mark.skipif(te_recipe is None, reason="Transformer Engine's recipe module not installed")
def test_maps_to_te_recipe_objects():
    current = to_te_recipe(RECIPES["current-pow2-e4m3"])
    assert type(current).__name__ == "Float8CurrentScaling"
    assert current.fp8_format == te_recipe.Format.E4M3
    assert current.fp8_quant_fwd_inp.power_2_scale and current.fp8_quant_bwd_grad.power_2_scale
    block = to_te_recipe(RECIPES["block-hybrid-1d-weights"])
    assert type(block).__name__ == "Float8BlockScaling"
    assert (block.x_block_scaling_dim, block.w_block_scaling_dim) == (1, 1)
    assert block.fp8_format == te_recipe.Format.HYBRID
    mx = to_te_recipe(RECIPES["mxfp8"])
    assert type(mx).__name__ == "MXFP8BlockScaling" and mx.fp8_format == te_recipe.Format.E4M3


@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_runs_on_scaled_mm_as_on_the_emulation(name):
    """torch._scaled_mm (oneDNN on a CPU) multiplies every recipe's casts: per tensor in one
    GEMM, block-scaled in one row-wise GEMM per K block. The same casts, so the outputs and
    both gradients are equal up to accumulation order. 320 features, 288 outputs and 72 tokens
    leave partial 128-blocks on the K of every GEMM and on the weight's rows (MXFP8 pads the
    tokens to 96); rows and K blocks of every tensor have their own magnitudes, so a scale
    applied to the wrong block shows."""
    from fp8ops.precision import ScaledMmGemm, block_scaled_mm_unsupported

    recipe = RECIPES[name]
    reason = block_scaled_mm_unsupported("cpu")
    if reason is not None:
        pytest.skip(f"no FP8 torch._scaled_mm GEMMs for {recipe.kind} here: {reason}")
    g = torch.Generator().manual_seed(4)

    def level(n, sign=1):  # each 128 block of a dimension its own power of 2
        return 2.0 ** (sign * (torch.arange(n) // 128 % 4))

    x = torch.randn(72, 320, generator=g) * level(320) * torch.logspace(-1, 1, 72)[:, None]
    w = torch.randn(288, 320, generator=g) * level(320, -1) * level(288)[:, None] * 0.1
    grad = torch.randn(72, 288, generator=g) * level(288, -1) * torch.logspace(-1, 1, 72)[:, None]
    native_and_emulated = (run(recipe, x, w, grad, ScaledMmGemm()), run(recipe, x, w, grad))
    for native, emulated in zip(*native_and_emulated, strict=True):
        difference = (native.double() - emulated.double()).norm() / emulated.double().norm()
        assert difference < 2.0**-20, difference.item()  # float32 GEMMs: measured <= 2.3e-7


def test_mxfp8_pads_the_tokens_to_32_as_megatron_does():
    """40 tokens: padded with zero rows to 64 for the casts (zeros change no block's amax), the
    padding cut from the output and the input's gradient."""
    recipe = RECIPES["mxfp8"]
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(40, 64, generator=g), torch.randn(32, 64, generator=g)
    grad = torch.randn(40, 32, generator=g)
    out, dx, dw = run(recipe, x, w, grad)
    assert out.shape == (40, 32) and dx.shape == (40, 64)
    layer = Fp8Linear(64, 32, recipe, bias=False)
    layer.track_stats = True
    with Fp8Scope(recipe)(), torch.no_grad():
        layer(x)
    assert layer.last_cast_stats["input"].numel == 40 * 64  # the padding is not counted
    padded_x = torch.nn.functional.pad(x, (0, 0, 0, 24))
    padded_grad = torch.nn.functional.pad(grad, (0, 0, 0, 24))
    expected, _, expected_dw = run(recipe, padded_x, w, padded_grad)
    torch.testing.assert_close(out, expected[:40])
    torch.testing.assert_close(dw, expected_dw)


def _block_record(q):
    from fp8ops.precision.stateless import CastRecord

    record = CastRecord()
    record.note("input", q.amax, None, q)
    return dict(zip(CastRecord.ROWS, record.table[:, 0].tolist(), strict=True))


def test_the_cast_record_reports_block_exponents_over_live_blocks_and_the_floor():
    # Four 1x32 MXFP8 blocks: ordinary, all zero (left out), one so small its E8M0 exponent
    # sits at the floor, and one large.
    x = torch.zeros(32, 128)  # MXFP8 takes multiples of 32: the other rows' blocks are zero
    x[0, :32] = torch.linspace(-3.0, 3.0, 32)
    x[0, 64:96] = 1e-41  # amax / 448 below 2**-127
    x[0, 96:] = 1000.0
    q = quantize_mxfp8(x, E4M3)
    got = _block_record(q)
    live = [0, 2, 3]
    exponents = (q.exponent.view(-1).to(torch.int32) - 127)[live].tolist()  # scale_inv 2**(e-127)
    assert exponents[1] == -127
    assert (got["exp_min"], got["exp_max"]) == (min(exponents), max(exponents))
    assert got["exp_median"] == sorted(exponents)[1]
    assert (got["at_floor"], got["blocks"]) == (1.0, 3.0)
    # Block scaling (1x128, float32 scales): fp8_max / 1e-41 overflows, the substitute is taken.
    y = torch.cat([torch.full((1, 128), 2.0), torch.full((1, 128), 1e-41)])
    q = quantize_scaled(y, (1, 128), E4M3, power_2_scale=True)
    got = _block_record(q)
    assert (got["at_floor"], got["blocks"]) == (1.0, 2.0)
    expected = torch.frexp(q.scale_inv.view(-1)).exponent - 1
    assert (got["exp_min"], got["exp_max"]) == (expected.min().item(), expected.max().item())
    # A per-tensor scale notes no block metrics.
    from fp8ops.precision.stateless import CastRecord

    record = CastRecord()
    record.note("input", torch.tensor(2.0), torch.tensor(224.0))
    assert all(math.isnan(v) for v in record.table[2:, 0].tolist())


def test_the_cast_record_keeps_the_scale_of_the_cast_whose_amax_it_reports():
    """Current scaling casts input and grad_output once per micro-batch: the record's amax is
    the step's largest and its scale that cast's, not the last cast's; a NaN cast (TE skips
    its scale) changes neither once a finite one is noted."""
    from fp8ops.precision.stateless import CastRecord

    recipe = RECIPES["current"]
    record = CastRecord()
    for peak in (2.0, 8.0, 3.0, math.nan):
        x = torch.linspace(-1.0, 1.0, 64).reshape(4, 16) * peak
        recipe.quantize(x, "input", record=record)
    amax, scale = record.table[0, 0].item(), record.table[1, 0].item()
    assert amax == 8.0
    assert scale == 448.0 / 8.0  # 56 exactly (the last cast's would be 448 / 3)
