"""The FP8 linear: casts recorded into delayed-scaling state, with a pluggable GEMM.

Forward: input and weight are cast to E4M3 with their slot scales; the GEMM multiplies the
FP8 operands. Backward: grad output is cast with the backward scale (E5M2 under HYBRID);
dgrad = grad_out @ W and wgrad = grad_out^T @ x use the same FP8 operands, as TE does.
Every cast max-accumulates its amax into history row 0 of its slot. The weight is cast (and
its amax recorded) only on the first micro-batch of a step, so its history rolls once per
optimizer step. Each of the three GEMMs may run in high precision instead (``gemms.py``); a
tensor then read by no FP8 GEMM is not cast.

Backends differ only in :class:`Fp8Gemm`: :class:`EmulatedGemm` here; a native FP8 GEMM
(``torch._scaled_mm`` on GPUs) is another implementation of the same protocol. The scaling
bookkeeping never changes.

Not supported yet: activation recompute (its forward replay runs outside the scope) and
Megatron's fused ``main_grad`` accumulation; the Megatron layers do not enable either.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import nn

from fp8ops.precision import cast_kernel
from fp8ops.precision.blocks import BlockQuantized
from fp8ops.precision.compiled import Compiled, compiles_for, env_choice, record_probes
from fp8ops.precision.gemms import ALL_GEMMS, hp_dgrad, hp_fprop, hp_wgrad
from fp8ops.precision.quantize import (
    COUNTS,
    CastStats,
    QuantizedTensor,
    _cast_and_amax,
    _cast_with_stats,
    cast_and_amax,
    quantize,
)
from fp8ops.precision.recipe import DelayedScalingRecipe
from fp8ops.precision.scaling import BWD_GRAD_OUTPUT, FWD_INPUT, FWD_WEIGHT
from fp8ops.precision.scope import Fp8Scope, active_scope
from fp8ops.precision.state import Fp8Meta, ScalingState
from fp8ops.precision.stateless import CastRecord, StatelessRecipe, stateless_fp8_linear


class Fp8Gemm(Protocol):
    """``a @ b.T (+ bias)`` of two FP8 tensors, scaled back by both ``scale_inv``s, with the
    bias added to the float32 accumulator before the one rounding to ``out_dtype``."""

    def __call__(
        self,
        a: QuantizedTensor,
        b: QuantizedTensor,
        out_dtype: torch.dtype,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class EmulatedGemm:
    """FP8 GEMM on any device: the FP8 values are exact in float32, so multiplying them
    there and applying ``scale_inv_a * scale_inv_b`` to the float32 accumulator is what a
    tensor-core FP8 GEMM computes, up to accumulation order; the bias joins in float32 as in
    cuBLAS's epilogue."""

    def __call__(self, a, b, out_dtype, bias=None):
        if isinstance(a, BlockQuantized) or isinstance(b, BlockQuantized):
            # Block scales vary along the reduction: each operand is dequantized first (exact
            # for power-of-2 scales), which TE's block GEMM computes slice by slice.
            accumulator = a.dequantize() @ b.dequantize().t()
        else:
            accumulator = (a.data.float() @ b.data.float().t()) * (a.scale_inv * b.scale_inv)
        if bias is not None:
            accumulator = accumulator + bias.float()
        return accumulator.to(out_dtype)


def _cast_and_record(x, history, scales, slot: int, fp8_max: float, dtype, transposed: bool):
    """The ordinary step's cast as one function of tensors, compiled on GPUs (``compiled.py``):
    the cast and its amax folded into ``history[0, slot]`` (in place, as TE's atomicMaxFloat).
    One compiled call instead of a dozen small eager ones: a GPU step of FP8 layers is bound by
    the host's time per call (docs/gpu.md). ``scale_inv`` is the caller's: Triton's ``1 / x``
    is not the correctly rounded reciprocal TE computes (``__frcp_rn``), torch's eager one is."""
    data, row_amax, *data_t = _cast_and_amax(x, scales[slot], fp8_max, dtype, transposed)
    history[0, slot] = torch.fmax(history[0, slot], row_amax.amax())  # = ScalingState.record_amax
    return (data, *data_t)


def _cast_record_and_count(x, history, scales, slot, fp8_max, dtype, transposed: bool):
    """:func:`_cast_and_record` on a step that telemetry measures: the same cast, which also
    returns its amax and what it did (``CastStats.counts``), from the same call."""
    data, row_amax, *per_row = _cast_with_stats(x, scales[slot], fp8_max, dtype, transposed)
    amax = row_amax.amax()
    history[0, slot] = torch.fmax(history[0, slot], amax)  # = ScalingState.record_amax
    counts = torch.stack(per_row[: len(COUNTS)]).sum(dim=1)
    return (data, amax, counts, *per_row[len(COUNTS) :])  # the transposed copy last, if made


def _fast_versions(fn, kernel) -> dict[str, Compiled]:
    """``fn``'s two fast versions, each verified against ``fn`` itself: Inductor's compilation of
    it, and the hand-written Triton kernel ``kernel`` of the same function (``cast_kernel.py``)."""
    return {
        "inductor": Compiled(fn, probes=record_probes),
        "triton": Compiled(
            fn, probes=cast_kernel.probes, build=lambda _: kernel, key=cast_kernel.key
        ),
    }


_CAST_AND_RECORD = _fast_versions(_cast_and_record, cast_kernel.cast_and_record)
_CAST_RECORD_AND_COUNT = _fast_versions(_cast_record_and_count, cast_kernel.cast_record_and_count)
CAST_KERNEL_ENV = "FP8OPS_CAST_KERNEL"
CAST_KERNELS = ("auto", *_CAST_AND_RECORD)
_cast_kernel = env_choice(CAST_KERNEL_ENV, CAST_KERNELS, "auto")


def set_cast_kernel(name: str) -> str:
    """Which fast version casts where the casts are compiled (``compiled.py``): ``inductor``
    (torch.compile of ``_cast_and_record``, and of ``_cast_record_and_count`` on the steps
    telemetry measures), ``triton`` (the hand-written kernels of ``cast_kernel.py``), or
    ``auto``: ``triton`` for CUDA tensors, where it was measured faster (docs/gpu.md),
    ``inductor`` elsewhere (Triton's kernels need a GPU). Returns the old choice."""
    global _cast_kernel
    if name not in CAST_KERNELS:
        raise ValueError(f"cast kernel {name!r}: use one of {sorted(CAST_KERNELS)}")
    old, _cast_kernel = _cast_kernel, name
    return old


def _kernel_for(device_type: str) -> str:
    """The fast version (a key of ``_CAST_AND_RECORD``) that casts tensors on a device of this
    type. Under ``auto``: the hand-written kernel on GPUs, where the H200 ran the 8B layer
    stack's FP8 step in 35.5 ms against 38.5 ms with Inductor's; Inductor's elsewhere, since
    Triton's kernels need a GPU. A specialisation that fails its verification runs eager
    either way (``Compiled``), not the other fast version."""
    if _cast_kernel != "auto":
        return _cast_kernel
    return "triton" if device_type == "cuda" else "inductor"


def cast_path(device: torch.device | str) -> str:
    """What runs the ordinary step's casts on ``device``: ``eager``, or ``compiled: inductor``
    / ``compiled: triton`` (each specialisation verified first; one that fails runs eager)."""
    kernel = _kernel_for(torch.device(device).type)
    return f"compiled: {kernel}" if compiles_for(device) else "eager"


def cast_and_record_status() -> dict[str, dict]:
    """Each fast version's verification status per specialisation (the GPU check's report), of
    the ordinary step's cast and the measuring step's: each key starts with the function's name."""
    return {
        name: {
            (versions[name].fn.__name__, *key): status
            for versions in (_CAST_AND_RECORD, _CAST_RECORD_AND_COUNT)
            for key, status in versions[name].status.items()
        }
        for name in _CAST_AND_RECORD
    }


def cast_and_record(
    x: torch.Tensor,
    state: ScalingState,
    slot: int,
    track: dict | None,
    role: str,
    *,
    transposed: bool = False,
) -> QuantizedTensor:
    """Cast ``x`` (2-D) with the slot's current scale and fold its amax into row 0.

    With ``track`` (a dict) the full cast statistics are stored under ``role`` for telemetry;
    without it only the amax pass runs, which is all delayed scaling needs. ``transposed``: the
    cast also makes the transposed copy a backward GEMM will take (``QuantizedTensor.data_t``).
    """
    if not x.numel():  # an empty tensor: nothing for a kernel to do
        if track is None:
            quantized, amax = cast_and_amax(x, state.scale[slot], state.fp8, transposed=transposed)
        else:
            quantized, stats = quantize(x, state.scale[slot], state.fp8, transposed=transposed)
            amax, track[role] = stats.amax, stats
        state.record_amax(slot, amax)
        return quantized
    fp8 = state.fp8
    # The scale this cast uses, before anything could change it.
    scale_inv = torch.reciprocal(state.scale[slot])
    versions = _CAST_AND_RECORD if track is None else _CAST_RECORD_AND_COUNT
    data, *rest = versions[_kernel_for(x.device.type)](
        x.detach(), state.amax_history, state.scale, slot, fp8.max, fp8.torch_dtype, transposed
    )
    if track is not None:
        amax, counts, *rest = rest
        track[role] = CastStats(amax=amax, counts=counts, numel=x.numel())
    return QuantizedTensor(data, scale_inv, fp8, rest[0] if transposed else None)


class Fp8LinearFunction(torch.autograd.Function):
    """``y = x @ W.T + b`` with each of its GEMMs in FP8 or in high precision (``gemms.py``).
    ``x`` is ``[..., in]``, ``W`` is ``[out, in]``.

    The FP8 weight arrives already cast (it may come from the step's first micro-batch; None
    when no FP8 GEMM reads the weight); ``weight`` itself is here to receive its gradient and,
    for a GEMM in high precision, to be multiplied.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, qw, meta, gemm, update_scope, track, dgrad, wgrad, fp8):
        """``qw``: the FP8 weight; ``dgrad``/``wgrad``: whether the backward will compute the
        input's / the weight's gradient; ``fp8``: the GEMMs that run in FP8."""
        x2d = x.reshape(-1, weight.shape[1])  # [tokens, in]
        fp8_wgrad = wgrad and "wgrad" in fp8
        if "fprop" in fp8 or fp8_wgrad:  # cast only for a GEMM that reads it in FP8
            qx = cast_and_record(x2d, meta.forward, FWD_INPUT, track, "input", transposed=fp8_wgrad)
        if "fprop" in fp8:
            out = gemm(qx, qw, out_dtype=x.dtype, bias=bias)  # [tokens, out]
        else:
            out = hp_fprop(x2d, weight, bias)

        # What the backward GEMMs multiply, in the layouts they multiply it in, is all it keeps,
        # as in TE: the FP8 copies for an FP8 GEMM (a quarter of the float32 memory; both
        # transposed copies come from the casts), the high-precision input for a wgrad in high
        # precision (the weight is the parameter itself: no copy).
        fp8_dgrad = dgrad and "dgrad" in fp8
        ctx.save_for_backward(
            qx.transposed().data if fp8_wgrad else None,
            qx.scale_inv if fp8_wgrad else None,
            qw.transposed().data if fp8_dgrad else None,
            qw.scale_inv if fp8_dgrad else None,
            x2d if wgrad and not fp8_wgrad else None,
            weight if dgrad and not fp8_dgrad else None,
        )
        ctx.meta, ctx.gemm, ctx.track, ctx.update_scope = meta, gemm, track, update_scope
        ctx.fp8 = fp8
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.out_features, ctx.has_bias = weight.shape[0], bias is not None
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        qx_t_data, qx_scale_inv, qw_t_data, qw_scale_inv, x2d, weight = ctx.saved_tensors
        fwd = ctx.meta.forward.fp8
        grad2d = grad_out.reshape(-1, ctx.out_features)  # [tokens, out]
        needs_input, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        fp8_dgrad = needs_input and "dgrad" in ctx.fp8
        fp8_wgrad = needs_weight and "wgrad" in ctx.fp8
        if fp8_dgrad or fp8_wgrad:
            qg = cast_and_record(
                grad2d,
                ctx.meta.backward,
                BWD_GRAD_OUTPUT,
                ctx.track,
                "grad_output",
                transposed=fp8_wgrad,
            )
        grad_input = grad_weight = grad_bias = None
        if needs_input:
            if fp8_dgrad:
                qw_t = QuantizedTensor(qw_t_data, qw_scale_inv, fwd)  # [in, out]
                grad_input = ctx.gemm(qg, qw_t, out_dtype=ctx.x_dtype)  # [tokens, in]
            else:
                grad_input = hp_dgrad(grad2d, weight)
            grad_input = grad_input.reshape(ctx.x_shape)
        if needs_weight:
            if fp8_wgrad:
                qx_t = QuantizedTensor(qx_t_data, qx_scale_inv, fwd)  # [in, tokens]
                grad_weight = ctx.gemm(qg.transposed(), qx_t, out_dtype=ctx.w_dtype)  # [out, in]
            else:
                grad_weight = hp_wgrad(grad2d, x2d)
        if needs_bias and ctx.has_bias:
            grad_bias = grad2d.sum(dim=0)

        if ctx.update_scope is not None:
            # This module ran first in the scope, so its backward runs last: every grad
            # amax of this backward pass has been recorded by now.
            ctx.update_scope.reduce_and_update(forward=False)
        return grad_input, grad_weight, grad_bias, *[None] * 8


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    meta: Fp8Meta | None,
    scope: Fp8Scope,
    *,
    gemm: Fp8Gemm,
    cached_weight: QuantizedTensor | None = None,
    track: dict | None = None,
    record: CastRecord | None = None,
    recipe: StatelessRecipe | None = None,
    gemms: frozenset[str] = ALL_GEMMS,
) -> tuple[torch.Tensor, QuantizedTensor | None]:
    """Run one FP8 linear inside ``scope``: under delayed scaling with the module's ``meta``,
    under a stateless recipe with ``meta=None`` — the module's own ``recipe`` (a per-module
    recipe, TE's nested autocast), else the scope's. ``gemms``: the GEMMs that run in FP8 (the
    others in high precision, ``gemms.py``); a tensor no FP8 GEMM reads is not cast, and under
    delayed scaling records no amax, so its history does not roll.

    Returns the output and the FP8 weight used (None: no FP8 GEMM read it); pass that back as
    ``cached_weight`` on later micro-batches of the same step to skip the weight cast (and its
    amax), as TE does when ``is_first_microbatch`` is False.
    """
    if meta is None:  # a module of a stateless recipe: nothing to record or update
        recipe = scope.recipe if recipe is None else recipe
        if not isinstance(recipe, StatelessRecipe):
            raise ValueError(
                f"a module without delayed-scaling state cannot run under {recipe}; "
                "build the module and the scope from the same recipe"
            )
        return stateless_fp8_linear(
            x,
            weight,
            bias,
            recipe,
            gemm=gemm,
            cached_weight=cached_weight,
            track=track,
            record=record,
            gemms=gemms,
        )
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {weight.shape[1]}")
    scope.register(meta)
    # Only a call that will run a backward may own the backward update (TE does the same):
    # otherwise a frozen or no-grad first module would leave gradients never rescaled.
    builds_graph = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias)
    )
    dgrad = builds_graph and x.requires_grad
    wgrad = builds_graph and weight.requires_grad
    fp8_dgrad = dgrad and "dgrad" in gemms
    if cached_weight is None and ("fprop" in gemms or fp8_dgrad):
        cached_weight = cast_and_record(
            weight, meta.forward, FWD_WEIGHT, track, "weight", transposed=fp8_dgrad
        )
    update_scope = scope if builds_graph and scope.claim_backward_update() else None
    out = Fp8LinearFunction.apply(
        x,
        weight,
        bias,
        cached_weight,
        meta,
        gemm,
        update_scope,
        track,
        dgrad,
        wgrad,
        gemms,
    )
    return out, cached_weight


class Fp8Linear(nn.Module):
    """A plain FP8 linear layer (the Megatron tensor-parallel layers build on ``fp8_linear``).

    Outside an active :class:`Fp8Scope` it runs in the weight's dtype, like a TE module
    outside ``fp8_autocast``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        recipe: DelayedScalingRecipe | StatelessRecipe,
        *,
        bias: bool = True,
        gemm: Fp8Gemm | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.recipe = recipe
        self.fp8_meta = Fp8Meta.fresh(recipe) if isinstance(recipe, DelayedScalingRecipe) else None
        self.gemm = gemm or EmulatedGemm()
        self.fp8_gemms = ALL_GEMMS  # the GEMMs in FP8; the others in the weight's dtype
        self.track_stats = False
        self.last_cast_stats: dict | None = None  # role -> CastStats of the last call
        self._weight_fp8 = None  # the step's FP8 weight (delayed: one cast; stateless: two)

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        scope = active_scope()
        if scope is None:
            return nn.functional.linear(x, self.weight, self.bias)
        if scope.recipe != self.recipe:
            raise ValueError(
                f"this module was built for {self.recipe}, the scope runs {scope.recipe}"
            )
        # TE semantics: None means "no micro-batching", so the weight is cast every call.
        reuse = is_first_microbatch is False and self._weight_fp8 is not None
        self.last_cast_stats = {} if self.track_stats else None
        out, weight_fp8 = fp8_linear(
            x,
            self.weight,
            self.bias,
            self.fp8_meta,
            scope,
            gemm=self.gemm,
            cached_weight=self._weight_fp8 if reuse else None,
            track=self.last_cast_stats,
            gemms=self.fp8_gemms,
        )
        # Keep the FP8 weight only when micro-batching says a later call may reuse it.
        self._weight_fp8 = weight_fp8 if is_first_microbatch is not None else None
        return out
