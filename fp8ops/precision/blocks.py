"""Block-scaled FP8: a 2-D tensor cut into blocks that each share one scale.

The stateless recipes differ only in the block and the rule that makes a block's scale from its
amax (``scales.py``); the cast is the same for all, ``fp8(f32(x) * scale)`` with the saturating
conversion of ``formats.py``:

| recipe | block | scale rule |
|---|---|---|
| current | the whole tensor | ``scale_from_amax``, ``value_for_inf`` FLT_MAX |
| block, 1D | 1x128 row-wise, 128x1 for the column-wise copy | ``scale_from_amax``, the input dtype's max |
| block, 2D (weights) | 128x128 | the same |
| MXFP8 | 1x32 row-wise, 32x1 column-wise | E8M0: a power of two rounded toward +inf |

A tensor whose sides are not multiples of the block is cut into partial blocks at its edges;
TE's kernels zero-fill those on load, which leaves the amax and every in-bounds byte as if the
tensor were zero-padded, and that is what :func:`block_amax` does. Scales are kept on the
logical block grid only (TE's buffers are padded; the padding is never read here).

A column-wise copy (what a wgrad GEMM multiplies) is quantized again from high precision, never
derived from the row-wise bytes: the two round differently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8ops.precision.formats import Fp8Dtype, saturating_cast
from fp8ops.precision.quantize import CastStats
from fp8ops.precision.scales import (
    e8m0_from_amax,
    e8m0_multiplier,
    e8m0_scale_inv,
    input_dtype_max,
    scale_from_amax,
    tensor_amax,
)

BLOCK = 128  # block scaling's block edge
MX_BLOCK = 32  # MXFP8's


@dataclass(frozen=True)
class BlockQuantized:
    """FP8 data ``[M, K]`` with one float32 scale per ``block`` (rows, cols) of it."""

    data: torch.Tensor  # float8, [M, K]
    scale_inv: (
        torch.Tensor
    )  # float32, [ceil(M / rows), ceil(K / cols)]: what dequantizing multiplies
    block: tuple[int, int]
    fp8: Fp8Dtype
    scale: torch.Tensor  # float32, the same grid: what the cast multiplied by
    amax: torch.Tensor  # float32 0-dim: the tensor's amax (NaN skipped), for telemetry
    # MXFP8 only: the E8M0 exponent bytes (uint8) the scales are 2**(e - 127) of
    exponent: torch.Tensor | None = None
    # For telemetry, on the scale grid: each block's amax, and whether its scale sat at the
    # floor (no larger scale representable: block scaling's inf-scale substitute, E8M0 byte 0)
    block_amax: torch.Tensor | None = None
    at_floor: torch.Tensor | None = None

    def expanded_scale_inv(self) -> torch.Tensor:
        """``scale_inv`` repeated over each block's elements, ``[M, K]``."""
        return expand(self.scale_inv, self.block, self.data.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.float() * self.expanded_scale_inv()).to(dtype)

    def transposed(self) -> BlockQuantized:
        """The same values transposed, blocks included: a 128x1-blocked ``[M, K]`` becomes a
        1x128-blocked ``[K, M]``. Exact, unlike casting the transpose afresh with the other
        blocking: that is the column-wise copy, quantized from high precision."""

        def t(grid):
            return None if grid is None else grid.t().contiguous()

        return BlockQuantized(
            self.data.t().contiguous(),
            self.scale_inv.t().contiguous(),
            self.block[::-1],
            self.fp8,
            self.scale.t().contiguous(),
            self.amax,
            t(self.exponent),
            t(self.block_amax),
            t(self.at_floor),
        )


def grid_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def _blocked(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``x`` as float32 ``[gm, rows, gk, cols]``, zero-padded to whole blocks."""
    rows, cols = block
    (m, k), (gm, gk) = x.shape, grid_shape(tuple(x.shape), block)
    x = x.detach().float()
    if (gm * rows, gk * cols) != (m, k):
        x = torch.nn.functional.pad(x, (0, gk * cols - k, 0, gm * rows - m))
    return x.reshape(gm, rows, gk, cols)


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max |x| of every block of a 2-D tensor, NaN elements skipped, partial blocks padded with
    zeros (which cannot raise a block's amax): ``[ceil(M / rows), ceil(K / cols)]`` float32."""
    return tensor_amax(_blocked(x, block), dims=(1, 3))


def expand(grid: torch.Tensor, block: tuple[int, int], shape) -> torch.Tensor:
    """A per-block tensor repeated over its blocks' elements and cropped to ``shape``."""
    rows, cols = block
    full = grid.repeat_interleave(rows, dim=0).repeat_interleave(cols, dim=1)
    return full[: shape[0], : shape[1]]


def _cast(blocks: torch.Tensor, multiplier: torch.Tensor, shape, fp8: Fp8Dtype) -> torch.Tensor:
    """The saturating cast of ``[gm, rows, gk, cols]`` blocks, each by its multiplier, back
    to ``shape``."""
    data = saturating_cast(blocks, multiplier[:, None, :, None], fp8)
    gm, rows, gk, cols = blocks.shape
    data = data.reshape(gm * rows, gk * cols)
    return data if tuple(data.shape) == tuple(shape) else data[: shape[0], : shape[1]].contiguous()


def _check_2d(x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"block quantization takes a 2-D tensor, got shape {tuple(x.shape)}")


def quantize_scaled(
    x: torch.Tensor,
    block: tuple[int, int],
    fp8: Fp8Dtype,
    *,
    power_2_scale: bool,
    epsilon: float = 0.0,
    value_for_inf: float | None = None,
) -> BlockQuantized:
    """Current or block scaling of a 2-D tensor: each block's scale by TE's
    ``compute_scale_from_amax``; ``value_for_inf`` defaults to the input dtype's largest value
    (block scaling's rule; current scaling passes FLT_MAX)."""
    _check_2d(x)
    if value_for_inf is None:
        value_for_inf = input_dtype_max(x.dtype)
    blocks = _blocked(x, block)
    amax = tensor_amax(blocks, dims=(1, 3))
    scale = scale_from_amax(
        amax,
        fp8.max,
        power_2_scale=power_2_scale,
        epsilon=epsilon,
        value_for_inf=value_for_inf,
    )
    # Correctly rounded (TE: __frcp_rn; the 1-D block kernel divides in double, the same
    # value), and exact for a power of two.
    data = _cast(blocks, scale, x.shape, fp8)
    # The blocks whose fp8_max / amax overflowed (scale_from_amax then takes the substitute, the
    # largest scale there is, and still too small to lift their values clear of the flush).
    overflowed = torch.isinf(fp8.max / amax.clamp_min(epsilon))
    at_floor = (amax > 0) & torch.isfinite(amax) & overflowed
    return BlockQuantized(
        data,
        torch.reciprocal(scale),
        block,
        fp8,
        scale,
        _whole(amax),
        block_amax=amax,
        at_floor=at_floor,
    )


def quantize_mxfp8(x: torch.Tensor, fp8: Fp8Dtype, *, columnwise: bool = False) -> BlockQuantized:
    """MXFP8 of a 2-D tensor: 1x32 blocks along its rows, or with ``columnwise`` 32x1 blocks
    along its columns (stored untransposed, as TE does). Both sides must be multiples of 32."""
    _check_2d(x)
    if any(side % MX_BLOCK for side in x.shape):
        raise ValueError(
            f"MXFP8 needs both dimensions divisible by {MX_BLOCK}, got shape {tuple(x.shape)}"
        )
    block = (MX_BLOCK, 1) if columnwise else (1, MX_BLOCK)
    blocks = _blocked(x, block)
    amax = tensor_amax(blocks, dims=(1, 3))
    e = e8m0_from_amax(amax, fp8.max)
    multiplier = e8m0_multiplier(e)
    data = _cast(blocks, multiplier, x.shape, fp8)
    return BlockQuantized(
        data,
        e8m0_scale_inv(e),
        block,
        fp8,
        multiplier,
        _whole(amax),
        e.to(torch.uint8),
        block_amax=amax,
        at_floor=(amax > 0) & (e == 0),  # E8M0's smallest scale, 2**-127
    )


def _whole(block_amax: torch.Tensor) -> torch.Tensor:
    return block_amax.amax() if block_amax.numel() else torch.zeros(())


def block_cast_stats(x: torch.Tensor, q: BlockQuantized, *, rows: int | None = None) -> CastStats:
    """What a block cast did (``CastStats``, as the per-tensor casts report it): the amax, and
    the elements it saturated (``|x * scale| > fp8 max``), sent to zero from non-zero, and the
    NaN and inf inputs. ``rows``: only the first rows count (the rest is zero padding, which
    none of the counts sees, but the element count would)."""
    flat = x.detach().float()
    scaled = flat * expand(q.scale, q.block, flat.shape)
    zero = (q.data.view(torch.uint8) & 0x7F) == 0
    counts = torch.stack(
        [
            (scaled.abs() > q.fp8.max).sum(),
            ((flat != 0) & zero).sum(),
            torch.isnan(flat).sum(),
            torch.isinf(flat).sum(),
        ]
    )
    numel = flat.numel() if rows is None else rows * flat.shape[1]
    return CastStats(amax=q.amax, counts=counts, numel=numel)
