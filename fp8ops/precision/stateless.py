"""The stateless recipes (TE's ``Float8CurrentScaling``, ``Float8BlockScaling``,
``MXFP8BlockScaling``) and the FP8 linear under them.

Nothing is carried between casts: every cast takes its scales from the tensor it casts
(``blocks.py``), so there is no amax history, no update and no state to checkpoint. The recipe
decides only how each tensor role is blocked; the GEMM is the backend's, as for delayed scaling.

A GEMM ``a @ b.T`` takes both operands with their blocks along the reduction dimension (their
last). The linear's three GEMMs therefore need each tensor blocked two ways: *row-wise*
(blocks along its last dimension) and *column-wise* (along its first), the copy a GEMM takes
transposed. As in TE, a column-wise copy is quantized again from high precision, except where
the two are the same values: one per-tensor scale (current scaling) or square 2-D blocks.

| GEMM | a | b |
|---|---|---|
| fprop ``y = x W^T`` | x row-wise | W row-wise |
| dgrad ``dx = dy W`` | dy row-wise | W column-wise, transposed |
| wgrad ``dW = dy^T x`` | dy column-wise, transposed | x column-wise, transposed |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from fp8ops.precision.blocks import (
    BLOCK,
    MX_BLOCK,
    BlockQuantized,
    block_cast_stats,
    quantize_mxfp8,
    quantize_scaled,
)
from fp8ops.precision.formats import Fp8Dtype, Fp8Format
from fp8ops.precision.gemms import ALL_GEMMS, hp_dgrad, hp_fprop, hp_wgrad
from fp8ops.precision.quantize import QuantizedTensor, cast, quantize
from fp8ops.precision.scales import scale_from_amax, tensor_amax

ROLES = ("input", "weight", "grad_output")
Quantized = QuantizedTensor | BlockQuantized


@dataclass(frozen=True, kw_only=True)
class StatelessRecipe:
    """One of TE's stateless recipes, with the fields TE gives it (``recipe/__init__.py``).

    ``power_2_scale`` and ``amax_epsilon`` are TE's ``QParams`` (the same for every role, as in
    TE's defaults); the block dimensions are ``Float8BlockScaling``'s."""

    kind: Literal["current", "block", "mxfp8"]
    fp8_format: Fp8Format
    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1

    def __post_init__(self) -> None:
        if self.fp8_format is Fp8Format.E5M2:
            Fp8Format.parse("e5m2")  # raises the explanatory error
        if self.amax_epsilon < 0:
            raise ValueError(f"amax_epsilon must be >= 0, got {self.amax_epsilon}")
        dims = {
            "x_block_scaling_dim": self.x_block_scaling_dim,
            "w_block_scaling_dim": self.w_block_scaling_dim,
            "grad_block_scaling_dim": self.grad_block_scaling_dim,
        }
        for name, dim in dims.items():
            if dim not in (1, 2):
                raise ValueError(f"{name} must be 1 or 2, got {dim}")
        if sum(dim == 2 for dim in dims.values()) > 1:
            raise ValueError("block scaling multiplies a 2-D-blocked operand only by a 1-D one")
        if self.kind == "mxfp8" and (self.power_2_scale or self.amax_epsilon):
            raise ValueError("MXFP8's scales are powers of two by construction and take no epsilon")

    @classmethod
    def current(
        cls,
        fp8_format: Fp8Format = Fp8Format.HYBRID,
        *,
        power_2_scale: bool = False,
        amax_epsilon: float = 0.0,
    ) -> StatelessRecipe:
        """TE's ``Float8CurrentScaling`` defaults: HYBRID, scales not rounded to powers of 2."""
        return cls(
            kind="current",
            fp8_format=fp8_format,
            power_2_scale=power_2_scale,
            amax_epsilon=amax_epsilon,
        )

    @classmethod
    def block(
        cls, fp8_format: Fp8Format = Fp8Format.E4M3, *, power_2_scale: bool = True, **dims
    ) -> StatelessRecipe:
        """TE's ``Float8BlockScaling`` defaults: E4M3, power-of-2 scales, 1x128 activations and
        gradients, 128x128 weights."""
        return cls(kind="block", fp8_format=fp8_format, power_2_scale=power_2_scale, **dims)

    @classmethod
    def mxfp8(cls, fp8_format: Fp8Format = Fp8Format.E4M3) -> StatelessRecipe:
        """TE's ``MXFP8BlockScaling``: E4M3 by default, 1x32 blocks, E8M0 scales."""
        return cls(kind="mxfp8", fp8_format=fp8_format)

    # -- how each role is cast -----------------------------------------------------------

    def fp8(self, role: str) -> Fp8Dtype:
        return self.fp8_format.backward if role == "grad_output" else self.fp8_format.forward

    def block_dim(self, role: str) -> int:
        return {
            "input": self.x_block_scaling_dim,
            "weight": self.w_block_scaling_dim,
            "grad_output": self.grad_block_scaling_dim,
        }[role]

    def same_both_ways(self, role: str) -> bool:
        """Whether a role's column-wise copy is its row-wise one: one scale per tensor, or
        square 2-D blocks."""
        return self.kind == "current" or (self.kind == "block" and self.block_dim(role) == 2)

    def quantize(
        self,
        x: torch.Tensor,
        role: str,
        *,
        columnwise: bool = False,
        track: dict | None = None,
        record: CastRecord | None = None,
        rows: int | None = None,
    ) -> Quantized:
        """Cast a 2-D tensor of ``role``, blocked along its rows (the default) or its columns;
        with ``track`` the cast's statistics are stored there under ``role``; ``record`` notes
        its amax (and, per tensor, its scale) for the step's telemetry. ``rows``: how many of
        ``x``'s rows are real, the rest padding (MXFP8's tokens), which the statistics leave out."""
        fp8 = self.fp8(role)
        if self.kind == "current":
            amax = tensor_amax(x)
            scale = scale_from_amax(
                amax, fp8.max, power_2_scale=self.power_2_scale, epsilon=self.amax_epsilon
            )
            if record is not None:
                record.note(role, amax, scale)
            if track is None:
                return cast(x, scale, fp8)
            q, track[role] = quantize(x, scale, fp8)
            return q
        if self.kind == "mxfp8":
            q = quantize_mxfp8(x, fp8, columnwise=columnwise)
        else:
            block = (BLOCK, BLOCK) if self.block_dim(role) == 2 else (1, BLOCK)
            block = block[::-1] if columnwise else block
            q = quantize_scaled(
                x, block, fp8, power_2_scale=self.power_2_scale, epsilon=self.amax_epsilon
            )
        if record is not None:
            record.note(role, q.amax, None, q)
        if track is not None:
            track[role] = block_cast_stats(x, q, rows=rows)
        return q

    def columnwise(self, x: torch.Tensor, role: str, rowwise: Quantized) -> Quantized:
        """The column-wise copy of ``x``: ``rowwise`` itself where the two are the same values,
        otherwise quantized again from high precision."""
        if self.same_both_ways(role):
            return rowwise
        return self.quantize(x, role, columnwise=True)

    def divisor(self) -> int:
        """What every GEMM dimension must be a multiple of (MXFP8's block; the token dimension
        is padded to it, the others are admission's rule); 1 for the others, whose partial
        blocks are zero-padded."""
        return MX_BLOCK if self.kind == "mxfp8" else 1


class CastRecord:
    """What one module's casts of a step were, for telemetry, per role (``ROLES``): the amax
    (the largest over the step's micro-batches) and the scale that cast was cast with, for a
    per-tensor cast (NaN for blocks, which have many); for block casts, the exponent of the blocks' decode scales
    (``scale_inv``) over the blocks that hold a non-zero finite value: the lowest and highest
    over the step, the (lower) median of the last cast, and how many of those blocks sat at
    the scale floor out of how many. A few tensor ops per cast, on its device: no host sync."""

    ROWS = ("amax", "scale", "exp_min", "exp_median", "exp_max", "at_floor", "blocks")

    def __init__(self, device: torch.device | str | None = None):
        # NaN until a cast notes one
        self.table = torch.full((len(self.ROWS), len(ROLES)), float("nan"), device=device)

    def clear(self) -> None:
        self.table.fill_(float("nan"))

    def note(
        self,
        role: str,
        amax: torch.Tensor,
        scale: torch.Tensor | None,
        blocks: BlockQuantized | None = None,
    ) -> None:
        i, t = ROLES.index(role), self.table
        amax = amax.to(t.device)
        if scale is not None:
            # The scale of the cast whose amax the row reports (the first such cast on a tie,
            # which had the same scale): a reader takes a row's amax and scale as one cast's.
            largest = torch.isnan(t[0, i]) | (amax > t[0, i])
            t[1, i] = torch.where(largest, scale.to(t.device), t[1, i])
        t[0, i] = torch.fmax(t[0, i], amax)
        if blocks is None or blocks.block_amax is None or not blocks.block_amax.numel():
            return
        live = (blocks.block_amax > 0) & torch.isfinite(blocks.block_amax)
        exponent = torch.frexp(blocks.scale_inv).exponent.float() - 1  # floor(log2) of a normal
        inf = torch.tensor(float("inf"), device=exponent.device)
        lowest = torch.where(live, exponent, inf).amin()
        highest = torch.where(live, exponent, -inf).amax()
        any_live = live.any()
        nan = torch.tensor(float("nan"), device=exponent.device)
        t[2, i] = torch.fmin(t[2, i], torch.where(any_live, lowest, nan).to(t.device))
        t[3, i] = torch.where(live, exponent, nan).nanmedian().to(t.device)
        t[4, i] = torch.fmax(t[4, i], torch.where(any_live, highest, nan).to(t.device))
        for row, count in ((5, (blocks.at_floor & live).sum()), (6, live.sum())):
            t[row, i] = torch.nan_to_num(t[row, i], nan=0.0) + count.to(t.device)

    def to(self, device) -> CastRecord:
        self.table = self.table.to(device)
        return self


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero rows appended up to a multiple (MXFP8's token dimension, padded as Megatron pads
    it): zeros change no block's amax, and the rows they add are cut from the results."""
    extra = -t.shape[0] % multiple
    return torch.nn.functional.pad(t, (0, 0, 0, extra)) if extra else t


class StatelessFp8LinearFunction(torch.autograd.Function):
    """``y = x @ W.T + b`` under a stateless recipe (the module docstring's GEMMs), each GEMM in
    FP8 or in high precision (``gemms.py``); ``x`` is ``[..., in]``, ``W`` is ``[out, in]``. The
    weight's two copies arrive already cast (they may come from the step's first micro-batch;
    None where no FP8 GEMM reads them)."""

    @staticmethod
    def forward(ctx, x, weight, bias, weight_casts, recipe, gemm, track, record, wgrad, fp8):
        tokens = x.numel() // weight.shape[1]
        x_rows = x.reshape(tokens, weight.shape[1])
        x2d = _pad_rows(x_rows, recipe.divisor())
        fp8_wgrad = wgrad and "wgrad" in fp8
        if "fprop" in fp8 or fp8_wgrad:  # cast only for a GEMM that reads it in FP8
            qx = recipe.quantize(x2d, "input", track=track, record=record, rows=tokens)
        qw, qw_columnwise = weight_casts
        if "fprop" in fp8:
            out = gemm(qx, qw, out_dtype=x.dtype, bias=bias)[:tokens]
        else:
            out = hp_fprop(x_rows, weight, bias)
        # What the backward GEMMs multiply is all it keeps, as in TE: the FP8 copies of an FP8
        # GEMM, the high-precision input of a wgrad in high precision.
        ctx.x_t = recipe.columnwise(x2d, "input", qx).transposed() if fp8_wgrad else None
        ctx.w_t = None if qw_columnwise is None else qw_columnwise.transposed()
        ctx.save_for_backward(x_rows if wgrad and not fp8_wgrad else None, weight)
        ctx.recipe, ctx.gemm, ctx.track, ctx.record, ctx.fp8 = recipe, gemm, track, record, fp8
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.out_features, ctx.has_bias, ctx.tokens = weight.shape[0], bias is not None, tokens
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        recipe = ctx.recipe
        x_rows, weight = ctx.saved_tensors
        grad2d = grad_out.reshape(ctx.tokens, ctx.out_features)
        padded = _pad_rows(grad2d, recipe.divisor())
        needs_input, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        fp8_dgrad = needs_input and "dgrad" in ctx.fp8
        fp8_wgrad = needs_weight and "wgrad" in ctx.fp8
        if fp8_dgrad or fp8_wgrad:
            qg = recipe.quantize(
                padded, "grad_output", track=ctx.track, record=ctx.record, rows=ctx.tokens
            )
        grad_input = grad_weight = grad_bias = None
        if needs_input:
            if fp8_dgrad:
                grad_input = ctx.gemm(qg, ctx.w_t, out_dtype=ctx.x_dtype)[: ctx.tokens]
            else:
                grad_input = hp_dgrad(grad2d, weight)
            grad_input = grad_input.reshape(ctx.x_shape)
        if needs_weight:
            if fp8_wgrad:
                qg_t = recipe.columnwise(padded, "grad_output", qg).transposed()
                grad_weight = ctx.gemm(qg_t, ctx.x_t, out_dtype=ctx.w_dtype)
            else:
                grad_weight = hp_wgrad(grad2d, x_rows)
        if needs_bias and ctx.has_bias:
            grad_bias = grad2d.sum(dim=0)
        return grad_input, grad_weight, grad_bias, *[None] * 7


def _weight_casts_needed(cached, fprop: bool, dgrad: bool) -> bool:
    """Whether the weight must be cast now: a GEMM reads it in FP8 and ``cached`` (the step's
    first micro-batch's casts) lacks the copy it reads."""
    if not (fprop or dgrad):
        return False
    return cached is None or (dgrad and cached[1] is None)


def cast_weight(
    weight: torch.Tensor,
    recipe: StatelessRecipe,
    *,
    dgrad: bool,
    track: dict | None,
    record: CastRecord | None = None,
) -> tuple[Quantized, Quantized | None]:
    """The weight's row-wise cast and, when a dgrad will need it, its column-wise copy."""
    qw = recipe.quantize(weight.detach(), "weight", track=track, record=record)
    return qw, recipe.columnwise(weight.detach(), "weight", qw) if dgrad else None


def stateless_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: StatelessRecipe,
    *,
    gemm,
    cached_weight: tuple[Quantized, Quantized | None] | None = None,
    track: dict | None = None,
    record: CastRecord | None = None,
    gemms: frozenset[str] = ALL_GEMMS,
) -> tuple[torch.Tensor, tuple[Quantized, Quantized | None] | None]:
    """One FP8 linear under ``recipe``, the GEMMs ``gemms`` in FP8 and the others in high
    precision. Returns the output and the weight's casts (None: no FP8 GEMM read the weight);
    pass those back as ``cached_weight`` on later micro-batches of a step to skip casting the
    weight again (TE's ``is_first_microbatch=False``)."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {weight.shape[1]}")
    builds_graph = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias)
    )
    fp8_dgrad = builds_graph and x.requires_grad and "dgrad" in gemms
    wgrad = builds_graph and weight.requires_grad
    if _weight_casts_needed(cached_weight, "fprop" in gemms, fp8_dgrad):
        # The row-wise cast is made whenever the weight is cast, as TE's debug quantizer does
        # for a tensor only a column-wise GEMM reads in FP8.
        cached_weight = cast_weight(weight, recipe, dgrad=fp8_dgrad, track=track, record=record)
    out = StatelessFp8LinearFunction.apply(
        x, weight, bias, cached_weight or (None, None), recipe, gemm, track, record, wgrad, gemms
    )
    return out, cached_weight
