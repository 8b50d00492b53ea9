"""A run directory: where a run keeps what (:mod:`~fp8ops.run.layout`), what its records hold
(:mod:`~fp8ops.run.records`), the one writer (:class:`~fp8ops.run.run_dir.RunDir`) and the
versions a run records (:mod:`~fp8ops.run.environment`).

At the bottom of the package graph: it imports only ``fp8ops.manifest``, ``fp8ops.errors`` and
``fp8ops.files``, so every other package can read and write runs through it.
"""

from fp8ops.run.layout import RunLayout
from fp8ops.run.records import (
    AdmissionRow,
    AdmissionTable,
    EvalRow,
    Event,
    Fallback,
    LayersDocument,
    LayersFileError,
    MetricsRow,
    RunRecord,
    RunRecordError,
    Status,
    find_status,
    read_evals,
    read_events,
    read_fallbacks,
    read_layers_json,
    read_metrics,
    read_run_record,
    read_status,
    write_layers_json,
)
from fp8ops.run.run_dir import RunDir, locked_manifest, trained_now

__all__ = [
    "AdmissionRow",
    "AdmissionTable",
    "EvalRow",
    "Event",
    "Fallback",
    "LayersDocument",
    "LayersFileError",
    "MetricsRow",
    "RunDir",
    "RunLayout",
    "RunRecord",
    "RunRecordError",
    "Status",
    "find_status",
    "locked_manifest",
    "read_evals",
    "read_events",
    "read_fallbacks",
    "read_layers_json",
    "read_metrics",
    "read_run_record",
    "read_status",
    "trained_now",
    "write_layers_json",
]
