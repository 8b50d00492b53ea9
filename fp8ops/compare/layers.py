"""Per-module telemetry summaries of one run, from its ``telemetry.zarr``.

What the verdict and the report say about each FP8 module is measured over the last quarter of
the run, where a release candidate has settled: the largest saturation and underflow of each
FP8 slot, and the mean of the sampled FP8-vs-reference GEMM errors (``fp8_rel_error``, every
``telemetry.error_sample_every`` steps). A run too short to have an error sample in its last
quarter is summarised over all its samples instead. NaN/Inf cast counts are summed over the
whole run: one NaN anywhere matters.

Rank 0's telemetry is read (what ``fp8ops inspect`` shows by default): reading every rank of a
large job would multiply the cost by the world size, and a non-finite value on another rank
still shows up in the run's ``nonfinite`` alerts, which are gathered from all ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from fp8ops.telemetry import open_run
from fp8ops.telemetry.catalogue import SLOTS
from fp8ops.telemetry.store import STORE_NAME


@dataclass(frozen=True)
class LayerSummary:
    """One module over the summary window. None: never measured there (a BF16 module's casts,
    or cast statistics sampled less often than the window is long)."""

    module: str
    fp8: bool  # ran in FP8 during the window (fp8_enabled)
    saturation: dict[str, float | None]  # slot -> largest fraction clipped at the FP8 maximum
    underflow: dict[str, float | None]  # slot -> largest fraction flushed to zero
    fp8_error: float | None  # mean sampled ||y_fp8 - y_ref|| / ||y_ref||
    fp8_error_max: float | None
    error_samples: int
    nonfinite: int  # NaN + Inf cast elements over the whole run, all slots

    @property
    def max_saturation(self) -> float | None:
        return _largest(self.saturation)

    @property
    def max_underflow(self) -> float | None:
        return _largest(self.underflow)


@dataclass(frozen=True)
class TelemetrySummary:
    window: tuple[int, int]  # first and last step of the summary window
    error_window: tuple[int, int]  # where the error samples came from
    layers: tuple[LayerSummary, ...]  # in the store's module order
    nonfinite_steps: tuple[int, ...]  # steps with a NaN or Inf in some cast

    @property
    def nonfinite(self) -> int:
        return sum(layer.nonfinite for layer in self.layers)


def summarise_telemetry(run_dir: Path) -> TelemetrySummary | None:
    """The run's per-module summary; None if it has no telemetry (a run without FP8 modules
    writes none) or no committed step yet. A damaged store raises its ``TelemetryError``."""
    if not (Path(run_dir) / STORE_NAME).exists():
        return None
    store = open_run(run_dir)
    steps = store.steps()
    if not steps:
        return None
    start = steps[0] + (3 * len(steps)) // 4  # the last quarter, at least one step

    errors = store.metric_window("fp8_rel_error")  # [steps, modules], NaN between samples
    error_start = start if errors.loc[start:].notna().any().any() else steps[0]
    errors = errors.loc[error_start:]
    enabled = store.metric_window("fp8_enabled", start=start).max()
    saturation = {s: store.metric_window(f"{s}.saturation", start=start).max() for s in SLOTS}
    underflow = {s: store.metric_window(f"{s}.underflow", start=start).max() for s in SLOTS}
    nonfinite = sum(
        store.metric_window(f"{slot}.{kind}").fillna(0) for slot in SLOTS for kind in ("nan", "inf")
    )  # [steps, modules] of counts
    bad_steps = nonfinite.index[(nonfinite > 0).any(axis=1)]

    layers = tuple(
        LayerSummary(
            module=module,
            fp8=bool(enabled[module] > 0),  # NaN (never recorded) compares False
            saturation={s: _value(saturation[s][module]) for s in SLOTS},
            underflow={s: _value(underflow[s][module]) for s in SLOTS},
            fp8_error=_value(errors[module].mean()),
            fp8_error_max=_value(errors[module].max()),
            error_samples=int(errors[module].count()),
            nonfinite=int(nonfinite[module].sum()),
        )
        for module in store.modules
    )
    return TelemetrySummary(
        window=(start, steps[-1]),
        error_window=(error_start, steps[-1]),
        layers=layers,
        nonfinite_steps=tuple(int(step) for step in bad_steps),
    )


def _value(x) -> float | None:
    x = float(x)
    return None if math.isnan(x) else x  # NaN: nothing measured


def _largest(by_slot: dict[str, float | None]) -> float | None:
    known = [v for v in by_slot.values() if v is not None]
    return max(known) if known else None
