"""How the stateless recipes turn an amax into a scale, as Transformer Engine's kernels do.

Current and block scaling share one rule, TE's ``compute_scale_from_amax`` (docs/precision.md):

1. an amax below ``epsilon`` becomes ``epsilon`` (a NaN amax fails the test and passes through);
2. an amax that is 0, inf or NaN gives scale 1;
3. otherwise ``scale = fp8_max / amax``, one IEEE float32 division;
4. an infinite quotient (a tiny or denormal amax) becomes ``value_for_inf``: FLT_MAX for current
   scaling, the *input* dtype's largest value for block scaling (bf16: 3.3895314e38);
5. with ``power_2_scale`` the mantissa bits are cleared: the scale rounds *down* to a power of 2.

MXFP8 keeps one E8M0 exponent per 32 elements instead: ``amax * fp32(1/fp8_max)`` rounded to
float32, then to a power of two *toward +inf* (so no element of the block overflows).

All of it is integer and float32 arithmetic on tensors; IEEE division and denormals on the CPU
are what TE's kernels (built without fast-math) compute.
"""

from __future__ import annotations

import torch

FLT_MAX = torch.finfo(torch.float32).max
# float32 bit patterns
_EXPONENT_MASK = 0xFF800000 - (1 << 32)  # sign and exponent, as an int32 (the top bit set)
_TWO_TO_MINUS_127 = 0x00400000  # 2**-127, a float32 denormal
E8M0_NAN = 0xFF


def input_dtype_max(dtype: torch.dtype) -> float:
    """The block recipe's substitute for an infinite scale: the input dtype's largest value
    (TE's ``compute_scale_from_types``). float32, bf16 and fp16 inputs are what TE quantizes."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"block scaling quantizes float32, bfloat16 or float16 input, not {dtype}")
    return torch.finfo(dtype).max


def tensor_amax(x: torch.Tensor, dims: tuple[int, ...] | None = None) -> torch.Tensor:
    """max |x| in float32 over ``dims`` (all by default), NaN elements skipped, seeded with 0:
    TE's fmaxf reduction. An all-NaN or empty reduction gives 0; an inf element gives inf."""
    magnitude = x.detach().float().abs().nan_to_num(nan=0.0, posinf=torch.inf)
    if magnitude.numel() == 0:
        shape = [] if dims is None else [s for d, s in enumerate(x.shape) if d not in dims]
        return torch.zeros(shape, dtype=torch.float32, device=x.device)
    return magnitude.amax() if dims is None else magnitude.amax(dim=dims)


def scale_from_amax(
    amax: torch.Tensor,
    fp8_max: float,
    *,
    power_2_scale: bool,
    epsilon: float = 0.0,
    value_for_inf: float = FLT_MAX,
) -> torch.Tensor:
    """TE's ``compute_scale_from_amax``, element-wise over a float32 amax tensor."""
    amax = amax.float()
    eps = torch.tensor(epsilon, dtype=torch.float32, device=amax.device)
    amax = torch.where(amax < eps, eps, amax)  # NaN < eps is False: a NaN amax stays NaN
    special = torch.isinf(amax) | torch.isnan(amax) | (amax == 0)
    quotient = torch.tensor(fp8_max, dtype=torch.float32) / torch.where(special, 1.0, amax)
    substitute = torch.tensor(value_for_inf, dtype=torch.float32)
    scale = torch.where(torch.isinf(quotient), substitute, quotient)
    if power_2_scale:
        scale = (scale.view(torch.int32) & _EXPONENT_MASK).view(torch.float32)
    return torch.where(special, 1.0, scale)


def e8m0_from_amax(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """MXFP8's biased block exponent (uint8 as int32, 0..254; 255 for NaN): the float32 product
    ``amax * fp32(1 / fp8_max)`` rounded up to a power of two, as ``cvt.rp.satfinite.ue8m0``."""
    reciprocal = torch.tensor(1.0 / fp8_max, dtype=torch.float32)  # 1/448 rounds slightly up
    bits = (amax.float() * reciprocal).view(torch.int32)
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    rounded_up = exponent + (mantissa != 0).to(torch.int32)
    # A denormal product: at most 2**-127 rounds up to 2**-127 (byte 0), more to 2**-126.
    denormal = (mantissa > _TWO_TO_MINUS_127).to(torch.int32)
    e = torch.where(exponent == 0, denormal, rounded_up).clamp_max(254)  # inf -> 254
    return torch.where((exponent == 0xFF) & (mantissa != 0), E8M0_NAN, e)


def _power_of_two(biased: torch.Tensor) -> torch.Tensor:
    """2**(biased - 127) as float32 for biased in 0..254 (0 is the denormal 2**-127), NaN at 255."""
    bits = torch.where(biased > 0, biased << 23, _TWO_TO_MINUS_127)
    bits = torch.where(biased >= 255, 0x7FC00000, bits)
    return bits.to(torch.int32).view(torch.float32)


def e8m0_scale_inv(e: torch.Tensor) -> torch.Tensor:
    """The decode scale the GEMM multiplies by: 2**(e - 127)."""
    return _power_of_two(e.to(torch.int32))


def e8m0_multiplier(e: torch.Tensor) -> torch.Tensor:
    """The encode multiplier the cast uses: 2**(127 - e) (TE's ``exp2f_rcp``); e = 254 gives
    the denormal 2**-127. As TE has it since 2.13; earlier versions gave 1 for e = 0 and 0 for
    e = 254 (docs/precision.md)."""
    e = e.to(torch.int32)
    return torch.where(e >= 255, _power_of_two(e), _power_of_two(254 - e))
