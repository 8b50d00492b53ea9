"""What compare reads: the inputs resolved into tracks, and one :class:`RunRecords` per run.

Two forms of input::

    fp8ops compare runs/bf16 runs/fp8 runs/fp8-b   # run directories: the first is the reference
    fp8ops compare runs/dual                       # a dual-track directory (dualtrack.json)

Everything is read up front, so a damaged or missing file stops the comparison with its path
before anything is judged; nothing here imports torch or Megatron.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fp8ops.alerts import Alert, read_alerts
from fp8ops.compare.layers import TelemetrySummary, summarise_telemetry
from fp8ops.dualtrack.tracks import CANDIDATE, FALLBACK, LABELS, PLAN
from fp8ops.errors import Fp8opsError
from fp8ops.files import loads_json
from fp8ops.manifest import Manifest, ManifestStore, manifest_hash
from fp8ops.run import (
    RunLayout,
    RunRecord,
    RunRecordError,
    Status,
    find_status,
    locked_manifest,
    read_evals,
    read_events,
    read_metrics,
    read_run_record,
)
from fp8ops.run.layout import MANIFEST
from fp8ops.run.records import LayersDocument, read_layers_json

USAGE = "give run directories (the reference first, then candidates) or one dual-track directory"

Role = Literal["reference", "candidate"]


@dataclass(frozen=True)
class Track:
    """One run to compare, and what the inputs say about it."""

    label: str
    path: Path
    role: Role
    fallback_modules: dict[str, str] = field(default_factory=dict)  # dual-track: module -> why


@dataclass(frozen=True)
class Resume:
    """A ``resumed`` event: training went on after ``step`` from ``checkpoint``."""

    step: int
    checkpoint: str | None


@dataclass
class RunRecords:
    """Everything compare uses from one run directory."""

    track: Track
    manifest: Manifest
    manifest_sha256: str
    info: RunRecord  # run.json
    status: Status  # status.json
    # metrics.jsonl and eval.jsonl: one row per step in step order (latest line wins), as
    # written (the fields a row holds, checked by fp8ops.run.records)
    metrics: list[dict[str, Any]]
    tokens_through: dict[int, int]  # step -> training tokens of steps 1..step
    evals: list[dict[str, Any]]
    capability: list[dict[str, Any]]  # capability.jsonl, one per step (latest line wins)
    predictions: dict[int, list[dict[str, Any]]]  # step -> its per-item records
    resumes: list[Resume]
    restarts: list[int]  # the step every later `train_started` continued from (> 0)
    alerts: list[Alert]
    layers: LayersDocument
    telemetry: TelemetrySummary | None  # None: the run has no telemetry.zarr (no FP8 modules)

    @property
    def label(self) -> str:
        return self.track.label

    @property
    def path(self) -> Path:
        return self.track.path

    @property
    def state(self) -> str:
        return self.status.state

    @property
    def last_step(self) -> int:
        return self.metrics[-1]["step"] if self.metrics else 0


# --------------------------------------------------------------------------------------
# The inputs
# --------------------------------------------------------------------------------------


def resolve_tracks(paths: list[Path]) -> tuple[list[Track], Path | None]:
    """The tracks to compare, reference first, and the dual-track directory if one was given."""
    paths = [Path(p) for p in paths]
    for path in paths:
        if not path.exists():
            raise Fp8opsError(f"{path}: no such directory; {USAGE}")
        if not path.is_dir():
            raise Fp8opsError(f"{path}: not a directory; {USAGE}")
    dual = [p for p in paths if (p / PLAN).is_file()]
    if dual:
        if len(paths) > 1:
            raise Fp8opsError(
                f"{dual[0]} is a dual-track directory ({PLAN}); give it alone, or give "
                "run directories only"
            )
        return _dualtrack_tracks(dual[0]), dual[0]
    if len(paths) < 2:
        raise Fp8opsError(
            f"{paths[0] if paths else 'no runs'}: compare needs a reference and at least one "
            f"candidate; {USAGE}"
        )
    names = [p.resolve().name for p in paths]
    labels = names if len(set(names)) == len(names) else [str(p) for p in paths]
    return [
        Track(label, path, "reference" if i == 0 else "candidate")
        for i, (label, path) in enumerate(zip(labels, paths))
    ], None


def _dualtrack_tracks(directory: Path) -> list[Track]:
    """The tracks ``dualtrack.json`` lists: the one ``control`` track is the reference."""
    file = directory / PLAN
    document = _read_json(file)
    tracks = document.get("tracks")
    if not isinstance(tracks, list) or not tracks:
        raise Fp8opsError(f"{file}: no 'tracks' list; the file is damaged (rerun fp8ops dualtrack)")
    listed = {
        entry.get("label"): entry.get("status") for entry in tracks if isinstance(entry, dict)
    }
    expected = document.get("requested") or LABELS  # --tracks, or the three tracks
    missing = [label for label in expected if label not in listed]
    if missing == [FALLBACK] and listed.get(CANDIDATE) == "failed":
        missing = []  # the candidate failed (and fails here); the fallback never ran after it
    if missing:
        raise Fp8opsError(
            f"{file}: the {', '.join(missing)} track has not started; the evaluation is "
            f"unfinished (run fp8ops dualtrack again to finish it)"
        )
    found = []
    for i, entry in enumerate(tracks):
        where = f"{file}: tracks[{i}]"
        if not isinstance(entry, dict) or not all(k in entry for k in ("label", "run_dir", "role")):
            raise Fp8opsError(f"{where} needs label, run_dir and role; the file is damaged")
        if entry.get("status") == "skipped":  # a fallback track with nothing to fall back
            continue
        if entry.get("status") in ("running", "interrupted"):
            raise Fp8opsError(
                f"{where}: the {entry['label']} track is {entry['status']}; the evaluation is "
                "unfinished (run fp8ops dualtrack again to finish it)"
            )
        if entry["role"] not in ("control", "candidate"):
            raise Fp8opsError(
                f"{where}.role is {entry['role']!r}; expected 'control' or 'candidate'"
            )
        path = directory / entry["run_dir"]
        if not path.is_dir():
            raise Fp8opsError(
                f"{where}.run_dir: {path} does not exist; the track has not run yet (run "
                f"fp8ops dualtrack again to finish it)"
            )
        role: Role = "reference" if entry["role"] == "control" else "candidate"
        fallbacks = dict(entry.get("fallback_modules") or {})
        found.append(Track(str(entry["label"]), path, role, fallbacks))
    controls = [t for t in found if t.role == "reference"]
    if len(controls) != 1 or len(found) < 2:
        raise Fp8opsError(
            f"{file}: needs exactly one track with role 'control' and at least one candidate "
            f"(found {len(controls)} control and {len(found) - len(controls)} candidates)"
        )
    return controls + [t for t in found if t.role == "candidate"]


def default_out(tracks: list[Track], dualtrack: Path | None) -> Path:
    """Where the report goes without --out: beside the runs it compares."""
    if dualtrack is not None:
        return dualtrack / "compare"
    # Named for the runs, so comparing the reference with another candidate keeps this one.
    names = "-".join(track.path.name for track in tracks[1:])
    return tracks[0].path.parent / f"compare-{tracks[0].path.name}-vs-{names}"


# --------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------


def load_run(track: Track) -> RunRecords:
    """Read ``track``'s run directory; an :class:`Fp8opsError` names what is missing or damaged."""
    path, layout = track.path, RunLayout(track.path)
    status = _read(find_status, path)
    if status is None:
        raise Fp8opsError(
            f"{path}: not an fp8ops run directory (no status.json); {USAGE}, as `fp8ops train` "
            "leaves them"
        )
    if status.state == "imported":
        # TE's statistics logs hold per-layer statistics only: no loss, no evaluation, no data
        # or seed fingerprint, so no gate could be judged and no comparability checked.
        raise Fp8opsError(
            f"{path}: an imported run ({status.reason}); compare judges held-out loss and "
            "capability evaluations on the same data, which those logs do not record. Look at "
            "it with fp8ops inspect, fp8ops alerts --replay MANIFEST or fp8ops console"
        )
    if not layout.manifest.is_file():
        raise Fp8opsError(f"{path}: no {MANIFEST}; the run directory is incomplete or damaged")
    manifest = locked_manifest(path)  # not a manifest.yaml edited or copied in since
    info = _read(read_run_record, path)
    _check_own_info(path, info)
    state = status.state
    evals = _as_written(_read(read_evals, path))
    if not evals and state not in ("stopped", "failed"):
        # A run that ended early is judged (and fails); one that just never evaluated can't be.
        raise Fp8opsError(
            f"{layout.evals}: no evaluation recorded (status {state} at step "
            f"{status.step}); compare judges held-out loss, so train with "
            "data.eval_fraction > 0 and let the run reach its first schedule.eval_interval"
        )
    metrics = _as_written(_read(read_metrics, path))
    capability, predictions = _read_capability(path)
    events = [event.model_dump() for event in _read(read_events, path)]
    return RunRecords(
        track=track,
        manifest=manifest,
        manifest_sha256=manifest_hash(manifest),
        info=info,
        status=status,
        metrics=metrics,
        tokens_through=_cumulative_tokens(path, metrics),
        evals=evals,
        capability=capability,
        predictions=predictions,
        resumes=[
            Resume(e["step"], e.get("checkpoint"))
            for e in events
            if e.get("event") == "resumed" and isinstance(e.get("step"), int)
        ],
        restarts=[
            e["from_step"]
            for e in events
            if e.get("event") == "train_started"
            and isinstance(e.get("from_step"), int)
            and e["from_step"] > 0
        ],
        alerts=read_alerts(path),
        layers=read_layers_json(path),
        telemetry=summarise_telemetry(path),
    )


def _check_own_info(path: Path, info: RunRecord) -> None:
    """``run.json`` is this run's: written under one of its revisions. The comparability checks
    read it (data, seeds, initial weights), so one copied in from another run would make them
    pass or fail on the other run's facts."""
    store = ManifestStore(RunLayout(path).manifests)
    digest = info.manifest
    if digest is None or not store.path_for(digest).is_file():
        raise Fp8opsError(
            f"{RunLayout(path).run_record}: manifest is {_short(digest)}, which is not one of "
            f"this run's revisions ({store.directory}): the file belongs to another run, or is "
            "damaged. Restore the run's own run.json"
        )


def _read(reader, path: Path):
    """A run record through ``reader`` (fp8ops.run.records), its problem as compare's error."""
    try:
        return reader(path)
    except RunRecordError as exc:
        raise Fp8opsError(str(exc)) from None


def _as_written(rows: list) -> list[dict[str, Any]]:
    """Rows as the log holds them: a field the line does not have stays absent."""
    return [row.model_dump(exclude_unset=True) for row in rows]


def _read_json(file: Path) -> dict[str, Any]:
    try:
        document = loads_json(file.read_text())
    except FileNotFoundError:
        raise Fp8opsError(f"{file}: no such file") from None
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise Fp8opsError(f"{file}: cannot be read ({exc}); the file is damaged") from None
    if not isinstance(document, dict):
        raise Fp8opsError(f"{file}: not a JSON object; the file is damaged")
    return document


def _cumulative_tokens(path: Path, metrics: list[dict[str, Any]]) -> dict[int, int]:
    total, through = 0, {}
    for record in metrics:
        if not isinstance(record["tokens"], int):
            raise Fp8opsError(
                f"{path}/metrics.jsonl: step {record['step']}: tokens is {record['tokens']!r}, "
                "not an integer; the file is damaged"
            )
        total += record["tokens"]
        through[record["step"]] = total
    return through


def _read_capability(path: Path) -> tuple[list[dict[str, Any]], dict[int, list[dict[str, Any]]]]:
    """Capability records (latest line per step) and every record's per-item predictions."""
    from fp8ops.evaluate.records import LOG, read_capability, read_predictions

    required = ("items", "correct", "accuracy", "buckets", "predictions", "predictions_sha256")
    try:
        records = read_capability(path)
    except (KeyError, TypeError):  # a line without a step
        raise Fp8opsError(f"{path / LOG}: a record has no 'step'; the file is damaged") from None
    for record in records:
        missing = [key for key in required if key not in record]
        if missing:
            raise Fp8opsError(
                f"{path / LOG}: the record of step {record['step']} has no {missing[0]!r} "
                "field; the file is damaged"
            )
    return records, {record["step"]: read_predictions(path, record) for record in records}


# --------------------------------------------------------------------------------------
# Comparability
# --------------------------------------------------------------------------------------


def check_comparable(reference: RunRecords, candidates: list[RunRecords]) -> None:
    """Refuse runs that did not see the same data in the same batches: their losses and
    accuracies would differ for reasons other than precision."""
    for run in candidates:
        for field_path, ours, theirs in (
            (
                "run.json data.fingerprint",
                _data_fingerprint(run.info),
                _data_fingerprint(reference.info),
            ),
            ("run.json seeds.data", _data_seed(run.info), _data_seed(reference.info)),
            (
                "manifest.yaml schedule.global_batch_size",
                run.manifest.schedule.global_batch_size,
                reference.manifest.schedule.global_batch_size,
            ),
            # Another length is another learning-rate schedule, judged at another end.
            (
                "manifest.yaml schedule.train_steps",
                run.manifest.schedule.train_steps,
                reference.manifest.schedule.train_steps,
            ),
        ):
            if ours is None or ours != theirs:
                raise Fp8opsError(
                    f"{run.path}: {field_path} is {_short(ours)}, the reference "
                    f"{reference.path} has {_short(theirs)}; runs are comparable only with the "
                    "same data, data seed, batch and length (train them from one manifest, e.g. "
                    "with fp8ops dualtrack)"
                )
        # Both start from the same weights (the base checkpoint, or one seed: the FP8 and BF16
        # builds draw them alike). Older runs did not record it, and fingerprints of two
        # schemes (checkpoint/weights.py) cannot be compared; then it is not checked.
        ours = run.info.model.initial_weights_fingerprint
        theirs = reference.info.model.initial_weights_fingerprint
        same_scheme = _fingerprint_scheme(run.info) == _fingerprint_scheme(reference.info)
        if ours is not None and theirs is not None and same_scheme and ours != theirs:
            raise Fp8opsError(
                f"{run.path}: run.json model.initial_weights_fingerprint is {_short(ours)}, the "
                f"reference {reference.path} started from {_short(theirs)}; runs are comparable "
                "only from the same initial weights (the same model.init_checkpoint and seeds)"
            )
        ref_tokens = {m["step"]: m["tokens"] for m in reference.metrics}
        for record in run.metrics:
            theirs = ref_tokens.get(record["step"])
            if theirs is not None and theirs != record["tokens"]:
                raise Fp8opsError(
                    f"{run.path}: metrics.jsonl step {record['step']} has tokens "
                    f"{record['tokens']}, the reference {reference.path} has {theirs}; runs are "
                    "comparable only with equal tokens per step (same global batch, sequence "
                    "length and data.pad_to; under pad_to longest also the same micro-batch "
                    "size and data-parallel size, which group the rows)"
                )


def _data_fingerprint(info: RunRecord) -> str | None:
    return info.data.fingerprint if info.data is not None else None


def _data_seed(info: RunRecord) -> int | None:
    return (info.seeds or {}).get("data")


def _fingerprint_scheme(info: RunRecord) -> str:
    # Runs that record none fingerprinted by module path (checkpoint/weights.py's legacy scheme).
    return info.model.initial_weights_fingerprint_scheme or "parameter-names"


def _short(value: Any) -> str:
    if value is None:
        return "missing"
    text = str(value)
    return text[:12] + "..." if len(text) == 64 else text  # a sha256: its prefix is enough


def finite(value: Any) -> bool:
    """A number that is neither missing (JSON null) nor NaN nor infinite."""
    return isinstance(value, (int, float)) and math.isfinite(value)
