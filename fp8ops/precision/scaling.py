"""Delayed scaling: the per-module state and its update, identical to Transformer Engine's.

Every backend (the CPU emulation, a native FP8 GEMM, and TE itself on a GPU) shares this one
bookkeeping. The semantics are those of TE's fused kernel
``common/recipe/delayed_scaling.cu::kernel_bulk`` (see ``docs/precision.md``):

* row 0 of ``amax_history`` is an accumulator: casts max-accumulate into it between updates;
* at an update, a slot whose (reduced) amax is 0 is neither rolled nor rescaled, so a module
  that did not run keeps its state;
* otherwise the window is the L-1 past values plus the current one; its max ignores NaN and
  propagates +inf; the history rolls to ``[0, h[2], ..., h[L-1], current]``;
* the new scale is one IEEE float32 division ``fp32(fp8_max * 2**-margin) / amax`` when that
  amax is finite and positive, else the old scale; an infinite quotient becomes FLT_MAX.

Beyond TE's two fused algorithms ("max", "most_recent") we offer window statistics that TE
can only express as a *callable* ``amax_compute_algo``. TE runs callables on its unfused
Python path, whose semantics differ (it always rolls, and computes the scale as
``(fp8_max / amax) / 2**margin`` in two roundings); those algorithms follow that path exactly,
so a TE run given the same callable produces the same scales.
"""

from __future__ import annotations

import functools
import math

import torch

from fp8ops.amax_algo import AmaxAlgo, parse_amax_algo

FLT_MAX = torch.finfo(torch.float32).max

# Slot indices within one GEMM's state, as in TE's FP8FwdTensors / FP8BwdTensors.
FWD_INPUT, FWD_WEIGHT, FWD_OUTPUT = 0, 1, 2
BWD_GRAD_OUTPUT, BWD_GRAD_INPUT = 0, 1


# --------------------------------------------------------------------------------------
# Window statistics (TE's callable path)
# --------------------------------------------------------------------------------------


def window_amax(algo: AmaxAlgo, amax_history: torch.Tensor) -> torch.Tensor:
    """The statistic of a callable-path algorithm over the full ``[L, n]`` history.

    NaN entries count as 0, as the fused kernel's ``fmaxf`` reduction (seeded with 0)
    ignores them.
    """
    history = torch.nan_to_num(amax_history, nan=0.0, posinf=math.inf, neginf=0.0)
    length = history.shape[0]
    if algo.kind == "quantile":
        # torch.quantile(history, q, dim=0, interpolation="higher"): the value at a sorted
        # index, found without sorting every window.
        return _order_statistic(history, _quantile_index(algo.q, length, history.dtype))
    if algo.kind == "trimmed_max":
        # The (k+1)-th largest value: drop the k largest outliers of the window.
        return _order_statistic(history, length - 1 - min(algo.k, length - 1))
    raise ValueError(f"{algo.name!r} is a fused algorithm, not a window statistic")


@functools.cache
def _quantile_index(q: float, length: int, dtype: torch.dtype) -> int:
    """The sorted index ``torch.quantile(..., interpolation="higher")`` takes in a window of
    ``length``: asked of torch itself (on 0, 1, ..., length - 1), so that its rounding of
    ``q * (length - 1)`` in ``dtype`` is the one used."""
    ranks = torch.arange(length, dtype=dtype)
    return int(torch.quantile(ranks, q, interpolation="higher").item())


def _order_statistic(values: torch.Tensor, index: int) -> torch.Tensor:
    """The ``index``-th smallest of ``values`` along dim 0 (0-based). A few values from either
    end: a top-k (a 0.99 quantile of 1024 is the 11th largest); else torch's selection."""
    above = values.shape[0] - index
    if above <= _FEW:
        return values.topk(above, dim=0).values[-1]
    if index < _FEW:
        return values.topk(index + 1, dim=0, largest=False).values[-1]
    return values.kthvalue(index + 1, dim=0).values


_FEW = 64  # up to here a top-k is faster than kthvalue (measured, docs/benchmarks/recipes.md)


# --------------------------------------------------------------------------------------
# The update
# --------------------------------------------------------------------------------------


def scaled_max(fp8_max: float, margin: int) -> float:
    """``fp8_max * 2**-margin`` as TE's host code forms it, ``float * powf(2.f, -margin)``: both
    factors float32, and so the product (a margin past 149 gives 0, as in TE)."""
    power = torch.tensor(math.ldexp(1.0, min(-margin, 1000)), dtype=torch.float32)
    return (torch.tensor(fp8_max, dtype=torch.float32) * power).item()


def _scaled_max(fp8_max: float, margin: int, like: torch.Tensor) -> torch.Tensor:
    # A full tensor rather than a 0-dim one keeps torch off its scalar fast paths.
    return torch.full_like(like, scaled_max(fp8_max, margin))


def update_delayed_scaling(
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    *,
    fp8_max: float,
    margin: int,
    algo: str | AmaxAlgo,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One delayed-scaling update of ``n`` slots, bit for bit TE's.

    Args:
        amax_history: ``[L, n]`` float32; row 0 holds the amaxes accumulated since the last update.
        scale: ``[n]`` float32, the scales the casts used.
        amax: ``[n]`` float32, the amaxes after the all-reduce (equal to row 0 without one).
        fp8_max: 448 (E4M3) or 57344 (E5M2).
        margin: scale = fp8_max / amax / 2**margin.
        algo: "max" or "most_recent" (TE's fused kernel) or a window statistic
            ("quantile:Q", "trimmed_max:K") following TE's callable-algorithm path.

    Returns:
        ``(new_history, new_scale)``, new tensors; the inputs are not modified.
    """
    algo = parse_amax_algo(algo) if isinstance(algo, str) else algo
    _check_shapes(amax_history, scale, amax)
    if algo.fused:
        return _fused_update(amax_history, scale, amax, fp8_max, margin, algo.kind)
    return _callable_path_update(amax_history, scale, amax, fp8_max, margin, algo)


def _check_shapes(amax_history: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor) -> None:
    for name, t in (("amax_history", amax_history), ("scale", scale), ("amax", amax)):
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
    if amax_history.dim() != 2 or amax_history.shape[0] < 1:
        raise ValueError(f"amax_history must be [L >= 1, n], got {tuple(amax_history.shape)}")
    n = amax_history.shape[1]
    if scale.shape != (n,) or amax.shape != (n,):
        raise ValueError(
            f"scale and amax must be [{n}], got {tuple(scale.shape)} and {tuple(amax.shape)}"
        )


def _fused_update(amax_history, scale, amax, fp8_max, margin, kind):
    """TE's ``kernel_bulk``, vectorised over slots."""
    # last = reduced amax, or this rank's row 0 where the reduction gave exactly 0 (NaN != 0).
    last = torch.where(amax != 0, amax, amax_history[0])
    ran = last != 0  # a slot that saw no non-zero amax is neither rolled nor rescaled

    window = torch.cat([amax_history[1:], last.unsqueeze(0)])
    # fmaxf-reduce seeded with 0.0: NaN entries are ignored, +inf wins.
    window_max = torch.where(torch.isnan(window), 0.0, window).amax(dim=0).clamp_min(0.0)
    # [0, h[2], ..., h[L-1], last]; for L == 1 the window is [last] and this is [0.0].
    rolled = torch.cat([torch.zeros_like(last).unsqueeze(0), window[1:]])
    new_history = torch.where(ran, rolled, amax_history)

    new_amax = last if kind == "most_recent" else torch.where(ran, window_max, 0.0)
    return new_history, _new_scale_ieee(new_amax, scale, _scaled_max(fp8_max, margin, scale))


def _new_scale_ieee(amax, scale, scaled_max):
    usable = torch.isfinite(amax) & (amax > 0)
    # Tensor / tensor on float32 is one correctly rounded division (TE: div.rn.f32). The
    # denominator of unusable slots is replaced by 1 so no inf/NaN is ever produced there.
    quotient = scaled_max / torch.where(usable, amax, 1.0)
    new_scale = torch.where(usable, quotient, scale)
    # The kernel clamps after choosing, so a kept infinite scale (loaded state) is clamped too.
    return torch.where(torch.isinf(new_scale), FLT_MAX, new_scale).to(torch.float32)


def _callable_path_update(amax_history, scale, amax, fp8_max, margin, algo):
    """TE's unfused path (``_amax_and_scale_update``) with a window-statistic callable."""
    history = amax_history.clone()
    history[0] = amax
    window = window_amax(algo, history)
    # Always rolls, even for a zero amax: old values age out (unlike the fused kernel).
    new_history = torch.roll(history, -1, dims=0)
    new_history[0] = 0.0
    return new_history, callable_path_scale(window, scale, fp8_max, margin)


def callable_path_scale(window, scale, fp8_max: float, margin: int) -> torch.Tensor:
    """TE's ``_default_sf_compute`` on a window statistic, same expression and order, so the
    same roundings; ``scale`` where the statistic is not finite and positive."""
    sf = (fp8_max / window) / (2.0**margin)
    sf = torch.where(window > 0.0, sf, scale)
    sf = torch.where(torch.isfinite(window), sf, scale)
    sf = torch.where(torch.isinf(sf), torch.full_like(sf, FLT_MAX), sf)
    return sf.to(torch.float32)
