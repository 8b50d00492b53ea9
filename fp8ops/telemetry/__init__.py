"""Per-layer FP8 telemetry: what is measured (``catalogue``), how a run writes it and how it
is read back."""

from fp8ops.telemetry.catalogue import MODULE_METRIC_NAMES, STEP_METRIC_NAMES, Metric
from fp8ops.telemetry.reader import TelemetryRun, open_run
from fp8ops.telemetry.store import TelemetryError, TelemetryWriter

__all__ = [
    "MODULE_METRIC_NAMES",
    "STEP_METRIC_NAMES",
    "Metric",
    "TelemetryError",
    "TelemetryRun",
    "TelemetryWriter",
    "open_run",
]
