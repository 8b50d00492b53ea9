"""What a sink is given: scalars and text at a step, made from the run's own records.

The trainer's records reach the sinks as they are written (``metrics.jsonl``, ``eval.jsonl``,
``events.jsonl``: :meth:`fp8ops.run.RunDir.listen`), the step's alerts with what the run did
about them, and the step's telemetry row (:mod:`fp8ops.sinks.layers`). Each is turned into items
here, in the sinks' thread, so the training step only queues the record.

Names: ``train/<field>`` for a metrics row, ``eval/loss`` and ``eval/<bucket>`` for an
evaluation, ``capability/accuracy``, ``alerts/<level>`` (how many fired at the step), text
under ``alerts`` and ``events``, and ``layers/<metric>/...`` for the per-layer summary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fp8ops.alerts.records import LEVELS, decode_float, format_value


@dataclass(frozen=True)
class Scalars:
    """Numbers at a step, by name."""

    step: int
    values: dict[str, float]


@dataclass(frozen=True)
class Text:
    """A line (or lines) of text at a step, under ``tag``."""

    step: int
    tag: str
    text: str


@dataclass(frozen=True)
class Checkpointed:
    """A checkpoint was saved: a resume continues from here, so the sinks flush and their
    state (``sinks.json``) is written."""

    step: int


@dataclass(frozen=True)
class Ended:
    """The run segment ended this way (completed, paused, interrupted, stopped, failed)."""

    step: int
    outcome: str


Item = Scalars | Text | Checkpointed | Ended

# The metrics row's fields sent as train/<name> (``step`` is the step itself).
TRAIN_FIELDS = (
    "loss",
    "grad_norm",
    "update_norm",
    "lr",
    "skipped",
    "tokens",
    "loss_tokens",
    "seconds",
    "tokens_per_s",
    "peak_memory_mib",
)
# Events that become something else than a line of text, or nothing: an evaluation's numbers
# come from eval.jsonl, and the routine FP8 agreement check is news only when ranks disagree.
_QUIET_EVENTS = {"evaluated", "fp8_state_checked", "train_started"}
_ENDINGS = {
    "train_completed": "completed",
    "paused": "paused",
    "interrupted": "interrupted",
    "stopped": "stopped",
    "failed": "failed",
}


def from_record(file: str, record: dict[str, Any], *, step: int, every_steps: int) -> list[Item]:
    """The items of one appended record of ``file`` (``metrics.jsonl``, ``eval.jsonl``,
    ``events.jsonl``). ``step``: the last step seen, for an event that names none; a metrics
    row is sent every ``every_steps`` steps."""
    if file == "metrics.jsonl":
        at = int(record["step"])
        if at % every_steps:
            return []
        return [Scalars(at, _numbers(record, TRAIN_FIELDS, "train/"))]
    if file == "eval.jsonl":
        values = {"eval/loss": float(record["loss"])}
        for bucket, loss in (record.get("buckets") or {}).items():
            values[f"eval/{bucket}"] = float(loss)
        return [Scalars(int(record["step"]), values)]
    if file == "events.jsonl":
        return _event_items(record, step)
    return []


def _event_items(record: dict[str, Any], step: int) -> list[Item]:
    kind = str(record.get("event"))
    at = record.get("step")
    at = int(at) if isinstance(at, int) else step
    if kind == "capability_evaluated":
        return [Scalars(at, _numbers(record, ("accuracy",), "capability/"))]
    if kind == "checkpoint_saved":
        return [Checkpointed(at)]
    if kind in _QUIET_EVENTS and record.get("agree", True):
        return []
    fields = {k: v for k, v in record.items() if k not in ("event", "time")}
    items: list[Item] = [Text(at, "events", f"{kind}: {json.dumps(fields, sort_keys=True)}")]
    if kind in _ENDINGS:
        items.append(Ended(at, _ENDINGS[kind]))
    return items


def from_alerts(alerts: list[dict[str, Any]]) -> list[Item]:
    """A step's gathered alerts (``to_json()`` records, each with the ``action`` the run took:
    :func:`fp8ops.notify.notice.action_of`): how many per level, and a line each."""
    if not alerts:
        return []
    step = max(int(a["step"]) for a in alerts)
    counts = {f"alerts/{level}": 0.0 for level in LEVELS}
    lines = []
    for alert in alerts:
        counts[f"alerts/{alert['level']}"] += 1
        lines.append(alert_line(alert))
    return [Scalars(step, counts), Text(step, "alerts", "\n".join(lines))]


def alert_line(alert: dict[str, Any]) -> str:
    """``[degrade] saturation decoder.layers.1.mlp.linear_fc1 weight.saturation 0.0021 >=
    0.001 (rank 0): proposed``."""
    where = " ".join(str(alert[k]) for k in ("rule", "module", "metric") if alert.get(k))
    value, threshold = alert.get("value"), alert.get("threshold")
    if value is not None:
        where += f" {format_value(decode_float(value))}"
        if threshold is not None:
            where += f" vs {format_value(decode_float(threshold))}"
    rank = f" (rank {alert['rank']})" if alert.get("rank") is not None else ""
    action = f": {alert['action']}" if alert.get("action") else ""
    return f"[{alert['level']}] {where}{rank}{action}"


def _numbers(record: dict[str, Any], fields: tuple[str, ...], prefix: str) -> dict[str, float]:
    """The fields of ``record`` that hold a number (None, a missing field: left out)."""
    values = {}
    for name in fields:
        value = record.get(name)
        if isinstance(value, bool):
            value = float(value)
        if isinstance(value, int | float) or value in ("nan", "inf", "-inf"):
            values[prefix + name] = decode_float(value)  # alerts' JSON spells non-finite so
    return values
