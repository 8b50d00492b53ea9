"""Per-module delayed-scaling state, laid out as TE's ``fp8_meta``.

Forward: ``amax_history [L, 3]`` and ``scale [3]`` for (input, weight, output).
Backward: ``amax_history [L, 2]`` and ``scale [2]`` for (grad_output, grad_input).
Scales start at 1, histories at 0. The OUTPUT and GRAD_INPUT slots are only used when an
FP8 output is requested, so they normally stay at scale 1 with a zero history, as in TE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp8ops.precision.formats import Fp8Dtype
from fp8ops.precision.recipe import DelayedScalingRecipe


@dataclass
class ScalingState:
    """One direction of one module: the amax history and the scales of its slots."""

    amax_history: torch.Tensor  # [L, n] float32; row 0 accumulates since the last update
    scale: torch.Tensor  # [n] float32; what the next casts multiply by
    fp8: Fp8Dtype
    # [n] float32: the amax each slot last fed an update (the reduced row 0 of an update in which
    # it ran), for telemetry; NaN once the collector starts a step, until the slot feeds one.
    # Not part of the state a checkpoint holds. None: not tracked (TE's own state).
    last_amax: torch.Tensor | None = None

    @classmethod
    def fresh(
        cls, history_len: int, num_slots: int, fp8: Fp8Dtype, device: torch.device | None = None
    ) -> ScalingState:
        return cls(
            amax_history=torch.zeros(history_len, num_slots, dtype=torch.float32, device=device),
            scale=torch.ones(num_slots, dtype=torch.float32, device=device),
            fp8=fp8,
            last_amax=torch.full((num_slots,), math.nan, dtype=torch.float32, device=device),
        )

    def record_amax(self, slot: int, amax: torch.Tensor) -> None:
        """Max-accumulate a cast's amax into row 0, as TE's atomicMaxFloat does."""
        row = self.amax_history[0]
        row[slot] = torch.fmax(row[slot], amax.to(row.dtype))

    @torch.no_grad()
    def carry_scales(self, factor: float) -> None:
        """Multiply every scale an update has set by ``factor``, a power of two (in place).

        Used when a resume changes the FP8 maximum or the margin: the histories hold raw
        amaxes, valid under any recipe, but each scale was computed for the old
        ``fp8_max * 2**-margin``. Both are powers of two apart, and multiplying a correctly
        rounded quotient by a power of two is exact, so the result is bit for bit the scale the
        last update would have computed under the new recipe. Exceptions: a result outside
        float32's normal range (an infinite product becomes FLT_MAX, as the update clamps), and
        an old scale the update had clamped to FLT_MAX (an amax so small that the quotient
        overflowed: the new one may not).

        A slot no update has set keeps its initial scale 1, as the new recipe would: one whose
        scale is 1 and whose history holds no finite positive amax. (An update that set exactly
        1, from an amax that has since left the history, is taken for none; with
        ``amax_history_len`` 1 every amax leaves at once.)
        """
        _check_power_of_two(factor)
        # One rounding, of the exact product: float64 holds both factors exactly.
        carried = (self.scale.double() * factor).to(torch.float32)
        carried = torch.where(torch.isinf(carried), torch.finfo(torch.float32).max, carried)
        history = self.amax_history
        seen = (torch.isfinite(history) & (history > 0)).any(dim=0)
        self.scale.copy_(torch.where((self.scale != 1.0) | seen, carried, self.scale))


@dataclass
class Fp8Meta:
    """The full delayed-scaling state of one single-GEMM module (TE: ``num_gemms = 1``)."""

    forward: ScalingState
    backward: ScalingState
    recipe: DelayedScalingRecipe  # what the state was built for; a scope checks it matches

    @classmethod
    def fresh(cls, recipe: DelayedScalingRecipe) -> Fp8Meta:
        return cls(
            recipe=recipe,
            forward=ScalingState.fresh(recipe.amax_history_len, 3, recipe.fp8_format.forward),
            backward=ScalingState.fresh(recipe.amax_history_len, 2, recipe.fp8_format.backward),
        )

    def direction(self, forward: bool) -> ScalingState:
        return self.forward if forward else self.backward

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors only (never pickled objects), with TE's ``_extra_state`` key names."""
        return {
            "scale_fwd": self.forward.scale.clone(),
            "amax_history_fwd": self.forward.amax_history.clone(),
            "scale_bwd": self.backward.scale.clone(),
            "amax_history_bwd": self.backward.amax_history.clone(),
        }

    @torch.no_grad()  # a loaded tensor that requires grad must not make the state require it
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for key, target in (
            ("scale_fwd", self.forward.scale),
            ("amax_history_fwd", self.forward.amax_history),
            ("scale_bwd", self.backward.scale),
            ("amax_history_bwd", self.backward.amax_history),
        ):
            if state[key].shape != target.shape:
                raise ValueError(
                    f"FP8 state {key}: shape {tuple(state[key].shape)} does not match "
                    f"this module's {tuple(target.shape)}"
                )
            target.copy_(state[key])


def scale_factor(old: DelayedScalingRecipe, new: DelayedScalingRecipe, forward: bool) -> float:
    """``new``'s ``fp8_max * 2**-margin`` over ``old``'s for one direction: what a scale computed
    under ``old`` must be multiplied by to be ``new``'s (a power of two: 448 and 57344 are)."""

    def top(recipe: DelayedScalingRecipe) -> float:  # exact in float64
        fp8 = recipe.fp8_format.forward if forward else recipe.fp8_format.backward
        return math.ldexp(fp8.max, -recipe.margin)

    return top(new) / top(old)


def carry_scales(metas, old: DelayedScalingRecipe, new: DelayedScalingRecipe) -> dict[str, float]:
    """Make scales computed under ``old`` the scales of ``new`` (:meth:`ScalingState.carry_scales`)
    in every ``Fp8Meta`` (or TE view) of ``metas``; returns the factor per direction, only where
    it is not 1 (empty: nothing to do)."""
    factors = {
        direction: scale_factor(old, new, forward)
        for direction, forward in (("forward", True), ("backward", False))
    }
    factors = {direction: f for direction, f in factors.items() if f != 1.0}
    for meta in metas:
        for direction, factor in factors.items():
            meta.direction(direction == "forward").carry_scales(factor)
    return factors


def _check_power_of_two(factor: float) -> None:
    mantissa, _ = math.frexp(factor)
    if factor <= 0 or mantissa != 0.5:
        raise ValueError(f"a scale factor must be a power of two, got {factor!r}")
