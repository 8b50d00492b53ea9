"""The per-layer summary a sink gets each step: the worst modules by the metrics the alert rules
judge, not every module's every metric.

A run of the CPU default has 8 FP8 modules, an 8B model 128, each with 52 metrics a step
(``fp8ops.telemetry.catalogue``): as scalars that would be thousands of series per step, past
what W&B and MLflow take without throttling, and unreadable in a dashboard. The store keeps
them all (``telemetry.zarr``, ``fp8ops inspect``); a sink gets, for each key metric,

* ``layers/<metric>/max``: the largest value over every module, every step it was measured, so
  one chart shows the run's worst at each step;
* ``layers/<metric>/<module>``: the value of each of the ``logging.worst_modules`` worst
  modules of the step that is off its quiet value (0 for a fraction, 1 for a scale change), so
  a module's series appears once it is among the worst.

A module's value is its worst FP8 slot (``input``, ``weight``, ``grad_output``) for the slot
metrics. A metric not measured at the step (a step between ``telemetry.every_steps``, an
unsampled error) is NaN in the row and not sent. Under tensor parallelism the row is rank 0's
view (its shards), as the store's rank 0 group is.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fp8ops.telemetry.catalogue import COLUMN, SLOTS

# What the alert rules judge per module (saturation, underflow, scale_jitter, fp8_error,
# blocks_at_floor), each worst at its high end (catalogue.worst_end).
KEY_METRICS = ("saturation", "underflow", "scale_change", "fp8_rel_error", "blocks_at_floor")
# A value at which a metric says nothing happened; such a module is not among the worst.
_QUIET = {"scale_change": 1.0}


def _columns(metric: str) -> list[int]:
    slotted = [COLUMN[f"{slot}.{metric}"] for slot in SLOTS if f"{slot}.{metric}" in COLUMN]
    return slotted or [COLUMN[metric]]


_COLUMNS = {metric: _columns(metric) for metric in KEY_METRICS}


def worst_modules(names: Sequence[str], row: np.ndarray, k: int) -> dict[str, float]:
    """``{"layers/<metric>/max": v, "layers/<metric>/<module>": v, ...}`` of one telemetry row
    (``[modules, metrics]``, modules named by ``names``) with the ``k`` worst modules."""
    values: dict[str, float] = {}
    for metric in KEY_METRICS:
        # fmax ignores NaN (an unmeasured slot) unless every slot is NaN.
        per_module = np.fmax.reduce(row[:, _COLUMNS[metric]], axis=1)
        finite = np.isfinite(per_module)
        if not finite.any():
            continue
        values[f"layers/{metric}/max"] = float(per_module[finite].max())
        ranked = np.where(finite, per_module, -np.inf)
        quiet = _QUIET.get(metric, 0.0)
        for index in np.argsort(-ranked, kind="stable")[:k]:
            if ranked[index] > quiet:
                values[f"layers/{metric}/{names[index]}"] = float(ranked[index])
    return values
