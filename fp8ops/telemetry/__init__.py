"""Per-layer FP8 telemetry: what is measured (``catalogue``), how a run writes it and how it
is read back."""

from fp8ops.telemetry.catalogue import MODULE_METRIC_NAMES, STEP_METRIC_NAMES, Metric

__all__ = ["MODULE_METRIC_NAMES", "STEP_METRIC_NAMES", "Metric"]
