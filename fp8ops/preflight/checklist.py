"""The checklist, run: every item in order, timed, its evidence kept, the rehearsal runs trained
in a scratch directory when an item first needs them and removed afterwards (unless kept).

::

    report = run_preflight(resolve_target(Path("manifests/tiny-gpt-cpu.yaml")), Options(steps=6))
    report.exit_code          # 0: no item failed; 1: one did
    report.to_json()          # what --json writes
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from fp8ops.errors import Fp8opsError
from fp8ops.manifest import manifest_hash
from fp8ops.preflight import checks, rehearsal
from fp8ops.preflight.rehearsal import Rehearsal, RehearsalError
from fp8ops.preflight.results import ITEMS, Evidence, Item, ItemResult
from fp8ops.preflight.target import Target
from fp8ops.run import find_status


@dataclass(frozen=True)
class Options:
    steps: int = 6  # K: the rehearsals stop at K/2 and resume to K
    work_dir: Path | None = None  # None: a temporary directory
    keep: bool = False  # keep the rehearsal runs
    skip: frozenset[int] = frozenset()  # item numbers


@dataclass
class Report:
    target: Target
    options: Options
    results: list[ItemResult] = field(default_factory=list)
    seconds: float = 0.0
    kept: Path | None = None  # where the rehearsal runs are, when kept

    @property
    def exit_code(self) -> int:
        return 1 if any(r.outcome == "fail" for r in self.results) else 0

    def counts(self) -> dict[str, int]:
        return {
            o: sum(r.outcome == o for r in self.results) for o in ("pass", "fail", "n/a", "skipped")
        }

    def to_json(self) -> dict[str, Any]:
        return _plain(
            {
                "target": str(self.target.path),
                "mode": "run" if self.target.is_run else "manifest",
                "manifest": manifest_hash(self.target.manifest),
                "steps": self.options.steps,
                "work_dir": None if self.kept is None else str(self.kept),
                "seconds": round(self.seconds, 2),
                "summary": self.counts(),
                "exit_code": self.exit_code,
                "items": [r.to_json() for r in self.results],
            }
        )


def run_preflight(
    target: Target,
    options: Options,
    *,
    on_start: Callable[[Item], None] = lambda item: None,
    on_done: Callable[[ItemResult], None] = lambda result: None,
    say: Callable[[str], None] = lambda text: None,
) -> Report:
    """Every item of the checklist against ``target``; ``on_start``/``on_done`` around each
    item and ``say`` (what a rehearsal trains now) report progress."""
    report = Report(target, options)
    started = time.perf_counter()
    with scratch_dir(options.work_dir, options.keep) as work_dir:
        context = _Context(target, options, work_dir, say)
        for item in ITEMS:
            on_start(item)
            if item.number in options.skip:
                evidence = Evidence()
                evidence.na("skipped (--skip): not checked")
                result = ItemResult(item, evidence, 0.0, skipped=True)
            else:
                item_started = time.perf_counter()
                evidence = _run_item(item, context)
                result = ItemResult(item, evidence, time.perf_counter() - item_started)
            report.results.append(result)
            on_done(result)
        report.kept = work_dir if options.keep else None
    report.seconds = time.perf_counter() - started
    return report


class _Context:
    """What the items share: the target, and the rehearsal, made when first needed."""

    def __init__(
        self, target: Target, options: Options, work_dir: Path, say: Callable[[str], None]
    ):
        self.target, self.options, self.work_dir, self.say = target, options, work_dir, say

    @cached_property
    def rehearsal(self) -> Rehearsal:
        return Rehearsal(self.target.manifest, self.work_dir, self.options.steps, self.say)


def _telemetry(context: _Context) -> Evidence:
    """The run's own telemetry; for a manifest, the straight rehearsal run's."""
    target = context.target
    if target.is_run:
        status = find_status(target.run_dir)
        live = status is None or status.state == "running"  # its store may be a block behind
        return checks.telemetry(target.run_dir, target.manifest, None if live else status.step)
    run = context.rehearsal
    return checks.telemetry(run.straight(), run.manifest, run.steps)


_ITEMS: dict[str, Callable[[_Context], Evidence]] = {
    "versions": lambda c: checks.versions(c.target),
    "version-control": lambda c: checks.version_control(c.target),
    "fingerprints": lambda c: checks.fingerprints(c.target),
    "fp8-state": lambda c: rehearsal.fp8_state_survives(c.rehearsal),
    "bf16-control": lambda c: rehearsal.bf16_control(c.rehearsal),
    "telemetry": _telemetry,
    "gates": lambda c: checks.gates(c.target),
    "fallback": lambda c: rehearsal.fallback(c.rehearsal),
    "topology": lambda c: rehearsal.topology_change(c.rehearsal),
}


def _run_item(item: Item, context: _Context) -> Evidence:
    """The item's evidence; whatever it raises fails the item, not the checklist."""
    try:
        return _ITEMS[item.key](context)
    except (Fp8opsError, RehearsalError) as exc:
        evidence = Evidence()
        evidence.fail(str(exc))
        return evidence
    except Exception as exc:  # noqa: BLE001 - a bug: report it with its traceback, go on
        evidence = Evidence()
        evidence.fail(f"internal error: {type(exc).__name__}: {exc} (traceback in the JSON)")
        evidence.facts["traceback"] = traceback.format_exc()
        return evidence


@contextmanager
def scratch_dir(work_dir: Path | None, keep: bool) -> Iterator[Path]:
    """Where the rehearsals run: ``work_dir`` (new or empty) or a temporary directory; what
    preflight put there is removed afterwards unless ``keep``."""
    if work_dir is None:
        path, created = Path(tempfile.mkdtemp(prefix="fp8ops-preflight-")), True
    else:
        path = Path(work_dir)
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise Fp8opsError(
                f"--work-dir {path}: not an empty directory; give a new or empty one (preflight "
                "trains its rehearsal runs there and removes them afterwards unless --keep)"
            )
        created = not path.exists()
        path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    finally:
        if not keep:
            for child in [path] if created else list(path.iterdir()):
                if child.is_dir():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)


def _plain(value: Any) -> Any:
    """JSON-safe: non-finite floats as "nan"/"inf" (a rehearsal's loss may be one), paths and
    other objects as text."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def write_json(report: Report, path: Path) -> None:
    from fp8ops.files import atomic_write_text

    atomic_write_text(path, json.dumps(report.to_json(), indent=2) + "\n")
