"""The ways a run ends, each leaving its run directory resumable or finished:

* completed: after the last step, the result judged from the records (:func:`releasable`),
  the final checkpoint, then, if the result is releasable (:func:`check_releasable`),
  ``final/`` (:func:`save_final_weights`), then status completed (:func:`complete`);
* not releasable: the last step trained but its loss, its weights or the held-out evaluation
  is not finite, or most steps were skipped (:class:`NotReleasable`, exit 5): judged before the
  final checkpoint, which then deletes no earlier one (the advice names them), no ``final/``,
  status failed;
* paused: ``--stop-at`` (status paused) or a stop request (status interrupted; the command exits
  75, for a requeue): a checkpoint at the step boundary (:func:`pause`);
* stopped: a Stop alert (:class:`StopRun`, exit 3): a checkpoint of the step that raised it,
  resumable with an approved override, and status stopped (:func:`stop`);
* failed: anything else raised: the telemetry measured up to the failure kept, status failed
  (:func:`fail`); a full, over-quota or read-only disk said once, as
  :class:`~fp8ops.errors.StorageFull` (exit 74), naming the path and the checkpoint kept.

What a run (or a segment of it, between resumes) reports to the command line is a
:class:`TrainResult`. ``save_checkpoint(step, reason)``: the trainer's collective save.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from fp8ops.checkpoint import CheckpointDir, read_meta, weights
from fp8ops.checkpoint.directory import checkpoint_step
from fp8ops.collective import on_rank0
from fp8ops.errors import (
    STORAGE_ERRNOS,
    Fp8opsError,
    StorageFull,
    storage_error,
    worker_failures,
)
from fp8ops.files import disk_full, mount_point
from fp8ops.manifest.schema import Manifest
from fp8ops.run import RunDir, read_evals, read_metrics
from fp8ops.telemetry import TelemetryWriter

SaveCheckpoint = Callable[[int, str], Path]


class StopRun(Fp8opsError):
    """A Stop alert: the run saved a checkpoint and its telemetry and ended (exit code 3)."""

    exit_code = 3
    collective = True  # every rank raises it; rank 0 says so

    def __init__(self, message: str, alerts: list[dict]):
        super().__init__(f"stopped by an alert: {message}")
        self.alerts = alerts


class NotReleasable(Fp8opsError):
    """The run trained to its last step, but what it trained cannot be released (exit 5)."""

    exit_code = 5
    collective = True  # every rank raises it; rank 0 says so


# More than this share of the run's steps skipped (non-finite gradients) and its weights are
# not released: a run that skipped most of its steps did not train as configured, whatever its
# last loss says.
MAX_SKIPPED_SHARE = 0.5


@dataclass(frozen=True)
class TrainResult:
    """What a run (or a segment of it, between resumes) reports to the command line."""

    run_dir: Path
    steps: int  # the step the run stands at
    first_loss: float
    last_loss: float
    last_eval_loss: float | None
    seconds: float
    first_step: int = 1  # of this segment
    paused: bool = False  # --stop-at or a stop request: checkpointed and left to resume
    interrupted_by: str | None = None  # the stop request (signal, request file) that ended it
    resume_summary: list[str] | None = None
    capability_accuracy: float | None = None  # the segment's last capability evaluation


def release_problems(run_dir: Path, steps: int) -> list[str]:
    """Why the result of the run in ``run_dir`` at its last step ``steps`` is not releasable,
    read from its records (every segment's, across resumes); empty when it is.

    Releasable: the last step's training loss, the weights it ended with and the last held-out
    evaluation are finite, and at most :data:`MAX_SKIPPED_SHARE` of the steps were skipped. The
    loss was computed before the last update, so the weights are read from the last row's norms:
    the weights' before the update and the update's (finite both, so is their sum). A line the
    records lost (a crash mid-write) is not held against the run."""
    metrics = [row for row in read_metrics(run_dir) if row.step <= steps]
    problems = []
    last = metrics[-1] if metrics and metrics[-1].step == steps else None
    if last is not None and not math.isfinite(last.loss):
        problems.append(f"the training loss of step {steps} is {last.loss}")
    for norm, what in (("weight_norm", "weights before it"), ("update_norm", "update")):
        value = None if last is None else getattr(last, norm)
        if value is not None and not math.isfinite(value):
            problems.append(f"the norm of step {steps}'s {what} is {value} ({norm})")
    evals = [row for row in read_evals(run_dir) if row.step <= steps]
    if evals and not math.isfinite(evals[-1].loss):
        problems.append(
            f"the held-out loss of the last evaluation (step {evals[-1].step}) is {evals[-1].loss}"
        )
    skipped = sum(bool(row.skipped) for row in metrics)
    if skipped > MAX_SKIPPED_SHARE * len(metrics):
        problems.append(
            f"{skipped} of its {len(metrics)} steps were skipped (non-finite gradients), more "
            f"than {MAX_SKIPPED_SHARE:.0%}"
        )
    return problems


def releasable(run: RunDir, steps: int) -> list[str]:
    """:func:`release_problems` on every rank (collective: rank 0 reads the records and tells
    the others; a record it cannot read, such as a damaged line, fails every rank)."""
    return on_rank0(run.writer, lambda: release_problems(run.path, steps))


def check_releasable(
    run: RunDir, steps: int, checkpoint: Path, problems: list[str] | None = None
) -> None:
    """Refuse to release a run whose result is unusable (``problems``: :func:`releasable`'s,
    found before the final ``checkpoint`` was saved, or found now), whatever its alert
    settings (``alerts.nonfinite_stop: false`` only demotes an alert): an event, and
    :class:`NotReleasable` on every rank, so no ``final/`` is written and the run ends failed
    with its checkpoints kept: the last for diagnosis, the earlier ones to resume with a fix
    (the final save of such a run deletes none of them)."""
    problems = releasable(run, steps) if problems is None else problems
    if not problems:
        return
    kept = [path.name for path in CheckpointDir(run.path).complete()]
    run.event("not_releasable", step=steps, problems=problems, checkpoint=checkpoint.name)
    earlier = [name for name in kept if name != checkpoint.name]
    resume = (
        f"; to go on, resume an earlier one with a fix (fp8ops resume {run.path} --checkpoint "
        f"{checkpoint_step(earlier[-1])} --set ... --accept-drift WHY)"
        if earlier
        else ""
    )
    raise NotReleasable(
        f"{run.path}: trained to step {steps}, but the result is not releasable: "
        f"{'; '.join(problems)}. No final weights were written and the run is marked failed; "
        f"its checkpoints are kept ({', '.join(kept)} in {checkpoint.parent.name}/): the last, "
        f"{checkpoint.name}, for diagnosis{resume}. See metrics.jsonl and `fp8ops alerts "
        f"{run.path}` for where it went wrong (alerts.nonfinite_stop: false does not release "
        "such a run)"
    )


def save_final_weights(
    run: RunDir,
    model: nn.Module,
    manifest: Manifest,
    checkpoint: Path,
    last_loss: float,
    *,
    is_main: bool,
) -> None:
    """``final/``: the weights of the final ``checkpoint`` (the model holds them)."""
    # The same weights: the checkpoint already gathered and hashed them.
    saved = read_meta(checkpoint)
    meta = {
        "architecture": weights.architecture(manifest.model),
        "fingerprint": saved.weights_fingerprint,
        "fingerprint_scheme": saved.weights_fingerprint_scheme,
        "manifest": saved.manifest,  # what trained them (a finish may run under a later one)
        "steps": manifest.schedule.train_steps,
        "last_loss": last_loss,
    }
    weights.save_weights(model, run.layout.final, meta, is_main=is_main)
    run.event("weights_saved", path="final", fingerprint=saved.weights_fingerprint)


def complete(run: RunDir, manifest: Manifest, started: float) -> float:
    """Mark the run completed (final weights written); the seconds since ``started``."""
    seconds = time.perf_counter() - started
    run.completed(manifest.schedule.train_steps, seconds)
    return seconds


def pause(
    run: RunDir,
    telemetry: TelemetryWriter | None,
    save_checkpoint: SaveCheckpoint,
    step: int,
    why: str,
) -> None:
    """Stop at a step boundary with a checkpoint, ready for ``fp8ops resume``: ``why`` is
    ``stop-at`` (status paused) or a stop request's reason (status interrupted: requeue)."""
    requested = why != "stop-at"
    path = save_checkpoint(step, f"requested: {why}" if requested else why)
    if telemetry is not None:
        telemetry.close()
    run.paused(step, path.name, why, requested=requested)


def stop(
    run: RunDir,
    telemetry: TelemetryWriter | None,
    save_checkpoint: SaveCheckpoint,
    stopped: StopRun,
) -> None:
    """The Stop path: telemetry flushed, a checkpoint of the step that raised the alert
    (resumable, e.g. with an approved override), the run marked stopped."""
    first = stopped.alerts[0]
    try:
        path = save_checkpoint(first["step"], f"alert-stop: {first['rule']}")
        _close_telemetry_after(run, telemetry, stopped)
        run.stopped(first, path.name)
    except BaseException as exc:  # the Stop path itself failed: say so, not "running"
        full = fail(run, telemetry, exc, first["step"])
        if full is None:
            raise
        raise full from exc


def fail(
    run: RunDir, telemetry: TelemetryWriter | None, failure: BaseException, step: int | None
) -> StorageFull | None:
    """Any other end: the telemetry measured up to the failure kept, the run marked failed at
    ``step``, the last one it finished. Where a full (or over-quota, read-only) disk is why,
    the failed saves are removed first, so that the records can still say so, and the
    :class:`~fp8ops.errors.StorageFull` to raise instead of ``failure`` is returned."""
    cause = storage_cause(run.path, failure)  # before anything frees space
    discarded = CheckpointDir(run.path).discard_partial() if cause and run.writer else []
    _close_telemetry_after(run, telemetry, failure)
    if cause is None:
        run.failed(failure, step)
        return None
    message = storage_message(run.path, cause, step, discarded)
    written = run.failed(StorageFull(message), step)
    said = "status.json says failed" if written else "status.json could not be updated either"
    return StorageFull(f"{message} ({said})")


def storage_cause(run_dir: Path, failure: BaseException) -> tuple[str, str, str] | None:
    """(path, why, the error) where ``failure`` came from a full, over-quota or read-only
    file system: an ``OSError`` saying so in its chain, or, for an error that says nothing
    (torch's zip writer reports a short write as "unexpected pos"), a file system under
    ``run_dir`` that is full or had less room than a checkpoint takes when the failed save
    began. None otherwise, and for a user error that says what it is."""
    if isinstance(failure, StorageFull):
        return None  # already said
    found = storage_error(failure)
    if found is not None:
        error = f"{type(found).__name__}: {found}"
        return str(found.filename or run_dir), STORAGE_ERRNOS[found.errno], error
    # Not for a user error (it says what it is) nor an interrupt (Ctrl-C is not the disk).
    # (torch's CheckpointException is a BaseException, not an Exception.)
    unsaid = not isinstance(failure, (Fp8opsError, KeyboardInterrupt, SystemExit))
    why = disk_full(run_dir, need=_room_lacking(run_dir)) if unsaid else None
    if why is None:
        return None
    said = (worker_failures(failure) or [failure])[0]  # a worker's own words, if it collects them
    first_line = (str(said).strip().splitlines() or [""])[0][:200]
    return str(run_dir), why, f"{type(said).__name__}: {first_line}"


def _room_lacking(run_dir: Path) -> int:
    """While a save is cut short (its ``.partial`` left), the free space it still needed to
    complete: the size of the latest whole checkpoint (about what the save takes) less what
    the ``.partial`` already holds. A save cut short by anything else (a peer's crash late in
    the save) on a disk with room for it leaves at least that much free, so the free space,
    which the ``.partial`` takes its share of, is not read as a full disk. 0 otherwise (no
    save failed, or none before)."""
    store = CheckpointDir(run_dir)
    try:
        partial = store.partial()
        latest = store.latest() if partial else None
    except Fp8opsError:
        return 0
    if latest is None:
        return 0
    written = sum(_bytes(p) for p in partial)
    return max(0, _bytes(latest) - written)


def _bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def storage_message(
    run_dir: Path, cause: tuple[str, str, str], step: int | None, discarded: list[str] = ()
) -> str:
    """A full disk said once: the path, what was kept, and what to do."""
    path, why, error = cause
    try:
        latest = CheckpointDir(run_dir).latest()
    except Fp8opsError:
        latest = None
    if latest is None:
        kept = "no checkpoint was saved before it"
        then = (
            f"start it again with `fp8ops train MANIFEST --resume --run-dir {run_dir}` (which "
            "sets this attempt aside)"
        )
    else:
        kept = f"checkpoints/{latest.name} is the latest whole checkpoint"
        then = f"continue with `fp8ops resume {run_dir}`"
    if discarded:
        kept += f" (the failed save {', '.join(discarded)} was removed)"
    after = "" if step is None else f" after step {step}"
    where = mount_point(run_dir)
    fix = (
        f"Make {where} writable"
        if "read-only" in why
        else f"Free space on {where} (or raise the quota)"
    )
    return (
        f"{path}: {why}{after} ({error}). Nothing written before it was lost: {kept}, and the "
        f"logs and telemetry hold the steps written before the failure. {fix}, then {then}"
    )


def _close_telemetry_after(
    run: RunDir, telemetry: TelemetryWriter | None, failure: BaseException
) -> None:
    """Flush telemetry on a failure path; a writer error then is recorded, not raised, so
    the failure that stopped the run stays the one reported."""
    try:
        if telemetry is not None:
            telemetry.close()
    except Exception as exc:  # noqa: BLE001 - secondary to `failure`
        with contextlib.suppress(OSError):  # a full disk may take the event too
            run.event("telemetry_lost", error=str(exc), during=type(failure).__name__)
