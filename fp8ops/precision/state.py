"""Per-module delayed-scaling state, laid out as TE's ``fp8_meta``.

Forward: ``amax_history [L, 3]`` and ``scale [3]`` for (input, weight, output).
Backward: ``amax_history [L, 2]`` and ``scale [2]`` for (grad_output, grad_input).
Scales start at 1, histories at 0. The OUTPUT and GRAD_INPUT slots are only used when an
FP8 output is requested, so they normally stay at scale 1 with a zero history, as in TE.
"""

from __future__ import annotations

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

    @classmethod
    def fresh(
        cls, history_len: int, num_slots: int, fp8: Fp8Dtype, device: torch.device | None = None
    ) -> ScalingState:
        return cls(
            amax_history=torch.zeros(history_len, num_slots, dtype=torch.float32, device=device),
            scale=torch.ones(num_slots, dtype=torch.float32, device=device),
            fp8=fp8,
        )

    def record_amax(self, slot: int, amax: torch.Tensor) -> None:
        """Max-accumulate a cast's amax into row 0, as TE's atomicMaxFloat does."""
        row = self.amax_history[0]
        row[slot] = torch.fmax(row[slot], amax.to(row.dtype))


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
