"""Observe / Degrade / Stop alerts on per-layer FP8 telemetry.

Reading order: ``rules`` (:class:`AlertEngine`, fed one telemetry row per step by the trainer,
and the rules table), ``records`` (:class:`Alert`, :class:`Proposal` and their JSON), ``files``
(``alerts.jsonl`` in a run directory). Thresholds come from the manifest's ``alerts`` section
(``fp8ops.manifest.schema.Alerts``).

Levels: *observe* is logged; *degrade* also proposes running the module in BF16 (a
:class:`Proposal`, which the trainer writes to the run's override ledger, ``overrides.jsonl``,
for review); *stop* makes the trainer save a checkpoint and exit non-zero with the alert's
message.
"""

import importlib

# Loaded on first use (PEP 562): `fp8ops.alerts.cli` is imported by every `fp8ops` command to
# register `fp8ops alerts`, and the rules' imports (numpy, telemetry) are not needed for that.
_WHERE = {
    "LEVELS": "records",
    "Alert": "records",
    "Level": "records",
    "Proposal": "records",
    "select_alerts": "records",
    "read_alerts": "files",
    "read_run_alerts": "files",
    "write_alerts": "files",
    "AlertEngine": "rules",
}

__all__ = [
    "LEVELS",
    "Alert",
    "AlertEngine",
    "Level",
    "Proposal",
    "read_alerts",
    "read_run_alerts",
    "select_alerts",
    "write_alerts",
]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
