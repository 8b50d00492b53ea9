"""The alert rules run again over a run's stored telemetry: ``fp8ops alerts RUN_DIR --replay M``.

The trainer judges each step's row as it is made (``rules.AlertEngine``); a replay feeds the
same engine the rows ``telemetry.zarr`` holds, step by step and rank by rank, under the
``alerts`` section of the manifest given. For a run fp8ops did not train (imported from
Transformer Engine's debug logs, ``fp8ops.te_import``) this is how its alerts come to be; for
one it trained, it shows what other thresholds would have said.

What differs from the live judgement:

* the rows are the stored ones, float32 (the live engine sees the loss as a Python float);
* nothing stops: a live run ends at its first Stop alert, a replay goes on and reports the step
  where a live run would have stopped (:attr:`Replay.stop_step`), and proposes no override;
* an imported run has no step metrics (TE's statistics logs hold no loss): its stored loss and
  gradient norm are NaN for "not logged", and are not judged;
* TE reduces activation and gradient statistics over its reduction group, so the ranks of an
  imported run log the same values: a module alert is kept once, from the lowest rank, where
  higher ranks report the very same one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from fp8ops.alerts.records import Alert, merge_rank_alerts
from fp8ops.alerts.rules import AlertEngine
from fp8ops.errors import Fp8opsError
from fp8ops.files import append_lines, atomic_write_text, json_line
from fp8ops.manifest import Manifest
from fp8ops.run import RunLayout, read_run_record
from fp8ops.run.records import ImportedFrom
from fp8ops.telemetry.catalogue import MODULE_METRIC_NAMES, STEP_METRIC_NAMES
from fp8ops.telemetry.reader import TelemetryRun, open_run

BLOCK_STEPS = 2048  # steps read at once per rank: 2048 x 256 modules x 60 metrics is 126 MB


@dataclass
class Replay:
    """What the rules found, in step order (Stop first within a step, then by rank)."""

    alerts: list[Alert]
    steps: dict[int, int]  # rank -> steps judged
    imported: bool
    stop: Alert | None = None  # the first Stop alert: where a live run would have stopped
    missing_metrics: list[str] = field(default_factory=list)  # catalogue metrics not stored

    @property
    def stop_step(self) -> int | None:
        return None if self.stop is None else self.stop.step


def replay_alerts(run_dir: str | Path, manifest: Manifest) -> Replay:
    """Judge every committed step of every rank of ``run_dir``'s store by ``manifest``'s
    ``alerts`` section (and its ``precision.amax_compute_algo``, which amax_jump compares
    with)."""
    run_dir = Path(run_dir)
    store = open_run(run_dir)
    imported = _imported_from(run_dir)
    is_imported = imported is not None
    # An imported run's recipe as the import knew it (TE's logs name none of their own).
    scaling = (imported and imported.recipe) or manifest.precision.scaling
    columns = [store.metrics.index(m) if m in store.metrics else -1 for m in MODULE_METRIC_NAMES]
    missing = [m for m, c in zip(MODULE_METRIC_NAMES, columns, strict=True) if c < 0]
    enabled = MODULE_METRIC_NAMES.index("fp8_enabled")

    engines: dict[int, AlertEngine] = {}
    found: dict[int, dict[int, list[dict]]] = {}  # step -> rank -> alerts (as JSON)
    for rank in store.ranks:
        steps = store.steps(rank)
        if not steps:
            continue
        for start in range(steps.start, steps.stop, BLOCK_STEPS):
            rows = _catalogue_rows(store, rank, start, start + BLOCK_STEPS, columns)
            scalars = (
                None if is_imported else store.step_metrics(start, start + len(rows), rank=rank)
            )
            for offset, row in enumerate(rows):
                step = start + offset
                engine = engines.get(rank)
                on = row[:, enabled] != 0  # NaN (not recorded) counts as FP8: judged
                if engine is None:
                    engine = engines[rank] = AlertEngine(
                        manifest.alerts,
                        store.modules,
                        on,
                        amax_compute_algo=manifest.precision.amax_compute_algo,
                        delayed=[scaling == "delayed"] * len(store.modules),
                    )
                left = engine.fp8 & ~on  # switched to BF16 at this step (auto-degrade)
                if left.any():
                    engine.hold(np.asarray(store.modules)[left].tolist())
                values = {} if scalars is None else _step_values(scalars, offset)
                alerts = engine.observe(step, row, values)
                if alerts:
                    found.setdefault(step, {})[rank] = [a.to_json() for a in alerts]

    alerts: list[Alert] = []
    width = max(store.ranks, default=-1) + 1
    for step in sorted(found):
        gathered = [found[step].get(rank, []) for rank in range(width)]
        merged = merge_rank_alerts(gathered)
        if is_imported:
            merged = _once_per_value(merged)
        alerts += [Alert.from_json(record) for record in merged]
    stop = next((a for a in alerts if a.level == "stop"), None)
    judged = {rank: len(store.steps(rank)) for rank in store.ranks}
    return Replay(alerts, judged, is_imported, stop, missing)


def record_replay(run_dir: str | Path, replay: Replay, manifest_file: str | Path) -> Path:
    """Write an imported run's ``alerts.jsonl`` (replacing an earlier replay's) and an
    ``alerts_replayed`` event naming the manifest. A run fp8ops trained keeps the alerts it
    raised while training: refused."""
    import hashlib

    run_dir, manifest_file = Path(run_dir), Path(manifest_file)
    layout = RunLayout(run_dir)
    if not replay.imported:
        raise Fp8opsError(
            f"{run_dir} was trained by fp8ops: its alerts.jsonl is what the rules said while it "
            "trained and is not replaced; the replay is shown only"
        )
    atomic_write_text(layout.alerts, "".join(json_line(a.to_json()) for a in replay.alerts))
    event = {
        "event": "alerts_replayed",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "manifest": str(manifest_file.resolve()),
        "manifest_sha256": hashlib.sha256(manifest_file.read_bytes()).hexdigest(),
        "alerts": len(replay.alerts),
        "stop_step": replay.stop_step,
    }
    append_lines(layout.events, json_line(event))
    return layout.alerts


def _imported_from(run_dir: Path) -> ImportedFrom | None:
    """Where an imported run came from; None for a run fp8ops trained (or one without a
    run.json, such as a store alone)."""
    if not RunLayout(run_dir).run_record.exists():
        return None
    return read_run_record(run_dir).imported


def _catalogue_rows(
    store: TelemetryRun, rank: int, start: int, stop: int, columns: list[int]
) -> np.ndarray:
    """Rows [start, stop) in the catalogue's column order (NaN for a metric not stored)."""
    rows = store.module_rows(start, stop, rank=rank)
    picked = rows[:, :, [max(c, 0) for c in columns]]
    picked[:, :, [i for i, c in enumerate(columns) if c < 0]] = np.nan
    return picked


def _step_values(frame: pd.DataFrame, offset: int) -> dict[str, float]:
    """The stored step metrics of one step, as the engine takes them (a stored NaN loss is a
    loss that was not finite: the trainer stores what it saw)."""
    row = frame.iloc[offset]
    return {name: float(row[name]) for name in STEP_METRIC_NAMES if name in row.index}


def _once_per_value(merged: list[dict]) -> list[dict]:
    """Module alerts of one step that higher ranks repeat with the very same value dropped."""
    seen, kept = set(), []
    for record in merged:
        key = (record["rule"], record["level"], record.get("module"), record.get("metric"))
        key += (str(record.get("value")),)
        if record.get("module") is not None and key in seen:
            continue
        seen.add(key)
        kept.append(record)
    return kept
