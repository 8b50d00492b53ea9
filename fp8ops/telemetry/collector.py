"""The collector: one ``[modules, metrics]`` row of telemetry per step, from the model itself.

Reading order: :class:`TelemetryCollector` attaches a :class:`~fp8ops.telemetry.probe.Probe` to
every FP8-capable module; the trainer calls :meth:`begin_step` before the step's first
micro-batch and :meth:`end_step` after its last backward, before the optimizer zeroes the
gradients. The FP8 state has then been updated for this step, so the row holds the scales the
next step will use.

Cadence (``telemetry`` section of the manifest): the scaling state is read every step (it is
there anyway); full cast statistics and norms every ``every_steps`` steps, because they cost
extra passes over every cast tensor; the FP8-vs-reference error every ``error_sample_every``
steps, because it costs one more GEMM per module. Unmeasured values are NaN.

On a GPU a row costs one device-to-host transfer: the FP8 state of every module and every
measured value (still tensors on the device until then) travel together.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from fp8ops.precision.scaling import BWD_GRAD_OUTPUT, FWD_INPUT, FWD_WEIGHT
from fp8ops.telemetry.catalogue import COLUMN, MODULE_METRIC_NAMES
from fp8ops.telemetry.probe import Probe

# (slot name in the catalogue, forward?, slot index in the FP8 state)
_SLOTS = (("input", True, FWD_INPUT), ("weight", True, FWD_WEIGHT),
          ("grad_output", False, BWD_GRAD_OUTPUT))  # fmt: skip


class TelemetryCollector:
    """Per-step telemetry rows for a model's FP8-capable modules (in module order)."""

    def __init__(self, modules: dict, telemetry_cfg):
        """``modules``: FQN -> FP8 linear (``fp8ops.megatron.fp8_modules(model)``)."""
        self.modules = modules
        self.names = list(modules)
        self.cfg = telemetry_cfg
        self._previous_scale: dict[str, dict[str, float]] = {}
        self.active = False
        self.set_active(True)

    def set_active(self, active: bool) -> None:
        """Attach probes to the modules (True) or remove them, so the model runs unobserved
        (False: :meth:`end_step` then returns an all-NaN row). Benchmarks toggle this."""
        if active != self.active:
            for module in self.modules.values():
                module.probe = Probe() if active else None
            self.active = active

    @contextlib.contextmanager
    def paused(self):
        """Run the model unobserved (an evaluation): its GEMMs, casts and errors must not land
        in the next training step's row. The probes come back empty."""
        was_active = self.active
        self.set_active(False)
        try:
            yield
        finally:
            self.set_active(was_active)

    def seed_previous_scales(self) -> None:
        """After a checkpoint is loaded: the scales it restored are the "previous" ones, so the
        first resumed row reports the same scale change an uninterrupted run would."""
        states = self._host_states()
        for name in self.modules:
            self._previous_scale[name] = {
                slot: float(states[name][forward][1][index]) for slot, forward, index in _SLOTS
            }

    def begin_step(self, step: int) -> None:
        """Set this step's cadence on every probe (``step`` counts from 1)."""
        if not self.active:
            return
        measure = step % self.cfg.every_steps == 0
        sample = step % self.cfg.error_sample_every == 0
        for module in self.modules.values():
            module.probe.measure = measure
            module.probe.sample_error = sample and module.fp8_enabled

    def end_step(self) -> np.ndarray:
        """This step's ``[modules, metrics]`` float32 row (NaN where nothing was measured)."""
        row = np.full((len(self.names), len(MODULE_METRIC_NAMES)), np.nan, dtype=np.float32)
        if not self.active:
            return row
        states = self._host_states()
        records = [module.probe.take() for module in self.modules.values()]
        measured = _to_host(
            [
                self._measured(module, record)
                for module, record in zip(self.modules.values(), records)
            ]
        )
        for i, (name, module) in enumerate(self.modules.items()):
            values = self._state_metrics(name, states[name])
            values.update(self._counts(module, records[i]))
            values.update(measured[i])
            for metric, value in values.items():
                row[i, COLUMN[metric]] = value
        return row

    # -- the three kinds of metrics --------------------------------------------------------

    def _host_states(self) -> dict[str, dict[bool, tuple[torch.Tensor, torch.Tensor]]]:
        """Every module's (amax history, scale) per direction (forward True), in host memory.

        On the CPU these are the state's own tensors (read only, no copy). On a GPU they come
        over in one copy for all modules: a transfer per tensor is a host sync each, four per
        module and step.
        """
        directions = [
            module.fp8_meta.direction(forward)
            for module in self.modules.values()
            for forward in (True, False)
        ]
        tensors = [t for state in directions for t in (state.amax_history, state.scale)]
        if any(t.device.type != "cpu" for t in tensors):
            tensors = _host_copies(tensors)
        host = iter(tensors)
        return {
            name: {forward: (next(host), next(host)) for forward in (True, False)}
            for name in self.modules
        }

    def _state_metrics(self, name: str, states: dict) -> dict[str, float]:
        """From the delayed-scaling state (host copies: :meth:`_host_states`): what the scales
        are and what they are based on."""
        # numpy on the small CPU state: this runs every step for every module, and a torch
        # call per value (quantile, item) would cost more than the whole rest of the row.
        values = {}
        previous = self._previous_scale.setdefault(name, {})
        for slot, forward, index in _SLOTS:
            amax_history, scale_tensor = states[forward]
            history = amax_history[1:, index].numpy()  # row 0 is the accumulator
            scale = float(scale_tensor[index])
            values[f"{slot}.amax"] = history[-1]
            values[f"{slot}.scale"] = scale
            values[f"{slot}.scale_inv"] = 1.0 / scale
            values[f"{slot}.window_max"] = history.max()
            seen = np.sort(history[history > 0])
            if seen.size:
                values[f"{slot}.window_p50"] = _quantile(seen, 0.5)
                values[f"{slot}.window_p90"] = _quantile(seen, 0.9)
            if slot in previous:
                ratio = scale / previous[slot]
                values[f"{slot}.scale_change"] = max(ratio, 1.0 / ratio)
            previous[slot] = scale
        return values

    @staticmethod
    def _measured(module, record: Probe) -> dict[str, torch.Tensor | float]:
        """What this step measured, as 0-dim tensors where the device computed it: saturation,
        underflow, NaN and Inf over all micro-batches' casts, and the norms."""
        values: dict[str, torch.Tensor | float] = {}
        for slot, _, _ in _SLOTS:
            stats = [log[slot] for log in record.cast_logs if slot in log]
            if not stats:
                continue
            numel = sum(s.numel for s in stats)
            for name in ("saturated", "underflow", "nan", "inf"):
                total = torch.stack([getattr(s, name) for s in stats]).sum()
                metric = {"saturated": "saturation"}.get(name, name)
                # Fractions as Python computes int / int: in float64, then into the float32 row.
                ratio = name in ("saturated", "underflow")
                values[f"{slot}.{metric}"] = total.double() / numel if ratio else total
        values["input_norm"] = record.input_norm
        values["fp8_rel_error"] = record.rel_error
        if record.measure:
            values["weight_norm"] = module.weight.detach().float().norm()
            grad = module.weight.grad
            values["grad_norm"] = grad.float().norm() if grad is not None else math.nan
        return values

    @staticmethod
    def _counts(module, record: Probe) -> dict[str, float]:
        return {
            "fp8_gemms": record.fp8_gemms,
            "fallback_gemms": record.fallback_gemms,
            "fp8_enabled": float(module.fp8_enabled),
        }


def _to_host(rows: list[dict[str, torch.Tensor | float]]) -> list[dict[str, float]]:
    """The same dicts with every tensor replaced by its value, all fetched in one transfer
    (float64 holds float32 norms and int64 counts below 2**53 exactly)."""
    tensors = [v for values in rows for v in values.values() if isinstance(v, torch.Tensor)]
    if tensors:
        host = iter(torch.stack([t.reshape(()).double() for t in tensors]).cpu().tolist())
    return [
        {k: next(host) if isinstance(v, torch.Tensor) else v for k, v in values.items()}
        for values in rows
    ]


def _host_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Float32 host copies of ``tensors`` (one device, any shapes) in one transfer."""
    flat = torch.cat([t.reshape(-1).float() for t in tensors]).cpu()
    pieces = flat.split([t.numel() for t in tensors])
    return [piece.view(t.shape) for piece, t in zip(pieces, tensors, strict=True)]


def _quantile(ordered: np.ndarray, q: float) -> float:
    """numpy's default (linear) quantile of sorted values; ``np.quantile`` costs ~30 us a call
    in argument handling, more than the whole row of a small module."""
    position = q * (ordered.size - 1)
    low = int(position)
    high = min(low + 1, ordered.size - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (position - low))
