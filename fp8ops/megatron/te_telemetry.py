"""Telemetry of Megatron's TE projections, read from TE's own FP8 state.

The telemetry collector reads, of each module, ``fp8_meta.direction(forward)`` (an amax history
and scales, fp8ops' :class:`~fp8ops.precision.state.ScalingState`), ``weight``, ``fp8_enabled``
and a ``probe`` it attaches; the trainer's checkpoints and rank checks read the same
``fp8_meta``. :func:`te_telemetry_modules` gives that view of a TE model
(``te_backend.build_gpt_te``), one :class:`TeTelemetryModule` per projection:

* the state is TE's own ``fp8_meta`` tensors, read through ``te_state.TeFp8MetaView`` (the
  view checkpoints use too). Reading them costs no kernel of its own: the collector snapshots
  every module's state in three ``cat`` s per row, whatever the backend;
* a forward hook counts each call's GEMMs, in FP8 or in the base dtype (TE sets ``module.fp8``
  at every forward), and on statistics steps measures the norm of the module's input (of a
  ``LayerNormLinear``, the input before its norm);
* on statistics steps, saturation, underflow, NaN and Inf of TE's casts are recomputed from the
  tensors TE cast and the scales it used (TE's casts keep no counts): the weight (whenever TE
  casts it: not on micro-batches where ``is_first_microbatch`` is False), the input of a plain
  ``Linear``, and the output's gradient (a hook on the output). The input a ``LayerNormLinear``
  casts is its normalised input, which the hook does not see: its counts stay NaN. With
  sequence parallelism a row-parallel module's output gradient is this rank's part of what TE
  gathers and casts.

The FP8-vs-reference error stays NaN for every TE module: the hook sees neither the GEMM's
higher-precision result nor, for a ``LayerNormLinear``, its input. Activation recompute is not
supported (fp8ops' manifests cannot turn it on): TE's recompute pass would run the hooks again.

No machine here has Transformer Engine: the tests run this against a stand-in that keeps TE's
layout TE documents for ``fp8_meta`` (``scaling_fwd``/``scaling_bwd`` with ``scale`` and
``amax_history``; ``tests/support/te_stand_in.py`` lists what it keeps), not against TE.
"""

from __future__ import annotations

import torch
from torch import nn

from fp8ops.megatron.te_backend import te_projections
from fp8ops.megatron.te_state import TeFp8MetaView
from fp8ops.precision.quantize import CastStats, quantize
from fp8ops.precision.recipe import DelayedScalingRecipe
from fp8ops.precision.scaling import BWD_GRAD_OUTPUT, FWD_INPUT, FWD_WEIGHT


class TeTelemetryModule:
    """One TE projection, seen by the telemetry collector as an fp8ops FP8 linear."""

    def __init__(self, module: nn.Module, recipe: DelayedScalingRecipe, name: str):
        self.module = module
        self.fp8_meta = TeFp8MetaView(module, recipe, name)
        self.probe = None  # the collector attaches one (TelemetryCollector.set_active)
        self._casts_weight = True  # whether the forward in progress casts the weight
        self._hooks = (
            module.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            module.register_forward_hook(self._after_forward),
        )

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight

    @property
    def fp8_enabled(self) -> bool:
        return self.module.fp8_enabled

    def remove(self) -> None:
        """Detach the hooks (the module runs unobserved)."""
        for hook in self._hooks:
            hook.remove()

    def _before_forward(self, module, args, kwargs) -> None:
        # Read before the forward, which clears Megatron's flag (TELinear.forward).
        self._casts_weight = _casts_weight(module, kwargs)

    def _after_forward(self, module, args, output) -> None:
        probe = self.probe
        if probe is None:
            return
        x = args[0]
        # TE sets module.fp8 at every forward: whether this one ran its GEMMs in FP8.
        if not getattr(module, "fp8", False):
            probe.fallback_call(x, module.weight)
            return
        probe.fp8_call(x, output, module.weight, None, error=False)
        if probe.measure:
            out = output[0] if isinstance(output, tuple) else output  # Megatron: (out, bias)
            self._cast_statistics(probe, x, out)

    def _cast_statistics(self, probe, x: torch.Tensor, out: torch.Tensor) -> None:
        """On statistics steps: what TE's casts of this forward did, recomputed with the scales
        they used (the update comes at the autocast's exit, after this hook). An extra pass
        over each tensor, as fp8ops' own statistics casts cost; none on other steps."""
        log = probe.track()
        forward = self.fp8_meta.direction(True)
        with torch.no_grad():
            if self._casts_weight:  # else TE reused the FP8 weight of an earlier micro-batch
                log["weight"] = _stats(self.weight, forward.scale[FWD_WEIGHT], forward.fp8)
            # A LayerNormLinear casts its normalised input, which this hook does not see.
            if not hasattr(self.module, "layer_norm_weight"):
                log["input"] = _stats(x, forward.scale[FWD_INPUT], forward.fp8)
        if out.requires_grad:
            # The gradient TE casts in backward is the gradient of this output; the backward
            # scale is read when it arrives (the backward update comes after the whole pass).
            def grad_statistics(grad: torch.Tensor) -> None:
                backward = self.fp8_meta.direction(False)
                with torch.no_grad():
                    log["grad_output"] = _stats(grad, backward.scale[BWD_GRAD_OUTPUT], backward.fp8)

            out.register_hook(grad_statistics)


def _casts_weight(module: nn.Module, kwargs: dict) -> bool:
    """Whether TE casts the weight in this forward: unless ``is_first_microbatch`` is False,
    which makes it reuse the FP8 weight cached by the step's first micro-batch. Megatron's TE
    linears keep the flag on the module and pass None instead when
    ``disable_parameter_transpose_cache`` is set; TE's own modules take it as an argument."""
    if "is_first_microbatch" in kwargs:
        flag = kwargs["is_first_microbatch"]
    elif getattr(module, "disable_parameter_transpose_cache", False):
        flag = None
    else:
        flag = getattr(module, "is_first_microbatch", None)
    return flag is not False


def _stats(x: torch.Tensor, scale: torch.Tensor, fp8) -> CastStats:
    return quantize(x.detach(), scale, fp8)[1]


def te_telemetry_modules(model: nn.Module, recipe: DelayedScalingRecipe) -> dict:
    """The decoder's TE projections (``te_backend.te_projections``) by fully qualified name,
    in module order, as the telemetry collector reads them."""
    return {
        name: TeTelemetryModule(module, recipe, name)
        for name, module in te_projections(model).items()
    }
