"""``alerts.jsonl``: a run's alerts, appended. (Override proposals go to the ledger,
``overrides.jsonl``: :mod:`fp8ops.overrides`.)

One JSON object per line, never rewritten: a crash loses at most the line being written, and the
readers skip such a torn last line (``fp8ops.files.read_jsonl``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from fp8ops.alerts.records import Alert
from fp8ops.errors import Fp8opsError
from fp8ops.files import append_lines, json_line, read_jsonl
from fp8ops.run import RunLayout
from fp8ops.run.layout import ALERTS

T = TypeVar("T")


def write_alerts(run_dir: str | Path, alerts: Iterable[Alert | Mapping[str, Any]]) -> None:
    """Append alerts (or their ``to_json()`` records, e.g. with a ``rank`` added)."""
    _append(RunLayout(run_dir).alerts, alerts)


def read_alerts(run_dir: str | Path) -> list[Alert]:
    """A run's alerts in the order they were written; none if it has no ``alerts.jsonl``."""
    return _parse(RunLayout(run_dir).alerts, Alert.from_json)


def read_run_alerts(run_dir: str | Path) -> list[Alert]:
    """:func:`read_alerts` for the command line: a missing or foreign directory is an error."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise Fp8opsError(f"{run_dir}: no such run directory")
    if not run_dir.is_dir():
        raise Fp8opsError(f"{run_dir}: not a directory; give a run directory")
    layout = RunLayout(run_dir)
    if not (layout.alerts.exists() or layout.is_run()):
        raise Fp8opsError(f"{run_dir}: not an fp8ops run directory (no status.json, no {ALERTS})")
    return read_alerts(run_dir)


def _append(path: Path, records: Iterable[Any]) -> None:
    lines = [json_line(r.to_json() if hasattr(r, "to_json") else dict(r)) for r in records]
    if lines:
        append_lines(path, "".join(lines))  # one write: a crash tears at most the last line


def _parse(path: Path, parse: Callable[[dict[str, Any]], T]) -> list[T]:
    # Imported here: fp8ops.train's package imports torch, which reading a log does not need.

    if not path.exists():
        return []
    parsed = []
    for number, record in enumerate(read_jsonl(path), 1):
        try:
            parsed.append(parse(record))
        except (KeyError, TypeError, ValueError) as exc:
            detail = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
            raise Fp8opsError(f"{path}: record {number} is not valid ({detail})") from None
    return parsed
