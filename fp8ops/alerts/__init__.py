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

from fp8ops.alerts.files import ALERTS, read_alerts, read_run_alerts, write_alerts
from fp8ops.alerts.records import LEVELS, Alert, Level, Proposal, select_alerts
from fp8ops.alerts.rules import AlertEngine

__all__ = [
    "ALERTS",
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
