"""The stateless recipes' arithmetic, bit for bit against an independent oracle written from
Transformer Engine's kernels (``support/te_recipe_oracle.py``): the scales of current and block
scaling (epsilon; zero, NaN and inf amax; the inf-scale substitute of each; power-of-2 by
truncation), MXFP8's E8M0 exponent rounded toward +inf, the NaN-skipping amax, partial blocks,
column-wise copies quantized from high precision; at least 100,000 random cases per recipe in
the full suite (a tenth in the fast tier), special values included."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch
from support import te_recipe_oracle as oracle
from support.test_tier import FAST

from fp8ops.precision import E4M3, E5M2
from fp8ops.precision.blocks import (
    BlockQuantized,
    block_amax,
    quantize_mxfp8,
    quantize_scaled,
)
from fp8ops.precision.quantize import quantize_current
from fp8ops.precision.scales import (
    FLT_MAX,
    e8m0_from_amax,
    e8m0_multiplier,
    e8m0_scale_inv,
    scale_from_amax,
    tensor_amax,
)

CASES = 10_000 if FAST else 100_000  # per recipe
BF16_MAX = 3.3895313892515355e38


def cases(full: int = CASES) -> int:
    return full


def seeded(*key) -> np.random.Generator:
    """A generator seeded by the test's parameters, the same in every process (Python's
    ``hash`` of a string is not), so a failure can be replayed."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


# -- random inputs with special values -----------------------------------------------------------


def random_blocks(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """``n`` blocks of ``size`` float32 elements, each block around its own magnitude (2**-140 to
    2**130, so denormal and overflowing amaxes occur), with special blocks and elements mixed in:
    all-zero, all-NaN, NaN and inf elements, signed zeros, denormals, amax exactly 448 * 2**k."""
    centre = rng.uniform(-140, 130, size=(n, 1))
    spread = rng.choice([0.5, 3.0, 12.0], size=(n, 1))
    x = np.exp2(centre + spread * rng.standard_normal((n, size)))
    with np.errstate(over="ignore"):  # magnitudes past float32's range become inf: kept
        x = (x * rng.choice([-1.0, 1.0], size=(n, size))).astype(np.float32)
    kind = rng.random(n)
    x[kind < 0.02] = 0.0
    x[(kind >= 0.02) & (kind < 0.03)] = np.nan
    some = (kind >= 0.03) & (kind < 0.06)
    x[some, rng.integers(0, size, some.sum())] = np.inf * rng.choice([-1, 1], some.sum())
    some = (kind >= 0.06) & (kind < 0.12)
    x[some, rng.integers(0, size, some.sum())] = np.nan
    some = (kind >= 0.12) & (kind < 0.16)  # the amax a power of two times 448
    x[some] = np.clip(x[some], -100, 100)
    x[some, 0] = 448.0 * np.exp2(rng.integers(-20, 20, some.sum()))
    some = (kind >= 0.16) & (kind < 0.2)  # denormal elements
    x[some] = rng.choice([1e-40, -3e-39, 1.4e-45, 0.0, -0.0], size=(some.sum(), size))
    sprinkle = rng.random((n, size)) < 0.01
    x[sprinkle] = rng.choice([0.0, -0.0], size=sprinkle.sum())
    return x


def as_input(x: np.ndarray, dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray]:
    """The tensor in ``dtype`` and its float32 values (exact) for the oracle."""
    t = torch.from_numpy(x).to(dtype)
    return t, t.float().numpy()


def bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy()


def assert_same_bytes(ours: torch.Tensor, expected: np.ndarray, fp8: str) -> None:
    """Equal bytes, NaN codes compared as NaN-ness (TE and torch agree on which is NaN)."""
    got = bytes_of(ours).reshape(expected.shape)
    nan_got = np.isnan(oracle.decode(got, fp8))
    nan_expected = np.isnan(oracle.decode(expected, fp8))
    np.testing.assert_array_equal(nan_got, nan_expected)
    mismatched = (got != expected) & ~nan_expected
    assert not mismatched.any(), (
        f"{mismatched.sum()} bytes differ; first at {np.argwhere(mismatched)[0]}: "
        f"{got[mismatched][:4]} vs {expected[mismatched][:4]}"
    )


def assert_same_f32(ours: torch.Tensor, expected: np.ndarray) -> None:
    got = ours.numpy().astype(np.float32)
    expected = np.asarray(expected, np.float32)
    same = (got.view(np.uint32) == expected.view(np.uint32)) | (np.isnan(got) & np.isnan(expected))
    assert same.all(), f"{(~same).sum()} differ; first: {got[~same][:4]} vs {expected[~same][:4]}"


# -- the scale rule: TE's table -------------------------------------------------------------------

TINY, DENORMAL, JUST_ABOVE = 1.4e-36, 1e-40, float(np.nextafter(np.float32(1.75), np.float32(2)))


@pytest.mark.parametrize(
    ("amax", "current", "current_pow2", "block_bf16", "current_e5m2"),
    [
        (0.0, 1, 1, 1, 1),
        (math.inf, 1, 1, 1, 1),
        (math.nan, 1, 1, 1, 1),
        (448.0, 1, 1, 1, 128),
        (1.0, 448, 256, 448, 57344),
        (3.0, 149.33333, 128, 149.33333, 19114.666),
        (TINY, 448 / TINY, 2.0**127, 448 / TINY, FLT_MAX),
        (2.0**-126, FLT_MAX, 2.0**127, BF16_MAX, FLT_MAX),
        (DENORMAL, FLT_MAX, 2.0**127, BF16_MAX, FLT_MAX),
        (JUST_ABOVE, 255.99998, 128, 255.99998, 32767.998),
    ],
)
def test_scale_rule_table(amax, current, current_pow2, block_bf16, current_e5m2):
    """The reference table of TE's compute_scale_from_amax (pow2 truncates: 1.75 + 1 ulp gives
    128 where torchao's log2 rule gives 256)."""
    a = torch.tensor([amax], dtype=torch.float32)

    def s(fp8_max, pow2, value_for_inf=FLT_MAX):
        got = scale_from_amax(a, fp8_max, power_2_scale=pow2, value_for_inf=value_for_inf)
        return got.item()

    assert s(448.0, False) == pytest.approx(current, rel=1e-7)
    assert s(448.0, True) == current_pow2
    assert s(448.0, False, BF16_MAX) == pytest.approx(block_bf16, rel=1e-7)
    assert s(448.0, True, BF16_MAX) == current_pow2
    assert s(57344.0, False) == pytest.approx(current_e5m2, rel=1e-7)


def test_epsilon_clamps_amax_but_not_nan():
    a = torch.tensor([0.0, 1e-20, math.nan, 2.0])
    got = scale_from_amax(a, 448.0, power_2_scale=False, epsilon=1e-12)
    assert got[0].item() == pytest.approx(448 / 1e-12, rel=1e-6)  # zero is clamped to eps first
    assert got[1].item() == got[0].item()
    assert got[2].item() == 1.0  # NaN fails amax < eps, then is special
    assert got[3].item() == 224.0


def test_scale_inv_of_the_extremes_is_the_correctly_rounded_denormal():
    """No flush-to-zero: 1/FLT_MAX is the denormal 2.938736e-39, 1/2**127 is 2**-127."""
    q = quantize_current(torch.tensor([DENORMAL, 0.0]), E4M3)
    assert q.scale_inv.item() == np.float32(1.0) / np.float32(FLT_MAX) != 0
    q = quantize_current(torch.tensor([DENORMAL, 0.0]), E4M3, power_2_scale=True)
    assert q.scale_inv.item() == 2.0**-127


# -- current scaling --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("fp8", "pow2", "eps"), [(E4M3, False, 0.0), (E5M2, True, 0.0), (E4M3, False, 1e-6)]
)
def test_current_scaling_matches_oracle(dtype, fp8, pow2, eps):
    """``CASES`` tensors of 16 elements, each its own current-scaling tensor: the rule is the
    block rule with one block per tensor and FLT_MAX for an infinite quotient, so a 1x16 blocking
    runs them all at once; a sample also goes through ``quantize_current`` whole."""
    rng = seeded(str(dtype), fp8.name, pow2, eps)
    x, values = as_input(random_blocks(rng, CASES, 16), dtype)
    ours = quantize_scaled(x, (1, 16), fp8, power_2_scale=pow2, epsilon=eps, value_for_inf=FLT_MAX)
    expected, scale_inv, _ = oracle.quantize_blocks(
        values, (1, 16), fp8.name, pow2=pow2, eps=eps, value_for_inf=float(FLT_MAX)
    )
    assert_same_bytes(ours.data, expected, fp8.name)
    assert_same_f32(ours.scale_inv, scale_inv)
    for i in range(0, CASES, CASES // 500):  # the whole-tensor path on 500 of them
        whole = quantize_current(x[i], fp8, power_2_scale=pow2, epsilon=eps)
        assert_same_bytes(whole.data, expected[i], fp8.name)
        assert_same_f32(whole.scale_inv.reshape(1), scale_inv[i])


def test_current_scaling_special_tensors():
    """Empty and all-NaN tensors: amax 0, scale 1; one inf element: scale 1, the inf saturates
    and the rest are cast unscaled; -0 gives byte 0x80."""
    assert tensor_amax(torch.empty(0)).item() == 0.0
    q = quantize_current(torch.tensor([math.nan, math.nan]), E4M3)
    assert q.scale_inv.item() == 1.0
    q = quantize_current(torch.tensor([math.inf, 3.0, -0.0, 1000.0]), E4M3)
    assert q.scale_inv.item() == 1.0
    assert q.data.float().tolist() == [448.0, 3.0, 0.0, 448.0]
    assert bytes_of(q.data)[2] == 0x80
    q = quantize_current(torch.tensor([math.nan, 2.0]), E4M3)  # NaN skipped by the amax
    assert q.scale_inv.item() == np.float32(1) / np.float32(224.0)
    assert math.isnan(q.data.float()[0].item())


def test_casts_round_twice_first_to_float32():
    """Products near an FP8 midpoint: x * scale is rounded to float32 before FP8, as TE does.
    A cast from the exact product would differ on some of these."""
    rng = np.random.default_rng(7)
    values, _ = oracle.fp8_values("e4m3")
    mids = (values[1:-1] + values[2:]) / 2
    amax = np.float32(3.0)
    s = oracle.scale_from_amax(amax, 448.0, False, 0.0, float(FLT_MAX))
    x = np.float32(mids[rng.integers(0, len(mids), 20_000)] / np.float64(s))
    toward = x * rng.choice([0.0, 1.0, 2.0], len(x)).astype(np.float32)
    x = np.nextafter(x, toward)  # -1 ulp, unmoved, +1 ulp
    x = np.concatenate([[amax], x[np.abs(x) < amax]]).astype(np.float32)
    ours = quantize_current(torch.from_numpy(x), E4M3)
    expected, _, _ = oracle.quantize_blocks(
        x[None], (1, len(x)), "e4m3", pow2=False, value_for_inf=float(FLT_MAX)
    )
    assert_same_bytes(ours.data, expected[0], "e4m3")
    once = oracle.encode(x.astype(np.float64) * np.float64(s), "e4m3")  # what one rounding gives
    assert (once != expected[0]).any(), "no case here separates one rounding from two"


# -- block scaling ----------------------------------------------------------------------------


def block_tensor(rng, blocks: int, block: tuple[int, int]) -> np.ndarray:
    """A tensor of about ``blocks`` blocks of ``block``, sides not multiples of the block (the
    edges are partial blocks), each block around its own magnitude."""
    rows, cols = block
    gk = 13 if cols > 1 else 1
    gm = -(-blocks // gk)
    m, k = gm * rows - (5 if rows > 1 else 0), gk * cols - (44 if cols > 1 else 0)
    m, k = max(m, 1), max(k, 1)
    if rows == 1:
        raw = random_blocks(rng, m * gk, cols).reshape(m, gk * cols)
    else:
        raw = random_blocks(rng, gm * k, rows).reshape(gm, k, rows).transpose(0, 2, 1)
        raw = raw.reshape(gm * rows, k)
    return np.ascontiguousarray(raw[:m, :k])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize(("block", "fp8"), [((1, 128), E4M3), ((128, 1), E5M2)])
def test_block_scaling_1d_matches_oracle(dtype, pow2, block, fp8):
    """``CASES`` 1-D blocks (row-wise 1x128, and the column-wise 128x1 copy a wgrad takes),
    partial blocks at the edges; an infinite quotient becomes the *input* dtype's max."""
    rng = seeded(str(dtype), pow2, block)
    x, values = as_input(block_tensor(rng, CASES, block), dtype)
    ours = quantize_scaled(x, block, fp8, power_2_scale=pow2)
    expected, scale_inv, _ = oracle.quantize_blocks(
        values, block, fp8.name, pow2=pow2, value_for_inf=float(torch.finfo(dtype).max)
    )
    assert ours.scale_inv.numel() >= CASES
    assert_same_bytes(ours.data, expected, fp8.name)
    assert_same_f32(ours.scale_inv, scale_inv)


@pytest.mark.parametrize("shape", [(303, 300), (256, 384), (1, 129)])
@pytest.mark.parametrize("pow2", [True, False])
def test_block_scaling_2d_matches_oracle_and_transposes_exactly(shape, pow2):
    """128x128 weight tiles (TE's own 303x300 case among them); the column-wise copy dgrad
    takes is the exact transpose of data and scales."""
    rng = np.random.default_rng(shape[0] * shape[1] + pow2)
    raw = random_blocks(rng, shape[0], shape[1])  # each row its own magnitude
    x, values = as_input(raw, torch.bfloat16)
    ours = quantize_scaled(x, (128, 128), E4M3, power_2_scale=pow2)
    expected, scale_inv, _ = oracle.quantize_blocks(
        values, (128, 128), "e4m3", pow2=pow2, value_for_inf=BF16_MAX
    )
    assert_same_bytes(ours.data, expected, "e4m3")
    assert_same_f32(ours.scale_inv, scale_inv)
    t = ours.transposed()
    assert torch.equal(bytes_of_t(t.data), bytes_of_t(ours.data).t())
    assert torch.equal(t.scale_inv, ours.scale_inv.t())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pow2", [True, False])
def test_block_scaling_2d_random_tiles_match_oracle(dtype, pow2):
    """Many 128x128 tiles, each around its own magnitude or a special one (all zero, all NaN,
    an inf or NaN element, a denormal or overflowing amax, an amax of 448 * 2**k), partial
    tiles on both edges: 400 tiles in the full suite, 42 in the fast tier."""
    rng = seeded(str(dtype), pow2, "2d")
    gm, gk = (7, 6) if FAST else (20, 20)
    tiles = random_blocks(rng, gm * gk, 128 * 128).reshape(gm, gk, 128, 128)
    raw = tiles.transpose(0, 2, 1, 3).reshape(gm * 128, gk * 128)[:-5, :-44]
    x, values = as_input(np.ascontiguousarray(raw), dtype)
    ours = quantize_scaled(x, (128, 128), E4M3, power_2_scale=pow2)
    expected, scale_inv, _ = oracle.quantize_blocks(
        values, (128, 128), "e4m3", pow2=pow2, value_for_inf=float(torch.finfo(dtype).max)
    )
    assert ours.scale_inv.shape == (gm, gk)
    assert_same_bytes(ours.data, expected, "e4m3")
    assert_same_f32(ours.scale_inv, scale_inv)


def bytes_of_t(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_block_special_blocks():
    """All-zero block: scale 1, scale_inv 1. A denormal block amax: bf16 input gives the bf16
    max, float32 input FLT_MAX, pow2 2**127. An inf element: block scale 1."""
    x = torch.zeros(2, 256)
    x[1, :128] = 1e-40
    x[1, 128] = math.inf
    x[1, 129] = 3.0
    q32 = quantize_scaled(x, (1, 128), E4M3, power_2_scale=False)
    assert q32.scale_inv.tolist()[0] == [1.0, 1.0]
    assert q32.scale_inv[1, 0].item() == np.float32(1) / np.float32(FLT_MAX)
    assert q32.scale_inv[1, 1].item() == 1.0
    assert q32.data[1, 128:130].float().tolist() == [448.0, 3.0]
    q16 = quantize_scaled(x.bfloat16(), (1, 128), E4M3, power_2_scale=False)
    assert q16.scale_inv[1, 0].item() == np.float32(1) / np.float32(BF16_MAX)
    q2 = quantize_scaled(x.bfloat16(), (1, 128), E4M3, power_2_scale=True)
    assert q2.scale_inv[1, 0].item() == 2.0**-127


def test_columnwise_copy_is_not_the_rowwise_bytes_transposed():
    """The negative control: transposing the row-wise FP8 is not what TE's column-wise copy is."""
    rng = np.random.default_rng(3)
    x = torch.from_numpy(
        rng.standard_normal((256, 256)).astype(np.float32)
        * np.exp2(rng.integers(-8, 8, (256, 1))).astype(np.float32)
    )
    row = quantize_scaled(x, (1, 128), E4M3, power_2_scale=True)
    col = quantize_scaled(x.t().contiguous(), (1, 128), E4M3, power_2_scale=True)
    assert not torch.equal(row.data.view(torch.uint8).t(), col.data.view(torch.uint8))
    again = quantize_scaled(x, (128, 1), E4M3, power_2_scale=True)  # the 128x1 copy, untransposed
    assert torch.equal(again.data.view(torch.uint8), col.data.view(torch.uint8).t())
    flipped = row.transposed()  # the same values, blocks transposed with them: 128x1 on x.T
    assert flipped.block == (128, 1) and torch.equal(flipped.dequantize(), row.dequantize().t())
    assert not torch.equal(flipped.data.view(torch.uint8), col.data.view(torch.uint8))


def test_partial_blocks_equal_zero_padding():
    rng = np.random.default_rng(5)
    x = torch.from_numpy(rng.standard_normal((130, 200)).astype(np.float32))
    padded = torch.nn.functional.pad(x, (0, 56, 0, 126))
    a = quantize_scaled(x, (128, 128), E4M3, power_2_scale=True)
    b = quantize_scaled(padded, (128, 128), E4M3, power_2_scale=True)
    assert torch.equal(a.scale_inv, b.scale_inv)
    assert torch.equal(a.data.view(torch.uint8), b.data[:130, :200].view(torch.uint8))
    assert torch.equal(block_amax(x, (128, 128)), block_amax(padded, (128, 128)))


# -- MXFP8 --------------------------------------------------------------------------------------


def all_positive_finite_bf16() -> torch.Tensor:
    bits = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16)  # 0x0001 .. 0x7F7F
    return bits.view(torch.bfloat16)


def test_e8m0_exhaustive_over_bf16():
    """Every positive finite bf16 value as a block amax: TE's exponent equals the exact
    ``clamp(127 + ceil(log2(amax / 448)), 0, 254)`` and the oracle's, and no element of the block
    overflows 448 after scaling."""
    amax = all_positive_finite_bf16().float()
    assert amax.numel() == 32_639
    e = e8m0_from_amax(amax, 448.0)
    exact = []
    for a in amax.tolist():
        m, x = math.frexp(a / 448)  # a / 448 = m * 2**x, m in [0.5, 1): exact in float64
        ceil_log2 = x - 1 if m == 0.5 else x
        exact.append(min(max(127 + ceil_log2, 0), 254))
    assert e.tolist() == exact
    assert e.tolist() == [oracle.e8m0(a, 448.0) for a in amax.tolist()]
    scaled = amax * e8m0_multiplier(e)
    assert (scaled <= 448).all()


def test_e8m0_special_values():
    a = torch.tensor([0.0, math.inf, 448.0 * 2**-3, 448.0, 448.0 * 2**5, 448 * 2.0**-127, 1e-45])
    assert e8m0_from_amax(a, 448.0).tolist() == [0, 254, 124, 127, 132, 0, 0]
    assert e8m0_from_amax(torch.tensor([math.nan]), 448.0).tolist() == [255]
    assert e8m0_scale_inv(torch.tensor([0, 127, 254])).tolist() == [2.0**-127, 1.0, 2.0**127]
    assert e8m0_multiplier(torch.tensor([0, 127, 254])).tolist() == [2.0**127, 1.0, 2.0**-127]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("columnwise", "fp8"), [(False, E4M3), (True, E5M2)])
def test_mxfp8_matches_oracle(dtype, columnwise, fp8):
    """``CASES`` 32-element blocks, row-wise (1x32) or column-wise (32x1, untransposed), E4M3
    and E5M2 (``float(1/57344)``): bytes, exponents and decode scales."""
    rng = seeded(str(dtype), columnwise)
    raw = random_blocks(rng, 1024 * -(-CASES // 1024), 32)  # each row one block
    if columnwise:
        raw = np.ascontiguousarray(raw.reshape(-1, 32, 32).transpose(0, 2, 1).reshape(-1, 32).T)
    else:
        raw = raw.reshape(-1, 32 * 32)
    x, values = as_input(raw, dtype)
    ours = quantize_mxfp8(x, fp8, columnwise=columnwise)
    block = (32, 1) if columnwise else (1, 32)
    expected, scale_inv, exponents = oracle.quantize_blocks(
        values, block, fp8.name, pow2=True, value_for_inf=0.0, mxfp8=True
    )
    assert ours.exponent.numel() >= CASES
    assert ours.exponent.to(torch.int64).numpy().tolist() == exponents.tolist()
    assert_same_bytes(ours.data, expected, fp8.name)
    assert_same_f32(ours.scale_inv, scale_inv)


def test_mxfp8_blocks_with_inf_and_nan():
    """An inf element: e = 254, the multiplier the denormal 2**-127, so ordinary elements
    underflow to 0 and the inf saturates; a NaN element stays NaN and does not set the amax;
    an all-zero block has e = 0."""
    x = torch.zeros(32, 96)
    x[0, 0], x[0, 1] = math.inf, 5.0
    x[0, 32], x[0, 33] = math.nan, 448.0
    q = quantize_mxfp8(x, E4M3)
    assert q.exponent[0].tolist() == [254, 127, 0]
    assert q.data[0, :2].float().tolist() == [448.0, 0.0]
    assert math.isnan(q.data[0, 32].float().item()) and q.data[0, 33].float().item() == 448.0


def test_mxfp8_refuses_sides_not_divisible_by_32():
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_mxfp8(torch.ones(32, 48), E4M3)


def test_dequantize_inverts_within_fp8_precision():
    rng = np.random.default_rng(11)
    x = torch.from_numpy(rng.standard_normal((64, 256)).astype(np.float32))
    for q in (
        quantize_mxfp8(x, E4M3),
        quantize_scaled(x, (1, 128), E4M3, power_2_scale=True),
        quantize_scaled(x, (128, 128), E4M3, power_2_scale=False),
    ):
        assert isinstance(q, BlockQuantized)
        err = (q.dequantize() - x).abs() / x.abs().clamp_min(1e-3)
        assert err.median() < 0.04
