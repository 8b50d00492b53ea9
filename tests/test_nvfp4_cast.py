"""NVFP4 casts (``fp8ops/precision/nvfp4.py``) bit for bit against an independent oracle written
from Transformer Engine's kernels (``support/nvfp4_oracle.py``): E2M1 bytes, E4M3 block scales
and the float32 amax behind the global scale, for 1x16 and 16x16 blocks, both copies, the random
Hadamard transform, row scaling and 4over6 (MAE, MSE; 448 and 256), with zeros, tiny and huge
amaxes, NaN and inf mixed in; 100,000 random blocks of 16 elements per configuration in the slow
tests (6,250 tiles where they are 16x16), 10,000 in the fast ones. Stochastic rounding is tested as TE tests it: each value lands on one of its
two neighbours, unbiased in expectation, two draws differ. Where TE's package is installed, the
same bytes and scales as TE's own reference quantizer. Then TE's refusals, and the recipe's
per-role quantizers against TE's own recipe class where it imports."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
import torch
from support import nvfp4_oracle as oracle
from support import te_nvfp4_reference

from fp8ops.precision import e2m1
from fp8ops.precision.nvfp4 import (
    RHT_MATRIX,
    RHT_SIGNS,
    NVFP4Config,
    NVFP4Recipe,
    global_encode_scale,
    quantize,
    random_hadamard_transform,
)
from fp8ops.precision.te_recipe import load_te_recipe_module

FLT_MAX = float(np.finfo(np.float32).max)


def seeded(*key) -> np.random.Generator:
    """A generator seeded by the test's parameters, the same in every process."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


# -- random inputs -----------------------------------------------------------------------------


def random_tensor(
    rng: np.random.Generator, rows: int, cols: int, magnitudes: tuple[float, float] = (-135, 125)
) -> np.ndarray:
    """float32 ``[rows, cols]`` around one magnitude per tensor (by default 2**-135 to 2**125:
    tiny and huge amaxes, overflowing global scales), each 16-block shifted below it by its own
    0 to 2**-30 (blocks whose scale underflows E4M3), with all-zero blocks, NaN, inf, denormal
    and signed zero elements mixed in."""
    centre = rng.uniform(*magnitudes)
    shift = rng.uniform(-30, 0, size=(rows, cols // 16, 1))
    spread = rng.choice([0.3, 2.0, 6.0], size=(rows, cols // 16, 1))
    log2 = centre + shift + spread * rng.standard_normal((rows, cols // 16, 16))
    with np.errstate(over="ignore"):
        x = (np.exp2(log2) * rng.choice([-1.0, 1.0], size=log2.shape)).astype(np.float32)
    kind = rng.random((rows, cols // 16))
    x[kind < 0.03] = 0.0
    x[(kind >= 0.03) & (kind < 0.05)] = rng.choice([1e-40, -3e-39, 1.4e-45, 0.0, -0.0], size=16)
    x = x.reshape(rows, cols)
    special = rng.random((rows, cols))
    x[special < 0.002] = np.nan
    x[(special >= 0.002) & (special < 0.004)] = -0.0
    if rng.random() < 0.1:  # an inf element: the global scale falls back to 1
        x[rng.integers(rows), rng.integers(cols)] = np.inf * rng.choice([-1, 1])
    return x


def rht_tensor(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """bf16-exact float32 values whose 16-term Hadamard sums are exact in float32: 8-bit
    mantissas within 2**8 of one magnitude (at most 8 + 8 + 4 carry bits = 20 < 24), so the
    summation order, which TE's tensor cores leave open, cannot change the result."""
    centre = int(rng.integers(-110, 110))
    mantissa = rng.integers(128, 256, size=(rows, cols)) * rng.choice([-1, 1], size=(rows, cols))
    exponent = centre + rng.integers(-8, 1, size=(rows, cols))
    x = np.ldexp(mantissa.astype(np.float64), exponent).astype(np.float32)
    x[rng.random((rows, cols)) < 0.05] = 0.0
    return x


# -- one configuration against the oracle -----------------------------------------------------

CONFIGS = {
    "1x16 float32": ({}, torch.float32),
    "1x16 bf16": ({}, torch.bfloat16),
    "1x16 fp16": ({}, torch.float16),
    "16x16": ({"with_2d_quantization": True}, torch.bfloat16),
    "rht": ({"with_rht": True}, torch.bfloat16),
    "row-scaled": ({"row_scaled_nvfp4": True}, torch.float32),
    "4over6 MAE 256": ({"nvfp4_use_4over6": True, "nvfp4_e4m3_max": 256}, torch.bfloat16),
    "4over6 MSE 448": (
        {"nvfp4_use_4over6": True, "nvfp4_4over6_err_mode": "MSE"},
        torch.float32,
    ),
    "4over6 16x16 MAE": (
        {"nvfp4_use_4over6": True, "nvfp4_e4m3_max": 256, "with_2d_quantization": True},
        torch.bfloat16,
    ),
    "4over6 16x16 MSE": (
        {"nvfp4_use_4over6": True, "nvfp4_4over6_err_mode": "MSE", "with_2d_quantization": True},
        torch.float32,
    ),
    "4over6 row-scaled": (
        {"nvfp4_use_4over6": True, "nvfp4_e4m3_max": 256, "row_scaled_nvfp4": True},
        torch.float32,
    ),
}
SHAPE = (64, 256)  # 1,024 1x16 blocks
SHAPE_2D = (256, 256)  # 256 16x16 tiles, as many blocks of 16 elements as 4 of SHAPE


def expected_copy(x: np.ndarray, config: NVFP4Config, *, columnwise: bool):
    if columnwise:
        x = x.T
        if config.with_rht:
            x = oracle.rht(x)
    four_over_six = config.nvfp4_4over6_err_mode if config.nvfp4_use_4over6 else None
    return oracle.quantize_rows(
        x,
        two_d=config.with_2d_quantization,
        row_scaled=config.row_scaled_nvfp4,
        four_over_six=four_over_six,
        e4m3_max=config.e4m3_max,
    )


def check_against_oracle(name: str, blocks: int) -> None:
    kwargs, dtype = CONFIGS[name]
    config = NVFP4Config(**kwargs)
    rng = seeded("nvfp4", name, blocks)
    shape = SHAPE_2D if config.with_2d_quantization else SHAPE
    per_tensor = shape[0] * shape[1] // 16  # blocks of 16 elements; a 16x16 tile holds 16
    for _ in range(-(-blocks // per_tensor)):
        if config.with_rht:
            x = rht_tensor(rng, *shape)
        else:  # fp16 holds 2**-24 to 65504: centred inside it, or nearly all would be 0 or inf
            x = random_tensor(rng, *shape, (-10, 14) if dtype == torch.float16 else (-135, 125))
        x = torch.from_numpy(x).to(dtype)
        values = x.float().numpy()  # the input's float32 values, exact
        q = quantize(x, config)
        for columnwise, copy in ((False, q.rowwise), (True, q.columnwise)):
            codes, scale, amax = expected_copy(values, config, columnwise=columnwise)
            where = f"{name}, {'column' if columnwise else 'row'}-wise"
            assert_same(copy.data.numpy(), oracle.pack(codes), f"{where}: data bytes")
            assert_same(copy.scale_inv.view(torch.uint8).numpy(), scale, f"{where}: scales")
            assert_same(copy.amax.numpy().view(np.uint32), amax.view(np.uint32), f"{where}: amax")
            # the same float32 operations in the same order on both sides: equal bits
            dequantized = oracle.dequantize(codes, scale, amax, config.e4m3_max)
            assert_same_f32(copy.dequantize().numpy(), dequantized, f"{where}: dequantized")


def assert_same_f32(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    same = (got.view(np.uint32) == expected.view(np.uint32)) | (np.isnan(got) & np.isnan(expected))
    assert same.all(), f"{what}: {(~same).sum()} differ: {got[~same][:4]} vs {expected[~same][:4]}"


def assert_same(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert got.shape == expected.shape, f"{what}: shape {got.shape} vs {expected.shape}"
    differ = got != expected
    assert not differ.any(), (
        f"{what}: {differ.sum()} differ; first at {np.argwhere(differ)[0]}: "
        f"{got[differ][:4]} vs {expected[differ][:4]}"
    )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cast_matches_oracle(name):
    check_against_oracle(name, 10_000)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cast_matches_oracle_100k_blocks(name):
    check_against_oracle(name, 100_000)


# TE's reference quantizer's arguments for each configuration it implements (it has no
# stochastic rounding).
REFERENCE_ARGUMENTS = {
    "1x16 float32": {},
    "16x16": {"quant_tile_shape": (16, 16)},
    "rht": {"with_rht": True},
    "row-scaled": {"row_scaled_nvfp4": True},
    "4over6 MAE 256": {"nvfp4_use_4over6": True, "nvfp4_e4m3_max": 256},
    "4over6 MSE 448": {"nvfp4_use_4over6": True, "nvfp4_4over6_err_mode": "MSE"},
    "4over6 16x16 MAE": {
        "nvfp4_use_4over6": True,
        "nvfp4_e4m3_max": 256,
        "quant_tile_shape": (16, 16),
    },
    "4over6 16x16 MSE": {
        "nvfp4_use_4over6": True,
        "nvfp4_4over6_err_mode": "MSE",
        "quant_tile_shape": (16, 16),
    },
}


@pytest.mark.parametrize("name", list(REFERENCE_ARGUMENTS))
def test_matches_tes_reference_quantizer(name):
    """The same bytes and scales as TE's own ``NVFP4QuantizerRef`` (the quantizer TE's kernels
    are tested against with atol=0), on finite tensors from 1e-30 to 1e30 in scale, both
    copies. Finite only: the reference keeps NaN where the kernels skip it."""
    reference = te_nvfp4_reference.load()
    if reference is None:
        pytest.skip("Transformer Engine's reference_nvfp4.py is not installed")
    kwargs, dtype = CONFIGS[name]
    config = NVFP4Config(**kwargs)
    quantizer = reference.NVFP4QuantizerRef(
        dtype=reference.reference_utils.Fp4Formats.E2M1, **REFERENCE_ARGUMENTS[name]
    )
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    for _ in range(4):
        scale = 10.0 ** torch.empty(1).uniform_(-30, 30, generator=g).item()
        x = torch.randn(64, 128, generator=g) * torch.logspace(-2, 2, 128) * scale
        x = x.to(dtype)
        theirs, ours = quantizer.quantize(x), quantize(x, config)
        pairs = {
            "row-wise data": (ours.rowwise.data, theirs.data),
            "row-wise scales": (ours.rowwise.scale_inv, theirs.scale),
            "column-wise data": (ours.columnwise.data, theirs.data_t),
            "column-wise scales": (ours.columnwise.scale_inv, theirs.scale_t),
        }
        for what, (a, b) in pairs.items():
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{name}: {what}"


# -- fixed numbers, worked by hand -------------------------------------------------------------


def test_a_block_worked_by_hand():
    """amax 2688 = 448 * 6 gives S_enc = 1; a block of amax 6 gets the decode scale
    e4m3(6 * f32(1/6)) = e4m3(1.0000000298) = 1 (byte 0x38) and multiplier 1, so each element is
    rounded as it stands: the midpoints 0.25, 1.25, 2.5, 5 go down and 0.75, 1.75, 3.5 up (to
    the even code), -0 keeps its sign, 5.1 > 5 goes to 6."""
    x = torch.zeros(16, 16)
    x[0] = torch.tensor(
        [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, 0.1, -0.0, 4.9, 5.1, 2.9, -6]
    )
    x[1, 0] = 2688.0
    q = quantize(x, NVFP4Config(), columnwise=False).rowwise
    codes = [7, 0, 2, 2, 4, 4, 6, 6, 8, 0xA, 0, 8, 6, 7, 5, 0xF]
    assert q.codes()[0].tolist() == codes
    assert q.data[0].tolist() == [0x07, 0x22, 0x44, 0x66, 0xA8, 0x80, 0x76, 0xF5]
    assert q.scale_inv.view(torch.uint8)[0, 0].item() == 0x38  # 1.0
    # 2688 * f32(1/6) = 448.00001 saturates to 448 (0x7E); 2688 / 448 = 6
    assert q.scale_inv.view(torch.uint8)[1, 0].item() == 0x7E
    assert q.codes()[1, 0].item() == 7
    assert q.amax.item() == 2688.0 and q.global_encode_scale().item() == 1.0
    # Dequantized: e2m1 * (1 * 2688) * f32(1 / 2688): two float32 roundings away from the grid
    # value, each within 2**-24 relatively.
    grid = e2m1.decode(torch.tensor(codes, dtype=torch.uint8))
    assert torch.allclose(q.dequantize()[0], grid, rtol=2.0**-23, atol=0)


@pytest.mark.parametrize(
    ("amax", "e4m3_max", "expected"),
    [
        (0.0, 448, 1.0),  # TE: a zero amax gives 1
        (float("inf"), 448, 1.0),  # 2688 / inf = 0, which gives 1
        (1e-40, 448, FLT_MAX),  # the quotient overflows: fminf to FLT_MAX
        (2688.0, 448, 1.0),
        (1.0, 448, 2688.0),
        (1.0, 256, 1536.0),
        (3.0, 448, 896.0),
    ],
)
def test_global_encode_scale(amax, e4m3_max, expected):
    got = global_encode_scale(torch.tensor([amax]), e4m3_max)
    assert got.item() == np.float32(expected)


def test_special_tensors():
    """All zeros: scale 1, zero scales and codes. An inf element: S_enc 1, its block's scale
    448, the element +-6. A NaN element is skipped by both amaxes and cast to +6. A tiny amax
    (S_enc = FLT_MAX) and a huge one match the oracle."""
    zeros = quantize(torch.zeros(32, 32), NVFP4Config())
    for copy in (zeros.rowwise, zeros.columnwise):
        assert copy.amax.item() == 0 and copy.global_encode_scale().item() == 1.0
        assert not copy.data.any() and not copy.scale_inv.view(torch.uint8).any()
    x = torch.full((16, 32), 0.5)
    x[3, 5], x[7, 20] = float("-inf"), float("nan")
    q = quantize(x, NVFP4Config(), columnwise=False).rowwise
    assert q.global_encode_scale().item() == 1.0
    assert q.scale_inv.view(torch.uint8)[3, 0].item() == 0x7E  # 448
    assert q.codes()[3, 5].item() == 0xF  # -6
    assert q.codes()[7, 20].item() == 0x7  # NaN -> +6
    for scale in (1e-40, 1e-30, 3e38):
        x = torch.linspace(-1, 1, 32 * 32).reshape(32, 32) * scale
        got = quantize(x, NVFP4Config()).rowwise
        codes, scales, _ = oracle.quantize_rows(x.numpy())
        assert_same(got.data.numpy(), oracle.pack(codes), f"amax {scale}: data")
        assert_same(got.scale_inv.view(torch.uint8).numpy(), scales, f"amax {scale}: scales")


def test_weights_16x16_copies_are_transposes():
    """With 16x16 tiles the column-wise copy holds the row-wise one's values transposed (TE:
    row- and column-wise copies of a weight are equal)."""
    x = torch.randn(48, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q = quantize(x, NVFP4Config(with_2d_quantization=True))
    assert torch.equal(q.columnwise.codes(), q.rowwise.codes().t())
    row_scales = q.rowwise.scale_inv.view(torch.uint8)[::16]  # one per tile, repeated on its rows
    assert torch.equal(q.columnwise.scale_inv.view(torch.uint8)[::16], row_scales.t())


def test_rht_matrix_is_orthogonal_with_tes_signs():
    """RHT_MATRIX = diag(TE's signs) H16 / 4 is orthogonal, so transforming twice by its
    transpose returns the input; its first column carries the sign vector."""
    assert torch.equal(RHT_MATRIX @ RHT_MATRIX.t(), torch.eye(16))
    assert (RHT_MATRIX[:, 0] * 4).tolist() == list(RHT_SIGNS)
    x = torch.tensor([[1.0] + [0.0] * 15], dtype=torch.bfloat16)
    assert (random_hadamard_transform(x).float() * 4).tolist() == [[1.0] * 16]


# -- stochastic rounding -----------------------------------------------------------------------

# Values of x * multiplier (the multiplier is exactly 1, as in the hand-worked block), each a
# multiple of 1/256 of its grid step, where TE's 8 random bits round up with probability equal
# to the fraction exactly, so the expectation is the value itself.
SR_VALUES = [
    0.5 + 0.5 * 77 / 256,
    -(0.5 * 156 / 256),
    1.25,
    -1.75,
    2.0 + 200 / 256,
    3.0 + 1 / 256,
    -(4.0 + 2 * 3 / 256),
    4.0 + 2 * 255 / 256,
    0.0,
    6.0,
    0.5 * 128 / 256,
    -(2.0 + 64 / 256),
    1.0 + 0.5 * 250 / 256,
    5.0,
    -0.5,
]


def sr_input(draws: int) -> torch.Tensor:
    """``draws`` rows of [6, SR_VALUES] (block amax 6 -> scale 1), then a row holding 2688 so
    S_enc = 1."""
    row = torch.tensor([6.0, *SR_VALUES])
    x = row.repeat(draws + 16, 1)
    x[draws:] = 0.0
    x[draws, 0] = 2688.0
    return x


def neighbours(v: float) -> tuple[float, float]:
    grid = sorted({s * g for g in e2m1.E2M1_GRID for s in (-1, 1)})
    return max(g for g in grid if g <= v), min(g for g in grid if g >= v)


def test_stochastic_rounding_lands_on_a_neighbour_unbiased():
    """Each value lands on one of its two grid neighbours, and the mean of 65,536 draws is
    within 5.3 standard errors of the value itself (each draw is Bernoulli with p = the
    fraction f, standard error step * sqrt(f (1 - f) / n)). Under an unbiased rounding a mean
    strays that far with probability 1.2e-7 (two-sided normal tail); over the 15 values the
    test fails falsely with probability below 2e-6 for a fresh seed (this one is fixed)."""
    draws = 65_536
    x = sr_input(draws)
    config = NVFP4Config(stochastic_rounding=True)
    q = quantize(x, config, columnwise=False, generator=torch.Generator().manual_seed(7))
    assert q.rowwise.scale_inv.view(torch.uint8)[:draws, 0].eq(0x38).all()  # scale 1
    values = e2m1.decode(q.rowwise.codes()[:draws, 1:]).double()
    for i, v in enumerate(SR_VALUES):
        lo, hi = neighbours(v)
        got = values[:, i]
        assert ((got == lo) | (got == hi)).all(), f"{v}: a draw off its neighbours {lo}, {hi}"
        if lo == hi:
            continue
        f = (v - lo) / (hi - lo)
        standard_error = (hi - lo) * (f * (1 - f) / draws) ** 0.5
        assert abs(got.mean().item() - v) <= 5.3 * standard_error, (v, got.mean().item())


def test_stochastic_rounding_replays_from_its_seed_and_draws_differ():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    config = NVFP4Config(stochastic_rounding=True)

    def draw(seed):
        q = quantize(x, config, generator=torch.Generator().manual_seed(seed))
        return q.rowwise.data, q.columnwise.data

    first, again, other = draw(3), draw(3), draw(4)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other[0]) and not torch.equal(first[1], other[1])
    # The scales do not depend on the draw: they are round-to-nearest's.
    rn = quantize(x, NVFP4Config())
    sr = quantize(x, config, generator=torch.Generator().manual_seed(3))
    for a, b in ((rn.rowwise, sr.rowwise), (rn.columnwise, sr.columnwise)):
        assert torch.equal(a.scale_inv.view(torch.uint8), b.scale_inv.view(torch.uint8))


def test_stochastic_rounding_of_nan_and_inf():
    """TE's rounding saturates: inf to +-6, NaN to +6, whatever the random bits."""
    v = torch.tensor([float("nan"), float("inf"), float("-inf"), 7.0, -100.0])
    for byte in (0, 128, 255):
        codes = e2m1.encode_sr(v, torch.full(v.shape, byte))
        assert codes.tolist() == [7, 7, 0xF, 7, 0xF]


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "dtype", "config", "words"),
    [
        ((16, 24), torch.float32, NVFP4Config(), "divisible by 16"),
        ((24, 16), torch.float32, NVFP4Config(), "divisible by 16"),
        ((16,), torch.float32, NVFP4Config(), "2-D"),
        ((2, 16, 16), torch.float32, NVFP4Config(), "2-D"),
        ((16, 16), torch.float32, NVFP4Config(with_rht=True), "bfloat16"),
        ((16, 16), torch.float32, NVFP4Config(stochastic_rounding=True), "generator"),
    ],
)
def test_bad_input_refused(shape, dtype, config, words):
    with pytest.raises(ValueError, match=words):
        quantize(torch.zeros(shape, dtype=dtype), config)


def test_integer_input_refused():
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        quantize(torch.zeros(16, 16, dtype=torch.int32), NVFP4Config())


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"nvfp4_use_4over6": True, "with_rht": True}, "4over6 .* Hadamard"),
        ({"nvfp4_use_4over6": True, "stochastic_rounding": True}, "4over6 .* stochastic"),
        ({"row_scaled_nvfp4": True, "with_rht": True}, "row-scaled .* Hadamard"),
        ({"row_scaled_nvfp4": True, "with_2d_quantization": True}, "row-scaled .* 2-D"),
        ({"row_scaled_nvfp4": True, "stochastic_rounding": True}, "row-scaled .* stochastic"),
        ({"nvfp4_use_4over6": True, "nvfp4_e4m3_max": 300}, "nvfp4_e4m3_max"),
        ({"nvfp4_e4m3_max": 256}, "only to 4over6"),
        ({"nvfp4_use_4over6": True, "nvfp4_4over6_err_mode": "L1"}, "nvfp4_4over6_err_mode"),
    ],
)
def test_config_refuses_what_te_refuses(kwargs, words):
    with pytest.raises(ValueError, match=words):
        NVFP4Config(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"nvfp4_4over6": "activations"}, "input: .*Hadamard.*disable_rht"),
        ({"nvfp4_4over6": "some"}, "nvfp4_4over6 must be one of"),
        ({"nvfp4_4over6_e4m3_use_256": "x"}, "nvfp4_4over6_e4m3_use_256 must be one of"),
        ({"nvfp4_4over6_err_mode": "mae"}, "'MAE' or 'MSE'"),
    ],
)
def test_recipe_refusals(kwargs, words):
    with pytest.raises(ValueError, match=words):
        NVFP4Recipe(**kwargs)


def test_recipe_roles():
    """TE's per-role defaults, and 4over6 by scope (never on gradients; 256 by default)."""
    recipe = NVFP4Recipe()
    assert recipe.config("input") == NVFP4Config(with_rht=True)
    assert recipe.config("weight") == NVFP4Config(with_2d_quantization=True)
    assert recipe.config("grad_output") == NVFP4Config(with_rht=True, stochastic_rounding=True)
    post = NVFP4Recipe(disable_rht=True, nvfp4_4over6="all", nvfp4_4over6_e4m3_use_256="weights")
    assert post.config("input").nvfp4_use_4over6 and post.config("input").nvfp4_e4m3_max == 448
    assert post.config("weight").nvfp4_e4m3_max == 256
    assert not post.config("grad_output").nvfp4_use_4over6
    assert (
        NVFP4Recipe(row_scaled_activation=True, disable_rht=True).config("input").row_scaled_nvfp4
    )


def test_recipe_fields_and_roles_match_tes():
    """Our fields are TE's ``NVFP4BlockScaling``'s with its defaults (its environment switches
    unset), and each role's switches are TE's QParams."""
    te = load_te_recipe_module()
    if te is None or not hasattr(te, "NVFP4BlockScaling"):
        pytest.skip("Transformer Engine's recipe module with NVFP4BlockScaling is not installed")
    if any(k.startswith("NVTE_NVFP4") for k in os.environ):
        pytest.skip("NVTE_NVFP4_* set: TE's defaults come from the environment")
    ours = NVFP4Recipe()
    theirs = te.NVFP4BlockScaling()
    for name in NVFP4Recipe.__dataclass_fields__:
        assert getattr(theirs, name) == getattr(ours, name), name
    params = {
        "input": theirs.fp4_quant_fwd_inp,
        "weight": theirs.fp4_quant_fwd_weight,
        "grad_output": theirs.fp4_quant_bwd_grad,
    }
    for role, qparams in params.items():
        config = ours.config(role)
        assert qparams.random_hadamard_transform == config.with_rht, role
        assert qparams.stochastic_rounding == config.stochastic_rounding, role
        assert qparams.fp4_2d_quantization == config.with_2d_quantization, role


def test_e2m1_packing_round_trips():
    codes = torch.arange(16, dtype=torch.uint8).repeat(2, 1)
    packed = e2m1.pack(codes)
    assert packed[0].tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    assert torch.equal(e2m1.unpack(packed), codes)
