"""FP4 E2M1, the element format of NVFP4: its codes, the two roundings TE's kernels use, and the
packing of two codes per byte.

A code is 4 bits: a sign bit (8) and a magnitude index 0..7 into ``E2M1_GRID``. Conversion
follows PTX ``cvt.rn.satfinite.e2m1x2.f32``, as TE's cast kernels issue it: round to nearest,
ties to the even code; anything beyond 6, infinities included, becomes +-6; the sign of zero is
kept. NaN, which E2M1 cannot hold, becomes +6, as TE's software stochastic rounding has it
(``ptx.cuh``); TE's tests never feed NaN to its kernels, so for round-to-nearest this one case
is a choice made here, not a checked fact. TE's pure-torch reference quantizer writes +0 for
both -0.0 and NaN.

Stochastic rounding follows TE's ``stochastic_round_fp4_e2m1`` (``ptx.cuh``): 8 random bits
``r`` per element, ``t = |x| + (r / 256) * step`` with ``step`` the grid spacing at ``|x|``,
then ``t`` rounded down onto the grid (the spacing at ``t``, which the jitter may have carried
into the next region), capped at 6, the sign put back (NaN: +6). On the GPU the bits come from
Philox; here from a ``torch.Generator`` the caller seeds, so a draw can be replayed on the CPU
but never matches a GPU's.
"""

from __future__ import annotations

import torch

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of code & 7
E2M1_MAX = 6.0
SIGN = 8
_MAX_CODE = 7

# Midpoints between neighbouring grid values, each with the side its tie goes to: the even
# code (0.25 sits between codes 0 and 1 and goes down to 0; 0.75 between 1 and 2 goes up).
_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)


def _boundaries() -> torch.Tensor:
    """The midpoints as float32, a tie-up one lowered by one ulp: then for any float32 ``a``
    the magnitude index is the number of boundaries strictly below ``a`` (``a >= m`` is
    ``a > m - ulp``)."""
    down = torch.tensor(_TIES_DOWN, dtype=torch.float32)
    up = torch.tensor(_TIES_UP, dtype=torch.float32)
    return torch.cat([down, torch.nextafter(up, torch.zeros_like(up))]).sort().values


_BOUNDARIES = _boundaries()


def encode_rn(v: torch.Tensor) -> torch.Tensor:
    """float32 values to E2M1 codes (uint8, one per element): round to nearest even,
    saturating, NaN to +6."""
    index = torch.bucketize(v.abs(), _BOUNDARIES.to(v.device)).to(torch.uint8)
    nan = torch.isnan(v)
    index = torch.where(nan, _MAX_CODE, index)
    negative = torch.signbit(v) & ~nan
    return index | (negative.to(torch.uint8) * SIGN)


def encode_sr(v: torch.Tensor, random_bytes: torch.Tensor) -> torch.Tensor:
    """float32 values to E2M1 codes by TE's stochastic rounding, one random byte (0..255, any
    integer dtype) per element."""
    a = v.abs()
    u = random_bytes.to(torch.float32) * (1.0 / 256.0)
    # u * step is exact (8 bits times a power of two), so the sum rounds once, as TE's fmaf.
    t = a + u * _spacing(a)
    step_t = _spacing(t)
    rounded = torch.floor(t / step_t) * step_t  # exact: a power-of-two division
    q = torch.fmin(rounded, torch.tensor(E2M1_MAX))  # fmin: a NaN t gives 6, as fminf
    q = torch.where(torch.isnan(v), q, torch.copysign(q, v))
    return encode_rn(q)  # q lies on the grid: this only looks its code up


def _spacing(a: torch.Tensor) -> torch.Tensor:
    """The grid step at a magnitude: 0.5 below 2, 1 in [2, 4), 2 from 4."""
    return torch.where(a >= 4.0, 2.0, torch.where(a >= 2.0, 1.0, 0.5))


def decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, one per element) to their float32 values."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=codes.device)
    magnitude = grid[(codes & _MAX_CODE).long()]
    return torch.where((codes & SIGN) != 0, -magnitude, magnitude)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., 2n]`` to bytes ``[..., n]``: element 2i in the low nibble, 2i + 1 in the
    high one (TE's order: ``cvt.rn.satfinite.e2m1x2`` puts its first operand high)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(data: torch.Tensor) -> torch.Tensor:
    """Bytes ``[..., n]`` back to codes ``[..., 2n]``."""
    return torch.stack([data & 0xF, data >> 4], dim=-1).flatten(-2)
