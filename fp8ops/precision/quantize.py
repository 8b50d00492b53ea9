"""Quantize a tensor with a given scale, and count what the cast did to it.

On GPUs the two casts the FP8 linear runs are compiled into fused kernels (``compiled.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp8ops.precision.compiled import Compiled, cast_probes
from fp8ops.precision.formats import Fp8Dtype, saturating_cast
from fp8ops.precision.scales import scale_from_amax, tensor_amax

COUNTS = ("saturated", "underflow", "nan", "inf")  # CastStats.counts, in this order


@dataclass(frozen=True)
class CastStats:
    """What one cast did, as tensors (on the cast's device, but for an empty tensor's), so no
    host sync is forced; the counts are one tensor, so telemetry copies a cast's four as one."""

    amax: torch.Tensor  # float32 max |x|, NaN ignored (TE's fmaxf), +inf kept
    # [4] int64, COUNTS: |x * scale| > fp8 max (clipped to +-max, inf included); non-zero
    # inputs whose FP8 value is zero; NaN inputs; infinite inputs.
    counts: torch.Tensor
    numel: int

    def as_dict(self) -> dict[str, float]:
        """Plain numbers, for logs and tests (forces a host sync)."""
        return {
            "amax": self.amax.item(),
            **dict(zip(COUNTS, self.counts.tolist(), strict=True)),
            "numel": self.numel,
        }


@dataclass(frozen=True)
class QuantizedTensor:
    """FP8 data plus the float32 reciprocal of the scale that produced it."""

    data: torch.Tensor  # torch.float8_e4m3fn / float8_e5m2
    scale_inv: torch.Tensor  # 0-dim float32, correctly rounded 1/scale (TE: __frcp_rn)
    fp8: Fp8Dtype
    # The row-major copy of data.T that a GEMM taking this operand transposed needs (TE's
    # "columnwise" data; of the [rows, last dim] view when data has more than 2 dimensions);
    # made by the same cast when asked for (``transposed=True``).
    data_t: torch.Tensor | None = None

    def transposed(self) -> QuantizedTensor:
        """``data.T`` as a row-major FP8 tensor, the cast's copy when it made one."""
        data_t = self.data_t if self.data_t is not None else self.data.t().contiguous()
        return QuantizedTensor(
            data=data_t, scale_inv=self.scale_inv, fp8=self.fp8, data_t=self.data
        )

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


# The two casts the FP8 linear runs, each one function of tensors that runs eager or compiled
# into fused kernels (compiled.py: on GPUs, checked bit for bit against these same functions).
# They take a 2-D view and reduce each row, and the caller reduces the rows: a row reduction
# compiles to one kernel with a block per row that also writes the FP8 bytes, where a reduction
# of the whole tensor to one value would be split for the size first compiled, not the size
# run. A max and an integer sum come out the same in any order, so this changes no bit. With
# ``transposed`` they also return the transposed FP8 copy a backward GEMM needs, from the same
# call: one call fewer, which matters because a GPU step of FP8 layers is bound by the host's
# time per call, not by the GPU (docs/gpu.md).


def _cast_and_amax(x, scale, fp8_max: float, dtype: torch.dtype, transposed: bool):
    flat = x.float()
    data = (flat * scale).clamp(-fp8_max, fp8_max).to(dtype)  # = saturating_cast
    row_amax = flat.abs().nan_to_num(nan=0.0, posinf=math.inf).amax(dim=1)  # = amax_of
    if transposed:
        return data, row_amax, data.t().contiguous()
    return data, row_amax


def _cast_with_stats(x, scale, fp8_max: float, dtype: torch.dtype, transposed: bool):
    flat = x.float()
    scaled = flat * scale
    data = scaled.clamp(-fp8_max, fp8_max).to(dtype)  # = saturating_cast
    is_nan = torch.isnan(flat)
    # FP8 zero is +0 or -0: every bit but the sign is clear. NaN casts to NaN, never to zero.
    zero = (data.view(torch.uint8) & 0x7F) == 0
    outputs = (
        data,
        flat.abs().masked_fill(is_nan, 0.0).amax(dim=1),
        (scaled.abs() > fp8_max).sum(dim=1),  # saturated, inf included
        ((flat != 0) & zero).sum(dim=1),  # underflow
        is_nan.sum(dim=1),
        torch.isinf(flat).sum(dim=1),
    )
    return (*outputs, data.t().contiguous()) if transposed else outputs


_CAST_AND_AMAX = Compiled(_cast_and_amax, probes=cast_probes)
_CAST_WITH_STATS = Compiled(_cast_with_stats, probes=cast_probes)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1, x.shape[-1]) if x.dim() >= 2 else x.detach().reshape(1, -1)


def _quantized(x, data, data_t, scale, fp8, transposed) -> QuantizedTensor:
    if transposed and data_t is None:  # x is empty
        data_t = _rows(data).t().contiguous()
    data = data.reshape(x.shape)
    return QuantizedTensor(data=data, scale_inv=torch.reciprocal(scale), fp8=fp8, data_t=data_t)


def cast_and_amax(
    x: torch.Tensor, scale: torch.Tensor, fp8: Fp8Dtype, *, transposed: bool = False
) -> tuple[QuantizedTensor, torch.Tensor]:
    """:func:`cast` and :func:`amax_of` in one go: all that delayed scaling needs of a cast.
    ``transposed`` (2-D ``x``): also the transposed FP8 copy (``QuantizedTensor.data_t``)."""
    scale = scale.detach().float().reshape(())
    if x.numel() == 0:
        return _quantized(x, cast(x, scale, fp8).data, None, scale, fp8, transposed), amax_of(x)
    data, row_amax, *data_t = _CAST_AND_AMAX(_rows(x), scale, fp8.max, fp8.torch_dtype, transposed)
    quantized = _quantized(x, data, data_t[0] if transposed else None, scale, fp8, transposed)
    return quantized, row_amax.amax()


def quantize(
    x: torch.Tensor, scale: torch.Tensor, fp8: Fp8Dtype, *, transposed: bool = False
) -> tuple[QuantizedTensor, CastStats]:
    """Cast ``x`` to FP8 with ``scale`` (saturating, RNE), returning the data and statistics.

    The statistics cost more than the cast; delayed scaling itself needs only the amax
    (:func:`cast_and_amax`), which is what the FP8 linear computes on ordinary steps.
    """
    scale = scale.detach().float().reshape(())
    if x.numel() == 0:
        data, data_t = saturating_cast(x.detach(), scale, fp8), None
        amax, counts = torch.zeros(()), torch.zeros(len(COUNTS), dtype=torch.int64, device=x.device)
    else:
        data, *per_row = _CAST_WITH_STATS(_rows(x), scale, fp8.max, fp8.torch_dtype, transposed)
        data_t = per_row.pop() if transposed else None
        amax, counts = per_row[0].amax(), torch.stack(per_row[1:]).sum(dim=1)
    stats = CastStats(amax=amax, counts=counts, numel=x.numel())
    return _quantized(x, data, data_t, scale, fp8, transposed), stats


def quantize_current(
    x: torch.Tensor, fp8: Fp8Dtype, *, power_2_scale: bool = False, epsilon: float = 0.0
) -> QuantizedTensor:
    """Per-tensor current scaling (TE's ``Float8CurrentScaling``): the scale from this tensor's
    own amax (NaN skipped) by ``compute_scale_from_amax`` with FLT_MAX for an infinite
    quotient, then the cast; ``scale_inv`` the correctly rounded reciprocal (``__frcp_rn``)."""
    scale = scale_from_amax(tensor_amax(x), fp8.max, power_2_scale=power_2_scale, epsilon=epsilon)
    return cast(x, scale, fp8)
