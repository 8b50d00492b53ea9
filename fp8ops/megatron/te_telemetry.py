"""Telemetry of Megatron's TE projections, read from TE's own FP8 state.

The telemetry collector reads, of each module, ``fp8_meta.direction(forward)`` (an amax history
and scales, fp8ops' :class:`~fp8ops.precision.state.ScalingState`), ``weight``, ``fp8_enabled``
and a ``probe`` it attaches. :func:`te_telemetry_modules` gives it that view of a TE model
(``te_backend.build_gpt_te``), one :class:`TeTelemetryModule` per projection:

* the state is TE's own tensors, ``fp8_meta["scaling_fwd"]`` and ``["scaling_bwd"]``
  (``amax_history [L, 3]`` and ``scale [3]`` forward, ``[L, 2]`` and ``[2]`` backward: one GEMM
  per module in Megatron's spec, the layout fp8ops' state copies), read afresh every row, because
  TE rebinds them (loading a checkpoint, changing the history length). A history loaded at
  another length, which TE adjusts only at the next forward, is shown as TE will adjust it.
  Reading them costs no
  kernel of its own: the collector snapshots every module's state in three ``cat`` s per row,
  whatever the backend. Before a module's first FP8 forward TE has no state for it yet; the view
  then shows the state TE will create (scales 1, histories 0), as fp8ops' own layers start;
* a forward hook counts each call's GEMMs, in FP8 or in the base dtype (TE sets ``module.fp8``
  at every forward), and on statistics steps the norm of the module's input (of a
  ``LayerNormLinear``, the input before its norm).

Not read from TE: saturation and underflow (TE's casts keep no counts, and the input a
``LayerNormLinear`` casts is its normalised input, which the hook does not see) and the
FP8-vs-reference error (for the same reason); their columns stay NaN on the TE backend. No machine
here has Transformer Engine: the tests run this against a stand-in that keeps TE's documented
layout (``../shared/reference/transformer-engine.md`` §1-2), not against TE.
"""

from __future__ import annotations

import torch
from torch import nn

from fp8ops.precision.recipe import DelayedScalingRecipe
from fp8ops.precision.state import ScalingState

SLOTS_PER_GEMM = {True: 3, False: 2}  # TE's FP8FwdTensors / FP8BwdTensors
TE_KEYS = {True: "scaling_fwd", False: "scaling_bwd"}


class TeFp8MetaView:
    """A TE module's delayed-scaling state as ``Fp8Meta.direction`` gives it: TE's tensors."""

    def __init__(self, module: nn.Module, recipe: DelayedScalingRecipe, name: str):
        self.module, self.recipe, self.name = module, recipe, name
        self._initial: dict[bool, ScalingState] = {}

    def direction(self, forward: bool) -> ScalingState:
        fp8 = self.recipe.fp8_format.forward if forward else self.recipe.fp8_format.backward
        state = self.module.fp8_meta.get(TE_KEYS[forward])
        if (
            state is None
        ):  # no FP8 forward yet: the state TE will create (DelayedScalingRecipeState)
            if forward not in self._initial:
                initial = ScalingState.fresh(
                    self.recipe.amax_history_len, SLOTS_PER_GEMM[forward], fp8
                )
                device = self.module.weight.device
                initial.amax_history, initial.scale = (
                    initial.amax_history.to(device),
                    initial.scale.to(device),
                )
                self._initial[forward] = initial
            return self._initial[forward]
        slots = state.amax_history.shape[1]
        if slots != SLOTS_PER_GEMM[forward]:
            raise ValueError(
                f"{self.name}: TE's fp8_meta[{TE_KEYS[forward]!r}].amax_history has {slots} "
                f"slots, telemetry reads modules of one GEMM ({SLOTS_PER_GEMM[forward]}); a "
                "module of several GEMMs (LayerNormMLP) is not one of Megatron's GPT projections"
            )
        history = _at_length(state.amax_history, self.recipe.amax_history_len)
        return ScalingState(amax_history=history, scale=state.scale, fp8=fp8)


def _at_length(history: torch.Tensor, length: int) -> torch.Tensor:
    """``history`` as TE will have it at the module's next forward: a checkpoint saved with
    another ``amax_history_len`` loads at its own length, and TE's
    ``adjust_amax_history_length`` truncates it or pads it with zeros at the end then
    (reference §4). A copy, only in that case."""
    if history.shape[0] == length:
        return history
    if history.shape[0] > length:
        return history[:length].clone()
    return torch.nn.functional.pad(history, (0, 0, 0, length - history.shape[0]))


class TeTelemetryModule:
    """One TE projection, seen by the telemetry collector as an fp8ops FP8 linear."""

    def __init__(self, module: nn.Module, recipe: DelayedScalingRecipe, name: str):
        self.module = module
        self.fp8_meta = TeFp8MetaView(module, recipe, name)
        self.probe = None  # the collector attaches one (TelemetryCollector.set_active)
        self._hook = module.register_forward_hook(self._after_forward)

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight

    @property
    def fp8_enabled(self) -> bool:
        return self.module.fp8_enabled

    def remove(self) -> None:
        """Detach the forward hook (the module runs unobserved)."""
        self._hook.remove()

    def _after_forward(self, module, args, output) -> None:
        if self.probe is None:
            return
        x = args[0]
        # TE sets module.fp8 at every forward: whether this one ran its GEMMs in FP8.
        if getattr(module, "fp8", False):
            self.probe.fp8_call(x, output, module.weight, None, error=False)
        else:
            self.probe.fallback_call(x, module.weight)


def te_telemetry_modules(model: nn.Module, recipe: DelayedScalingRecipe) -> dict:
    """The decoder's TE projections (those carrying ``fp8_enabled``) by fully qualified name,
    in module order, as the telemetry collector reads them."""
    return {
        name: TeTelemetryModule(module, recipe, name)
        for name, module in model.named_modules()
        if hasattr(module, "fp8_enabled") and name.split(".", 1)[0] == "decoder"
    }
