"""Per-layer FP8 telemetry: what is measured (``catalogue``), how a run writes it and how it
is read back; ``cli`` (``fp8ops inspect``).

Attributes load on first use (PEP 562): every ``fp8ops`` command imports ``telemetry.cli`` to
register ``inspect``, and zarr, pandas and xarray cost more than a command such as a drifted
resume's refusal should pay.
"""

import importlib

_WHERE = {
    "MODULE_METRIC_NAMES": "catalogue",
    "STEP_METRIC_NAMES": "catalogue",
    "Metric": "catalogue",
    "TelemetryError": "store",
    "TelemetryRun": "reader",
    "TelemetryWriter": "store",
    "open_run": "reader",
}

__all__ = [
    "MODULE_METRIC_NAMES",
    "STEP_METRIC_NAMES",
    "Metric",
    "TelemetryError",
    "TelemetryRun",
    "TelemetryWriter",
    "open_run",
]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
