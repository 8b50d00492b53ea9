"""``fp8ops dualtrack MANIFEST``: train the three tracks one after another, then compare them.

::

    DIR/                        (default runs/NAME-dualtrack)
      dualtrack.json            the source manifest's hash, the tracks, their status and time
      tracks/source.yaml        the manifest given (the derived revision under --set)
      tracks/bf16.yaml          tracks/fp8.yaml    tracks/fp8-fallback.yaml (once decided)
      bf16/  fp8/  fp8-fallback/   ordinary run directories (fp8ops inspect, console, resume)
      compare/                  fp8ops compare's report.html, verdict.json and png/

Every track runs as ``fp8ops train TRACK.yaml --resume`` would: a finished track is left as it
is, an interrupted one continues from its checkpoint, so the command itself is resumable (and
requeueable: a stop request ends it with exit 75 after the current track checkpoints). A
candidate stopped by a Stop alert is not retried; the comparison fails it.

Under torchrun every rank runs this function: they train each track together, and each writes
the same track manifests (``write_manifest`` leaves an identical file alone); rank 0 writes the
rest.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from fp8ops.dualtrack.tracks import (
    CANDIDATE,
    CONTROL,
    FALLBACK,
    LABELS,
    PLAN,
    Track,
    candidate_fp8_modules,
    check_fallback_globs,
    control_manifest,
    fallback_manifest,
    fallback_modules,
    recipe_manifest,
)
from fp8ops.errors import Fp8opsError, ManifestError
from fp8ops.files import atomic_write_text, loads_json
from fp8ops.manifest import derive, load_manifest, manifest_hash, write_manifest
from fp8ops.manifest.schema import Manifest
from fp8ops.run import find_status
from fp8ops.run.layout import STOP_REQUEST


@dataclass(frozen=True)
class TrackOutcome:
    """How a track stands after this invocation."""

    track: Track
    status: str  # completed | stopped | failed | interrupted | skipped
    seconds: float  # spent training it in this invocation
    note: str = ""


def run_dualtrack(
    manifest_path: Path,
    out_dir: Path,
    *,
    assignments: dict | None = None,
    progress: bool = True,
    tracks: tuple[str, ...] | None = None,
) -> list[TrackOutcome]:
    """Train the control, the candidate and the candidate with fallbacks into ``out_dir``; or,
    with ``tracks`` (``parse_tracks``), the control and one candidate per recipe named, each
    the manifest under that ``precision.scaling`` (same data, same tokens)."""
    import torch.distributed as dist

    from fp8ops.megatron import check_gemms_run
    from fp8ops.train.distributed import rank_device, shared_process_group
    from fp8ops.train.signals import stop_on_signals

    source = _source_manifest(Path(manifest_path), assignments or {})
    out_dir = Path(out_dir)
    # What can refuse the manifest runs before anything is written, so a refused manifest does
    # not claim the directory for itself.
    control_source = control_manifest(source)
    recipes = {name: recipe_manifest(source, name) for name in (tracks or ())[1:]}
    _check_world_size(source, manifest_path)
    for manifest in _fp8_tracks(source, recipes):  # their GEMMs, before any track trains
        check_gemms_run(manifest, rank_device())
    # Each track's training answers SIGUSR1/SIGTERM itself (checkpoint, exit 75); this catches
    # one that arrives between two tracks.
    with stop_on_signals() as between, shared_process_group():
        plan = _open_plan(out_dir, source, tracks)  # every rank checks before rank 0 writes
        dist.barrier()
        tracks_dir = out_dir / "tracks"
        if _is_main():
            tracks_dir.mkdir(parents=True, exist_ok=True)
            _save_plan(out_dir, plan)
            write_manifest(source, tracks_dir / "source.yaml")
        dist.barrier()
        control = Track(CONTROL, "control", tracks_dir / "bf16.yaml", out_dir / CONTROL)
        candidate = Track(CANDIDATE, "candidate", tracks_dir / "fp8.yaml", out_dir / CANDIDATE)
        write_manifest(control_source, control.manifest_file)
        if recipes:
            return _train_recipes(recipes, control, out_dir, progress, plan, between)
        write_manifest(source, candidate.manifest_file)
        outcomes = [_train(control, out_dir, progress, plan)]
        _stop_if_asked(between, out_dir)
        # A typo in dualtrack.fallback_modules is found now, not after the candidate trained.
        check_fallback_globs(source, control.run_dir)
        outcomes.append(_train(candidate, out_dir, progress, plan))
        _stop_if_asked(between, out_dir)
        outcomes.append(_train_fallback(source, out_dir, candidate, progress, plan))
    return outcomes


def _train_recipes(
    recipes: dict[str, Manifest], control: Track, out_dir: Path, progress: bool, plan, between
) -> list[TrackOutcome]:
    """The control, then one candidate per recipe, in the order given."""
    candidates = []
    for name, manifest in recipes.items():
        track = Track(name, "candidate", out_dir / "tracks" / f"{name}.yaml", out_dir / name)
        write_manifest(manifest, track.manifest_file)
        candidates.append(track)
    outcomes = [_train(control, out_dir, progress, plan)]
    for track in candidates:
        _stop_if_asked(between, out_dir)
        outcomes.append(_train(track, out_dir, progress, plan))
    return outcomes


def _stop_if_asked(request, out_dir: Path) -> None:
    """Between two tracks: a signal, or ``DIR/stop.request``, ends the command with exit 75
    (collective: every rank agrees); the next invocation goes on with the next track."""
    from fp8ops.train.signals import Interrupted

    if request.agreed(out_dir):
        if _is_main():
            (out_dir / STOP_REQUEST).unlink(missing_ok=True)  # answered
        raise Interrupted(
            f"stopped between two tracks ({request.reason}); run fp8ops dualtrack again to "
            "go on with the next track"
        )


def _train_fallback(
    source: Manifest, out_dir: Path, candidate: Track, progress: bool, plan: dict
) -> TrackOutcome:
    """The third track: its modules chosen from the candidate's run, once."""
    file = out_dir / "tracks" / f"{FALLBACK}.yaml"
    if file.exists():  # decided by an earlier invocation: keep it, the run resumes under it
        inherited = {o.module for o in source.precision.overrides}
        modules = {
            o.module: o.reason
            for o in load_manifest(file).precision.overrides
            if o.module not in inherited
        }
    else:
        modules = fallback_modules(source, candidate.run_dir)
        every = len(modules) == len(candidate_fp8_modules(source, candidate.run_dir))
        if modules and not every:
            write_manifest(fallback_manifest(source, modules), file)
    track = Track(FALLBACK, "candidate", file, out_dir / FALLBACK, modules)
    note = None
    if not modules:
        note = "no high-risk modules (see the manifest's dualtrack section): same as fp8"
    elif not file.exists():  # every FP8 module chosen
        note = (
            f"the dualtrack rules choose all {len(modules)} of the candidate's FP8 modules: "
            "the track would be a second BF16 control (narrow the manifest's dualtrack "
            "section)"
        )
    if note is not None:
        _record(plan, out_dir, track, "skipped", 0.0, note)
        return TrackOutcome(track, "skipped", 0.0, note)
    return _train(track, out_dir, progress, plan)


def _train(track: Track, out_dir: Path, progress: bool, plan: dict) -> TrackOutcome:
    """Train one track to its end (or find it there). dualtrack.json says "running" while it
    trains and keeps the time of an attempt that is interrupted."""
    from fp8ops.train import run_training
    from fp8ops.train.ending import StopRun

    before = find_status(track.run_dir) if track.run_dir.exists() else None
    if (
        before is not None and before.state == "stopped"
    ):  # a Stop alert would stop it again at the same step
        _record(plan, out_dir, track, "stopped", 0.0)
        return TrackOutcome(track, "stopped", 0.0, "stopped by an alert (earlier)")
    if _is_main():
        print(f"dual-track: training {track.label} in {track.run_dir}", flush=True)
    _record(plan, out_dir, track, "running", 0.0)
    started, state = time.perf_counter(), "interrupted"  # unless training returns or stops
    try:  # trained to the end, or found there (a Complete plan)
        run_training(track.manifest_file, track.run_dir, progress=progress, resume=True)
        state = "completed"
    except StopRun as stop:
        state = "stopped"
        if _is_main():
            print(f"dual-track: {track.label} {stop}", flush=True)
    finally:
        after = find_status(track.run_dir) if track.run_dir.exists() else None
        failed = after is not None and after != before and after.state == "failed"
        if state == "interrupted" and failed:
            state = "failed"  # judged (and failed) by compare; the next invocation retries it
        seconds = time.perf_counter() - started
        _record(plan, out_dir, track, state, seconds)
    return TrackOutcome(track, state, seconds)


def _fp8_tracks(source: Manifest, recipes: dict[str, Manifest]) -> list[Manifest]:
    """The manifests of the FP8 tracks that will train: one per recipe named by ``--tracks``,
    else the candidate (the source; the fallback runs the same with some modules in BF16)."""
    return list(recipes.values()) if recipes else [source]


def _check_world_size(source: Manifest, path: Path) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != source.topology.world_size:
        raise ManifestError(
            f"{path}: this job has {world} process(es) but topology asks for "
            f"{source.topology.world_size}; start fp8ops dualtrack with `torchrun "
            f"--nproc-per-node {source.topology.world_size}` or change the topology with --set"
        )


def _source_manifest(path: Path, assignments: dict) -> Manifest:
    manifest = load_manifest(path)
    if not assignments:
        return manifest
    reason = "fp8ops dualtrack --set " + " ".join(f"{k}={v}" for k, v in assignments.items())
    return derive(manifest, assignments, reason, source=f"{path} with --set")


def _open_plan(out_dir: Path, source: Manifest, tracks: tuple[str, ...] | None) -> dict:
    """dualtrack.json as an earlier invocation left it (then for the same manifest and
    tracks), or a new plan for a new or empty directory. Reads only."""

    path = out_dir / PLAN
    digest = manifest_hash(source)
    if path.exists():
        try:
            plan = loads_json(path.read_text())
        except (OSError, ValueError) as exc:
            raise Fp8opsError(f"{path}: unreadable ({exc}); move the directory aside") from None
        if plan.get("manifest") != digest:
            raise Fp8opsError(
                f"{out_dir} holds the dual-track evaluation of manifest "
                f"{str(plan.get('manifest'))[:12]}, not of this one ({digest[:12]}); give "
                "another --out, or resume that evaluation with its own manifest "
                f"({out_dir / 'tracks' / 'source.yaml'})"
            )
        if plan.get("requested") != (list(tracks) if tracks else None):
            raise Fp8opsError(
                f"{out_dir} holds the dual-track evaluation of tracks "
                f"{','.join(plan.get('requested') or LABELS)}, not "
                f"{','.join(tracks or LABELS)}; give another --out, or the same --tracks"
            )
        return plan
    if out_dir.exists() and any(out_dir.iterdir()):
        raise Fp8opsError(
            f"{out_dir} exists and is not a dual-track directory (no {PLAN}); give another --out"
        )
    plan = {"manifest": digest, "name": source.name, "tracks": []}
    if tracks:
        plan["requested"] = list(tracks)
    return plan


def _record(
    plan: dict, root: Path, track: Track, status: str, seconds: float, note: str = ""
) -> None:
    """Update the track's entry in dualtrack.json (status: running, completed, stopped, failed,
    interrupted or skipped); time adds up across invocations."""
    entries = {entry["label"]: entry for entry in plan["tracks"]}
    earlier = entries.get(track.label, {})
    entry = track.record(root) | {
        "manifest": manifest_hash(load_manifest(track.manifest_file))
        if track.manifest_file.exists()
        else None,
        "status": status,
        "seconds": round(earlier.get("seconds", 0.0) + seconds, 3),
    }
    if note:
        entry["note"] = note
    entries[track.label] = entry
    order = plan.get("requested") or (CONTROL, CANDIDATE, FALLBACK)
    plan["tracks"] = [entries[label] for label in order if label in entries]
    if _is_main():
        _save_plan(root, plan)


def _save_plan(out_dir: Path, plan: dict) -> None:
    import json

    atomic_write_text(out_dir / PLAN, json.dumps(plan, indent=2) + "\n")


def _is_main() -> bool:
    return os.environ.get("RANK", "0") == "0"
