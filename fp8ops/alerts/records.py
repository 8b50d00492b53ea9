"""What the alert rules produce: an :class:`Alert` per condition, a :class:`Proposal` per module.

Both are frozen and turn into JSON (``alerts.jsonl``; proposals enter the override ledger). JSON has no NaN
or infinity, and a non-finite value is exactly what a Stop alert reports, so those are written as
the strings ``"nan"``, ``"inf"`` and ``"-inf"`` and read back as floats.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Literal

Level = Literal["observe", "degrade", "stop"]
LEVELS: tuple[Level, ...] = ("observe", "degrade", "stop")  # mildest first
SEVERITY = {level: rank for rank, level in enumerate(LEVELS)}


def check_level(level: str) -> Level:
    if level not in SEVERITY:
        raise ValueError(f"alert level {level!r}: must be one of {', '.join(LEVELS)}")
    return level  # type: ignore[return-value]


@dataclass(frozen=True)
class Alert:
    """One alert: a rule's condition started holding at ``step``.

    ``module`` is None for run-level alerts (loss, global gradient norm, ranks); ``metric`` is a
    catalogue name (``input.saturation``, ``grad_norm``, ``loss``); ``value`` is what was seen and
    ``threshold`` what it was compared against; ``message`` says all of it in one sentence.
    ``rank`` is the reporting rank where the trainer gathered alerts from several.
    """

    step: int
    level: Level
    rule: str
    module: str | None
    metric: str | None
    value: float | None
    threshold: float | None
    message: str
    rank: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "level": self.level,
            "rule": self.rule,
            "module": self.module,
            "metric": self.metric,
            "value": encode_float(self.value),
            "threshold": encode_float(self.threshold),
            "message": self.message,
            "rank": self.rank,
        }

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> Alert:
        """An alert from its JSON line (extra keys are ignored)."""
        return cls(
            step=int(record["step"]),
            level=check_level(record["level"]),
            rule=str(record["rule"]),
            module=record.get("module"),
            metric=record.get("metric"),
            value=decode_float(record.get("value")),
            threshold=decode_float(record.get("threshold")),
            message=str(record.get("message", "")),
            rank=record.get("rank"),
        )


@dataclass(frozen=True)
class Proposal:
    """A proposed override: run ``module`` in the base dtype (BF16) from the next revision on.

    Written when a Degrade alert fires for an FP8 module (or a Stop alert of a threshold rule,
    which passes Degrade on its way up); ``reason`` is the alert's sentence and ``metrics`` the
    values the module's alerts of that step reported, by metric name. The trainer writes it to
    the run's override ledger (``fp8ops.overrides.Ledger.propose``), where it is reviewed.
    """

    step: int
    module: str
    reason: str
    metrics: dict[str, float | None] = field(default_factory=dict)
    rule: str = ""  # the rule of the alert it answers (an auto-degrade policy acts by rule)
    # Only these GEMMs to BF16 (an auto-degrade policy of granularity gemm); None: all three
    gemms: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        found = {
            "step": self.step,
            "module": self.module,
            "reason": self.reason,
            "metrics": {name: encode_float(value) for name, value in self.metrics.items()},
        }
        return found if self.gemms is None else {**found, "gemms": list(self.gemms)}

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> Proposal:
        return cls(
            step=int(record["step"]),
            module=str(record["module"]),
            reason=str(record.get("reason", "")),
            metrics={k: decode_float(v) for k, v in (record.get("metrics") or {}).items()},
            gemms=None if record.get("gemms") is None else tuple(record["gemms"]),
        )


def merge_rank_alerts(gathered: Sequence[Iterable[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """One step's alerts of every rank (``gathered[rank]``, as JSON), each tagged with its rank.

    A run-level alert (no module) is judged on values every rank shares after their reductions
    (the loss, the step's gradient norm), so each rank raises the same one: it is kept once,
    from the first rank. Module alerts stay per rank: ranks hold different shards.
    """
    merged, seen = [], set()
    for rank, alerts in enumerate(gathered):
        for alert in alerts:
            if alert.get("module") is None:
                key = (alert["rule"], alert["level"], alert["step"], alert.get("message"))
                if key in seen:
                    continue
                seen.add(key)
            merged.append(dict(alert, rank=rank))
    return merged


def select_alerts(
    alerts: Iterable[Alert], level: str | None = None, module: str | None = None
) -> list[Alert]:
    """The alerts at ``level`` or above whose module matches the glob ``module``.

    A module glob leaves out run-level alerts (they have no module).
    """
    least = SEVERITY[check_level(level)] if level is not None else 0
    return [
        a
        for a in alerts
        if SEVERITY[a.level] >= least
        and (module is None or (a.module is not None and fnmatchcase(a.module, module)))
    ]


def encode_float(value: float | None) -> float | str | None:
    """A JSON-safe number: non-finite floats become "nan", "inf" or "-inf"."""
    if value is None:
        return None
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def decode_float(value: Any) -> float | None:
    if value is None:
        return None
    return float(value)  # float("nan"), float("inf") and float("-inf") read the strings back


def format_value(value: float | None) -> str:
    """A value for a sentence or a table cell: four significant digits, counts as integers."""
    if value is None:
        return "-"
    if not math.isfinite(value):
        return str(value)  # nan, inf, -inf
    return f"{value:.4g}"
