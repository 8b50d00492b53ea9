"""Quantize a tensor with a given scale, and count what the cast did to it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp8ops.precision.formats import Fp8Dtype, saturating_cast


@dataclass(frozen=True)
class CastStats:
    """What one cast did. Counts are 0-dim int64 tensors so no host sync is forced."""

    amax: torch.Tensor  # float32 max |x|, NaN ignored (TE's fmaxf), +inf kept
    saturated: torch.Tensor  # |x * scale| > fp8 max (clipped to +-max), inf included
    underflow: torch.Tensor  # non-zero inputs whose FP8 value is zero
    nan: torch.Tensor
    inf: torch.Tensor
    numel: int

    def as_dict(self) -> dict[str, float]:
        """Plain numbers, for logs and tests (forces a host sync)."""
        return {
            "amax": self.amax.item(),
            "saturated": int(self.saturated),
            "underflow": int(self.underflow),
            "nan": int(self.nan),
            "inf": int(self.inf),
            "numel": self.numel,
        }


@dataclass(frozen=True)
class QuantizedTensor:
    """FP8 data plus the float32 reciprocal of the scale that produced it."""

    data: torch.Tensor  # torch.float8_e4m3fn / float8_e5m2
    scale_inv: torch.Tensor  # 0-dim float32, correctly rounded 1/scale (TE: __frcp_rn)
    fp8: Fp8Dtype

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.float() * self.scale_inv).to(dtype)


def amax_of(x: torch.Tensor) -> torch.Tensor:
    """max |x| ignoring NaN and seeded with 0, as the cast kernels' fmaxf reduction."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32)
    # nan_to_num would also clip +inf to FLT_MAX unless told otherwise; TE keeps the inf.
    return x.detach().float().abs().nan_to_num_(nan=0.0, posinf=math.inf).amax()


def cast(x: torch.Tensor, scale: torch.Tensor, fp8: Fp8Dtype) -> QuantizedTensor:
    """The saturating cast of ``x * scale`` with its ``scale_inv``; no statistics."""
    scale = scale.detach().float().reshape(())
    return QuantizedTensor(
        data=saturating_cast(x.detach(), scale, fp8), scale_inv=torch.reciprocal(scale), fp8=fp8
    )


def quantize(
    x: torch.Tensor, scale: torch.Tensor, fp8: Fp8Dtype
) -> tuple[QuantizedTensor, CastStats]:
    """Cast ``x`` to FP8 with ``scale`` (saturating, RNE), returning the data and statistics.

    The statistics cost extra passes over ``x``; delayed scaling itself needs only the amax
    (:func:`amax_of`), which is what the FP8 linear computes on ordinary steps.
    """
    # One scaled copy serves the cast and the counts: a telemetry step casts every FP8 tensor
    # this way, so each pass over the data shows in the step time.
    flat = x.detach().float()
    scale = scale.detach().float().reshape(())
    scaled = flat * scale
    data = scaled.clamp(-fp8.max, fp8.max).to(fp8.torch_dtype)  # = saturating_cast
    is_nan = torch.isnan(flat)
    magnitude = flat.abs()
    # FP8 zero is +0 or -0: every bit but the sign is clear. NaN casts to NaN, never to zero.
    zero = (data.view(torch.uint8) & 0x7F) == 0
    stats = CastStats(
        amax=magnitude.masked_fill(is_nan, 0.0).amax() if flat.numel() else torch.zeros(()),
        saturated=(scaled.abs() > fp8.max).sum(),
        underflow=((flat != 0) & zero).sum(),
        nan=is_nan.sum(),
        inf=torch.isinf(flat).sum(),
        numel=flat.numel(),
    )
    quantized = QuantizedTensor(data=data, scale_inv=torch.reciprocal(scale), fp8=fp8)
    return quantized, stats
