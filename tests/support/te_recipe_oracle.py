"""Test oracle for the stateless recipes (current, block, MXFP8), written from Transformer
Engine's kernels and sharing no code with ``fp8ops``:

* scales one block at a time in Python scalars (``np.float32`` arithmetic, bits through
  ``struct``), following ``recipe_common.cuh::compute_scale_from_amax`` and MXFP8's
  ``ptx_arch_spec.cuh::float_to_e8m0`` line by line;
* the FP8 conversion by table: every finite FP8 value decoded from its bits, and each scaled
  element sent to the nearest one, ties to the even code, beyond the largest finite value to it
  (``__NV_SATFINITE``), NaN to NaN. No torch FP8 dtype is involved.

Scale rule, per block (``amax`` = fmaxf-reduction seeded with 0, NaN elements skipped):

    if amax < eps: amax = eps
    if amax is inf, 0 or NaN: return 1
    s = f32(fp8_max) / f32(amax)                  # IEEE float32 division
    if s is inf: s = value_for_inf
    if pow2: bits(s) &= 0xFF800000
    scale_inv = f32(1 / s)                        # correctly rounded

MXFP8, per 32 elements:

    p = f32(amax * f32(1 / fp8_max))
    e = 0xFF if p is NaN; 0xFE if p is inf; 0 if p == 0
        else biased exponent of p, +1 if its mantissa is non-zero  (denormal: 1 if mantissa >
        0x400000 else 0), at most 0xFE
    multiplier = 2**(127 - e), scale_inv = 2**(e - 127)
"""

from __future__ import annotations

import math
import struct

import numpy as np

F32 = np.float32


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def bits_f32(bits: int) -> F32:
    return F32(struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0])


# -- the FP8 conversion ------------------------------------------------------------------------


def fp8_values(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Every non-negative finite value of the encoding (float64, ascending) and its code."""
    exponent_bits, mantissa_bits, bias = {"e4m3": (4, 3, 7), "e5m2": (5, 2, 15)}[name]
    values, codes = [], []
    for code in range(128):
        e, m = code >> mantissa_bits, code & ((1 << mantissa_bits) - 1)
        if name == "e4m3" and code == 0x7F:
            continue  # NaN
        if name == "e5m2" and e == (1 << exponent_bits) - 1:
            continue  # inf, NaN
        if e == 0:
            value = m * 2.0 ** (1 - bias - mantissa_bits)
        else:
            value = (1 + m / 2**mantissa_bits) * 2.0 ** (e - bias)
        values.append(value)
        codes.append(code)
    order = np.argsort(values)
    return np.asarray(values)[order], np.asarray(codes)[order]


NAN_CODE = {"e4m3": 0x7F, "e5m2": 0x7E}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def encode(v: np.ndarray, name: str) -> np.ndarray:
    """Values to FP8 bytes (uint8): nearest, ties to even code, saturating. Taken as they come
    (float32 or float64): the caller rounds the product to float32 first, as TE does."""
    values, codes = fp8_values(name)
    v = np.asarray(v).astype(np.float64)
    a = np.abs(v)
    i = np.clip(np.searchsorted(values, a), 1, len(values) - 1)
    lo, hi = values[i - 1], values[i]
    pick_hi = (a - lo > hi - a) | ((a - lo == hi - a) & (codes[i] % 2 == 0))
    code = np.where(pick_hi, codes[i], codes[i - 1])
    code = np.where(a >= values[-1], codes[-1], code)  # saturate (inf included)
    code = code | np.where(np.signbit(v), 0x80, 0)
    return np.where(np.isnan(v), NAN_CODE[name], code).astype(np.uint8)


def decode(codes: np.ndarray, name: str) -> np.ndarray:
    values, value_codes = fp8_values(name)
    table = np.full(256, np.nan)
    table[value_codes] = values
    table[value_codes | 0x80] = -values
    return table[np.asarray(codes, dtype=np.int64)]


# -- scales ------------------------------------------------------------------------------------


def fmax_amax(block: np.ndarray) -> F32:
    """fmaxf over |x| seeded with 0: NaN skipped (C99 fmax returns the other operand), inf kept."""
    return F32(np.fmax.reduce(np.abs(np.asarray(block, np.float32)).ravel(), initial=F32(0.0)))


def scale_from_amax(amax, fp8_max, pow2: bool, eps: float, value_for_inf: float) -> F32:
    amax = F32(amax)
    if amax < F32(eps):
        amax = F32(eps)
    if math.isinf(amax) or math.isnan(amax) or amax == 0:
        return F32(1.0)
    with np.errstate(over="ignore", divide="ignore"):
        s = F32(fp8_max) / amax
    if math.isinf(s):
        s = F32(value_for_inf)
    if pow2:
        s = bits_f32(f32_bits(s) & 0xFF800000)
    return s


def reciprocal(s: F32) -> F32:
    """The correctly rounded float32 1/s: rounding the exact double quotient once (never a
    harmful double rounding for a quotient of float32s)."""
    return F32(1.0 / float(s))


def e8m0(amax, fp8_max) -> int:
    with np.errstate(over="ignore"):
        p = F32(amax) * F32(1.0 / fp8_max)
    if math.isnan(p):
        return 0xFF
    if math.isinf(p):
        return 0xFE
    bits = f32_bits(p)
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    if exponent == 0:
        return 1 if mantissa > 0x400000 else 0
    return min(exponent + (1 if mantissa else 0), 0xFE)


def pow2_f32(k: int) -> F32:
    return F32(math.ldexp(1.0, k))  # 2**-127 is a float32 denormal, exactly held


# -- whole tensors ----------------------------------------------------------------------------


def quantize_blocks(x, block, name, *, pow2, eps=0.0, value_for_inf, mxfp8=False):
    """``x`` [M, K] (float32 values of the input) in blocks (rows, cols): the FP8 bytes, the
    scale_inv grid and, for MXFP8, the exponent grid."""
    x = np.asarray(x, dtype=np.float32)
    rows, cols = block
    m, k = x.shape
    gm, gk = -(-m // rows), -(-k // cols)
    multiplier = np.empty((m, k), np.float32)
    scale_inv = np.empty((gm, gk), np.float32)
    exponents = np.zeros((gm, gk), np.int64)
    for bi in range(gm):
        for bj in range(gk):
            r, c = slice(bi * rows, (bi + 1) * rows), slice(bj * cols, (bj + 1) * cols)
            amax = fmax_amax(x[r, c])
            if mxfp8:
                e = e8m0(amax, FP8_MAX[name])
                exponents[bi, bj] = e
                multiplier[r, c] = pow2_f32(127 - e) if e != 0xFF else np.nan
                scale_inv[bi, bj] = pow2_f32(e - 127) if e != 0xFF else np.nan
            else:
                s = scale_from_amax(amax, FP8_MAX[name], pow2, eps, value_for_inf)
                multiplier[r, c] = s
                scale_inv[bi, bj] = reciprocal(s)
    with np.errstate(over="ignore", invalid="ignore"):
        product = x * multiplier  # float32 * float32: the first of the two roundings
    return encode(product, name), scale_inv, exponents
