"""Test oracle for NVFP4 casts, written from Transformer Engine's kernels
(``cast/nvfp4/core_nvfp4.cuh``, ``quantize_transpose_nvfp4.cuh``, ``quantize_4over6_nvfp4.cuh``,
``util/ptx_arch_spec.cuh``) and its reference quantizer's definitions
(``pytorch/custom_recipes/reference_nvfp4.py``), sharing no code with ``fp8ops``:

* numpy only (no torch): ``np.float32`` arithmetic, one IEEE operation at a time, in the
  kernel's order, which is the only way a float32 result can be reproduced;
* E2M1 by explicit search: each value's distance in float64 to all 15 signed grid values, the
  nearest taken, a tie to the even code, beyond +-6 to +-6, NaN to +6, the sign of zero kept;
* E4M3 by the FP8 table of ``te_recipe_oracle`` (nearest, ties to even, saturating);
* 16x16 tiles cut with explicit slicing; the 2-D error's tree spelled out lane by lane;
* the RHT as a float64 product with TE's own 16x16 table (``nvfp4_tensor.get_hadamard_matrix``)
  and sign vector, rounded to float32, then to bf16 by bit arithmetic.

Per tensor (``amax`` NaN-skipping; per row when row-scaled):

    S_enc = f32(e4m3_max * 6) / amax;  FLT_MAX if that is inf;  1 if amax == 0 or S_enc == 0
    block scale  = e4m3(min(block_amax * (S_enc * f32(1/6)), FLT_MAX))
    multiplier   = min(1 / (f32(block scale) * f32(1 / S_enc)), FLT_MAX)
    element code = e2m1(x * multiplier)
    4over6: base = block_amax / 6 * S_enc; map-to-4 = e4m3(min(1.5 base, 448)), map-to-6 =
        e4m3(min(base, 448)); each candidate's error sum_i |((q_i * sf) * amax) / (6 e4m3_max)
        - x_i| (or its square), map-to-4 kept only if strictly lower
"""

from __future__ import annotations

import numpy as np

from support.te_recipe_oracle import decode as decode_fp8
from support.te_recipe_oracle import encode as encode_fp8

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], dtype=np.float64)
# TE's get_hadamard_matrix, row by row (before its 1/sqrt(16)).
HADAMARD_ROWS = [
    "++++++++++++++++",
    "+-+-+-+-+-+-+-+-",
    "++--++--++--++--",
    "+--++--++--++--+",
    "++++----++++----",
    "+-+--+-++-+--+-+",
    "++----++++----++",
    "+--+-++-+--+-++-",
    "++++++++--------",
    "+-+-+-+--+-+-+-+",
    "++--++----++--++",
    "+--++--+-++--++-",
    "++++--------++++",
    "+-+--+-+-+-++-+-",
    "++----++--++++--",
    "+--+-++--++-+--+",
]
HADAMARD = np.array([[1.0 if c == "+" else -1.0 for c in row] for row in HADAMARD_ROWS])


def e2m1_codes(v: np.ndarray) -> np.ndarray:
    """float32 values to E2M1 codes by nearest-grid search (uint8)."""
    v = np.asarray(v, dtype=np.float64)
    a = np.abs(v)
    with np.errstate(invalid="ignore"):
        distance = np.abs(a[..., None] - GRID)  # [..., 8]
    best = np.argmin(np.nan_to_num(distance, nan=0.0), axis=-1)
    nearest = distance == distance.min(axis=-1, keepdims=True)
    # a tie is between two neighbours, best and best + 1: take the even index of the two
    tie = nearest.sum(axis=-1) == 2
    best = np.where(tie, best + (best % 2), best)
    best = np.where(a > GRID[-1], 7, best)  # saturate, inf included
    best = np.where(np.isnan(v), 7, best)
    negative = np.signbit(v) & ~np.isnan(v)
    return (best | np.where(negative, 8, 0)).astype(np.uint8)


def e2m1_values(codes: np.ndarray) -> np.ndarray:
    magnitude = GRID[codes & 7]
    return np.where(codes & 8, -magnitude, magnitude).astype(np.float32)


def nan_skipping_amax(x: np.ndarray, axis=None) -> np.ndarray:
    a = np.abs(np.asarray(x, np.float32))
    return np.where(np.isnan(a), F32(0), a).max(axis=axis, initial=F32(0))


def global_encode_scale(amax: np.ndarray, e4m3_max: float) -> np.ndarray:
    amax = np.asarray(amax, np.float32)
    with np.errstate(divide="ignore", over="ignore"):
        s = F32(e4m3_max * 6.0) / amax
    s = np.where(np.isinf(s), FLT_MAX, s).astype(np.float32)
    return np.where((amax == 0) | (s == 0), F32(1), s).astype(np.float32)


def e4m3(v: np.ndarray) -> np.ndarray:
    """E4M3 bytes of non-negative float32 values, saturating."""
    return encode_fp8(np.asarray(v, np.float32), "e4m3")


def e4m3_value(byte: np.ndarray) -> np.ndarray:
    return decode_fp8(byte, "e4m3").astype(np.float32)


def _multiplier(scale_byte: np.ndarray, s_enc: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", over="ignore"):
        s_dec = F32(1) / s_enc
        m = F32(1) / (e4m3_value(scale_byte) * s_dec)
    return np.minimum(m, FLT_MAX).astype(np.float32)


def quantize_rows(
    x: np.ndarray,
    *,
    two_d: bool = False,
    row_scaled: bool = False,
    four_over_six: str | None = None,  # None, "MAE" or "MSE"
    e4m3_max: float = 448.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 ``x`` [R, C] cast in blocks along its rows: (codes [R, C] uint8, scale bytes
    [R, C / 16] uint8, amax [1] or [R])."""
    x = np.asarray(x, np.float32)
    rows, cols = x.shape
    amax = nan_skipping_amax(x, axis=1) if row_scaled else nan_skipping_amax(x).reshape(1)
    s_enc = global_encode_scale(amax, e4m3_max).reshape(-1, 1)
    ga = amax.reshape(-1, 1).astype(np.float32)
    nb = cols // 16
    block_amax = np.empty((rows, nb), np.float32)
    for j in range(nb):
        cut = x[:, 16 * j : 16 * (j + 1)]
        if two_d:
            for i in range(rows // 16):
                block_amax[16 * i : 16 * (i + 1), j] = nan_skipping_amax(cut[16 * i : 16 * (i + 1)])
        else:
            block_amax[:, j] = nan_skipping_amax(cut, axis=1)
    blocks = x.reshape(rows, nb, 16)
    with np.errstate(over="ignore", invalid="ignore"):
        if four_over_six is None:
            product = block_amax * (s_enc * F32(1.0 / 6.0))
            scale = e4m3(np.minimum(product, FLT_MAX))
            codes = e2m1_codes(blocks * _multiplier(scale, s_enc)[..., None])
            return codes.reshape(rows, cols), scale, amax
        base = block_amax / F32(6) * s_enc
        results = []
        for expand in (F32(1.5), F32(1.0)):
            scale = e4m3(np.minimum(base * expand, F32(448)))
            codes = e2m1_codes(blocks * _multiplier(scale, s_enc)[..., None])
            error = np.zeros((rows, nb), np.float32)
            sf = e4m3_value(scale)
            for i in range(16):
                val = ((e2m1_values(codes[..., i]) * sf) * ga) / F32(6.0 * e4m3_max)
                diff = val - blocks[..., i]
                error = error + (diff * diff if four_over_six == "MSE" else np.abs(diff))
            if two_d:
                error = _tile_error(error)
            results.append((codes, scale, error))
    (c4, s4, e4), (c6, s6, e6) = results
    with np.errstate(invalid="ignore"):
        pick4 = e4 < e6
    codes = np.where(pick4[..., None], c4, c6).reshape(rows, cols)
    return codes, np.where(pick4, s4, s6), amax


def _tile_error(error: np.ndarray) -> np.ndarray:
    """Per-row errors of 16x16 tiles summed as the warp shuffle does: lane i += lane i + 8, then
    + 4, + 2, + 1; lane 0 holds the tile's sum, which every row of the tile takes."""
    out = np.empty_like(error)
    for i in range(error.shape[0] // 16):
        lanes = [error[16 * i + r] for r in range(16)]
        for offset in (8, 4, 2, 1):
            lanes = [lanes[r] + lanes[r + offset] for r in range(offset)]
        out[16 * i : 16 * (i + 1)] = lanes[0]
    return out


def pack(codes: np.ndarray) -> np.ndarray:
    """Codes to bytes, TE's reference ``cast_to_fp4x2``: even element low, odd element high."""
    return (codes[:, ::2] + codes[:, 1::2] * 16).astype(np.uint8)


def bf16_round(v: np.ndarray) -> np.ndarray:
    """float32 to bf16 (returned as float32), nearest even, by bit arithmetic (finite input)."""
    bits = np.asarray(v, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return rounded.astype(np.uint32).view(np.float32)


def rht(x: np.ndarray) -> np.ndarray:
    """TE's RHT of bf16 values (given as float32) along rows, blocks of 16: float64 product,
    rounded to float32 (exact where the float32 sum is), then to bf16."""
    x = np.asarray(x, np.float64)
    matrix = (SIGNS[:, None] * HADAMARD) / 4.0
    y = (x.reshape(-1, 16) @ matrix).astype(np.float32)
    return bf16_round(y).reshape(x.shape)


def dequantize(codes: np.ndarray, scale: np.ndarray, amax: np.ndarray, e4m3_max: float):
    """TE's ``dequantize_fp4_kernel``: ``e2m1 * ((scale * amax) * f32(1 / (6 e4m3_max)))``."""
    factor = F32(1.0 / (6.0 * e4m3_max))
    rows, cols = codes.shape
    with np.errstate(invalid="ignore", over="ignore"):  # an inf amax times a zero scale: NaN
        per_block = (e4m3_value(scale) * amax.reshape(-1, 1).astype(np.float32)) * factor
        values = e2m1_values(codes).reshape(rows, cols // 16, 16) * per_block[..., None]
    return values.reshape(rows, cols)
