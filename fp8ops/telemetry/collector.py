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

On a GPU a row costs one device-to-host transfer for the FP8 state of every module, and on
measuring steps one more for every measured value (tensors on the device until then).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

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
        # [modules, slots] scales of the last row (NaN before the first): for scale_change.
        self._previous_scale = np.full((len(self.names), len(_SLOTS)), np.nan)
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
        if self.names:
            _, scale = self._slot_arrays(self._host_states())
            self._previous_scale = scale.astype(np.float64)

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
        for metric, values in self._state_metrics(states).items():
            row[:, COLUMN[metric]] = values
        for i, module in enumerate(self.modules.values()):
            for metric, value in (self._counts(module, records[i]) | measured[i]).items():
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

    def _slot_arrays(self, states: dict) -> tuple[np.ndarray, np.ndarray]:
        """``[modules, slots, L-1]`` float32 amax histories without the accumulator row 0, and
        ``[modules, slots]`` float32 scales, slots in ``_SLOTS`` order."""
        history = np.stack([
            [states[name][forward][0][1:, index].numpy() for _, forward, index in _SLOTS]
            for name in self.names
        ])  # fmt: skip
        scale = np.array(
            [
                [states[name][forward][1][index] for _, forward, index in _SLOTS]
                for name in self.names
            ],
            dtype=np.float32,
        )
        return history, scale

    def _state_metrics(self, states: dict) -> dict[str, np.ndarray]:
        """From the delayed-scaling state (host copies: :meth:`_host_states`), every module at
        once: what the scales are and what they are based on. ``[modules]`` per metric."""
        # Vectorised over modules and slots: this runs every step, and a numpy call per module
        # and slot cost more than a percent of a GPU step, which the host has to launch.
        if not self.names:  # a model without FP8-capable modules
            return {}
        history, scale = self._slot_arrays(states)
        seen = history > 0  # NaN and zero are no observation
        count = seen.sum(axis=-1)
        # Positive values first, ascending; the +inf filler sorts after them (and equals a +inf
        # amax, which is fine: only the first `count` places are read).
        ordered = np.sort(np.where(seen, history, np.inf), axis=-1)
        scale64 = scale.astype(np.float64)
        ratio = scale64 / self._previous_scale
        self._previous_scale = scale64
        columns = {
            "amax": history[..., -1],
            "scale": scale,
            "scale_inv": 1.0 / scale64,
            "window_max": history.max(axis=-1),
            "window_p50": _quantile(ordered, count, 0.5),
            "window_p90": _quantile(ordered, count, 0.9),
            "scale_change": np.maximum(ratio, 1.0 / ratio),
        }
        return {
            f"{slot}.{metric}": values[:, k]
            for metric, values in columns.items()
            for k, (slot, _, _) in enumerate(_SLOTS)
        }

    @staticmethod
    def _measured(module, record: Probe) -> dict:
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
                ratio = name in ("saturated", "underflow")
                values[f"{slot}.{metric}"] = _Fraction(total, numel) if ratio else total
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


@dataclass(frozen=True)
class _Fraction:
    """A count on the device over a number of elements: divided on the host, as Python divides
    int by int (a CUDA tensor divided by a number is multiplied by its reciprocal instead)."""

    count: torch.Tensor
    total: int


def _to_host(rows: list[dict]) -> list[dict[str, float]]:
    """The same dicts with every tensor (and :class:`_Fraction`) replaced by its value, all
    fetched in one transfer (float64 holds float32 norms and int64 counts below 2**53)."""

    def tensor_of(value):
        return value.count if isinstance(value, _Fraction) else value

    tensors = [tensor_of(v) for values in rows for v in values.values()]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if tensors:
        host = iter(torch.stack([t.reshape(()).double() for t in tensors]).cpu().tolist())

    def value_of(value):
        if isinstance(value, _Fraction):
            return int(next(host)) / value.total
        return next(host) if isinstance(value, torch.Tensor) else value

    return [{k: value_of(v) for k, v in values.items()} for values in rows]


def _host_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Float32 host copies of ``tensors`` (one device, any shapes) in one transfer."""
    flat = torch.cat([t.reshape(-1).float() for t in tensors]).cpu()
    pieces = flat.split([t.numel() for t in tensors])
    return [piece.view(t.shape) for piece, t in zip(pieces, tensors, strict=True)]


def _quantile(ordered: np.ndarray, count: np.ndarray, q: float) -> np.ndarray:
    """numpy's default (linear) quantile of the first ``count`` values of each sorted row, NaN
    where ``count`` is 0; float32 arithmetic throughout, as on one row of float32 values."""
    position = q * np.maximum(count - 1, 0)
    low = position.astype(np.int64)
    high = np.minimum(low + 1, np.maximum(count - 1, 0))
    below = np.take_along_axis(ordered, low[..., None], axis=-1)[..., 0]
    above = np.take_along_axis(ordered, high[..., None], axis=-1)[..., 0]
    with np.errstate(invalid="ignore"):  # inf - inf where the window holds an infinite amax
        value = below + (above - below) * (position - low).astype(np.float32)
    return np.where(count > 0, value, np.float32(np.nan))
