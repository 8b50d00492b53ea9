"""Which runs a runs directory holds, and what the console's header says about one.

Everything here reads small JSON/YAML files (status.json, manifest.yaml, alerts.jsonl,
layers.json, overrides.jsonl) and the telemetry marker: no torch, milliseconds per run. A file a
run has not written yet (a run still starting, a run with FP8 off and so no store) leaves its
field empty instead of failing the console.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from fp8ops.alerts import LEVELS, Alert, read_alerts
from fp8ops.errors import Fp8opsError
from fp8ops.manifest import Manifest, load_manifest, manifest_hash
from fp8ops.run import RunLayout, RunRecordError, find_status, read_run_record
from fp8ops.run.layout import MANIFEST, STATUS, TELEMETRY
from fp8ops.telemetry import TelemetryRun, open_run

# A directory is a run directory when it holds one of these (the trainer writes them first).
RUN_MARKERS = (STATUS, MANIFEST, TELEMETRY)
# status.json is rewritten every log_interval steps while a run trains; a "running" status
# older than this is probably a trainer that died without a word (kill -9, a lost node).
QUIET_S = 600


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in RUN_MARKERS)


def find_runs(runs_dir: str | Path) -> list[Path]:
    """The run directories in ``runs_dir`` (or ``runs_dir`` itself if it is one), the most
    recently updated first."""
    root = Path(runs_dir).expanduser().resolve()
    if not root.is_dir():
        raise Fp8opsError(f"{root}: no such runs directory")
    if is_run_dir(root):
        return [root]
    # Hidden directories are not runs: an import being written (.NAME.importing-PID) is one.
    runs = [p for p in root.iterdir() if is_run_dir(p) and not p.name.startswith(".")]
    return sorted(runs, key=_updated, reverse=True)


def _updated(run_dir: Path) -> float:
    stamps = [(run_dir / name).stat().st_mtime for name in RUN_MARKERS if (run_dir / name).exists()]
    return max(stamps, default=0.0)


def open_telemetry(run_dir: Path) -> TelemetryRun | None:
    """The run's telemetry, or None when it has no store (FP8 off, not started yet)."""
    if not RunLayout(run_dir).telemetry.exists():
        return None
    return open_run(run_dir)


@dataclass
class RunHeader:
    """What the console's header shows about a run."""

    run_dir: Path
    name: str
    manifest_hash: str | None = None
    revision: int | None = None
    revision_reason: str | None = None
    recipe: str = ""
    topology: str = ""
    state: str = "unknown"
    status_step: int | None = None
    updated: str | None = None
    last_step: int | None = None  # last committed telemetry step (rank 0)
    ranks: int = 0
    alerts: dict[str, int] = field(default_factory=dict)  # level -> count
    problems: list[str] = field(default_factory=list)  # files that could not be read


def read_header(
    run_dir: Path,
    telemetry: TelemetryRun | None,
    alerts: list[Alert] | None = None,
    manifest: Manifest | None = None,
) -> RunHeader:
    header, layout = RunHeader(run_dir, run_dir.name), RunLayout(run_dir)
    try:
        status = find_status(run_dir)
    except RunRecordError as exc:  # shown as the state: the rest of the run may still read
        header.state = f"unreadable status.json ({exc})"
    else:
        if status is not None:
            header.state, header.status_step = status.state, status.step
            header.updated = status.updated
        else:
            header.state = "not started"
    if header.state == "running":
        quiet = time.time() - layout.status.stat().st_mtime
        if quiet > QUIET_S:  # a killed trainer cannot say it stopped: say how long it has not
            header.state = f"running? (no word for {quiet / 60:.0f} min: is it still alive?)"
    if header.state == "imported" and manifest is None and not layout.manifest.exists():
        _imported_header(header, run_dir)  # no manifest: TE's logs were not an fp8ops run's
    else:
        try:
            manifest = manifest or load_manifest(layout.manifest)
        except Fp8opsError as exc:
            header.problems.append(str(exc))
    if manifest is not None:
        p, t = manifest.precision, manifest.topology
        header.name = manifest.name
        header.manifest_hash = manifest_hash(manifest)
        header.revision, header.revision_reason = manifest.revision.number, manifest.revision.reason
        header.recipe = p.recipe_summary if p.enabled else f"FP8 off ({p.base_dtype})"
        header.topology = (
            f"TP {t.tensor_parallel} x PP {t.pipeline_parallel} x DP {t.data_parallel} "
            f"(world {t.world_size}, amax reduction {t.amax_reduction})"
        )
    if telemetry is not None:
        header.last_step, header.ranks = telemetry.last_step(0), len(telemetry.ranks)
    try:
        alerts = read_alerts(run_dir) if alerts is None else alerts
    except Fp8opsError as exc:
        header.problems.append(str(exc))
        alerts = []
    header.alerts = {level: sum(a.level == level for a in alerts) for level in LEVELS}
    return header


def _imported_header(header: RunHeader, run_dir: Path) -> None:
    """An imported run's recipe and topology lines, from run.json's ``imported``."""
    try:
        imported = read_run_record(run_dir).imported
    except RunRecordError as exc:
        header.problems.append(str(exc))
        return
    if imported is None:
        header.problems.append(f"{run_dir}/run.json: state imported, but no 'imported' record")
        return
    recipe = imported.recipe or "recipe not known"
    header.recipe = f"imported from Transformer Engine debug logs ({recipe}): {imported.source}"
    header.topology = f"{len(imported.files)} rank logs"
