"""Quantize a tensor with a given scale, and count what the cast did to it."""

from __future__ import annotations

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
    magnitude = x.detach().abs().float()
    return torch.where(torch.isnan(magnitude), 0.0, magnitude).amax()


def quantize(
    x: torch.Tensor, scale: torch.Tensor, fp8: Fp8Dtype, *, with_stats: bool = True
) -> tuple[QuantizedTensor, CastStats | None]:
    """Cast ``x`` to FP8 with ``scale`` (saturating, RNE), returning the data and statistics.

    ``with_stats=False`` skips the counting passes (amax is still needed by delayed scaling,
    so callers that only want the amax use :func:`amax_of`).
    """
    scale = scale.detach().float().reshape(())
    data = saturating_cast(x.detach(), scale, fp8)
    quantized = QuantizedTensor(data=data, scale_inv=torch.reciprocal(scale), fp8=fp8)
    if not with_stats:
        return quantized, None

    flat = x.detach().float()
    is_nan = torch.isnan(flat)
    scaled_magnitude = (flat * scale).abs()
    stats = CastStats(
        amax=amax_of(flat),
        saturated=(scaled_magnitude > fp8.max).sum(),
        underflow=((flat != 0) & ~is_nan & (data.float() == 0)).sum(),
        nan=is_nan.sum(),
        inf=torch.isinf(flat).sum(),
        numel=flat.numel(),
    )
    return quantized, stats
